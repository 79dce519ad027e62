"""Ouro early-exit benchmark: a smoke run on a tiny random model saved like the recipe's."""

import shutil

import pytest
import torch

from benchmarks.bench_ouro_exit import main
from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from hf_fixedpoint.modeling.ouro import modeling_ouro
from recipes.stars_ouro import char_tokenizer


def _save_tiny_model(path):
    """A tiny random model saved like the recipe's (its character tokenizer's vocabulary, 3 loops)."""
    tok = char_tokenizer()
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, total_ut_steps=3,
                        pad_token_id=tok.pad_token_id)
    OuroForCausalLM(config).save_pretrained(path)


def test_smoke_run_reports_every_setting(tmp_path, capsys):
    _save_tiny_model(tmp_path)
    results = main(["--model_dir", str(tmp_path), "--loops", "3", "--problems", "4", "--batch_sizes", "1", "2",
                    "--repeats", "1", "--thresholds", "0.6", "--tols", "0.5"])
    assert set(results) == {(b, name) for b in (1, 2) for name in ("full depth", "q=0.6", "tol=0.5")}
    for batch in (1, 2):
        full = results[batch, "full depth"]
        assert full["loops_run"] == 3 and full["flops_ratio"] == 1.0
        for name in ("q=0.6", "tol=0.5"):
            assert 1 <= results[batch, name]["loops_run"] <= 3
            assert results[batch, name]["flops"] <= full["flops"]
    assert "settings within 1 point of full depth" in capsys.readouterr().out


def test_before_runs_another_modeling_file_interleaved(tmp_path, capsys):
    _save_tiny_model(tmp_path / "model")
    before = shutil.copy(modeling_ouro.__file__, tmp_path / "before.py")  # the same code: the same results
    args = ["--model_dir", str(tmp_path / "model"), "--loops", "3", "--problems", "4", "--batch_sizes", "2",
            "--repeats", "1", "--thresholds", "0.6", "--tols"]
    results = main(args + ["--before", str(before)])
    for name in ("full depth", "q=0.6"):
        now, old = results[2, name], results[2, name + " [before]"]
        assert all(now[k] == old[k] for k in ("exact_match", "flops", "loops_run", "batch_loops"))
    assert results[2, "full depth"]["batch_loops"] == 3 and 1 <= results[2, "q=0.6"]["batch_loops"] <= 3
    assert "same exact match, loops and FLOPs" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--before='nowhere.py' must be an existing modeling_ouro.py file"):
        main(args + ["--before", "nowhere.py"])
