"""Ouro's self-speculative decoding through vLLM's draft-model speculation (needs vLLM, like the rest of
``tests/serving``): the export drafts at fewer loops from a second folder (``tools.vllm_speculative.draft_folder``:
the same files, ``total_ut_steps=d`` in its config) and verifies at the engine's loops.

* Greedy tokens are transformers' at the target's loops (``test_vllm`` checks vLLM without speculation against the
  same reference), with a 1-loop draft (prefix caching on) and a full-depth one (off).
* The draft runs at its own loop count: a full-depth draft has every drafted token accepted, the random model's
  1-loop draft does not.
* Per-request ``extra_args`` are refused with speculation (vLLM builds no custom logits processor then, so the model
  would never see them) instead of being served at the engine's loops.
"""

import pytest

pytest.importorskip("vllm")

from tests.serving.test_vllm import LOOPS, MAX_TOKENS, PROMPTS, ouro_export, reference, run_children  # noqa: E402
from tools.vllm_speculative import draft_folder  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speculative")
    ouro_export(tmp / "ouro")
    plain = {"prompts": PROMPTS, "extra_args": [{}] * 3}
    per_request = {"prompts": PROMPTS[:1], "extra_args": [{"total_ut_steps": 1}]}

    def spec(draft, prefix_caching, batches):
        return {"model": str(tmp / "ouro"), "max_tokens": MAX_TOKENS, "batches": batches, "spec_counters": True,
                "llm_kwargs": {"enable_prefix_caching": prefix_caching, "disable_log_stats": False,
                               "speculative_config": {"method": "draft_model", "model": draft,
                                                      "num_speculative_tokens": 4}}}

    runs = run_children([spec(draft_folder(tmp / "ouro", 1, tmp), True, [plain, per_request]),
                         spec(str(tmp / "ouro"), False, [plain])], tmp)
    return tmp, runs


def test_speculative_tokens_are_the_targets(served):
    tmp, runs = served
    want = reference(tmp / "ouro", LOOPS)
    for run in runs:
        assert run["batches"][0]["tokens"] == want


def test_the_draft_runs_at_its_own_loops(served):
    _, (shallow, full) = served
    assert full["counters"]["drafted"] > 0
    assert full["counters"]["accepted"] == full["counters"]["drafted"]
    assert 0 < shallow["counters"]["drafted"] and shallow["counters"]["accepted"] < shallow["counters"]["drafted"]


def test_per_request_settings_are_refused_with_speculation(served):
    error = served[1][0]["batches"][1]["error"]
    assert "extra_args ['total_ut_steps'] are not served with speculative decoding" in error
    assert "Allowed values" in error
