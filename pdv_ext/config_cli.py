"""`pdv check-config FILE`: one line per error naming the key path, exit 2; `ok` and exit 0 when valid."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pdv check-config", description=__doc__)
    ap.add_argument("file", help="DeepSpeed config JSON with a \"pdv\" section (or a pdv YAML/JSON)")
    args = ap.parse_args(argv)
    from .config import check_file

    errors = check_file(args.file)
    if errors:
        for line in errors:
            print(line)
        return 2
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
