"""Whether a package scripts/dev sets up is installed already, read from package metadata alone.

Asking by importing costs seconds a package (torch 2 s, vLLM 10 s, SGLang 17 s) on every
`scripts/dev` run, most of a run's set-up; the metadata answers in milliseconds. An installed
package that does not import is then left for the tests to report: they import it and fail,
where only an absent package makes them skip.

    installed.py kvgen CHECKOUT EXTRA      kvgen installed editable from CHECKOUT since its
                                           pyproject.toml last changed, every requirement of
                                           EXTRA ("" for none) met
    installed.py pinned NAME==VERSION ...  each NAME at VERSION (NAME>=VERSION: at least it),
                                           and each bare NAME installed
    installed.py requirements CHECKOUT EXTRA
                                           every requirement of CHECKOUT's pyproject.toml, and
                                           of its EXTRA, met (kvgen itself aside)

Exit status 0: installed; 1: set-up has work to do (a line on stderr says what).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # a venv without packaging still has pip's copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version


def _missing_requirement(requirement: str, extra: str) -> str | None:
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": extra}):
        return None
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return f"{req.name} is not installed"
    if not req.specifier.contains(version, prereleases=True):
        return f"{req.name} {version} does not meet {req.specifier}"
    return None


def _first_missing(requirements: list[str], extra: str) -> str | None:
    """What the first unmet requirement lacks, or None."""
    return next((p for p in (_missing_requirement(r, extra) for r in requirements) if p), None)


def kvgen_problem(checkout: str, extra: str) -> str | None:
    try:
        dist = metadata.distribution("kvgen")
    except metadata.PackageNotFoundError:
        return "kvgen is not installed"
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    here = Path(checkout).resolve()
    if not origin.get("dir_info", {}).get("editable") or origin.get("url") != here.as_uri():
        return f"kvgen is installed from {origin.get('url', 'a wheel')}, not editable from {here.as_uri()}"
    record = Path(str(dist.locate_file(f"kvgen-{dist.version}.dist-info/METADATA")))
    if not record.is_file() or record.stat().st_mtime < os.stat(here / "pyproject.toml").st_mtime:
        return "pyproject.toml changed since kvgen was installed"
    return _first_missing(dist.requires or [], extra)


def requirements_problem(checkout: str, extra: str) -> str | None:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip's copy of tomli
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((Path(checkout) / "pyproject.toml").read_text("utf-8"))["project"]
    wanted = [*project.get("dependencies", []), *project.get("optional-dependencies", {}).get(extra, [])]
    return _first_missing(wanted, extra)


def pinned_problem(wanted: list[str]) -> str | None:
    for item in wanted:
        name, op, version = (item.partition(">=") if ">=" in item else item.partition("=="))
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            return f"{name} is not installed"
        if op == "==" and Version(have).public != Version(version).public:  # 2.14.1+cu128 is 2.14.1
            return f"{name} {have} is installed, not {version}"
        if op == ">=" and Version(have) < Version(version):
            return f"{name} {have} is older than {version}"
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["kvgen"] and len(argv) == 3:
        problem = kvgen_problem(argv[1], argv[2])
    elif argv[:1] == ["requirements"] and len(argv) == 3:
        problem = requirements_problem(argv[1], argv[2])
    elif argv[:1] == ["pinned"] and len(argv) > 1:
        problem = pinned_problem(argv[1:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    if problem:
        print(f"scripts/dev: to set up: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
