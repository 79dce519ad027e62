"""DEQ-LM served natively by the package's vLLM plugin (``vllm_plugin/deq_lm.py``; needs vLLM: ``python
tools/vllm_check.py`` builds its environment and runs these; the default suite skips them).

* transformers' greedy tokens (``generate``, which solves the whole sequence again at every step) with prompts of
  different lengths in one batch (prefills and decodes of several requests solved together, each new token against the
  earlier tokens' cached keys at the fixed point), where every solve converges (the reference checks that it does),
  and their log-probabilities to 1e-4; for the default solver (Anderson) and for Broyden with the per-token norm;
* without the plugin the export is refused, with how to install it;
* settings the plugin cannot serve are refused at engine start (``fp_stop_fraction``, tensor parallelism), and an
  engine started without ``enforce_eager`` runs eagerly all the same (its config, built here).

All vLLM runs happen in two child processes (``vllm_runs``); the tests compare their reports with transformers.
"""

import pytest
import torch

from hf_fixedpoint.modeling import DEQLMConfig, DEQLMForCausalLM
from hf_fixedpoint.vllm_plugin.settings import check_engine

pytest.importorskip("vllm")

from tests.serving.test_vllm import run_children  # noqa: E402
from tests.serving.test_vllm_attractor import MAX_TOKENS, PROMPTS, SHAPE  # noqa: E402  (head dim 64)

# Tolerances the float32 solves reach (transformers' per sequence, vLLM's per token), with room for the iterations.
VARIANTS = {
    "anderson": {"fp_tol": 1e-6, "fp_max_iter": 60},
    "broyden_token_linf": {"fp_solver": "broyden", "fp_norm": "token_linf", "fp_tol": 1e-5, "fp_max_iter": 60},
}


def deq_export(path, own):
    """A tiny DEQ-LM with random weights: embeddings and an untied head of std 1, the block's weights of std 0.08 (the
    map contracts, the solves take about 20 iterations, and the greedy tokens vary; a tied head would mostly repeat the
    input token, since the fixed point stays near its embedding)."""
    torch.manual_seed(0)
    model = DEQLMForCausalLM(DEQLMConfig(**SHAPE, **own, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 if "embed" in name or "lm_head" in name else 0.08)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    for name, own in VARIANTS.items():
        deq_export(tmp / name, own)
    batch = {"prompts": PROMPTS, "extra_args": [{}] * len(PROMPTS)}
    specs = [{"model": str(tmp / name), "max_tokens": MAX_TOKENS, "batches": [batch], "logprobs": True}
             for name in VARIANTS]
    specs.append({"model": str(tmp / "anderson"), "max_tokens": 2, "batches": [],
                  "llm_kwargs": {"hf_overrides": {"fp_stop_fraction": 0.2}}})
    with_plugin = run_children(specs, tmp)
    without = run_children([{"model": str(tmp / "anderson"), "max_tokens": 2, "batches": []}], tmp / "anderson",
                           env={"VLLM_PLUGINS": ""})
    return tmp, with_plugin, without[0]


def reference(path):
    """transformers' greedy tokens of every prompt (one prompt at a time), the log-probabilities of those tokens, and
    whether every solve of the full sequence converged."""
    model = DEQLMForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logprobs, converged = [], [], True
    for ids in PROMPTS:
        full = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        with torch.no_grad():
            out = model(full)
        converged = converged and bool(out.fp_stats.converged.all())
        new = full[0, len(ids):]
        tokens.append(new.tolist())
        scores = out.logits[0, len(ids) - 1:-1].log_softmax(-1)
        logprobs.append(scores.gather(-1, new[:, None])[:, 0].tolist())
    return tokens, logprobs, converged


@pytest.mark.parametrize("index, name", list(enumerate(VARIANTS)))
def test_deq_lm_matches_transformers(served, index, name):
    tmp, runs, _ = served
    tokens, logprobs, converged = reference(tmp / name)
    assert converged, name  # the comparison holds where the solves converge
    got = runs[index]["batches"][0]
    assert got["tokens"] == tokens, name
    assert len({t for row in tokens for t in row}) > 5  # varied tokens: the comparison can fail
    torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_without_the_plugin_the_export_is_refused(served):
    error = served[2]["start_error"]
    assert "DEQLMModel (hf-fixedpoint) cannot run on a generic Transformers backend" in error  # vLLM asks AutoModel
    assert "`pip install hf-fixedpoint` into vLLM's environment" in error


def test_unservable_settings_are_refused_at_engine_start(served):
    error = served[1][len(VARIANTS)]["start_error"]
    assert "fp_stop_fraction=0.2" in error and "Allowed values: 0.0" in error
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* DEQLMConfig: .* Allowed values: 1\."):
        check_engine(DEQLMConfig(**SHAPE), 2)


def test_engine_runs_eagerly_when_not_asked_to(tmp_path, monkeypatch):
    """The solve's iteration count depends on the data: the config hook turns CUDA graphs and compilation off."""
    from vllm.config import CompilationMode
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    deq_export(tmp_path, {})
    config = EngineArgs(model=str(tmp_path), trust_remote_code=True, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=256).create_engine_config()
    assert config.model_config.enforce_eager and config.compilation_config.mode == CompilationMode.NONE
