"""vLLM runs for ``tests/serving``, in a child process (vLLM's engine spawns workers, so it starts under
``if __name__ == "__main__"``): ``python -m tests.serving.vllm_runs <spec.json> <report.json>``.

The spec lists runs; each run starts one ``vllm.LLM`` (greedy, float32, eager) and records, per request batch, the
generated tokens (and their log-probabilities where the run sets ``"logprobs": true``), or the error of the start or of
a request; where the run sets ``"spec_counters": true`` (with ``"disable_log_stats": false`` in its ``llm_kwargs``),
also vLLM's speculative-decoding counters after its batches (``tools.vllm_speculative.counters``).
"""

import gc
import json
import sys


def sampling(max_tokens, extra, logprobs=False):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra or None,
                          logprobs=0 if logprobs else None)


def run(spec) -> dict:
    from vllm import LLM

    try:
        llm = LLM(spec["model"], dtype="float32", enforce_eager=True, trust_remote_code=True, skip_tokenizer_init=True,
                  max_model_len=256, seed=0, **spec.get("llm_kwargs", {}))
    except Exception as err:  # the refusal under test
        return {"start_error": f"{type(err).__name__}: {err}"}
    report = {"batches": []}
    for batch in spec["batches"]:
        prompts = [{"prompt_token_ids": ids} for ids in batch["prompts"]]
        params = [sampling(spec["max_tokens"], extra, spec.get("logprobs")) for extra in batch["extra_args"]]
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            report["batches"].append({"tokens": [list(o.outputs[0].token_ids) for o in outputs]})
            if spec.get("logprobs"):  # each generated token's log-probability
                report["batches"][-1]["logprobs"] = [[step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
                                                     for c in (o.outputs[0] for o in outputs)]
        except Exception as err:
            report["batches"].append({"error": f"{type(err).__name__}: {err}"})
    if spec.get("spec_counters"):
        from tools.vllm_speculative import counters

        report["counters"] = counters(llm)
    del llm  # shuts the engine down before the next run starts its own
    gc.collect()
    return report


if __name__ == "__main__":
    specs = json.load(open(sys.argv[1]))
    json.dump([run(spec) for spec in specs], open(sys.argv[2], "w"))
