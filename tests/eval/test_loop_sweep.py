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

from hf_fixedpoint.eval.loop_sweep import format_table, loop_sweep, main, plot_sweep  # noqa: E402
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
