"""Attractor LM served natively by the package's vLLM plugin (needs vLLM: ``python tools/vllm_check.py`` builds its
environment and runs these; the default suite skips them).

* transformers' greedy tokens, with prompts of different lengths in one batch (prefills and decodes of several
  requests solved together), for the default export (additive injection, Anderson) and for one with grouped-query
  attention, two attractor layers, the concat injection and another solver;
* ``readout_iters`` set with ``hf_overrides`` (a capped solve, and the T=0 readout of the proposal);
* a setting whose result would depend on the batch (``fp_stop_fraction``) is refused at engine start.

All vLLM runs happen in one child process (``vllm_runs``); the tests compare its reports with transformers.
"""

import pytest
import torch

pytest.importorskip("vllm")

from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM  # noqa: E402
from tests.serving.test_vllm import run_children  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 3], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
MAX_TOKENS = 12
SHAPE = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
         "max_position_embeddings": 256}  # head dim 64 (vLLM's CPU attention takes 32, 64, 80, ...)
VARIANTS = {
    "default": {"num_backbone_layers": 1, "num_attractor_layers": 1},
    "gqa_concat_broyden": {"num_key_value_heads": 1, "num_backbone_layers": 1, "num_attractor_layers": 2,
                           "injection": "concat", "fp_solver": "broyden", "fp_tol": 1e-5, "fp_max_iter": 30},
}
READOUTS = [2, 0]  # readout_iters given with hf_overrides to the default export


def attractor_export(path, own):
    """A tiny Attractor LM with random weights of some size (std 0.2: varied greedy tokens; the solves converge)."""
    torch.manual_seed(0)
    model = AttractorForCausalLM(AttractorConfig(**SHAPE, **own))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    for name, own in VARIANTS.items():
        attractor_export(tmp / name, own)
    batch = {"prompts": PROMPTS, "extra_args": [{}] * len(PROMPTS)}
    specs = [{"model": str(tmp / name), "max_tokens": MAX_TOKENS, "batches": [batch]} for name in VARIANTS]
    specs += [{"model": str(tmp / "default"), "max_tokens": MAX_TOKENS, "batches": [batch],
               "llm_kwargs": {"hf_overrides": {"readout_iters": k}}} for k in READOUTS]
    specs.append({"model": str(tmp / "default"), "max_tokens": 2, "batches": [],
                  "llm_kwargs": {"hf_overrides": {"fp_stop_fraction": 0.2}}})
    return tmp, run_children(specs, tmp)


def reference(path, **kwargs):
    """transformers' greedy tokens of every prompt, one prompt at a time; ``kwargs``: generate's per-call knobs."""
    model = AttractorForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)[0, len(ids):]
            .tolist() for ids in PROMPTS]


@pytest.mark.parametrize("index, name", list(enumerate(VARIANTS)))
def test_attractor_matches_transformers(served, index, name):
    tmp, runs = served
    assert runs[index]["batches"][0]["tokens"] == reference(tmp / name), name


@pytest.mark.parametrize("index, readout", list(enumerate(READOUTS)))
def test_readout_iters_from_hf_overrides(served, index, readout):
    tmp, runs = served
    got = runs[len(VARIANTS) + index]["batches"][0]["tokens"]
    assert got == reference(tmp / "default", readout_iters=readout)
    assert got != runs[0]["batches"][0]["tokens"]  # the setting reached the served model


def test_batch_dependent_stop_fraction_is_refused(served):
    error = served[1][-1]["start_error"]
    assert "fp_stop_fraction=0.2" in error and "Allowed values: 0.0" in error
