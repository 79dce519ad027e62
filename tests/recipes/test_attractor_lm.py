"""recipes/attractor_lm.py: a few steps on a local corpus, a resumed run, the comparison models and bad flags."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.attractor_lm import Args, build_data, build_model, build_optimizers, trapezoid

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
TINY = ["--batch_size", "2", "--seq_length", "32", "--hidden_size", "32", "--vocab_size", "300", "--eval_batches",
        "1", "--log_every", "1", "--fp_max_iter", "4"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(Path(json.__file__).read_text() * 3)  # any local text
    return str(path)


def run(*args):
    proc = subprocess.run([sys.executable, "-m", "recipes.attractor_lm", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_train_save_and_resume(tmp_path, corpus):
    out = tmp_path / "run"
    run("--output_dir", str(out), "--corpus", corpus, "--max_steps", "3", "--save_every", "2", *TINY)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(1 <= r["fp_iters"] <= 4 for r in log)
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"val_ppl", "val_ppl_t0", "t0_gap", "val_fp_iters", "parameters"} <= set(metrics)
    assert {"config.json", "model.safetensors", "modeling_attractor_lm.py", "fp_solvers.py",
            "tokenizer.json"} <= set(os.listdir(out))
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"].startswith(
        "modeling_attractor_lm.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)  # the saved model and tokenizer generate text
    prompt = AutoTokenizer.from_pretrained(out)("To be, or not", return_tensors="pt")
    assert model.generate(**prompt, max_new_tokens=3, do_sample=False).shape[1] == prompt["input_ids"].shape[1] + 3
    stdout = run("--output_dir", str(out), "--corpus", corpus, "--max_steps", "4", "--resume_from_checkpoint",
                 "latest", *TINY)
    assert "at step 3" in stdout  # the checkpoint written at the end
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # each step logged once


def test_killed_anywhere_and_resumed_ends_with_the_uninterrupted_weights(tmp_path, corpus, monkeypatch):
    """Issue 21: kills inside a save (the first one included), at a step boundary and in the export, then a torn
    newest checkpoint; resumed with ``latest`` until done, the weights, log and evaluations equal the uninterrupted
    run's."""
    from recipes import attractor_lm
    from tests.helpers import assert_survives_kills, kill_at_step, kill_during_save, kill_in, run_recipe

    def main(out, *extra):
        run_recipe(monkeypatch, attractor_lm, "--output_dir", out, "--corpus", corpus, "--max_steps", 5,
                   "--save_every", 1, "--eval_every", 2, *TINY, *extra)

    def log(out):
        return [(r["step"], r["loss"]) for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())]

    reference, out = assert_survives_kills(main, tmp_path, [
        lambda mp: kill_during_save(mp, 1), lambda mp: kill_at_step(mp, 3), lambda mp: kill_during_save(mp, 2),
        lambda mp: kill_in(mp, attractor_lm, "write_json")], torn="checkpoints/step_5")
    assert log(out) == log(reference)
    evals = [json.loads((d / "metrics.json").read_text())["evals"] for d in (out, reference)]
    assert evals[0] == evals[1] and len(evals[0]) == 2


def test_comparison_models_and_optimizer(corpus):
    args = Args(corpus=corpus, vocab_size=300, hidden_size=32, seq_length=32, num_backbone_layers=2,
                num_attractor_layers=1)
    tokenizer, train_ids, val_ids = build_data(args)
    assert len(train_ids) > 10 * len(val_ids) > 0  # --val_fraction 0.05
    counts = {}
    for arch in ("attractor", "transformer", "looped"):
        args.arch = arch
        model = build_model(args, tokenizer)
        counts[arch] = sum(p.numel() for p in model.parameters())
    assert counts["looped"] == counts["attractor"]
    assert abs(counts["transformer"] / counts["attractor"] - 1) < 0.02  # parameter-matched
    args.arch = "looped"
    looped = build_model(args, tokenizer)
    ids = train_ids[:32][None]
    assert looped(ids, use_cache=False).fp_stats.nfe == args.fp_max_iter  # a fixed number of loops
    optimizers = build_optimizers(looped, args)
    assert [type(o).__name__ for o in optimizers] == ["Muon", "AdamW"]
    muon = {id(p) for p in optimizers[0].param_groups[0]["params"]}
    assert id(looped.get_input_embeddings().weight) not in muon and all(
        torch.is_tensor(p) and p.ndim == 2 for p in optimizers[0].param_groups[0]["params"])
    args.max_steps, args.warmup_fraction, args.decay_fraction = 100, 0.1, 0.2
    f = trapezoid(args)
    assert [f(0), f(9), f(50), f(80), f(90), f(100)] == [0.1, 1.0, 1.0, 1.0, 0.5, 0.0]
    args.arch = "mlp"
    with pytest.raises(ValueError, match="--arch 'mlp' is not allowed"):
        build_model(args, tokenizer)


def test_unknown_flag_is_an_error():
    proc = subprocess.run([sys.executable, "-m", "recipes.attractor_lm", "--max_stpes", "2"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "max_stpes" in proc.stderr
