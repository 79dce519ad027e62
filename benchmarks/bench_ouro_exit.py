"""Ouro early exit that skips compute: FLOPs and wall time per generated token, exit on vs off (CPU, one thread).

    python -m recipes.stars_ouro --output_dir runs/stars_ouro    # once: trains the STARS model (~9 min)
    python -m benchmarks.bench_ouro_exit                         # --model_dir runs/stars_ouro/stars, ~3-6 min
    python -m benchmarks.bench_ouro_exit --quick                 # 32 problems, one repeat
    git show HEAD~1:modeling/ouro/modeling_ouro.py > /tmp/before.py
    python -m benchmarks.bench_ouro_exit --before /tmp/before.py # that code's model interleaved with this checkout's

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
produced each token); exact match is the whole answer right. ``batch loops`` is the mean over the forward calls of
the loops the batch computed (a loop runs while any of its tokens, at any position, runs): each costs about a full
loop on a small model, where a loop costs its count of PyTorch calls, so the wall time follows it rather than the
FLOPs. Target (issue 16): a setting whose exact match is within 1 point of full depth with >= 1.5x fewer FLOPs and
>= 1.3x less wall time per token at batch 16.

``--before FILE`` loads the ``OuroForCausalLM`` of another version of ``modeling_ouro.py`` (imported as a module of
``hf_fixedpoint.modeling.ouro``) with the same weights and runs every setting with it too, interleaved with this
checkout's: a before/after comparison in one run, rows marked ``[before]``.
"""

import argparse
import importlib.util
import os
import sys
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


def computed_loops(states) -> int:
    """Loops a call computed: ``exit_mode="skip"`` repeats the last state object for the loops it ran on no token."""
    ran = len(states)
    while ran > 1 and states[ran - 1] is states[ran - 2]:
        ran -= 1
    return ran


def greedy(model, x, new, loops, kwargs):
    """Greedy decoding with the cache, forward by forward, EOS excluded (as ``generate(min_new_tokens=new)``):
    (tokens, FLOPs, loops run) of each generated token and the loops the batch computed in each forward."""
    cache, tokens, flops, ran, batch_loops = DynamicCache(), [], [], [], []
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
        batch_loops.append(computed_loops(out.loop_hidden_states))
    return torch.cat(tokens, dim=1), torch.stack(flops, dim=1), torch.stack(ran, dim=1), batch_loops


def check_generate(model, x, new, loops, kwargs):
    """``generate`` gives the decoding loop's tokens and reports its FLOPs."""
    tokens, spent, _, _ = greedy(model, x, new, loops, kwargs)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, total_ut_steps=loops, return_dict_in_generate=True, **kwargs)
    if not (torch.equal(out.sequences[:, x.shape[1]:], tokens) and torch.equal(out.flops, spent)):
        raise RuntimeError(f"generate disagrees with the decoding loop for {kwargs}")


def measure(prompts, answers, batch, loops, cases, repeats):
    """Per setting ``(name, generate kwargs, model)``: exact match, FLOPs and loops run per generated token, loops the
    batch computed per forward, and seconds per generated token: for each batch of prompts the fastest of ``repeats``
    runs, the settings interleaved batch by batch (in rotating order), so that changes of the background load hit
    every setting alike."""
    new, starts = answers.shape[1], range(0, len(prompts), batch)
    best = {name: [float("inf")] * len(starts) for name, _, _ in cases}
    stats = {name: {"hits": 0, "flops": 0.0, "loops": 0.0, "batch_loops": []} for name, _, _ in cases}
    with torch.no_grad():
        for repeat in range(repeats):
            for j, i in enumerate(starts):
                x = prompts[i : i + batch]
                for name, kwargs, model in cases[j % len(cases):] + cases[: j % len(cases)]:
                    start = time.perf_counter()
                    tokens, spent, ran, batch_loops = greedy(model, x, new, loops, kwargs)
                    best[name][j] = min(best[name][j], time.perf_counter() - start)
                    if repeat == 0:
                        stats[name]["hits"] += int((tokens == answers[i : i + batch]).all(-1).sum())
                        stats[name]["flops"] += float(spent.double().sum())
                        stats[name]["loops"] += float(ran.double().sum())
                        stats[name]["batch_loops"] += batch_loops
    tokens = len(prompts) * new
    return {name: {"exact_match": st["hits"] / len(prompts), "flops": st["flops"] / tokens,
                   "loops_run": st["loops"] / tokens, "batch_loops": sum(st["batch_loops"]) / len(st["batch_loops"]),
                   "s_per_token": sum(best[name]) / tokens}
            for name, st in stats.items()}


