"""Whole Sudoku puzzles at CPU scale: FPRM, TRM (attention and ``mlp_t``), Attractor-reasoning and URM at matched
parameters and training time, on generated puzzles with a fixed number of blank cells (the difficulty control).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_sudoku_cpu --blanks 20 --minutes 3              # every model
    OMP_NUM_THREADS=1 python -m benchmarks.bench_sudoku_cpu --models fprm fprm_linf --blanks 20 30 --minutes 3
    OMP_NUM_THREADS=1 python -m benchmarks.bench_sudoku_cpu --models fprm fprm_k17 --blanks 5 --minutes 6 --lr 3e-3 \
        --breakdown

What it does, top to bottom:
1. sizes: each model's hidden size (``fprm_k17``'s too) is picked so its parameter count is the closest to FPRM's
   (3 x 3 convolution) at ``--hidden`` (multiples of ``--heads``; the table prints the counts);
2. runs: for each blank count and model, ``recipes.reasoning.main`` trains on ``--train_puzzles`` generated puzzles
   (with ``--num_aug`` symmetry copies) for ``--minutes`` of training time (evaluations excluded) or ``--max_steps``
   optimizer steps, one thread, and evaluates once at the end on ``--test_puzzles`` new puzzles with the same blank
   count (the recipe's EMA weights, its evaluation: FPRM one adaptive solve, TRM/URM ``halt_max_steps`` supervision
   steps); ``--cross_eval`` also evaluates each trained FPRM with the other ``solve_mode``;
3. one table: model, parameters, training minutes, optimizer steps, exact-puzzle accuracy, accuracy on the blank
   cells, mean iterations at evaluation (FPRM: solver steps; TRM/URM: supervision steps up to the first positive
   Q-halt logit); ``--breakdown`` adds the accuracy on the blank cells that are the only blank of their row, column
   or box, and on those alone in none (which constraints a model learned).
"""

import argparse
import json
import os
import tempfile
import time

import torch

from hf_fixedpoint.puzzles import build_dataset
from recipes import reasoning

# name -> (--model of the recipe, --model_kwargs). FPRM with its 3x3 grid convolution; TRM-MLP as the official
# Sudoku model (sequence MLP, no positional encoding) but with MLP expansion 2: at hidden 64 its sequence MLPs over
# 82 positions alone hold more parameters than the whole FPRM, so no hidden size matches it at expansion 4.
# fprm_k17: the 2-D convolution widened to 17 x 17 (offsets -8..8), so every cell reads its whole row and column in
# one step; with the research code's 3 x 3 kernel and rotary 1-d positions FPRM learns the row constraint only (a
# blank alone in its row: 1.000, its column: no better than the others; docs/reasoning.md). fprm_pos: the same 3 x 3
# model with a learned embedding per cell (pos_encodings="learned", TRM/HRM's option) in place of the rotary one.
VARIANTS = {
    "fprm": ("fprm", {"conv": "2d", "conv_kernel": 3}),
    "fprm_k17": ("fprm", {"conv": "2d", "conv_kernel": 17}),
    "fprm_linf": ("fprm", {"conv": "2d", "conv_kernel": 3, "fp_norm": "linf"}),
    "fprm_per_sample": ("fprm", {"conv": "2d", "conv_kernel": 3, "solve_mode": "per_sample"}),
    "fprm_pos": ("fprm", {"conv": "2d", "conv_kernel": 3, "pos_encodings": "learned"}),  # learned, in place of rope
    "trm": ("trm", {}),
    "trm_mlp_t": ("trm", {"mlp_t": True, "pos_encodings": "none", "expansion": 2}),  # expansion 4: 2x the params
    "attractor": ("attractor", {}),
    "urm": ("urm", {}),
}
SOLVE_MODES = ("official", "per_sample")
DIVERGED = {"exact_accuracy": float("nan"), "cell_accuracy_changed": float("nan"), "iterations_mean": float("nan")}


