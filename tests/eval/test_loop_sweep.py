"""Loop-count sweep through the lm-eval model: the knob reaches every call, table, plot, packaged word problems."""

import json
import os
import tempfile

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf_home_sweep_"))

import pytest  # noqa: E402

pytest.importorskip("lm_eval")

import torch  # noqa: E402

from hf_fixedpoint.eval.loop_sweep import (  # noqa: E402
    compute_sweep,
    exit_settings,
    format_compute_table,
    format_table,
    loop_sweep,
    main,
    plot_sweep,
)
from hf_fixedpoint.eval.runner import TASKS_DIR  # noqa: E402
from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM  # noqa: E402
from recipes.stars_ouro import char_tokenizer  # noqa: E402


def _tiny(tok):
    torch.manual_seed(0)
    return OuroForCausalLM(OuroConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                      total_ut_steps=2, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                      bos_token_id=tok.bos_token_id)).eval()


def test_packaged_word_problems_are_the_generated_ones():
    import importlib.util

    spec = importlib.util.spec_from_file_location("arith_word", os.path.join(TASKS_DIR, "arith_word.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with open(os.path.join(TASKS_DIR, "fp_arith_word.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    assert rows == gen.arith_word_problems()
    assert rows[1]["question"].startswith("Finn has 35 marbles and gives away 5") and rows[1]["answer"] == "30"


def test_packaged_additions_are_the_recipes_held_out_problems():
    from recipes.stars_ouro import addition_batch

    tok = char_tokenizer()
    ids, _ = addition_batch(100, 3, torch.Generator().manual_seed(10**6 + 7), tok)
    with open(os.path.join(TASKS_DIR, "fp_addition_rev.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    texts = ["".join(tok.convert_ids_to_tokens(row[:-1])) for row in ids.tolist()]  # without EOS
    assert [r["prompt"] + r["answer"] for r in rows] == texts
    assert all(len(r["prompt"]) == 8 and r["prompt"].endswith("=") and len(r["answer"]) == 4 for r in rows)
    a, b = rows[0]["prompt"][:3][::-1], rows[0]["prompt"][4:7][::-1]  # least significant digit first
    assert int(a) + int(b) == int(rows[0]["answer"][::-1])


def test_sweep_sets_the_loop_count_of_every_call(tmp_path):
    tok = char_tokenizer()
    model = _tiny(tok)
    seen = []
    model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("total_ut_steps")), with_kwargs=True)
    scores = loop_sweep(model, [1, 3], ["fp_arith_word"], tokenizer=tok, limit=2, batch_size=2)
    assert set(seen) == {1, 3} and seen[0] == 1 and seen[-1] == 3
    assert set(scores["fp_arith_word"]) == {"exact_match"} and set(scores["fp_arith_word"]["exact_match"]) == {1, 3}
    table = format_table(scores)
    assert table.splitlines()[0].split()[-2:] == ["1", "3"] and "fp_arith_word / exact_match" in table
    assert os.path.getsize(plot_sweep(scores, str(tmp_path / "s.png"))) > 0
    with pytest.raises(ValueError, match="knob='num_steps' is not a parameter of OuroForCausalLM.forward"):
        loop_sweep(model, [1], tokenizer=tok, knob="num_steps", limit=1)
    with pytest.raises(ValueError, match="loops="):
        loop_sweep(model, [0], tokenizer=tok, limit=1)


def test_command_line_on_a_saved_checkpoint(tmp_path, capsys):
    tok = char_tokenizer()
    _tiny(tok).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    scores = main(["--model_dir", str(tmp_path / "m"), "--loops", "1,2", "--limit", "2", "--batch_size", "2",
                   "--output_dir", str(tmp_path / "out")])
    assert set(scores["fp_arith_word"]["exact_match"]) == {1, 2}
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["fp_arith_word"]["exact_match"].keys() == {
        "1", "2"}
    assert (tmp_path / "out" / "sweep.png").exists()
    assert "fp_arith_word / exact_match" in capsys.readouterr().out


def _constant_gate(model, lam: float):
    """Every loop's exit probability is ``lam`` for every token: the exit loops are known exactly."""
    with torch.no_grad():
        model.model.early_exit_gate.weight.zero_()
        model.model.early_exit_gate.bias.fill_(float(torch.logit(torch.tensor(lam, dtype=torch.float64))))
    return model


def test_compute_sweep_reads_the_loops_run_from_the_outputs():
    tok = char_tokenizer()
    model = _constant_gate(_tiny(tok), 0.5)
    # cdf after loops 1, 2, 3: 0.5, 0.75, 0.875 -> q=0.7 exits after loop 2, q=0 after loop 1; tol=1e9 fires at the
    # first loop it is checked (the second); the fixed counts run every loop
    settings = exit_settings([1, 3], thresholds=[0.0, 0.7], tols=[1e9])
    assert [name for name, _, _ in settings] == ["loops=1", "loops=3", "q=0", "q=0.7", "tol=1e+09"]
    assert settings[3][2] == {"total_ut_steps": 3, "exit_mode": "skip", "exit_threshold": 0.7}
    seen = []
    model.register_forward_hook(lambda m, a, kw, out: seen.append((kw.get("exit_mode"), out.exit_loop)),
                                with_kwargs=True)
    rows = compute_sweep(model, settings, ["fp_arith_word"], tokenizer=tok, limit=2, batch_size=2)
    assert [r["mean_loops"] for r in rows] == [1.0, 3.0, 1.0, 2.0, 2.0]
    assert all(set(r["scores"]) == {"fp_arith_word"} and "exact_match" in r["scores"]["fp_arith_word"] for r in rows)
    assert any(mode == "skip" and exit_loop is not None for mode, exit_loop in seen)  # the knobs reached the calls
    table = format_compute_table(rows)
    assert table.splitlines()[4].split()[:2] == ["q=0.7", "2.00"]


def test_compute_sweep_mean_loops_follow_a_random_gate():
    """With an untrained gate the tokens exit at different loops: the mean is that of the calls' exit loops."""
    tok = char_tokenizer()
    model = _tiny(tok)
    with torch.no_grad():
        model.model.early_exit_gate.weight.normal_(0, 3.0)
    ran = []
    model.register_forward_hook(lambda m, a, kw, out: ran.append(out.exit_loop + 1), with_kwargs=True)
    (row,) = compute_sweep(model, exit_settings([2], thresholds=[0.5])[-1:], ["fp_arith_word"], tokenizer=tok,
                           limit=3, batch_size=3)
    counts = torch.cat([r.flatten() for r in ran]).double()
    assert row["mean_loops"] == pytest.approx(float(counts.mean()))
    assert 1.0 < row["mean_loops"] < 2.0  # some tokens exit after loop 1, some run both


def test_exit_settings_and_flags_are_validated(tmp_path):
    with pytest.raises(ValueError, match="exit threshold 1.5 must lie in"):
        exit_settings([2], thresholds=[1.5])
    with pytest.raises(ValueError, match="exit tolerance -0.1 must be >= 0"):
        exit_settings([2], tols=[-0.1])
    with pytest.raises(ValueError, match="exit_loops=0 must be an integer >= 1"):
        exit_settings([2], tols=[0.1], exit_loops=0)
    with pytest.raises(ValueError, match="--exit_thresholds='a' must be comma-separated numbers"):
        main(["--model_dir", str(tmp_path), "--exit_thresholds", "a"])
    with pytest.raises(ValueError, match="--knob='num_steps': the exit sweep"):
        main(["--model_dir", str(tmp_path), "--exit_tols", "0.1", "--knob", "num_steps"])


def test_command_line_accuracy_vs_compute(tmp_path, capsys):
    tok = char_tokenizer()
    _constant_gate(_tiny(tok), 0.5).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    rows = main(["--model_dir", str(tmp_path / "m"), "--loops", "1,3", "--exit_thresholds", "0.7", "--limit", "2",
                 "--batch_size", "2", "--output_dir", str(tmp_path / "out")])
    assert [(r["name"], r["mean_loops"]) for r in rows] == [("loops=1", 1.0), ("loops=3", 3.0), ("q=0.7", 2.0)]
    saved = json.loads((tmp_path / "out" / "compute.json").read_text())
    assert [r["mean_loops"] for r in saved] == [1.0, 3.0, 2.0]
    assert os.path.getsize(tmp_path / "out" / "accuracy_vs_compute.png") > 0
    assert (tmp_path / "out" / "sweep.png").exists()
    assert "q=0.7" in capsys.readouterr().out
