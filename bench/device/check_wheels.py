"""Check that the carried wheels plus the device image's packages satisfy arstream's dependencies.

The device machine has no package index: what the service needs and the image lacks travels as wheels in
`.whl/`. This walks the Requires-Dist closure from pyproject.toml's `[project] dependencies`, for CPython 3.12 on
x86-64 Linux, and reports every requirement that nothing satisfies, two wheels of one project, a wheel that
cannot install there (tags, Requires-Python), wheels nothing needs, and the carry's size.

Two modes:
- here (default): against the wheels' own metadata and `image_packages.txt` (the image's package list; versions
  only where the device notes gave them, so some image packages are checked for presence only);
- `--installed`, on the device after `pip install --target`: against what Python there actually imports
  (importlib.metadata over sys.path), versions and markers included.

Prints a short report and ONE JSON line; exit status 1 when something is missing or conflicting.

    python bench/device/check_wheels.py --wheels /work/main/.whl
    python3 bench/device/check_wheels.py --installed      # on the device, PYTHONPATH=/tmp/site:$PWD
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import json
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEVICE_PYTHON = (3, 12)
DEVICE_PLATFORMS = (
    [f"manylinux_2_{minor}_x86_64" for minor in range(39, 4, -1)]
    + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
)
DEVICE_ENVIRONMENT = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
    "platform_version": "", "extra": "",
}
CARRY_LIMIT_MIB = 64.0


@dataclass
class Dist:
    name: str
    version: str | None  # None: present, version not known
    requires: list[str] = field(default_factory=list)
    source: str = ""


def wheel_dist(path: Path) -> tuple[Dist, list[str]]:
    """The wheel's name, version and Requires-Dist, and what stops it installing on the device."""
    problems = []
    name, version, _, tags = parse_wheel_filename(path.name)
    supported = set(cpython_tags(DEVICE_PYTHON, abis=["cp312", "abi3", "none"], platforms=DEVICE_PLATFORMS))
    supported |= set(compatible_tags(DEVICE_PYTHON, "cp312", DEVICE_PLATFORMS))
    if not set(tags) & supported:
        problems.append(f"{path.name}: no tag installs on CPython 3.12 x86-64 Linux")
    with zipfile.ZipFile(path) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode("utf-8"))
    requires_python = metadata.get("Requires-Python")
    if requires_python and not SpecifierSet(requires_python).contains("3.12.3"):
        problems.append(f"{path.name}: Requires-Python {requires_python}")
    return Dist(str(name), str(version), metadata.get_all("Requires-Dist") or [], path.name), problems


def image_dists(path: Path) -> dict[str, Dist]:
    dists = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        dists[canonicalize_name(name)] = Dist(name, version or None, [], "image")
    return dists


def installed_dists() -> dict[str, Dist]:
    """First distribution of each name on sys.path: the one Python imports."""
    dists: dict[str, Dist] = {}
    for dist in importlib.metadata.distributions():
        key = canonicalize_name(dist.metadata["Name"] or "")
        if key and key not in dists:
            where = str(Path(str(getattr(dist, "_path", ""))).parent)  # which folder on sys.path won
            dists[key] = Dist(dist.metadata["Name"], dist.version, dist.requires or [], where)
    return dists


def project_requirements(pyproject: Path) -> list[str]:
    return tomllib.loads(pyproject.read_text())["project"]["dependencies"]


def resolve(roots: list[str], dists: dict[str, Dist], environment: dict, follow_unknown: bool) -> dict:
    """Walk the closure: each requirement is met, missing, or met with a version nobody can check here."""
    missing, conflicts, unchecked, used = [], [], [], {}
    queue = [(requirement, "pyproject") for requirement in roots]
    seen = set()
    while queue:
        text, wanted_by = queue.pop()
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        key = canonicalize_name(requirement.name)
        if (key, str(requirement.specifier)) in seen:
            continue
        seen.add((key, str(requirement.specifier)))
        dist = dists.get(key)
        if dist is None:
            missing.append(f"{text} (needed by {wanted_by})")
            continue
        used[key] = dist
        if dist.version is None:
            if str(requirement.specifier):
                unchecked.append(f"{requirement.name}{requirement.specifier} (needed by {wanted_by}; from the image)")
        elif not requirement.specifier.contains(Version(dist.version), prereleases=True):
            conflicts.append(f"{requirement.name}{requirement.specifier} needed by {wanted_by}, "
                             f"but {dist.name} {dist.version} ({dist.source})")
        if dist.requires or follow_unknown:
            queue.extend((child, f"{dist.name} {dist.version or ''}".strip()) for child in dist.requires)
    return {"missing": sorted(missing), "conflicts": sorted(conflicts), "unchecked": sorted(set(unchecked)),
            "used": used}


def tracked_mib() -> float | None:
    """Size of the tracked tree (what travels besides the carried paths)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = sum((REPO / name).stat().st_size for name in names.decode().split("\0") if name and (REPO / name).is_file())
    return round(total / 2**20, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl")
    parser.add_argument("--image", type=Path, default=HERE / "image_packages.txt")
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml", help="whose dependencies")
    parser.add_argument("--installed", action="store_true", help="check what this Python imports (on the device)")
    args = parser.parse_args()
    problems: list[str] = []
    report: dict = {"check": "wheels", "mode": "installed" if args.installed else "metadata"}
    if args.installed:
        dists = installed_dists()
        result = resolve(project_requirements(args.pyproject), dists, default_environment(), follow_unknown=False)
        report["python"] = sys.version.split()[0]
    else:
        wheels = sorted(args.wheels.glob("*.whl"))
        carried: dict[str, Dist] = {}
        for path in wheels:
            dist, wheel_problems = wheel_dist(path)
            problems += wheel_problems
            key = canonicalize_name(dist.name)
            if key in carried:
                problems.append(f"two wheels of {dist.name}: {carried[key].source} and {path.name}")
            carried[key] = dist
        dists = {**image_dists(args.image), **carried}  # a carried wheel shadows the image (PYTHONPATH first)
        result = resolve(project_requirements(args.pyproject), dists, DEVICE_ENVIRONMENT, follow_unknown=False)
        unused = sorted(dist.source for key, dist in carried.items() if key not in result["used"])
        wheel_mib = round(sum(path.stat().st_size for path in wheels) / 2**20, 2)
        tracked = tracked_mib()
        report.update(wheels=len(wheels), wheel_mib=wheel_mib, tracked_mib=tracked, unused_wheels=unused,
                      carry_left_mib=round(CARRY_LIMIT_MIB - wheel_mib - (tracked or 0), 2))
        if unused:  # not wrong, only weight in the carry
            print(f"note: wheels nothing needs: {', '.join(unused)}", file=sys.stderr)
    problems += [f"missing: {m}" for m in result["missing"]] + [f"conflict: {c}" for c in result["conflicts"]]
    used = result["used"]
    report.update(
        ok=not problems,
        problems=problems,
        missing=result["missing"], conflicts=result["conflicts"], unchecked_image_versions=result["unchecked"],
        resolved={dist.name: f"{dist.version or '?'} ({'wheel' if dist.source.endswith('.whl') else dist.source})"
                  for dist in sorted(used.values(), key=lambda d: d.name.lower())},
    )
    for problem in problems:
        print(f"PROBLEM {problem}", file=sys.stderr)
    for note in result["unchecked"]:
        print(f"unchecked {note}", file=sys.stderr)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
