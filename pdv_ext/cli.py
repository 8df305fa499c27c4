"""The `pdv` command: a thin dispatcher; each sub-command lives with its capability.

`pdv bench NAME ...` runs `pdv_ext.bench.<name>:main(argv)` (dashes become underscores); `pdv --version`
prints `pdv_ext.__version__`, the one version the package metadata also reads.
"""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

from . import __version__

COMMANDS = {
    "check-config": ("pdv_ext.config_cli:main", "validate the \"pdv\" section of a config file"),
    "bench": (None, "run a benchmark: pdv bench NAME --json"),
    "plan": ("pdv_ext.placement.cli:plan_main", "choose stage boundaries and rank placement"),
    "predict": ("pdv_ext.placement.cli:predict_main", "fit / evaluate the latency predictor"),
    "probe": ("pdv_ext.placement.probe:main", "measure devices and links of the launched ranks"),
    "profile": ("pdv_ext.placement.cli:profile_main", "profile the layers of a model"),
    "emulate": ("pdv_ext.emulate.cli:main", "run a command on an emulated heterogeneous cluster"),
    "plot": ("pdv_ext.plot:main", "plot metrics or a bench result (pdv plot metrics|adapt|faults|batch FILE --out m.png)"),
    "example": ("pdv_ext.examples:main", "list the shipped examples, or copy one out: pdv example NAME DIR"),
}

BENCHES = ["engine", "aggregate", "kernels", "byzantine", "convergence", "planner", "adaptive", "adapt", "faults", "placement",
           "grid", "init-search", "profile", "move"]


def _usage() -> str:
    lines = ["usage: pdv COMMAND [ARGS...] | pdv --version", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "benchmarks: " + ", ".join(BENCHES)]
    return "\n".join(lines)


def _call(spec: str, argv: List[str]) -> int:
    module, _, fn = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            print(f"pdv: this command is not available in this build ({module} missing)", file=sys.stderr)
            return 2
        raise
    return int(getattr(mod, fn)(argv) or 0)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"pdv_ext {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0].startswith("-"):
            asked = bool(rest) and rest[0] in ("-h", "--help")
            print("usage: pdv bench NAME [--json] ...; NAME is one of: " + ", ".join(BENCHES)
                  + "\n`pdv bench NAME --help` lists a benchmark's options", file=sys.stdout if asked else sys.stderr)
            return 0 if asked else 2
        name = rest[0]
        if name not in BENCHES:
            from .registry import did_you_mean

            print(f"pdv bench: unknown benchmark '{name}'{did_you_mean(name, BENCHES)}; known: {', '.join(BENCHES)}",
                  file=sys.stderr)
            return 2
        spec = f"pdv_ext.bench.{name.replace('-', '_')}:main"
        if "--json" in rest[1:] and not {"-h", "--help"} & set(rest[1:]):
            from .bench.common import json_stdout

            with json_stdout():  # stdout carries the JSON line alone
                return _call(spec, rest[1:])
        return _call(spec, rest[1:])
    if cmd not in COMMANDS:
        from .registry import did_you_mean

        print(f"pdv: unknown command '{cmd}'{did_you_mean(cmd, COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _call(COMMANDS[cmd][0], rest)


if __name__ == "__main__":
    sys.exit(main())
