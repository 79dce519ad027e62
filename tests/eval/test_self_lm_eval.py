"""SELF-LLaMA through lm-eval: the fp_max_iter / fp_tol model_args reach every call, and the per-cap table."""

import json
import os
import tempfile

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf_home_self_"))

import pytest  # noqa: E402

pytest.importorskip("lm_eval")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats  # noqa: E402
from hf_fixedpoint.eval.runner import TASKS_DIR, evaluate_offline  # noqa: E402
from hf_fixedpoint.eval.self_table import format_table, load_lm, main, self_table  # noqa: E402
from hf_fixedpoint.modeling import SelfLlamaForCausalLM  # noqa: E402
from recipes.stars_ouro import char_tokenizer  # noqa: E402

CAP = 6


def _llama_config(tok):
    # initializer_range=0.15: the attention loop needs several iterations, so the cap changes the logits.
    return LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.15, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer):
    """A plain tiny random LLaMA folder (what a SELF retrofit starts from)."""
    out = tmp_path_factory.mktemp("llama_tiny")
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def self_dir(tmp_path_factory, llama_dir, tokenizer):
    """The same weights saved as a SELF-LLaMA checkpoint (remote code next to the weights)."""
    out = tmp_path_factory.mktemp("self_llama_tiny")
    SelfLlamaForCausalLM.from_pretrained(llama_dir).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _loglikelihood(model, tok, context, continuation, **knobs):
    """log p(continuation | context), computed directly as lm-eval's HFLM defines it (no special tokens)."""
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]]), **knobs).logits[0, len(ctx) - 1:]
    return float(torch.log_softmax(logits.double(), -1)[torch.arange(len(cont)), torch.tensor(cont)].sum())


def test_model_args_cap_reaches_loglikelihood_and_generate(self_dir, tokenizer):
    model = SelfLlamaForCausalLM.from_pretrained(self_dir).eval()
    samples = {}
    for cap in (1, CAP):
        knobs = {"fp_max_iter": cap, "fp_tol": 1e-4}
        out = evaluate_offline(self_dir, ["fp_copy_mc", "fp_copy_gen"], model_args=knobs, limit=3, batch_size=1,
                               log_samples=True)
        assert out["config"]["fp_overrides"] == knobs
        samples[cap] = out["samples"]
    for cap in (1, CAP):
        # multiple choice: every choice's loglikelihood is the model's at that cap, computed here independently
        for s in samples[cap]["fp_copy_mc"]:
            for (context, continuation), resp in zip(s["arguments"], s["resps"]):
                direct = _loglikelihood(model, tokenizer, context, continuation, fp_max_iter=cap, fp_tol=1e-4)
                assert resp[0][0] == pytest.approx(direct, abs=1e-4)
        # generation: lm-eval's continuation is greedy generate at that cap (until "\n" or ".")
        for s in samples[cap]["fp_copy_gen"]:
            context = s["arguments"][0][0]
            ids = tokenizer(context, return_tensors="pt", add_special_tokens=False)
            gen = model.generate(**ids, max_new_tokens=16, do_sample=False, fp_max_iter=cap, fp_tol=1e-4)
            text = tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            assert s["resps"][0][0] == text.split("\n")[0].split(".")[0]
    lls = {cap: [r[0][0] for s in samples[cap]["fp_copy_mc"] for r in s["resps"]] for cap in (1, CAP)}
    assert max(abs(a - b) for a, b in zip(lls[1], lls[CAP])) > 1e-3  # the cap changes the scores
    gens = {cap: [s["resps"][0][0] for s in samples[cap]["fp_copy_gen"]] for cap in (1, CAP)}
    assert gens[1] != gens[CAP]


def test_table_iterations_are_the_models_stats(self_dir, tokenizer):
    lm = load_lm(self_dir)
    rows = self_table(lm, [1, CAP], ["fp_copy_mc", "fp_copy_gen"], limit=2)
    assert [(r["task"], r["cap"]) for r in rows] == [("fp_copy_mc", 1), ("fp_copy_gen", 1), ("fp_copy_mc", CAP),
                                                     ("fp_copy_gen", CAP)]
    assert "fp_stats_log" not in lm.forward_kwargs and lm.fp_overrides == {"fp_max_iter": CAP}
    for r in rows:
        assert r["examples"] == 2 and r["forward_calls"] >= 2 and r["model_seconds"] > 0 and r["model_cpu_seconds"] > 0
        assert set(r["metrics"]) == ({"acc", "acc_norm"} if r["task"] == "fp_copy_mc" else {"exact_match"})
    at1, at_cap = rows[0], rows[2]
    assert at1["fpsa_iter_median"] == at1["fpsa_iter_p90"] == 1 and at1["fpsa_cap_hit_rate"] == 1.0
    # Independent recomputation: one forward per (context + choice) request of the first two documents (batch 1,
    # so no padding), merged -> the same median / p90 / cap-hit rate as measured during the evaluation.
    model = SelfLlamaForCausalLM.from_pretrained(self_dir).eval()
    with open(os.path.join(TASKS_DIR, "fp_copy_mc.jsonl"), encoding="utf-8") as fh:
        docs = [json.loads(line) for line in fh][:2]
    stats = []
    for doc in docs:
        for choice in doc["choices"]:
            ids = tokenizer(f"Continue the pattern: {doc['context']} {choice}", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                stats.append(model(torch.tensor([ids[:-1]]), fp_max_iter=CAP).fp_stats)
    direct = FPSAStats.merge(stats).summary()
    assert at_cap["forward_calls"] == len(stats)
    assert at_cap["fpsa_iter_median"] == direct["fpsa_iter_median"] > 1
    assert at_cap["fpsa_iter_p90"] == direct["fpsa_iter_p90"]
    assert at_cap["fpsa_cap_hit_rate"] == pytest.approx(direct["fpsa_cap_hit_rate"])
    assert 1 < rows[3]["fpsa_iter_median"] <= CAP
    table = format_table(rows)
    assert table.count("\n") == 5 and f"| fp_copy_gen | {CAP} | exact_match" in table and "CPU ms / example" in table
    with pytest.raises(ValueError, match="caps="):
        self_table(lm, [0], ["fp_copy_mc"], limit=1)


def test_command_line_retrofits_a_plain_llama(llama_dir, tmp_path, capsys):
    rows = main(["--model", llama_dir, "--retrofit", "llama", "--caps", "1,3", "--tol", "1e-4", "--tasks",
                 "fp_copy_mc", "--limit", "2", "--output", str(tmp_path / "rows.json")])
    assert [r["cap"] for r in rows] == [1, 3] and rows[1]["fpsa_iter_median"] > 1
    assert json.loads((tmp_path / "rows.json").read_text())[1]["cap"] == 3
    assert "| fp_copy_mc | 3 | acc " in capsys.readouterr().out
    # the plain LLaMA loaded as itself has no fp_ settings: the knob error says which keys exist
    with pytest.raises(ValueError, match=r"Unknown fixed-point knob\(s\) \['fp_max_iter'\] for model_type='llama'"):
        self_table(load_lm(llama_dir), [2], ["fp_copy_mc"], limit=1)
    with pytest.raises(ValueError, match="retrofit='gpt2' is not allowed"):
        load_lm(llama_dir, retrofit="gpt2")
