"""Ouro early exit that skips compute: FLOPs and wall time per generated token, exit on vs off (CPU, one thread).

    python -m recipes.stars_ouro --output_dir runs/stars_ouro    # once: trains the STARS model (~9 min)
    python -m benchmarks.bench_ouro_exit                         # --model_dir runs/stars_ouro/stars, ~3-6 min
    python -m benchmarks.bench_ouro_exit --quick                 # 32 problems, one repeat

Held-out 3-digit additions of the recipe (its evaluation seed; numbers least significant digit first): the prompt
``a+b=`` is greedily continued for the answer's digits (a fixed count of new tokens, so every setting generates as
many tokens). Full depth (``exit_mode="select"`` with no exit rule: every loop for every token) is the
baseline; each exit setting runs ``exit_mode="skip"`` with the gate's Q-exit threshold (``q``) or the state-change
tolerance (``tol``). Timed: the forward calls of a greedy decoding loop with the cache (one forward per new token;
``generate`` adds a fixed cost per call that the exit does not change, and is checked, once per setting, to give the
same tokens and FLOPs). For batch sizes 1 and 16 the settings are interleaved batch of prompts by batch of prompts,
so that background load hits all alike; a setting's time is the sum over the batches of prompts of the fastest of
``--repeats`` runs. FLOPs per generated token are those the
model reports (``generate(..., return_dict_in_generate=True).flops``: matrix-multiply FLOPs of the position that
produced each token); exact match is the whole answer right. Target (issue 16): a setting whose exact match is within 1
point of full depth with >= 1.5x fewer FLOPs and >= 1.3x less wall time per token at batch 16.
"""

import argparse
import os
import time

import torch
from transformers import DynamicCache

from hf_fixedpoint.modeling import OuroForCausalLM
from recipes.stars_ouro import addition_batch, char_tokenizer

FLOPS_TARGET, WALL_TARGET = 1.5, 1.3
EVAL_SEED = 10**6 + 7  # the recipe's held-out problems


def settings(args):
    """``(name, generate kwargs)``: the baseline first."""
    out = [("full depth", {"exit_mode": "select"})]
    out += [(f"q={q:g}", {"exit_mode": "skip", "exit_threshold": q}) for q in args.thresholds]
    out += [(f"tol={t:g}", {"exit_mode": "skip", "exit_tol": t}) for t in args.tols]
    return out


def greedy(model, x, new, loops, kwargs):
    """Greedy decoding with the cache, forward by forward, EOS excluded (as ``generate(min_new_tokens=new)``):
    (tokens, FLOPs, loops run) of each generated token."""
    cache, tokens, flops, ran = DynamicCache(), [], [], []
    eos = model.generation_config.eos_token_id
    for _ in range(new):
        out = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1, total_ut_steps=loops, **kwargs)
        logits = out.logits[:, -1]
        if eos is not None:
            logits[:, eos] = float("-inf")
        x = logits.argmax(-1, keepdim=True)
        tokens.append(x)
        flops.append(out.flops[:, -1])
        ran.append(out.exit_loop[:, -1] + 1)
    return torch.cat(tokens, dim=1), torch.stack(flops, dim=1), torch.stack(ran, dim=1)


def check_generate(model, x, new, loops, kwargs):
    """``generate`` gives the decoding loop's tokens and reports its FLOPs."""
    tokens, spent, _ = greedy(model, x, new, loops, kwargs)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, total_ut_steps=loops, return_dict_in_generate=True, **kwargs)
    if not (torch.equal(out.sequences[:, x.shape[1]:], tokens) and torch.equal(out.flops, spent)):
        raise RuntimeError(f"generate disagrees with the decoding loop for {kwargs}")


