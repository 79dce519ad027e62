"""Repository rules: vendored copies in sync, import hygiene, packaging, CI wiring."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "hf_fixedpoint" / "core"


def test_vendored_copies_are_in_sync():
    from hf_fixedpoint import vendor

    assert vendor.sync(ROOT / "modeling", check=True) == []


def test_modeling_files_import_their_whole_closure_directly():
    """transformers 4.57-5.5 copy only a local folder's directly imported files into the modules cache."""
    from hf_fixedpoint import vendor

    for fam in vendor.family_dirs(ROOT / "modeling"):
        assert vendor.direct_import_problems(fam) == []


def test_direct_import_check_detects_an_indirect_import(tmp_path):
    from hf_fixedpoint import vendor

    (tmp_path / "configuration_x.py").write_text("from .fp_a import a\n")
    (tmp_path / "fp_a.py").write_text("from .fp_b import b\n")
    (tmp_path / "fp_b.py").write_text("b = 1\n")
    assert vendor.direct_import_problems(tmp_path) == [
        f"{tmp_path / 'configuration_x.py'}: imports fp_b only through another module; add `from .fp_b import ...`"]


def test_output_classes_declare_the_cache_through_cache_field():
    """transformers 5.24 renames ``past_key_values=`` into ``cache=`` in every ``ModelOutput`` subclass's ``__init__``:
    a class declaring its own ``past_key_values`` field must go through ``fp_compat.cache_field``."""
    for path in sorted((ROOT / "modeling").glob("*/modeling_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            fields = {s.target.id for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            if "past_key_values" in fields:
                assert "cache_field" in decorators, f"{path.name}: {node.name} declares past_key_values"


def test_vendor_check_detects_drift(tmp_path):
    import shutil

    from hf_fixedpoint import vendor

    shutil.copytree(ROOT / "modeling", tmp_path / "modeling")
    fam = next(p for p in (tmp_path / "modeling").iterdir() if p.is_dir() and any(p.glob("fp_*.py")))
    copy = next(fam.glob("fp_*.py"))
    copy.write_text(copy.read_text() + "\n# edited by hand\n")
    (fam / "fp_unused.py").write_text("")
    problems = vendor.sync(tmp_path / "modeling", check=True)
    assert any("differs from" in p for p in problems) and any("not imported" in p for p in problems)
    assert vendor.sync(tmp_path / "modeling") == [] and vendor.sync(tmp_path / "modeling", check=True) == []


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield 0, a.name
        elif isinstance(node, ast.ImportFrom):
            yield node.level, node.module or ""


@pytest.mark.parametrize("path", sorted(CORE.glob("fp_*.py")), ids=lambda p: p.name)
def test_core_files_import_only_stdlib_torch_and_siblings(path):
    allowed_top = set(sys.stdlib_module_names) | {"torch"}
    if path.name == "fp_compat.py":  # the one place that adapts to the installed transformers
        allowed_top.add("transformers")
    for level, name in _imports(path):
        if level:
            assert level == 1 and name.startswith("fp_") and "." not in name, f"{path.name}: from {'.' * level}{name}"
        else:
            assert name.split(".")[0] in allowed_top, f"{path.name} imports {name}"
    assert path.read_text().startswith(f"# Source of truth: hf_fixedpoint/core/{path.name}.")


def test_modeling_never_imports_hf_fixedpoint():
    for path in (ROOT / "modeling").rglob("*.py"):
        for level, name in _imports(path):
            assert not name.startswith("hf_fixedpoint"), f"{path} imports {name}"
            if path.name.startswith(("modeling_", "configuration_")):
                # save_pretrained copies only flat sibling modules (transformers' dynamic_module_utils regex).
                assert level in (0, 1) and (level == 0 or "." not in name), f"{path}: from {'.' * level}{name}"


def test_model_types_are_unique_and_match_folders():
    from transformers import CONFIG_MAPPING

    from hf_fixedpoint.modeling import FAMILIES

    types = [cfg.model_type for cfg, _ in FAMILIES]
    assert len(types) == len(set(types))
    for cfg, _ in FAMILIES:
        assert (ROOT / "modeling" / cfg.model_type).is_dir()
        assert CONFIG_MAPPING[cfg.model_type] is cfg


def test_pyproject_lists_every_package():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(meta["tool"]["setuptools"]["packages"])
    roots = {"hf_fixedpoint": ROOT / "hf_fixedpoint", "hf_fixedpoint.modeling": ROOT / "modeling",
             "hf_fixedpoint.eval": ROOT / "eval"}
    found = set()
    for name, base in roots.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    assert found == listed


def test_import_is_cheap_and_registers_families():
    code = (
        "import sys; import transformers; from transformers import PreTrainedModel; "
        "before = set(sys.modules); import hf_fixedpoint; "
        "heavy = ('accelerate', 'peft', 'lm_eval', 'evaluate', 'datasets'); "
        "new = [m for m in heavy if m in sys.modules and m not in before]; "
        "from transformers import AutoConfig; AutoConfig.for_model('deq_lm'); print(new)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_generic_top_level_names_are_not_installed(tmp_path):
    out = subprocess.run([sys.executable, "-c", "import modeling"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and "\ntest:" in makefile and "\ndemo:" in makefile


def test_core_dependencies_have_lower_bounds_and_no_caps():
    """``pip install hf-fixedpoint`` must not downgrade what users have: each floored dependency has no cap, and its
    bound is the release the lowest-versions leg tests (constraints-lowest.txt; tests/test_floors.py)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = meta["dependencies"] + [s for extra in meta["optional-dependencies"].values() for s in extra]
    lowest = dict(line.split("==") for line in (ROOT / "constraints-lowest.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#"))
    assert {"torch", "transformers", "accelerate", "peft", "datasets", "lm-eval", "evaluate"} <= set(lowest)
    for name in lowest:
        found = [s for s in specs if s.split(">")[0].split("<")[0].split("=")[0].strip().replace("_", "-") == name]
        assert found, name
        for spec in found:
            assert "<" not in spec and ">=" in spec, spec
            assert lowest[name].startswith(spec.split(">=")[1]), (spec, lowest[name])  # the bound is the tested floor
