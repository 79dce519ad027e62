"""Cost of a STARS training step against a plain step at the same loop count (CPU, one thread).

    python -m benchmarks.bench_stars           # ~1-2 minutes on an idle core
    python -m benchmarks.bench_stars --quick

A training step is forward + loss + backward + AdamW update on a random-token batch. The STARS step adds the JSRR
regularizer (one loop re-run at the detached last state in eager attention, a VJP with ``create_graph``, and the
double backward; ``n_iter=1`` as the public code). Cases: the recipe's addition model (hidden 64, 1 layer) at 4 and
8 loops, and a wider model (hidden 256, 2 layers, sequence 64) at 4 and 8 loops. Steps alternate (plain, STARS, ...)
and the ratio of median step times is reported. Target: <= 1.5x (the paper reports 2.04x).
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
    stars = STARSRegularizer(reg_weight=0.1, n_iter=1, product=product)
    for i in range(2):  # warm-up
        step_time(model, optimizer, ids, loops, None, i)
        step_time(model, optimizer, ids, loops, stars, i)
    plain, reg = [], []
    for i in range(repeats):
        plain.append(step_time(model, optimizer, ids, loops, None, i))
        reg.append(step_time(model, optimizer, ids, loops, stars, i))
    return statistics.median(plain), statistics.median(reg)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--product", default="vjp", choices=["vjp", "jvp", "double_backward"])
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    torch.set_num_threads(1)
    print(f"STARS step vs plain step (median of {repeats}; JSRR product={args.product}, n_iter=1)")
    print(f"{'case':<16s}{'loops':>6s}{'plain ms':>10s}{'STARS ms':>10s}{'ratio':>8s}  target <= {TARGET}x")
    rows = []
    for name, hidden, layers, heads, batch, seq, loops in CASES:
        plain, reg = run_case(hidden, layers, heads, batch, seq, loops, repeats, args.product)
        ratio = reg / plain
        rows.append((name, loops, ratio))
        print(f"{name:<16s}{loops:>6d}{1000 * plain:>10.1f}{1000 * reg:>10.1f}{ratio:>8.2f}  "
              f"{'PASS' if ratio <= TARGET else 'FAIL'}")
    return rows


if __name__ == "__main__":
    main()
