"""Cost of a STARS training step against a plain step at the same loop count (CPU, one thread).

    python -m benchmarks.bench_stars           # ~1-2 minutes on an idle core
    python -m benchmarks.bench_stars --quick

A training step is forward + loss + backward + AdamW update on a random-token batch. The STARS step adds the JSRR
regularizer (one loop re-run at the detached last state in eager attention, a VJP with ``create_graph``, and the
double backward; ``n_iter=1`` as the public code), over the whole batch as STARS does and, as the recipe does, over
the first quarter of the batch (``max_batch``). Cases: the recipe's former addition model (hidden 64, 1 layer, batch
128) at 4 and 8 loops, and a wider model (hidden 256, 2 layers, batch 16 x 64 tokens) at 4 and 8 loops. Steps
alternate (plain, STARS, STARS on a quarter, ...) and ratios of median step times are reported. Target: <= 1.5x (the
paper reports 2.04x).
"""

import argparse
import statistics
import time

import torch

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from hf_fixedpoint.stars import STARSRegularizer

TARGET = 1.5
CASES = [  # name, hidden, layers, heads, batch, sequence, loops
    ("addition model", 64, 1, 4, 128, 13, 4),
    ("addition model", 64, 1, 4, 128, 13, 8),
    ("wider model", 256, 2, 4, 16, 64, 4),
    ("wider model", 256, 2, 4, 16, 64, 8),
]


def step_time(model, optimizer, ids, loops, stars, step):
    t0 = time.perf_counter()
    out = model(ids, labels=ids, total_ut_steps=loops, use_cache=False)
    loss = stars(model, out, step)[0] if stars is not None else out.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - t0


def run_case(hidden, layers, heads, batch, seq, loops, repeats, product):
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=128, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=128,
                        total_ut_steps=loops, exit_loss="last")
    model = OuroForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))
    variants = [None, STARSRegularizer(reg_weight=0.1, n_iter=1, product=product),
                STARSRegularizer(reg_weight=0.1, n_iter=1, product=product, max_batch=batch // 4)]
    for i in range(2):  # warm-up
        for stars in variants:
            step_time(model, optimizer, ids, loops, stars, i)
    times = [[] for _ in variants]
    for i in range(repeats):
        for t, stars in zip(times, variants):
            t.append(step_time(model, optimizer, ids, loops, stars, i))
    return [statistics.median(t) for t in times]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--product", default="vjp", choices=["vjp", "jvp", "double_backward"])
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    torch.set_num_threads(1)
    print(f"STARS step vs plain step (median of {repeats}; JSRR product={args.product}, n_iter=1)")
    print(f"{'case':<16s}{'loops':>6s}{'plain ms':>10s}{'STARS ms':>10s}{'ratio':>7s}{'STARS B/4 ms':>14s}"
          f"{'ratio':>7s}   target <= {TARGET}x")
    rows = []
    for name, hidden, layers, heads, batch, seq, loops in CASES:
        plain, full, quarter = run_case(hidden, layers, heads, batch, seq, loops, repeats, args.product)
        r_full, r_quarter = full / plain, quarter / plain
        rows.append((name, loops, r_full, r_quarter))
        print(f"{name:<16s}{loops:>6d}{1000 * plain:>10.1f}{1000 * full:>10.1f}{r_full:>7.2f}{1000 * quarter:>14.1f}"
              f"{r_quarter:>7.2f}   full batch {'PASS' if r_full <= TARGET else 'FAIL'}, "
              f"B/4 {'PASS' if r_quarter <= TARGET else 'FAIL'}")
    return rows


if __name__ == "__main__":
    main()
