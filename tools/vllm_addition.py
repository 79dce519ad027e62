"""Score the addition demo's export (``make demo``: ``recipes/stars_ouro.py``) through vLLM: greedy exact match on the
recipe's held-out problems at given loop counts, side by side with transformers' on the same model.

    python tools/vllm_check.py --venv .venv-vllm                          # once: vLLM's environment with the package
    .venv-vllm/bin/python -m tools.vllm_addition runs/stars_ouro           # stars/ at 4 and 12 loops
    .venv-vllm/bin/python -m tools.vllm_addition runs/stars_ouro --runs stars,baseline --loops 1,4,12,16 \\
        --min_exact 0.99 --json vllm_addition.json                       # exit status 1 below 0.99

The problems are the recipe's (its ``EVAL_SEED``; ``--eval_size`` and ``--digits`` default to the run's
``metrics.json``). One vLLM engine per model folder (float32, eager), started with ``hf_overrides={"total_ut_steps":
max(loops)}`` (the paged cache holds that many loops); every problem is sent once per loop count with
``SamplingParams(extra_args={"total_ut_steps": k})``, all in one ``generate`` call. Prompt: the tokens of ``a+b=``;
greedy, at most ``digits + 2`` new tokens (the answer and the end token); a problem counts when vLLM's tokens are the
answer and the end token. Transformers: the recipe's own ``exact_match`` (each answer token the argmax given the
correct prefix: greedy decoding's condition) and ``generate``'s greedy tokens, which ``agree`` compares with vLLM's
(the share of problems with the same tokens). vLLM starts worker processes, so this runs as a script;
``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB).
"""

import argparse
import gc
import json
import os
import sys

import torch


def problems(eval_size, digits):
    """The recipe's held-out problems: ``(prompts, answers)`` as token-id lists (answer = sum digits + end token),
    and the ``(ids, labels)`` its ``exact_match`` takes."""
    from recipes.stars_ouro import EVAL_SEED, addition_batch, char_tokenizer

    ids, labels = addition_batch(eval_size, digits, torch.Generator().manual_seed(EVAL_SEED), char_tokenizer())
    cut = 2 * digits + 2  # "a+b="
    return [row[:cut] for row in ids.tolist()], [row[cut:] for row in ids.tolist()], (ids, labels)


def until_end(tokens, end):
    """``tokens`` up to and with the first ``end`` token."""
    return tokens[: tokens.index(end) + 1] if end in tokens else tokens


def transformers_scores(folder, loops, prompts, tensors, max_tokens):
    """Per loop count: the recipe's exact match and ``generate``'s greedy tokens (to the end token)."""
    from hf_fixedpoint.modeling import OuroForCausalLM
    from recipes.stars_ouro import exact_match

    model = OuroForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor(prompts)
    scores = {}
    for k in loops:
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                 total_ut_steps=k)[:, x.shape[1]:]
        tokens = [until_end(row, model.config.eos_token_id) for row in out.tolist()]
        scores[k] = {"exact": exact_match(model, *tensors, k), "tokens": tokens}
    return scores


def vllm_tokens(folder, loops, prompts, max_tokens):
    """Per loop count: vLLM's greedy tokens of every prompt (one engine, the depth per request)."""
    from vllm import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", enforce_eager=True, trust_remote_code=True, skip_tokenizer_init=True,
              max_model_len=len(prompts[0]) + max_tokens + 8, seed=0,
              hf_overrides={"total_ut_steps": max(loops)})
    requests = [{"prompt_token_ids": p} for _ in loops for p in prompts]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"total_ut_steps": k})
              for k in loops for _ in prompts]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
    del llm  # shuts the engine down before the next folder's starts
    gc.collect()
    return {k: outputs[i * len(prompts):(i + 1) * len(prompts)] for i, k in enumerate(loops)}


def score(folder, loops, eval_size, digits):
    """One model folder: per loop count, vLLM's and transformers' exact match and their token agreement."""
    prompts, answers, tensors = problems(eval_size, digits)
    served = vllm_tokens(folder, loops, prompts, digits + 2)
    reference = transformers_scores(folder, loops, prompts, tensors, digits + 2)
    n = len(prompts)
    return {k: {"vllm": sum(a == b for a, b in zip(served[k], answers)) / n,
                "transformers": reference[k]["exact"],
                "agree": sum(a == b for a, b in zip(served[k], reference[k]["tokens"])) / n} for k in loops}


def parse_problems(parser, argv, lists=("loops",)):
    """``parser``'s arguments from ``argv``, with the problem options added (``--eval_size``, ``--digits``: default the
    run's ``metrics.json`` in ``output_dir``, else 1000 and 3); the options named in ``lists`` become lists of the
    comma-separated integers >= 1 they hold."""
    parser.add_argument("--eval_size", type=int, default=None, help="problems (default: the run's, else 1000)")
    parser.add_argument("--digits", type=int, default=None, help="digits per operand (default: the run's, else 3)")
    args = parser.parse_args(argv)
    for name in lists:
        text = getattr(args, name)
        try:
            values = [int(k) for k in text.split(",") if k.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            parser.error(f"--{name}={text!r}: allowed values are comma-separated integers >= 1")
        setattr(args, name, values)
    metrics = os.path.join(args.output_dir, "metrics.json")
    run_args = json.load(open(metrics))["args"] if os.path.exists(metrics) else {}
    args.eval_size = args.eval_size or run_args.get("eval_size", 1000)
    args.digits = args.digits or run_args.get("digits", 3)
    return args


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="the recipe's --output_dir (holds stars/, baseline/, metrics.json)")
    parser.add_argument("--runs", default="stars", help="comma-separated model folders in output_dir")
    parser.add_argument("--loops", default="4,12", help="comma-separated loop counts")
    parser.add_argument("--min_exact", type=float, default=None, help="exit status 1 when vLLM scores below it")
    parser.add_argument("--json", default=None, help="also write the scores here")
    return parse_problems(parser, argv)


def main(argv=None):
    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = {run: score(os.path.join(args.output_dir, run), args.loops, args.eval_size, args.digits)
               for run in [r.strip() for r in args.runs.split(",") if r.strip()]}
    print(f"exact match (%) on {args.eval_size} held-out {args.digits}-digit additions, greedy")
    print(f"{'run':<10s}{'loops':>6s}{'vLLM':>8s}{'transformers':>14s}{'agree':>8s}")
    for run, rows in results.items():
        for k, row in rows.items():
            print(f"{run:<10s}{k:>6d}{100 * row['vllm']:8.1f}{100 * row['transformers']:14.1f}"
                  f"{100 * row['agree']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    low = [(run, k) for run, rows in results.items() for k, row in rows.items()
           if args.min_exact is not None and row["vllm"] < args.min_exact]
    if low:
        print(f"below --min_exact {args.min_exact}: {low}")
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