def load_before(path):
    """``OuroForCausalLM`` of another version of ``modeling_ouro.py``, imported as a module of the package (its
    relative imports resolve to this checkout's configuration and helpers)."""
    if not (path.endswith(".py") and os.path.isfile(path)):
        raise ValueError(f"--before={path!r} must be an existing modeling_ouro.py file (a .py file).")
    spec = importlib.util.spec_from_file_location("hf_fixedpoint.modeling.ouro._bench_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "OuroForCausalLM"):
        raise ValueError(f"--before={path!r} defines no OuroForCausalLM.")
    return module.OuroForCausalLM


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
    parser.add_argument("--before", default=None, help="another modeling_ouro.py: its model runs every setting too, "
                        "interleaved (rows marked [before])")
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.repeats = 32, 1
    if not os.path.isdir(args.model_dir):
        raise SystemExit(f"{args.model_dir} not found: train it with python -m recipes.stars_ouro --output_dir "
                         f"{os.path.dirname(args.model_dir) or '.'}")
    before = load_before(args.before) if args.before is not None else None
    torch.set_num_threads(1)
    model = OuroForCausalLM.from_pretrained(args.model_dir).float().eval()  # this checkout's code
    model.config.loop_guard_tol = None  # the depth guard is not what is measured here
    models = [("", model)]
    if before is not None:
        old = before.from_pretrained(args.model_dir).float().eval()
        old.config.loop_guard_tol = None
        models.append((" [before]", old))
    tokenizer = char_tokenizer()
    ids, _ = addition_batch(args.problems, args.digits, torch.Generator().manual_seed(EVAL_SEED), tokenizer)
    split = 2 * args.digits + 2  # "a+b=" | answer digits and EOS
    prompts, answers = ids[:, :split], ids[:, split:-1]  # the answer's digits, without EOS
    cases = settings(args)
    print(f"Ouro early exit: {args.model_dir}, {args.loops} loops at full depth, {args.problems} held-out "
          f"{args.digits}-digit additions, {answers.shape[1]} new tokens each; os.getloadavg() = "
          f"{os.getloadavg()[0]:.2f}")
    runs = [(name + tag, kwargs, m) for tag, m in models for name, kwargs in cases]
    results = {}
    for batch in args.batch_sizes:
        for _, kwargs, m in runs:  # warm-up, and the check against generate
            check_generate(m, prompts[:batch], answers.shape[1], args.loops, kwargs)
        measured = measure(prompts, answers, batch, args.loops, runs, args.repeats)
        print(f"\nbatch {batch}:  {'setting':<20s} {'exact':>6s} {'loops':>6s} {'batch loops':>11s} "
              f"{'MFLOP/tok':>10s} {'ms/tok':>7s} {'FLOPs x':>8s} {'wall x':>7s}")
        for tag, _ in models:  # ratios against the full depth of the same code
            base = measured[cases[0][0] + tag]
            for name, _ in cases:
                r = results[batch, name + tag] = measured[name + tag]
                r["flops_ratio"] = base["flops"] / r["flops"]
                r["wall_ratio"] = base["s_per_token"] / r["s_per_token"]
                print(f"{'':10s}{name + tag:<20s} {100 * r['exact_match']:6.1f} {r['loops_run']:6.2f} "
                      f"{r['batch_loops']:11.2f} {r['flops'] / 1e6:10.3f} {1e3 * r['s_per_token']:7.3f} "
                      f"{r['flops_ratio']:8.2f} {r['wall_ratio']:7.2f}")
        if len(models) > 1:
            compare(results, batch, cases)
    verdict(results, cases, max(args.batch_sizes))
    return results


def compare(results, batch, cases):
    """Before against now: the wall time of each setting, and whether the model reported the same results."""
    print(f"\nbatch {batch}, before -> now (ms/tok; full / setting):")
    for name, _ in cases:
        old, new = results[batch, name + " [before]"], results[batch, name]
        same = all(old[k] == new[k] for k in ("exact_match", "flops", "loops_run", "batch_loops"))
        print(f"  {name:<11s} {1e3 * old['s_per_token']:7.3f} -> {1e3 * new['s_per_token']:7.3f} ms/tok "
              f"({old['s_per_token'] / new['s_per_token']:.2f}x faster); full / setting {old['wall_ratio']:.2f}x -> "
              f"{new['wall_ratio']:.2f}x; {'same' if same else 'DIFFERENT'} exact match, loops and FLOPs")


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
