"""Self-speculative decoding benchmark: smoke runs of the Ouro mode (every setting, ``draft_max_depth`` included, on a
tiny random model with the addition demo's tokenizer) and of the Attractor LM mode on a tiny recipe-built model."""

import json
from pathlib import Path

import torch

from benchmarks.bench_speculative import ATTRACTOR_PROMPTS, main
from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from recipes.attractor_lm import Args, build_data, build_model
from recipes.stars_ouro import char_tokenizer


def test_ouro_mode_reports_every_setting(tmp_path, capsys):
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=len(char_tokenizer()), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, total_ut_steps=4, loop_guard_tol=None)
    OuroForCausalLM(config).save_pretrained(tmp_path / "ouro")
    results = main(["--model_dir", str(tmp_path / "ouro"), "--loops", "3", "--batch_sizes", "1", "2", "--problems",
                    "2", "--draft_depths", "1", "--draft_max_depths", "2", "3", "--repeats", "1"])
    names = {"full depth", "draft_depth=1", "draft_depth=1..2"}  # 3 is not below the full depth: left out
    assert set(results) == {(3, batch, name) for batch in (1, 2) for name in names}
    assert all(r["tokens_per_s"] > 0 and r["flops"] > 0 for r in results.values())
    assert results[3, 1, "draft_depth=1..2"]["acceptance"] is not None
    assert "target at" not in capsys.readouterr().out  # no row at 4 or 12 loops


def _save_tiny_attractor(tmp_path):
    """A tiny random Attractor LM and the recipe's BPE tokenizer (trained on any local text), saved as it does."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(json.__file__).read_text() * 3)
    args = Args(corpus=str(corpus), vocab_size=300, hidden_size=32, num_attention_heads=2, seq_length=64,
                fp_max_iter=6, fp_tol=1e-4)
    tokenizer, _, _ = build_data(args)
    torch.manual_seed(0)
    model = build_model(args, tokenizer)
    model.save_pretrained(tmp_path / "run")
    tokenizer.save_pretrained(tmp_path / "run")
    return str(tmp_path / "run")


def test_attractor_mode_reports_every_setting(tmp_path, capsys):
    best = main(["--attractor", _save_tiny_attractor(tmp_path), "--draft_depths", "1", "3", "--self_new_tokens", "4",
                 "--repeats", "1"])
    assert set(best) == {"full depth", "draft_depth=1", "draft_depth=3"}
    assert all(len(times) == len(ATTRACTOR_PROMPTS) and all(0 < t < 60 for t in times) for times in best.values())
    out = capsys.readouterr().out
    assert "full depth 6" in out
    for name in best:  # a row per setting: rate, speed-up, agreeing prefix out of 4 tokens per prompt
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert f"/{4 * len(ATTRACTOR_PROMPTS)}" in row
    assert "%" in next(line for line in out.splitlines() if line.startswith("draft_depth=1"))  # its acceptance
