"""The package's exports served by vLLM (needs vLLM: ``python tools/vllm_check.py`` builds its environment and runs
these; the default suite skips them).

* Ouro through the plugin gives transformers' greedy tokens: at the config's loop count, at another one set with
  ``hf_overrides``, and per request (``extra_args``: depths 1..3 and exit thresholds mixed in one batch);
* bad per-request values are refused with the key and the allowed values;
* Ouro is refused when the plugin is off (no silent fallback to vLLM's Transformers backend).

All vLLM runs happen in two child processes (``vllm_runs``); the tests compare their reports with transformers.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 3]]
MAX_TOKENS = 12
LOOPS, DEEPER = 3, 5
# (extra_args) of one mixed batch, prompt i % 3 each: depths and thresholds side by side
MIXED = [{"total_ut_steps": 1}, {"total_ut_steps": 2}, {}, {"total_ut_steps": 2, "exit_threshold": 0.5},
         {"exit_threshold": 0.5}, {"exit_threshold": None}]
BAD = [({"total_ut_steps": 0}, "total_ut_steps"), ({"total_ut_steps": LOOPS + 1}, "total_ut_steps"),
       ({"total_ut_steps": "2"}, "total_ut_steps"), ({"exit_threshold": 1.5}, "exit_threshold")]
def ouro_export(path):
    """A tiny Ouro with head dim 64 (vLLM's CPU attention takes 32, 64, 80, ...), random weights of some size."""
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                        total_ut_steps=LOOPS, pad_token_id=0)
    model = OuroForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)


def run_children(specs, tmp, env=None):
    spec_file, report_file = tmp / "spec.json", tmp / "report.json"
    spec_file.write_text(json.dumps(specs))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    subprocess.run([sys.executable, "-m", "tests.serving.vllm_runs", str(spec_file), str(report_file)], env=env,
                   check=True, timeout=1800)
    return json.loads(report_file.read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    ouro_export(tmp / "ouro")
    batches = [{"prompts": PROMPTS, "extra_args": [{}] * 3},
               {"prompts": [PROMPTS[i % 3] for i in range(len(MIXED))], "extra_args": MIXED}]
    batches += [{"prompts": PROMPTS[:1], "extra_args": [bad]} for bad, _ in BAD]
    specs = [{"model": str(tmp / "ouro"), "max_tokens": MAX_TOKENS, "batches": batches},
             {"model": str(tmp / "ouro"), "max_tokens": MAX_TOKENS, "batches": batches[:1],
              "llm_kwargs": {"hf_overrides": {"total_ut_steps": DEEPER}}}]
    with_plugin = run_children(specs, tmp)
    without = run_children([{"model": str(tmp / "ouro"), "max_tokens": 2, "batches": []}], tmp / "ouro",
                           env={"VLLM_PLUGINS": ""})
    return tmp, with_plugin, without[0]


def reference(path, loops, threshold="config"):
    """transformers' greedy tokens of every prompt at ``loops``; ``threshold``: the call's exit threshold (None:
    none, the last loop)."""
    model = OuroForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kwargs = {}
    if threshold is None:
        model.config.early_exit_threshold = None
    elif threshold != "config":
        kwargs["exit_threshold"] = threshold
    return [model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, total_ut_steps=loops,
                           **kwargs)[0, len(ids):].tolist() for ids in PROMPTS]


def test_ouro_matches_transformers_at_config_and_override_loops(served):
    tmp, runs, _ = served
    assert runs[0]["batches"][0]["tokens"] == reference(tmp / "ouro", LOOPS)
    assert runs[1]["batches"][0]["tokens"] == reference(tmp / "ouro", DEEPER)


def test_ouro_depth_and_threshold_per_request(served):
    tmp, runs, _ = served
    got = runs[0]["batches"][1]["tokens"]
    for i, extra in enumerate(MIXED):
        loops = extra.get("total_ut_steps", LOOPS)
        want = reference(tmp / "ouro", loops, extra.get("exit_threshold", "config"))[i % 3]
        assert got[i] == want, (i, extra)


def test_bad_request_settings_are_refused(served):
    _, runs, _ = served
    for (bad, key), batch in zip(BAD, runs[0]["batches"][2:]):
        assert f"extra_args['{key}']=" in batch["error"] and "Allowed values" in batch["error"], bad


def test_ouro_without_the_plugin_is_refused_not_served(served):
    error = served[2]["start_error"]
    assert "(hf-fixedpoint) cannot run on a generic Transformers backend" in error
    assert "`pip install hf-fixedpoint` into vLLM's environment" in error
