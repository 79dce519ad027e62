"""Ouro early-exit benchmark: a smoke run on a tiny random model saved like the recipe's."""

import torch

from benchmarks.bench_ouro_exit import main
from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from recipes.stars_ouro import char_tokenizer


def test_smoke_run_reports_every_setting(tmp_path, capsys):
    tok = char_tokenizer()
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, total_ut_steps=3,
                        pad_token_id=tok.pad_token_id)
    OuroForCausalLM(config).save_pretrained(tmp_path)
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
