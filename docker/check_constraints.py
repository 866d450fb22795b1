"""Refuse, in one line, lock pins that pip would refuse under the base image's constraints.

    python docker/check_constraints.py REQUIREMENTS CONSTRAINTS [CONSTRAINTS ...]

NGC PyTorch images (25.03 on) set PIP_CONSTRAINT=/etc/pip/constraint.txt, pinning every package
the image was built with; a requirement whose version range excludes a constraint's pin makes pip
fail with a resolution error deep in its log. This names every such pair at once. Only exact
pins (``==``) in the constraint files are read, as pip writes them; a missing constraints file is
no constraint (images before 25.03). Exit 0 when nothing conflicts, 1 otherwise.
"""
from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def requirements(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def pins(path: Path) -> dict[str, tuple[Version, str]]:
    """{name: (version, where)} of the ``name==version`` lines of a constraints file."""
    if not path.exists():
        return {}
    out = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            req = Requirement(line)
            (spec,) = req.specifier
            out[canonicalize_name(req.name)] = (Version(spec.version), f"{path}:{number}")
    return out


def conflicts(reqs: list[Requirement], constraints: list[Path]) -> list[str]:
    pinned = {}
    for path in constraints:
        pinned |= pins(path)
    out = []
    for req in reqs:
        hit = pinned.get(canonicalize_name(req.name))
        if hit is not None and not req.specifier.contains(hit[0], prereleases=True):
            out.append(f"{req} vs {req.name}=={hit[0]} ({hit[1]})")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    found = conflicts(requirements(Path(argv[0])), [Path(p) for p in argv[1:]])
    if found:
        print(f"{argv[0]} contradicts the base image's pip constraints: {'; '.join(found)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
