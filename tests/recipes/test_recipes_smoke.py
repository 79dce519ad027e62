"""Every recipe runs two steps on CPU and leaves a checkpoint that loads as remote code."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # 10-40 s (measured, CPU shared): the corpus and tokenizer are built anew for each of 7 runs
def test_train_deq_lm_killed_anywhere_and_resumed(tmp_path, monkeypatch):
    """Issue 21: kills inside a save, at a step boundary, on SIGTERM and in the export, then a torn newest
    checkpoint; resumed with ``latest`` until done, the weights equal the uninterrupted run's bitwise."""
    from recipes import train_deq_lm
    from tests.helpers import (
        assert_survives_kills,
        kill_at_step,
        kill_during_save,
        kill_in,
        run_recipe,
        sigterm_at_step,
    )

    def main(out, *extra):
        run_recipe(monkeypatch, train_deq_lm, "--output_dir", out, "--max_steps", 4, "--batch_size", 2,
                   "--seq_length", 16, "--hidden_size", 16, "--fp_max_iter", 4, "--save_every", 1, *extra)

    assert_survives_kills(main, tmp_path, [
        lambda mp: kill_during_save(mp, 2), lambda mp: kill_at_step(mp, 2), lambda mp: sigterm_at_step(mp, 1),
        lambda mp: kill_in(mp, train_deq_lm, "staged_folder")], torn="checkpoints/step_4")
