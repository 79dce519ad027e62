"""Copy the core files each model family imports next to its modeling file, byte for byte.

    python -m hf_fixedpoint.vendor           # write the copies
    python -m hf_fixedpoint.vendor --check   # exit 1 on drift, missing copies or stale fp_*.py files
    python hf_fixedpoint/vendor.py           # the same without importing hf_fixedpoint (when a copy is missing)

The check also fails when a ``modeling_*`` / ``configuration_*`` file reaches a module only through another module
(``direct_import_problems``): older transformers releases would not copy that module into the modules cache.

Why: ``save_pretrained`` copies a model's code into the checkpoint only from flat sibling files (``from .x import y``),
so a checkpoint loads with torch + transformers alone only if the solvers sit next to the modeling file. The copies are
generated, never edited; ``hf_fixedpoint/core/`` is the source of truth (transformers' ``FULL_COPIES`` idea).
"""

import argparse
import sys
from pathlib import Path

CORE_DIR = Path(__file__).resolve().parent / "core"


def default_modeling_dir() -> Path:
    """``modeling/`` beside the package in a checkout, else the installed ``hf_fixedpoint/modeling``.

    Found by path, without importing anything, so ``python hf_fixedpoint/vendor.py`` can repair a tree whose imports
    are broken because a copy is missing.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "modeling", here / "modeling"):
        if (candidate / "__init__.py").is_file():
            return candidate
    raise FileNotFoundError(f"no modeling/ folder found next to {here}")


def _core_imports(path: Path) -> set:
    """Core modules among a file's sibling imports, found the way save_pretrained finds the files it copies."""
    from transformers.dynamic_module_utils import get_relative_imports

    return {m for m in get_relative_imports(path) if (CORE_DIR / f"{m}.py").is_file()}


def required_core_files(family_dir: Path) -> set:
    """Core modules imported by a family's modeling/configuration files, closed over the core's own imports."""
    needed = set()
    for path in sorted(family_dir.glob("*.py")):
        if path.name.startswith(("modeling_", "configuration_")):
            needed |= _core_imports(path)
    todo = list(needed)
    while todo:
        name = todo.pop()
        for dep in _core_imports(CORE_DIR / f"{name}.py") - needed:
            needed.add(dep)
            todo.append(dep)
    return needed


def direct_import_problems(family_dir: Path) -> list:
    """Files a ``modeling_*`` / ``configuration_*`` file needs through other files but does not import itself.

    From a local folder, transformers 4.57 to 5.5 copy into the modules cache only the loaded file and its *direct*
    relative imports (they recurse only for Hub downloads): a module reached through another one is missing there and
    the load fails with ``FileNotFoundError``. So every module of a file's import closure is imported by the file.
    """
    from transformers.dynamic_module_utils import get_relative_imports

    problems = []
    for path in sorted(family_dir.glob("*.py")):
        if not path.name.startswith(("modeling_", "configuration_")):
            continue
        direct = set(get_relative_imports(path))
        closure, todo = set(direct), list(direct)
        while todo:
            sibling = family_dir / f"{todo.pop()}.py"
            for dep in get_relative_imports(sibling) if sibling.is_file() else ():
                if dep not in closure:
                    closure.add(dep)
                    todo.append(dep)
        for name in sorted(closure - direct):
            problems.append(f"{path}: imports {name} only through another module; add `from .{name} import ...`")
    return problems


def family_dirs(modeling_dir: Path):
    return sorted(p for p in modeling_dir.iterdir() if p.is_dir() and any(p.glob("modeling_*.py")))


def sync(modeling_dir: Path = None, check: bool = False) -> list:
    """Write (or with ``check`` compare) the copies; returns a list of problems (empty when in sync)."""
    modeling_dir = Path(modeling_dir) if modeling_dir else default_modeling_dir()
    problems = []
    for fam in family_dirs(modeling_dir):
        needed = required_core_files(fam)
        for name in sorted(needed):
            src, dst = CORE_DIR / f"{name}.py", fam / f"{name}.py"
            if check:
                if not dst.is_file():
                    problems.append(f"{dst}: missing copy of {src.name}")
                elif dst.read_bytes() != src.read_bytes():
                    problems.append(f"{dst}: differs from hf_fixedpoint/core/{src.name}")
            elif not dst.is_file() or dst.read_bytes() != src.read_bytes():
                dst.write_bytes(src.read_bytes())
        for stale in sorted(fam.glob("fp_*.py")):
            if stale.stem not in needed:
                if check:
                    problems.append(f"{stale}: not imported by {fam.name} any more")
                else:
                    stale.unlink()
        problems += direct_import_problems(fam)
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on drift instead of writing")
    parser.add_argument("--modeling-dir", type=Path, default=None, help="defaults to the installed modeling folder")
    args = parser.parse_args(argv)
    problems = sync(args.modeling_dir, check=args.check)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print("vendored core copies are out of date (`python -m hf_fixedpoint.vendor` rewrites them) or a modeling / "
              "configuration file lacks a direct import (fix it by hand)", file=sys.stderr)
        return 1
    if not args.check:
        print("vendored core copies are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