def recipe_argv(args, name, hidden, blanks, output_dir):
    model, kwargs = VARIANTS[name]
    return ["--model", model, "--task", "sudoku", "--seed", str(args.seed), "--hidden_size", str(hidden),
            "--num_attention_heads", str(args.heads), "--batch_size", str(args.batch_size),
            "--task_kwargs", json.dumps({"num_puzzles": args.train_puzzles, "num_aug": args.num_aug,
                                         "num_blanks": blanks}),
            "--test_task_kwargs", json.dumps({"num_puzzles": args.test_puzzles, "num_blanks": blanks}),
            "--model_kwargs", json.dumps(kwargs), "--max_steps", str(args.max_steps), "--lr", str(args.lr),
            "--eval_every", str(args.eval_every or 10**9), "--output_dir", output_dir]


def count_parameters(args, name, hidden, meta):
    recipe_args = reasoning.parse_args(recipe_argv(args, name, hidden, 1, "unused"))
    return sum(p.numel() for p in reasoning.build_model(recipe_args, meta).parameters())


def matched_hidden(args, meta):
    """1. Hidden size per model: the multiple of ``--heads`` whose parameter count is nearest FPRM's at --hidden."""
    target = count_parameters(args, "fprm", args.hidden, meta)
    sizes = {}
    for name in args.models:
        if name == "fprm":
            sizes[name] = (args.hidden, target)
            continue
        lo, hi = 1, 4 * args.hidden // args.heads  # bisection: the count grows with the hidden size
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if count_parameters(args, name, mid * args.heads, meta) < target else (lo, mid)
        counts = {h: count_parameters(args, name, h, meta) for h in {max(lo - 1, 1) * args.heads, lo * args.heads}}
        best = min(counts, key=lambda h: abs(counts[h] - target))
        sizes[name] = (best, counts[best])
    return target, sizes


def run(args, name, hidden, blanks, folder):
    """2. Train and evaluate one model with the recipe; returns its final evaluation and training record."""
    argv = recipe_argv(args, name, hidden, blanks, folder)
    if args.minutes > 0:
        argv += ["--max_train_seconds", str(60 * args.minutes)]
    reasoning.main(argv)
    with open(os.path.join(folder, "metrics.json")) as f:
        metrics = json.load(f)
    (result,) = (v for k, v in metrics["final"].items() if k != "step")
    return result, metrics["final"]["step"], metrics["train_seconds"]


def cross_eval(args, name, hidden, blanks, folder):
    """``--cross_eval``: the trained FPRM evaluated with the other ``solve_mode`` (``--init_from``, no training)."""
    _, kwargs = VARIANTS[name]
    other = [m for m in SOLVE_MODES if m != kwargs.get("solve_mode", "official")][0]
    argv = recipe_argv(args, name, hidden, blanks, folder + "_cross")
    argv[argv.index("--model_kwargs") + 1] = json.dumps({"solve_mode": other})  # overrides the saved config
    argv += ["--init_from", folder, "--max_steps", "0", "--ema_rate", "0"]
    reasoning.main(argv)
    with open(os.path.join(folder + "_cross", "metrics.json")) as f:
        final = json.load(f)["final"]
    return other, next(v for k, v in final.items() if k != "step")


def alone_in_unit(inputs, labels):
    """``{unit: (B, 81) bool}`` for ``row``, ``column`` and ``box``: the blank cells (input differs from the label)
    that are the only blank of their row, column or 3 x 3 box (the one missing digit of that unit)."""
    blank = (inputs != labels).view(-1, 9, 9)
    B = blank.shape[0]
    box = blank.view(B, 3, 3, 3, 3).sum((2, 4), keepdim=True).expand(B, 3, 3, 3, 3).reshape(B, 9, 9)
    counts = {"row": blank.sum(2, keepdim=True).expand(B, 9, 9), "column": blank.sum(1, keepdim=True).expand(B, 9, 9),
              "box": box}
    return {unit: (blank & (n == 1)).reshape(B, 81) for unit, n in counts.items()}


