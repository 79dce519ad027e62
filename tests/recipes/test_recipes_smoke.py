"""Every recipe runs two steps on CPU and leaves a checkpoint that loads as remote code."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_deq_lm_two_steps(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "recipes.train_deq_lm", "--output_dir", str(out), "--max_steps", "2",
                           "--log_every", "1", "--batch_size", "4"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step    2 loss" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"val_ppl_init", "val_ppl", "val_ppl_1_iter"} <= set(metrics)
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "modeling_deq_lm.py", "fp_solvers.py", "tokenizer.json"} <= files
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"].startswith(
        "modeling_deq_lm.")


def test_unknown_flag_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "recipes.train_deq_lm", "--max_stpes", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "max_stpes" in proc.stderr
