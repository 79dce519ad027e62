"""``tools/vllm_addition.py`` on a briefly trained addition model of the recipe (head dim 32): vLLM's greedy tokens
are transformers' at every loop count, both scored on the recipe's own held-out problems (needs vLLM, like the rest
of ``tests/serving``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from recipes import stars_ouro  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_scores_the_recipes_problems_as_transformers(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(stars_ouro, "plot", lambda *args: Path(args[-1]).touch())  # vLLM's venv has no matplotlib
    stars_ouro.main(["--output_dir", str(out), "--runs", "baseline", "--max_steps", "40", "--hidden_size", "64",
                     "--num_heads", "2", "--eval_size", "64", "--eval_loops", "2", "--save_every", "40"])
    report = tmp_path / "scores.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "tools.vllm_addition", str(out), "--runs", "baseline", "--loops", "2,5",
                    "--json", str(report)], env=env, cwd=ROOT, check=True, timeout=900)
    scores = json.loads(report.read_text())["baseline"]
    recipe = json.loads((out / "metrics.json").read_text())["exact_match"]["baseline"]
    assert scores["2"]["transformers"] == recipe["2"]  # the recipe's problems (its eval_size from metrics.json)
    for loops in ("2", "5"):  # 5: past the config's 4 loops, set by hf_overrides
        assert scores[loops]["agree"] == 1.0, loops
        assert scores[loops]["vllm"] == scores[loops]["transformers"], loops