@torch.no_grad()
def breakdown(args, name, blanks, folder):
    """``--breakdown``: accuracy of the trained model (the exported EMA weights, the recipe's evaluation) on the blank
    cells that are alone in their row, column or box, and on those alone in none of them: which constraints it
    learned. Returns ``{group: (cells, accuracy)}``."""
    model = reasoning.MODELS[VARIANTS[name][0]][1].from_pretrained(folder).eval()
    ds, _ = build_dataset("sudoku", "test", seed=args.seed, num_puzzles=args.test_puzzles, num_blanks=blanks)
    data = ds.with_format("torch", columns=["inputs", "labels", "puzzle_identifiers"])[:]
    b = {k: data[k].long() for k in ("inputs", "labels", "puzzle_identifiers")}
    if VARIANTS[name][0] == "fprm":
        logits = model(b["inputs"], b["puzzle_identifiers"]).logits
    else:
        logits = reasoning.supervised_eval(model, b, "cpu", model.config.halt_max_steps)[0].logits
    right = logits.argmax(-1) == b["labels"]
    groups = alone_in_unit(b["inputs"], b["labels"])
    groups["none"] = (b["inputs"] != b["labels"]) & ~(groups["row"] | groups["column"] | groups["box"])
    return {g: (int(m.sum()), right[m].float().mean().item() if m.any() else float("nan")) for g, m in groups.items()}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--blanks", nargs="+", type=int, default=[20], help="blank cells per puzzle (difficulty)")
    parser.add_argument("--minutes", type=float, default=3.0, help="training minutes per model (0: --max_steps only)")
    parser.add_argument("--max_steps", type=int, default=100000, help="optimizer steps per model (a cap)")
    parser.add_argument("--lr", type=float, default=1e-3, help="the recipe's --lr for every model")
    parser.add_argument("--eval_every", type=int, default=0, help="also evaluate every N steps (0: at the end only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64, help="FPRM's hidden size; the others are matched to it")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--train_puzzles", type=int, default=1000)
    parser.add_argument("--num_aug", type=int, default=3)
    parser.add_argument("--test_puzzles", type=int, default=200)
    parser.add_argument("--cross_eval", action="store_true", help="FPRM also evaluated with the other solve_mode")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print the accuracy on blanks alone in their row / column / box / none")
    parser.add_argument("--output_dir", default=None, help="keep the runs here (default: a temporary folder)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minutes < 0:
        parser.error(f"--minutes must be >= 0 (0: no time budget), got {args.minutes}")
    torch.set_num_threads(1)

    _, meta = build_dataset("sudoku", "train", seed=args.seed, num_puzzles=1, num_blanks=1)
    target, sizes = matched_hidden(args, meta)
    rows, parts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.output_dir or tmp
        for blanks in args.blanks:
            for name in args.models:
                hidden, params = sizes[name]
                folder = os.path.join(root, f"{name}_blanks{blanks}")
                start = time.time()
                try:
                    result, steps, seconds = run(args, name, hidden, blanks, folder)
                except FloatingPointError as err:  # a diverged run is a result too: the others still run
                    print(f"{name} at {blanks} blanks diverged: {err}", flush=True)
                    rows.append((blanks, f"{name} (diverged)", hidden, params, float("nan"), -1, DIVERGED, 0.0))
                    continue
                rows.append((blanks, name, hidden, params, seconds / 60, steps, result, time.time() - start))
                if args.breakdown:
                    parts.append((blanks, name, breakdown(args, name, blanks, folder)))
                if args.cross_eval and VARIANTS[name][0] == "fprm":
                    mode, other = cross_eval(args, name, hidden, blanks, folder)
                    rows.append((blanks, f"{name} eval {mode}", hidden, params, seconds / 60, steps, other, 0.0))

    # 3. The table.
    print(f"\nmatched parameters: FPRM hidden {args.hidden} has {target:,}; seed {args.seed}, "
          f"{args.train_puzzles} x {args.num_aug + 1} training rows, {args.test_puzzles} test puzzles")
    print("| blanks | model | hidden | params | train min | steps | exact | cell (blanks) | iterations | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for blanks, name, hidden, params, minutes, steps, r, wall in rows:
        print(f"| {blanks} | {name} | {hidden} | {params:,} | {minutes:.1f} | {steps} | {r['exact_accuracy']:.3f} | "
              f"{r['cell_accuracy_changed']:.3f} | {r['iterations_mean']:.1f} | {wall:.0f} |", flush=True)
    if parts:
        print("\naccuracy on the blank cells alone in their row / column / box / none of them (cells)")
        print("| blanks | model | row | column | box | none |\n|---|---|---|---|---|---|")
        for blanks, name, groups in parts:
            cells = " | ".join(f"{acc:.3f} ({n})" for n, acc in groups.values())
            print(f"| {blanks} | {name} | {cells} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
