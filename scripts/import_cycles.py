"""List the two-module import cycles inside a package (``a`` imports ``b`` and ``b`` imports ``a``, at any depth).

Usage: ``python scripts/import_cycles.py [package]`` (default ``symfuse``; the package must be importable). Imports
inside functions count too (grimp sees every ``import`` statement): a lazy import still ties the two modules.
"""

from __future__ import annotations

import sys

import grimp


def two_module_cycles(package: str) -> list[tuple[str, str]]:
    """Pairs ``(a, b)``, ``a < b``, where ``a`` imports ``b`` directly and ``b`` imports ``a`` directly."""
    graph = grimp.build_graph(package, cache_dir=None)
    pairs = set()
    for a in graph.modules:
        for b in graph.find_modules_directly_imported_by(a):
            if a in graph.find_modules_directly_imported_by(b):
                pairs.add(tuple(sorted((a, b))))
    return sorted(pairs)


def main(argv: list[str]) -> int:
    """Print each cycle and the count."""
    cycles = two_module_cycles(argv[1] if len(argv) > 1 else "symfuse")
    for a, b in cycles:
        print(f"{a} <-> {b}")
    print(f"{len(cycles)} two-module import cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
