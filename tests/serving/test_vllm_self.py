"""SELF-LLaMA and SELF-Mistral served by the vLLM plugin (``vllm_plugin/self_fpsa.py``; needs vLLM, the default suite
skips it):

* greedy tokens equal transformers' ``generate`` per prompt, prompts of different lengths in one batch and the same
  prompts beside other batch-mates, where every solve converges (the reference checks that it does), and so do their
  log-probabilities to 1e-5 (measured: 1e-6; 7e-5 when the converged keys are not stored after each solve);
* ``fp_max_iter=1`` (set with ``hf_overrides``) gives the base model's tokens, which differ from the solved ones;
* SELF-Mistral with a sliding window shorter than prompt plus output, and a learned per-head temperature;
* settings the plugin cannot serve are refused at engine start, naming the setting and the allowed values, and an
  engine started without ``enforce_eager`` runs eagerly all the same (its config, built here).

All engines run in one child process (``vllm_runs``); the tests compare its report with transformers.
"""

import pytest
import torch

from hf_fixedpoint.modeling import SelfLlamaConfig, SelfLlamaForCausalLM, SelfMistralConfig, SelfMistralForCausalLM
from hf_fixedpoint.vllm_plugin.settings import check_engine

pytest.importorskip("vllm")

from tests.serving.test_vllm import run_children  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 3]]
MATES = [[9, 10, 11, 12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48], [5, 6, 7, 8]]  # the same prompts, other mates
MAX_TOKENS = 12
WINDOW = 4  # SELF-Mistral's sliding window: shorter than every prompt plus its output
SHAPE = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 256}


def randomize(model, seed):
    """Weights of std 0.05: large enough that the solve changes the greedy tokens (the default init's 0.02 leaves them
    those of one step), small enough that every solve converges within the default cap."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
            elif p.dim() == 1 and p.shape[0] == SHAPE["num_attention_heads"]:  # learned log-temperatures
                p.uniform_(-0.5, 0.5)
    return model


def llama_export(path):
    randomize(SelfLlamaForCausalLM(SelfLlamaConfig(**SHAPE)), 0).save_pretrained(path)


def mistral_export(path):
    config = SelfMistralConfig(**SHAPE, sliding_window=WINDOW, fpsa_learn_temperature=True)
    randomize(SelfMistralForCausalLM(config), 1).save_pretrained(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served_self")
    llama_export(tmp / "llama")
    mistral_export(tmp / "mistral")
    batches = [{"prompts": PROMPTS, "extra_args": [{}] * 3}, {"prompts": MATES, "extra_args": [{}] * 3}]
    specs = [{"model": str(tmp / "llama"), "max_tokens": MAX_TOKENS, "batches": batches, "logprobs": True},
             {"model": str(tmp / "llama"), "max_tokens": MAX_TOKENS, "batches": batches[:1],
              "llm_kwargs": {"hf_overrides": {"fp_max_iter": 1}}},
             {"model": str(tmp / "mistral"), "max_tokens": MAX_TOKENS, "batches": batches[:1]},
             {"model": str(tmp / "llama"), "max_tokens": 2, "batches": [],
              "llm_kwargs": {"hf_overrides": {"fp_stop_fraction": 0.5}}}]
    return tmp, run_children(specs, tmp)


def reference(model_class, path, prompts, config_changes=None, logprobs=None, **call):
    """transformers' greedy tokens per prompt (batch of one each), and whether every solve converged; ``logprobs``: a
    list that receives each prompt's generated tokens' log-probabilities."""
    model = model_class.from_pretrained(path, dtype=torch.float32, **(config_changes or {})).eval()
    tokens, stats = [], []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, fp_stats_log=stats,
                             output_scores=True, return_dict_in_generate=True, **call)
        new = out.sequences[0, len(ids):]
        tokens.append(new.tolist())
        if logprobs is not None:
            logprobs.append([torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, new)])
    return tokens, all(s.summary()["fpsa_cap_hit_rate"] == 0.0 for s in stats)


def test_self_llama_matches_transformers_in_any_batch(served):
    tmp, runs = served
    for batch, prompts in zip(runs[0]["batches"], (PROMPTS, MATES)):
        logprobs = []
        want, converged = reference(SelfLlamaForCausalLM, tmp / "llama", prompts, logprobs=logprobs)
        assert converged  # the setting where the exact tokens are promised
        assert batch["tokens"] == want
        torch.testing.assert_close(torch.tensor(batch["logprobs"]), torch.tensor(logprobs), atol=1e-5, rtol=0)


def test_one_iteration_is_the_base_model(served):
    tmp, runs = served
    base, _ = reference(SelfLlamaForCausalLM, tmp / "llama", PROMPTS, fp_max_iter=1)
    assert runs[1]["batches"][0]["tokens"] == base
    assert base != runs[0]["batches"][0]["tokens"]  # the solve changes the tokens: the comparison above can fail


def test_self_mistral_sliding_window_and_temperature(served):
    tmp, runs = served
    want, converged = reference(SelfMistralForCausalLM, tmp / "mistral", PROMPTS)
    assert converged
    assert runs[2]["batches"][0]["tokens"] == want
    windowless, _ = reference(SelfMistralForCausalLM, tmp / "mistral", PROMPTS, {"sliding_window": None})
    assert windowless != want  # the window changes the tokens: the comparison above can fail


def test_unservable_settings_are_refused_at_engine_start(served):
    error = served[1][3]["start_error"]
    assert "fp_stop_fraction=0.5" in error and "Allowed values: 0.0" in error


def test_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* Allowed values: 1\."):
        check_engine(SelfLlamaConfig(**SHAPE), 2)
    check_engine(SelfLlamaConfig(**SHAPE), 1)


def test_engine_runs_eagerly_when_not_asked_to(tmp_path, monkeypatch):
    """The solves' iteration counts depend on the data: the config hook turns CUDA graphs and compilation off."""
    from vllm.config import CompilationMode
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llama_export(tmp_path)
    config = EngineArgs(model=str(tmp_path), trust_remote_code=True, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=256).create_engine_config()
    assert config.model_config.enforce_eager and config.compilation_config.mode == CompilationMode.NONE
