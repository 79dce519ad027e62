"""lm-eval integration: the ``hf-fixedpoint`` model, its per-call knobs, the packaged offline tasks and the runner."""

import functools
import json
import os
import shutil
import tempfile

# Offline before anything imports huggingface_hub / datasets (they read these at import time).
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf_home_eval_"))

import pytest  # noqa: E402

pytest.importorskip("lm_eval")

import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from hf_fixedpoint.eval.lm_harness import FixedPointLM  # noqa: E402
from hf_fixedpoint.eval.run_lm_eval import with_default_include_path  # noqa: E402
from hf_fixedpoint.eval.runner import TASKS_DIR, evaluate_offline  # noqa: E402
from hf_fixedpoint.modeling import DEQLMConfig, DEQLMForCausalLM  # noqa: E402
from tests.helpers import train_bpe_tokenizer  # noqa: E402


def _corpus():
    for name in ("fp_text_ppl.jsonl", "fp_copy_mc.jsonl", "fp_copy_gen.jsonl"):
        with open(os.path.join(TASKS_DIR, name), encoding="utf-8") as f:
            for line in f:
                yield " ".join(str(v) for v in json.loads(line).values())


def _tokenizer():
    return train_bpe_tokenizer(_corpus(), vocab_size=300)


def _config(tok, config_class=DEQLMConfig):
    # initializer_range=0.15: the solve needs many iterations and the logits depend on z*, so the cap changes scores.
    return config_class(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        max_position_embeddings=256, fp_max_iter=30, initializer_range=0.15,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("deq_lm_tiny")
    torch.manual_seed(0)
    DEQLMForCausalLM(_config(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


# A family whose forward has an extra named parameter (like ``num_loops`` of looped families).
class ScaledDEQLMConfig(DEQLMConfig):
    model_type = "deq_lm_scaled_test"

    def __init__(self, **kwargs):  # transformers 5 gives a config subclass without __init__ a generated one
        super().__init__(**kwargs)


class ScaledDEQLMForCausalLM(DEQLMForCausalLM):
    config_class = ScaledDEQLMConfig
    _auto_class = None  # save without remote code: this class lives in a test file

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, fp_overrides=None,
                logit_scale: float = 1.0, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                              labels=labels, fp_overrides=fp_overrides)
        out.logits = out.logits * logit_scale
        return out


ScaledDEQLMConfig._auto_class = None
AutoConfig.register(ScaledDEQLMConfig.model_type, ScaledDEQLMConfig, exist_ok=True)
AutoModelForCausalLM.register(ScaledDEQLMConfig, ScaledDEQLMForCausalLM, exist_ok=True)


def _spy_forward(model):
    """Record the keyword arguments of every ``model.forward`` call."""
    calls = []
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    model.forward = forward
    return calls


def test_fp_max_iter_changes_perplexity(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the packaged tasks find their data from any working directory
    scores = {}
    for max_iter in (1, 30):
        res = evaluate_offline(model_dir, ["fp_text_ppl"], model_args={"fp_max_iter": max_iter}, limit=8)
        assert res["config"]["fp_overrides"] == {"fp_max_iter": max_iter}
        scores[max_iter] = res["results"]["fp_text_ppl"]
    print({k: v["bits_per_byte,none"] for k, v in scores.items()})
    for metric in ("bits_per_byte,none", "byte_perplexity,none", "word_perplexity,none"):
        one, thirty = scores[1][metric], scores[30][metric]
        assert one == one and thirty == thirty  # not NaN
        assert abs(one - thirty) > 1e-3 * abs(thirty), (metric, one, thirty)


def test_unknown_fp_knob_raises_with_valid_keys(model_dir):
    with pytest.raises(ValueError) as err:
        FixedPointLM(model_dir, trust_remote_code=True, fp_max_itr=3)
    message = str(err.value)
    assert "fp_max_itr" in message and "fp_max_iter" in message and "fp_tol" in message
    with pytest.raises(ValueError, match="fp_max_iter"):
        FixedPointLM(model_dir, trust_remote_code=True, fp_max_iter=0)  # value checked too


def test_forward_knob_values_are_checked_at_load(tokenizer):
    # A model_args knob that is also a config setting (Ouro's loop count) is checked as the config checks it, at load.
    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM

    model = OuroForCausalLM(OuroConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, total_ut_steps=2))
    with pytest.raises(ValueError, match=r"total_ut_steps=0 is out of range; allowed values lie in \[1, inf\)"):
        FixedPointLM(model, tokenizer=tokenizer, total_ut_steps=0)
    assert FixedPointLM(model, tokenizer=tokenizer, total_ut_steps=1).forward_kwargs == {"total_ut_steps": 1}


def test_fp_max_iter_caps_evaluation_over_fp_eval_max_iter(tmp_path, tokenizer):
    # A per-call fp_max_iter replaces the config's evaluation cap (the lm-eval model runs in eval mode).
    config = _config(tokenizer)
    config.fp_eval_max_iter, config.fp_tol = 30, 1e-12
    torch.manual_seed(0)
    model = DEQLMForCausalLM(config)
    lm = FixedPointLM(model, tokenizer=tokenizer, fp_max_iter=1)
    ids = torch.tensor([tokenizer("gold red gold red").input_ids])
    with torch.no_grad():
        assert model.eval()(ids, **lm.call_kwargs()).fp_stats.nfe == 1
        assert model(ids).fp_stats.nfe == 30


def test_knobs_reach_forward_and_generate(model_dir):
    lm = FixedPointLM(model_dir, trust_remote_code=True, fp_max_iter=2, fp_tol=1e-3, batch_size=2)
    assert lm.device.type == "cpu" or torch.cuda.is_available()
    calls = _spy_forward(lm.model)
    generate_calls = []
    original_generate = lm.model.generate
    lm.model.generate = lambda **kw: generate_calls.append(kw) or original_generate(**kw)

    req = Instance(request_type="generate_until", doc={}, idx=0,
                   arguments=("red blue red blue", {"until": ["\n"], "max_gen_toks": 3, "do_sample": False}))
    (text,) = lm.generate_until([req])
    assert isinstance(text, str)
    assert generate_calls and generate_calls[0]["use_cache"] is False
    assert generate_calls[0]["fp_overrides"] == {"fp_max_iter": 2, "fp_tol": 1e-3}
    assert len(calls) >= 1 and all(c.get("fp_overrides") == {"fp_max_iter": 2, "fp_tol": 1e-3} for c in calls)

    calls.clear()
    req = Instance(request_type="loglikelihood", doc={}, idx=0, arguments=("red blue red", " blue"))
    lm.loglikelihood([req])
    assert calls and all(c.get("fp_overrides") == {"fp_max_iter": 2, "fp_tol": 1e-3} for c in calls)


def test_remote_code_checkpoint(model_dir, tmp_path):
    # An unregistered model_type makes transformers load the checkpoint's own code (as where hf-fixedpoint is not
    # installed); the knobs must still reach the remote class.
    remote = tmp_path / "remote"
    shutil.copytree(model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    assert "AutoModelForCausalLM" in config["auto_map"]
    config["model_type"] = "deq_lm_remote_test"
    (remote / "config.json").write_text(json.dumps(config))

    lm = FixedPointLM(str(remote), trust_remote_code=True, fp_max_iter=3)
    assert type(lm.model).__module__.startswith("transformers_modules.")
    calls = _spy_forward(lm.model)
    lm.loglikelihood_rolling([Instance(request_type="loglikelihood_rolling", doc={}, idx=0,
                                       arguments=("A small boat drifted past the harbor.",))])
    assert calls and all(c.get("fp_overrides") == {"fp_max_iter": 3} for c in calls)


def test_forward_parameter_knob_is_per_call(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = ScaledDEQLMForCausalLM(_config(tokenizer, ScaledDEQLMConfig))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = torch.tensor([tokenizer("gold red gold red").input_ids])

    lm = FixedPointLM(str(tmp_path), logit_scale=3.0, fp_max_iter=5)  # a directory: knob split before loading
    assert lm.forward_kwargs == {"logit_scale": 3.0} and lm.fp_overrides == {"fp_max_iter": 5}
    assert not hasattr(lm.config, "logit_scale")  # per call, not a config override
    with torch.no_grad():
        base = lm.model(ids, fp_overrides={"fp_max_iter": 5}).logits
    torch.testing.assert_close(lm._model_call(ids), 3.0 * base)

    lm = FixedPointLM(model, tokenizer=tokenizer, logit_scale=0.5)  # a model instance
    assert lm.forward_kwargs == {"logit_scale": 0.5}
    with torch.no_grad():
        base = model(ids).logits
    torch.testing.assert_close(lm._model_call(ids), 0.5 * base)


def test_cli_wrapper_adds_packaged_tasks():
    assert with_default_include_path(["run", "--model", "hf-fixedpoint"])[-2:] == ["--include_path", TASKS_DIR]
    assert with_default_include_path(["--model", "hf-fixedpoint", "--tasks", "fp_text_ppl"])[-1] == TASKS_DIR
    assert with_default_include_path(["run", "--include_path", "/x"]) == ["run", "--include_path", "/x"]
    assert with_default_include_path(["ls"]) == ["ls", "--include_path", TASKS_DIR]
    for argv in (["--help"], ["run", "-h"], ["run"], ["--include_path=/x", "--tasks", "t"]):
        assert with_default_include_path(argv) == argv
