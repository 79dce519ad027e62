"""SELF benchmark: a smoke run on a tiny random LLaMA (every section runs and reports its numbers)."""

from benchmarks.bench_self import main


def test_smoke_run_reports_every_section(capsys):
    results = main(["--tiny", "--new-tokens", "6", "--equiv-tokens", "4", "--cap", "4"])
    # fp_max_iter=1 is the base model exactly, for LLaMA and for Mistral with a sliding window shorter than the input
    assert results["a"] == "PASS" and results["b"] == "PASS"
    mistral = results["mistral_cached"]  # sliding-window cache with FPSA iterations vs full recomputation
    assert mistral["tokens_equal"] and mistral["diff_full"] < 1e-4 and mistral["entry_median"] > 1
    rows = results["rows"]
    assert [r["setting"] for r in rows] == ["picard, fp_max_iter=4", "picard damping 0.5, fp_max_iter=16"]
    for r in rows:
        # the tiny model converges well within the cap: cached decoding reproduces full recomputation
        assert r["cap_hit_rate"] == 0.0 and r["tokens_equal"] and r["diff_full"] < 1e-4 and r["diff_uncached"] < 1e-4
        assert r["steps"] == 5 and 1 < r["entry_median"] <= 16 and r["cached_s"] > 0 and r["uncached_s"] > 0
    out = capsys.readouterr().out
    assert "window changes the logits" in out and "per generated token" in out and "summary: (a) PASS, (b) PASS" in out
