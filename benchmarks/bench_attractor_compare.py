"""Small comparison on the same tokens: Attractor LM vs a parameter-matched Transformer vs a fixed-loop looped LM.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_attractor_compare --steps 300 --budget_minutes 4

Each model is trained by ``recipes/attractor_lm.py`` (same corpus, tokenizer, seed, batches and schedule: the data of
step ``s`` is a function of the seed and ``s``), for ``--steps`` steps or until ``--budget_minutes`` is spent. Printed:
validation perplexity, the Attractor's T=0 readout perplexity and its gap to the converged one (the paper's
"equilibrium internalization", target within 2%), and the Attractor's mean solver iterations per token over training.
Targets from the paper (140M parameters, 30 GPU-minute budgets are out of reach here): Attractor ppl below the
Transformer's.
"""

import argparse
import json
import os

from recipes.attractor_lm import Args, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs/attractor_compare")
    parser.add_argument("--steps", type=int, default=300, help="training steps per model (the same tokens for all)")
    parser.add_argument("--budget_minutes", type=float, default=4.0, help="wall-clock cap per model")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_length", type=int, default=128)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--looped_iters", type=int, default=6, help="loops of the fixed-loop LM")
    parser.add_argument("--archs", default="attractor,transformer,looped")
    cli = parser.parse_args()

    results = {}
    for arch in cli.archs.split(","):
        args = Args(output_dir=os.path.join(cli.output_dir, arch), arch=arch, max_steps=cli.steps,
                    max_train_seconds=60 * cli.budget_minutes, batch_size=cli.batch_size, seq_length=cli.seq_length,
                    hidden_size=cli.hidden_size, vocab_size=cli.vocab_size, log_every=10,
                    eval_every=max(1, cli.steps // 4), eval_batches=8,
                    fp_max_iter=cli.looped_iters if arch == "looped" else 12)
        results[arch] = run(args)
        log = [json.loads(line) for line in open(os.path.join(args.output_dir, "train_log.jsonl"))]
        results[arch]["iteration_curve"] = [(r["step"], round(r["fp_iters"], 2)) for r in log if "fp_iters" in r]

    print("\n| model | parameters | steps | train s | val ppl | T=0 ppl | T=0 gap | val iters/token |")
    print("|---|---|---|---|---|---|---|---|")
    for arch, m in results.items():
        t0 = f"{m['val_ppl_t0']:.2f}" if "val_ppl_t0" in m else "-"
        gap = f"{100 * m['t0_gap']:+.1f}%" if "t0_gap" in m else "-"
        print(f"| {arch} | {m['parameters']} | {m['steps']} | {m['train_seconds']:.0f} | {m['val_ppl']:.2f} | {t0} | "
              f"{gap} | {m['val_fp_iters']:.2f} |")
    if "attractor" in results and "transformer" in results:
        rel = results["attractor"]["val_ppl"] / results["transformer"]["val_ppl"] - 1
        print(f"Attractor vs Transformer validation perplexity: {100 * rel:+.1f}%")
    if "attractor" in results:
        curve = results["attractor"]["iteration_curve"]
        print("Attractor solver iterations per token over training (step, mean): " + ", ".join(map(str, curve)))
    os.makedirs(cli.output_dir, exist_ok=True)
    with open(os.path.join(cli.output_dir, "compare.json"), "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
