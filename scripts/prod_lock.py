"""Write requirements-prod.lock: the part of requirements.lock that ``symfuse[orchestration,gguf]`` needs.

The production images install it instead of requirements.lock, so they carry no dev tools (pytest, ruff, moto, ...)
and no test-only extra (lora). It is cut out of requirements.lock, never resolved on its own, so every version in it
is the lock's: the roots are the project's dependencies and the ``PROD_EXTRAS`` of pyproject.toml, and a locked
package is kept when one of the packages pip-compile recorded as needing it (its ``# via`` lines) is kept.
``bash scripts/lock.sh`` runs it after refreshing the lock; ``python scripts/prod_lock.py --check`` exits 1 if the
file is not what the lock gives.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements.lock"
PROD_LOCK = REPO / "requirements-prod.lock"
PROD_EXTRAS = ("orchestration", "gguf")
HEADER = f"""\
# Production subset of requirements.lock: symfuse[{",".join(PROD_EXTRAS)}] without dev / test packages.
# Generated from requirements.lock by scripts/prod_lock.py (bash scripts/lock.sh runs it); do not edit.
"""


def canonical(name: str) -> str:
    """PEP 503 name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """``(name -> pinned line, name -> names of the packages it is needed by)`` of a pip-compile lock."""
    pins: dict[str, str] = {}
    via: dict[str, set[str]] = {}
    current, in_via = None, False
    for line in text.splitlines():
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==\S+", line)
        if pin:
            current, in_via = canonical(pin.group(1)), False
            pins[current], via[current] = line.split(" #")[0].strip(), set()
            continue
        comment = line.strip()
        if current is None or not comment.startswith("#"):
            current, in_via = (None, False) if not comment else (current, in_via)
            continue
        body = comment.lstrip("#").strip()
        if body.startswith("via"):
            in_via, rest = True, body[3:].strip()
            if rest:
                via[current].add(rest)
        elif in_via and body and line.startswith("    #   "):
            via[current].add(body)
        else:
            in_via = False
    return pins, {name: {canonical(p.split(" ")[0]) for p in parents if "(" not in p} for name, parents in via.items()}


def roots(pyproject: dict) -> set[str]:
    """The project's direct requirements in production: its dependencies and ``PROD_EXTRAS``."""
    project = pyproject["project"]
    reqs = list(project["dependencies"])
    for extra in PROD_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return {canonical(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in reqs}


def prod_lock(lock_text: str, pyproject: dict) -> str:
    """The text of requirements-prod.lock for a lock and a pyproject."""
    pins, via = parse_lock(lock_text)
    keep = roots(pyproject) & set(pins)
    while True:
        more = {name for name, parents in via.items() if name not in keep and parents & keep}
        if not more:
            break
        keep |= more
    return HEADER + "".join(f"{pins[name]}\n" for name in sorted(keep))


def main(argv: list[str]) -> int:
    """Write (or with ``--check``, compare) requirements-prod.lock."""
    text = prod_lock(LOCK.read_text(), tomllib.loads((REPO / "pyproject.toml").read_text()))
    if "--check" in argv:
        if not PROD_LOCK.exists() or PROD_LOCK.read_text() != text:
            print(f"{PROD_LOCK.name} is not what {LOCK.name} gives; fix: python scripts/prod_lock.py", file=sys.stderr)
            return 1
        return 0
    PROD_LOCK.write_text(text)
    print(f"{PROD_LOCK.name}: {text.count(chr(10)) - HEADER.count(chr(10))} packages pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
