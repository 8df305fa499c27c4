"""Runnable examples that ship with the package: train scripts, plugin templates, configs, clusters and
scenarios. Run a script in place (`python -m pdv_ext.examples.minimal`, or under a launcher with
`deepspeed --module pdv_ext.examples.train_gpt` / `torchrun -m pdv_ext.examples.train_gpt`), or copy an
example out to edit it: `pdv example NAME DIR` (`pdv example` lists them).

Layout (package data, the same under `DIR` after a copy, so that the relative paths inside the configs and
scenarios, such as `../clusters/emulated_4dev.yaml`, keep working):

    minimal.py         the complete minimal program of docs/getting-started.md
    train_gpt.py       the main job: a byte-level GPT pipeline (pipe x data) through pdv_ext.initialize
    train_horovod.py   the Horovod example (digits classifier, pdv_ext.horovod.DistributedOptimizer)
    my_policy.py       a policy plugin template (PlateauLR)           } `pdv example plugins DIR`, with
    my_aggregator.py   an aggregator plugin template (NormFilteredMean) } configs/my_plugins.json
    configs/           demo.json, placement.json, recovery.json, horovod.yaml, my_plugins.json
    clusters/          cluster YAMLs (emulated_4dev.yaml, emulated_4equal.yaml, homogeneous.yaml, ...)
    scenarios/         `pdv bench adapt` scenarios (cluster + run shape + events); host_loss.yaml and
                       device_loss.yaml: faults for `pdv emulate` (docs/recovery.md); batch_*.yaml: batch
                       regimes for `pdv bench adaptive --scenario` (docs/policy.md)

This module imports nothing heavy: `pdv example` lists and copies without torch.
"""
from __future__ import annotations

import os
import shutil
from typing import Dict, List, NamedTuple

#: the folder the examples are installed in
HERE = os.path.dirname(os.path.abspath(__file__))


class Example(NamedTuple):
    files: List[str]   # paths relative to HERE; a folder stands for every file in it
    about: str
    run: str           # what to run after `pdv example NAME DIR` and `cd DIR`


EXAMPLES: Dict[str, Example] = {
    "minimal": Example(["minimal.py"], "the complete minimal program of the getting-started page (2 CPU ranks)",
                       "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 2 minimal.py --steps 5"),
    "train_gpt": Example(["train_gpt.py", "configs/demo.json", "configs/placement.json", "configs/recovery.json",
                          "clusters/emulated_4dev.yaml", "scenarios/host_loss.yaml", "scenarios/device_loss.yaml"],
                         "the main job: a byte-level GPT as a DeepSpeed pipeline, pipe x data, with its configs",
                         "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 4 train_gpt.py "
                         "--deepspeed_config configs/demo.json --steps 20"),
    "train_horovod": Example(["train_horovod.py", "configs/horovod.yaml"],
                             "the Horovod example: a digits classifier with pdv_ext's aggregators and policies",
                             "horovodrun -np 4 -H localhost:4 --gloo python train_horovod.py "
                             "--config configs/horovod.yaml"),
    "plugins": Example(["my_policy.py", "my_aggregator.py", "configs/my_plugins.json"],
                       "plugin templates: a policy (PlateauLR) and an aggregator (NormFilteredMean), and a config "
                       "naming both", "pdv check-config configs/my_plugins.json --world-size 4"),
    "configs": Example(["configs", "clusters"], "every shipped config, with the cluster YAMLs they name",
                       "pdv check-config configs/placement.json --world-size 4"),
    "clusters": Example(["clusters"], "cluster YAMLs: emulated ones, a homogeneous node, two GPU generations, a slow "
                                      "inter-host link", "pdv check-config clusters/emulated_4dev.yaml"),
    "scenarios": Example(["scenarios", "clusters"], "`pdv bench adapt` scenarios (a cluster that changes under a job)",
                         "sudo pdv bench adapt --scenario scenarios/dp4_straggler.yaml --json   # root: emulated "
                         "cluster"),
}
#: every example at once
ALL = "all"


def path(relative: str = "") -> str:
    """The installed path of an example file or folder (`path("configs/demo.json")`)."""
    return os.path.join(HERE, relative) if relative else HERE


def files(name: str) -> List[str]:
    """The files (relative to HERE) that `pdv example NAME DIR` copies; KeyError for an unknown name."""
    entries = sorted({f for ex in EXAMPLES.values() for f in ex.files}) if name == ALL else EXAMPLES[name].files
    out: List[str] = []
    for entry in entries:
        full = os.path.join(HERE, entry)
        if os.path.isdir(full):
            out += sorted(os.path.join(entry, f) for f in os.listdir(full)
                          if os.path.isfile(os.path.join(full, f)) and not f.startswith((".", "__")))
        else:
            out.append(entry)
    return sorted(set(out))


def copy(name: str, dest: str, force: bool = False) -> List[str]:
    """Copy example `name` into folder `dest` (created), keeping its layout; returns the written paths.
    FileExistsError (naming them) when files would be overwritten and not `force`."""
    wanted = files(name)
    clash = [f for f in wanted if os.path.exists(os.path.join(dest, f))]
    if clash and not force:
        raise FileExistsError(", ".join(os.path.join(dest, f) for f in clash))
    written = []
    for f in wanted:
        target = os.path.join(dest, f)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        shutil.copyfile(os.path.join(HERE, f), target)
        written.append(target)
    return written


def main(argv: List[str] | None = None) -> int:
    """`pdv example [NAME DIR [--force]]`: list the examples, or copy one out."""
    import argparse
    import sys

    from ..registry import did_you_mean

    names = list(EXAMPLES) + [ALL]
    ap = argparse.ArgumentParser(prog="pdv example", description="List the examples that ship with pdv_ext, or copy "
                                 "one into a folder to run and edit it (its configs' relative paths keep working).")
    ap.add_argument("name", nargs="?", help=f"one of: {', '.join(names)}")
    ap.add_argument("dir", nargs="?", help="folder to copy it into (created; default: the working directory)")
    ap.add_argument("--force", action="store_true", help="overwrite files that exist")
    args = ap.parse_args(argv)
    if args.name is None:
        print(f"examples (installed in {HERE}; copy one with `pdv example NAME DIR`, run a script in place with "
              "`python -m pdv_ext.examples.NAME`):")
        for n, ex in EXAMPLES.items():
            print(f"  {n:<14} {ex.about}")
        print(f"  {ALL:<14} every file above")
        return 0
    if args.name not in names:
        print(f"pdv example: unknown example '{args.name}'{did_you_mean(args.name, names)}; known: {', '.join(names)}",
              file=sys.stderr)
        return 2
    dest = args.dir or "."
    try:
        written = copy(args.name, dest, args.force)
    except FileExistsError as exc:
        print(f"pdv example: would overwrite {exc} (pass --force, or another DIR)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdv example: cannot write to {dest}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for w in written:
        print(w)
    if args.name != ALL:
        print(f"next: cd {dest} && {EXAMPLES[args.name].run}")
    return 0
