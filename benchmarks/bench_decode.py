"""Ouro decoding speed: dynamic cache in eager mode against a static cache with a compiled forward, batch 1 and 8.

    python -m benchmarks.bench_decode                   # CPU, one thread (torch.compile needs a C++ compiler)
    python -m benchmarks.bench_decode --device cuda     # on a GPU
    python -m benchmarks.bench_decode --quick           # fewer tokens, one repeat

A random Ouro (hidden 256, 4 layers, 4 loops, vocab 4096; float32) greedily generates ``--new_tokens`` tokens after
prompts of 32 tokens (at batch 8 every other row left-padded by 8). Two modes, in one run:

* ``dynamic eager``: ``generate``'s default ``DynamicCache`` (grown to one slot per (loop, layer)), no compilation;
* ``static compiled``: ``cache_implementation="static"`` (a ``StaticCache`` grown to the same slots), and ``generate``
  compiles the decoding forward with ``torch.compile`` (its ``CompileConfig``; on CPU ``_compile_all_devices``).

Both must generate the same tokens. The first static call (compilation) is timed apart; afterwards runs alternate
between the modes, so background load hits both alike, and tokens per second of the fastest runs are compared: the
printed ratio is static compiled / dynamic eager per batch size. No target: the issue asks for the measurement.
"""

import argparse
import time

import torch
from transformers import CompileConfig

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM


def build(device):
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, total_ut_steps=4,
                        pad_token_id=0, eos_token_id=None)
    return OuroForCausalLM(config).eval().to(device)


def prompts(batch, device):
    ids = torch.randint(1, 4096, (batch, 32), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    mask[1::2, :8] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def compile_config():
    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True  # generate compiles on GPUs only unless told (not an __init__ argument)
    return config


def generate(model, ids, mask, new_tokens, static):
    kwargs = {"cache_implementation": "static", "compile_config": compile_config()} if static else {}
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run_batch(model, batch, args):
    ids, mask = prompts(batch, args.device)
    _, compile_seconds = generate(model, ids, mask, args.new_tokens, static=True)  # compiles
    generate(model, ids, mask, 4, static=False)  # warm-up
    best, outs = {False: float("inf"), True: float("inf")}, {}
    for _ in range(args.repeats):
        for static in (False, True):
            outs[static], seconds = generate(model, ids, mask, args.new_tokens, static)
            best[static] = min(best[static], seconds)
    same = torch.equal(outs[False], outs[True])
    rate = {k: batch * args.new_tokens / v for k, v in best.items()}
    print(f"batch {batch}: dynamic eager {rate[False]:8.1f} tok/s | static compiled {rate[True]:8.1f} tok/s "
          f"(first call with compilation {compile_seconds:.1f} s) | ratio {rate[True] / rate[False]:.2f}x | "
          f"same tokens: {same}")
    return same


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--quick", action="store_true", help="16 new tokens, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    if args.device == "cpu":
        torch.set_num_threads(1)
    model = build(args.device)
    print(f"Ouro decode: {args.new_tokens} new tokens, torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    results = [run_batch(model, batch, args) for batch in args.batches]
    if not all(results):
        raise SystemExit("FAIL: the static compiled run generated other tokens than the dynamic eager run")


if __name__ == "__main__":
    main()
