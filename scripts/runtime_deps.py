#!/usr/bin/env python3
"""What an install of tandem needs besides tandem itself, read from pyproject.toml: the one list
that scripts/gpu_check.sh installs and checks and scripts/trim_sdist.sh carries as wheels.

  python3 scripts/runtime_deps.py                          # [project].dependencies, one a line
  python3 scripts/runtime_deps.py --sdist SDIST --build    # llama-cpp-python built from SDIST
  python3 scripts/runtime_deps.py --sdist SDIST --build --check   # exit 1 naming what is missing

With --sdist, llama-cpp-python is installed from that source tree (.tar.gz or folder) rather
than as a wheel, so its own dependencies, read from the sdist's pyproject.toml, replace it.
--build adds the build requirements of both (tandem's editable install and llama-cpp-python's
are built without isolation). --check looks in the Python that runs it: every requirement
whose markers apply must be installed at a version its specifier allows.
Stdlib only (tomllib, 3.11+), except --check, which needs `packaging` (pip vendors it).
"""
from __future__ import annotations

import argparse
import re
import sys
import tarfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, where installed
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "llama-cpp-python"


def dist_name(requirement: str) -> str:
    """'huggingface-hub==2.4.0' -> 'huggingface-hub'; names compared normalised (PEP 503)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if name is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def read_pyproject(source: Path) -> dict:
    """A pyproject.toml, or the one at the top of an sdist (.tar.gz) or its unpacked folder."""
    if source.is_dir():
        source = source / "pyproject.toml"
    if source.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(source) as tar:
            member = next((m for m in tar  # stops reading at the file
                           if m.name.count("/") == 1 and m.name.endswith("/pyproject.toml")), None)
            if member is None:
                raise FileNotFoundError(f"{source} holds no top-level pyproject.toml")
            return tomllib.loads(tar.extractfile(member).read().decode())
    return tomllib.loads(source.read_text())


def requirements(pyproject: Path, sdist: Path | None = None, build: bool = False) -> list[str]:
    """The requirements, in pyproject.toml's order."""
    ours = read_pyproject(pyproject)
    reqs = list(ours["project"]["dependencies"])
    if build:
        reqs += ours.get("build-system", {}).get("requires", [])
    if sdist is not None:
        theirs = read_pyproject(sdist)
        at = [i for i, r in enumerate(reqs) if dist_name(r) == LLAMA]
        if not at:
            raise ValueError(f"{pyproject} has no {LLAMA} dependency for --sdist to replace")
        reqs[at[0]:at[0] + 1] = theirs["project"].get("dependencies", [])
        if build:
            reqs += theirs.get("build-system", {}).get("requires", [])
    # a name twice (numpy: ours and llama-cpp-python's) stays twice: pip takes both specifiers
    return list(dict.fromkeys(reqs))


def missing(reqs: list[str]) -> list[str]:
    """What this Python lacks of `reqs`: one line per requirement not installed as asked."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare interpreter: pip's own copy of packaging
        from pip._vendor.packaging.requirements import Requirement

    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            out.append(f"{req.name}: not installed ({text} needed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name}: {have} installed, {text} needed")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    ap.add_argument("--sdist", type=Path, help=f"the {LLAMA} source it is installed from")
    ap.add_argument("--build", action="store_true", help="add the build requirements")
    ap.add_argument("--check", action="store_true",
                    help="exit 1, naming each, when this Python lacks any of them")
    ns = ap.parse_args(argv)
    reqs = requirements(ns.pyproject, ns.sdist, ns.build)
    if not ns.check:
        print("\n".join(reqs))
        return 0
    lacking = missing(reqs)
    for line in lacking:
        print(f"runtime_deps: {line}", file=sys.stderr)
    return 1 if lacking else 0


if __name__ == "__main__":
    sys.exit(main())
