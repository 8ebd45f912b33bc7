"""The wheels of a folder to install on the GPU machine, one per project: the newest version.

The GPU machine installs every wheel of ``.whl/`` offline (``/work/shared/GPU.md``), and that
folder collects the sets of several benchmarks (megatron-core's with pydantic 2.12, `unirl
serve`'s with pydantic 2.14, ...). pip refuses two versions of one project in one install, so
the GPU scripts install this list instead::

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site \\
        $(python3 benchmarks/wheel_set.py .whl)

Keeping the newest of each is consistent when each set was downloaded from one environment
whose versions are newer throughout (pydantic with its pydantic-core): say so where a set is
made. The file names follow PEP 427 (``{name}-{version}(-{build})?-{python}-{abi}-{platform}``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

try:
    from packaging.version import Version
except ImportError:  # a bare interpreter: pip, which installs these wheels, vendors it
    from pip._vendor.packaging.version import Version


def project(wheel: str) -> tuple[str, Version]:
    """The normalised project name (PEP 503) and the version of a wheel's file name."""
    name, version = Path(wheel).name.split("-")[:2]
    return re.sub(r"[-_.]+", "-", name).lower(), Version(version)


def newest_per_project(wheels: Iterable[str]) -> list[str]:
    """``wheels`` with only the newest version of each project, in name order."""
    best: dict[str, tuple[Version, str]] = {}
    for wheel in wheels:
        name, version = project(wheel)
        if name not in best or version > best[name][0]:
            best[name] = (version, wheel)
    return [best[name][1] for name in sorted(best)]


def main() -> None:
    folder = Path(sys.argv[1])
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"{folder}: no wheels; copy them there first (/work/shared/GPU.md)")
    print("\n".join(newest_per_project(wheels)))


if __name__ == "__main__":
    main()
