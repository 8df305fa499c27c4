"""The docs' commands work from an installed wheel (issue #35): `launch/` is a folder of the repository, not of
the package, so a page may name a `launch/...` path only where it says that is a checkout's (a paragraph, with
the code block it introduces, that mentions a checkout or the repository); the example files the docs name
(`clusters/*.yaml`, `scenarios/*.yaml`, `configs/*`) are the ones `pdv example` copies out. Also `pdv bench adapt
--help`, and gossip's sentence about its consensus-distance collective."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
EXAMPLES = os.path.join(ROOT, "pdv_ext", "examples")
PAGES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
CHECKOUT = re.compile(r"checkout|repositor", re.I)


def blocks(text):
    """Paragraphs (blank-line separated); a fenced code block belongs to the paragraph just before it."""
    out, cur, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if not fenced and cur == [] and out:  # a code block right after a blank line: join the paragraph
                cur = out.pop()
            fenced = not fenced
            cur.append(line)
            continue
        if not fenced and not line.strip():
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(line)
    if cur:
        out.append(cur)
    return ["\n".join(b) for b in out]


@pytest.mark.parametrize("page", PAGES)
def test_launch_paths_are_marked_as_a_checkouts(page):
    text = open(os.path.join(DOCS, page), encoding="utf-8").read()
    bad = [b.strip().splitlines()[0][:100] for b in blocks(text)
           if ("launch/" in b or re.search(r"\blaunch\.\w+:", b)) and not CHECKOUT.search(b)]  # a path, a module
    assert bad == [], f"{page}: `launch/...` in a paragraph that does not say it is a checkout's: {bad}"


@pytest.mark.parametrize("page", PAGES)
def test_the_example_files_the_docs_name_are_shipped(page):
    text = open(os.path.join(DOCS, page), encoding="utf-8").read()
    named = set(re.findall(r"(?<![\w/.-])(?:\.\./)?((?:clusters|scenarios|configs)/[\w.-]+\.(?:yaml|json))", text))
    missing = sorted(n for n in named if not os.path.isfile(os.path.join(EXAMPLES, n)))
    assert missing == [], f"{page} names example files that pdv_ext/examples does not ship: {missing}"


def test_bench_adapt_help_names_the_shipped_scenarios(capsys):
    from pdv_ext.bench import adapt

    with pytest.raises(SystemExit):
        adapt.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "pdv example scenarios" in out
    assert "launch/" not in out or "checkout" in out


def test_gossip_consensus_distance_is_one_all_gather_of_64_float64():
    text = " ".join(open(os.path.join(DOCS, "aggregation.md"), encoding="utf-8").read().split())
    assert "65 floats" not in text
    assert "one all-gather of 64 float64 per rank" in text