def measure(model, prompts, answers, batch, loops, cases, repeats):
    """Per setting: exact match, FLOPs and loops run per generated token, and seconds per generated token: for each
    batch of prompts the fastest of ``repeats`` runs, the settings interleaved batch by batch (in rotating order),
    so that changes of the background load hit every setting alike."""
    new, starts = answers.shape[1], range(0, len(prompts), batch)
    best = {name: [float("inf")] * len(starts) for name, _ in cases}
    stats = {name: {"hits": 0, "flops": 0.0, "loops": 0.0} for name, _ in cases}
    with torch.no_grad():
        for repeat in range(repeats):
            for j, i in enumerate(starts):
                x = prompts[i : i + batch]
                for name, kwargs in cases[j % len(cases):] + cases[: j % len(cases)]:
                    start = time.perf_counter()
                    tokens, spent, ran = greedy(model, x, new, loops, kwargs)
                    best[name][j] = min(best[name][j], time.perf_counter() - start)
                    if repeat == 0:
                        stats[name]["hits"] += int((tokens == answers[i : i + batch]).all(-1).sum())
                        stats[name]["flops"] += float(spent.double().sum())
                        stats[name]["loops"] += float(ran.double().sum())
    tokens = len(prompts) * new
    return {name: {"exact_match": st["hits"] / len(prompts), "flops": st["flops"] / tokens,
                   "loops_run": st["loops"] / tokens, "s_per_token": sum(best[name]) / tokens}
            for name, st in stats.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", default="runs/stars_ouro/stars")
    parser.add_argument("--loops", type=int, default=8, help="full depth (total_ut_steps)")
    parser.add_argument("--problems", type=int, default=128)
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.5, 0.9, 0.99])
    parser.add_argument("--tols", type=float, nargs="*", default=[0.2, 0.1, 0.05])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="32 problems, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.repeats = 32, 1
    if not os.path.isdir(args.model_dir):
        raise SystemExit(f"{args.model_dir} not found: train it with python -m recipes.stars_ouro --output_dir "
                         f"{os.path.dirname(args.model_dir) or '.'}")
    torch.set_num_threads(1)
    model = OuroForCausalLM.from_pretrained(args.model_dir).float().eval()  # this checkout's code
    model.config.loop_guard_tol = None  # the depth guard is not what is measured here
    tokenizer = char_tokenizer()
    ids, _ = addition_batch(args.problems, args.digits, torch.Generator().manual_seed(EVAL_SEED), tokenizer)
    split = 2 * args.digits + 2  # "a+b=" | answer digits and EOS
    prompts, answers = ids[:, :split], ids[:, split:-1]  # the answer's digits, without EOS
    cases = settings(args)
    print(f"Ouro early exit: {args.model_dir}, {args.loops} loops at full depth, {args.problems} held-out "
          f"{args.digits}-digit additions, {answers.shape[1]} new tokens each; os.getloadavg() = "
          f"{os.getloadavg()[0]:.2f}")
    results = {}
    for batch in args.batch_sizes:
        for _, kwargs in cases:  # warm-up, and the check against generate
            check_generate(model, prompts[:batch], answers.shape[1], args.loops, kwargs)
        measured = measure(model, prompts, answers, batch, args.loops, cases, args.repeats)
        base = measured[cases[0][0]]
        print(f"\nbatch {batch}:  {'setting':<11s} {'exact':>6s} {'loops':>6s} {'MFLOP/tok':>10s} {'ms/tok':>7s} "
              f"{'FLOPs x':>8s} {'wall x':>7s}")
        for name, _ in cases:
            r = results[batch, name] = measured[name]
            r["flops_ratio"], r["wall_ratio"] = base["flops"] / r["flops"], base["s_per_token"] / r["s_per_token"]
            print(f"{'':10s}{name:<11s} {100 * r['exact_match']:6.1f} {r['loops_run']:6.2f} {r['flops'] / 1e6:10.3f} "
                  f"{1e3 * r['s_per_token']:7.3f} {r['flops_ratio']:8.2f} {r['wall_ratio']:7.2f}")
    verdict(results, cases, max(args.batch_sizes))
    return results


def verdict(results, cases, batch):
    """The target for every setting that keeps exact match within 1 point of full depth; met if one meets both."""
    base = results[batch, cases[0][0]]
    ok = [name for name, _ in cases[1:] if results[batch, name]["exact_match"] >= base["exact_match"] - 0.01]
    print(f"\nbatch {batch}, settings within 1 point of full depth's exact match ({100 * base['exact_match']:.1f}); "
          f"target >= {FLOPS_TARGET}x fewer FLOPs and >= {WALL_TARGET}x less wall time per token:")
    met = []
    for name in ok:
        r = results[batch, name]
        if r["flops_ratio"] >= FLOPS_TARGET and r["wall_ratio"] >= WALL_TARGET:
            met.append(name)
        print(f"  {name:<9s} exact {100 * r['exact_match']:5.1f}: {r['flops_ratio']:.2f}x FLOPs, "
              f"{r['wall_ratio']:.2f}x wall: {'PASS' if name in met else 'FAIL'}")
    print(f"target {'PASS (' + ', '.join(met) + ')' if met else 'FAIL'}")


if __name__ == "__main__":
    main()
