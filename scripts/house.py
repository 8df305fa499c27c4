"""The house of pdv_ext: lines, rooms (folders and top-level modules), floors (levels of the folder import
graph), circles between files and between folders, imports that climb a floor, the largest files.

    python scripts/house.py [PACKAGE_DIR]     (default: this checkout's pdv_ext)

Uses the import graph of tests/unit/test_import_graph.py (imports inside functions count)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.unit.test_import_graph import climbs, folder_edges, folder_of, import_edges, import_loops  # noqa: E402


def house(pkg: Path) -> dict:
    files = sorted(pkg.rglob("*.py"))
    edges = import_edges(pkg)
    fedges = folder_edges(edges)
    rooms = sorted({folder_of(".".join(p.relative_to(pkg.parent).with_suffix("").parts)) for p in files} - {pkg.name})
    graph = {r: set() for r in rooms}
    for a, b, _ in fedges:
        if a in graph and b in graph:
            graph[a].add(b)
    floor: dict = {}

    def level(r: str, seen: frozenset = frozenset()) -> int:  # longest chain of imports below r (cut at circles)
        if r in floor:
            return floor[r]
        below = [level(b, seen | {r}) for b in graph[r] if b not in seen and b != r]
        floor[r] = 1 + max(below, default=0)
        return floor[r]

    for r in rooms:
        level(r)
    sizes = sorted(((sum(1 for _ in p.open(encoding="utf-8")), str(p.relative_to(pkg.parent))) for p in files),
                   reverse=True)
    return {"lines": sum(n for n, _ in sizes), "files": len(files), "rooms": len(rooms),
            "floors": max(floor.values(), default=0), "file_circles": len(import_loops(edges)),
            "folder_circles": [sorted(c) for c in import_loops(fedges)], "climbs": climbs(edges),
            "largest": [f"{p} {n}" for n, p in sizes[:6]]}


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "pdv_ext"
    print(json.dumps(house(target), indent=1))
