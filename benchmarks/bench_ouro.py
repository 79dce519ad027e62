"""Ouro generation: the per-(loop, layer) KV cache against uncached recomputation (CPU, one thread).

    python -m benchmarks.bench_ouro            # 128 new tokens, ~1-2 minutes on an idle core
    python -m benchmarks.bench_ouro --quick    # 32 new tokens

A random Ouro (hidden 256, 4 layers, 4 loops, 4 heads, vocab 4096; float32) greedily generates ``--new_tokens``
tokens after a left-padded batch of two prompts (32 and 24 tokens). ``use_cache=True`` keeps one ``DynamicCache``
slot per (loop, layer); ``use_cache=False`` recomputes the whole prefix for every token. Both runs must give the same
tokens; the target is a cached run at least 5x faster. Runs alternate (uncached, cached, ...) so background load hits
both alike, and the ratio of the fastest runs is reported.
"""

import argparse
import time

import torch

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM

TARGET = 5.0


def build():
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, total_ut_steps=4,
                        pad_token_id=0, eos_token_id=None)
    model = OuroForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 4096, (2, 32), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    return model, ids.masked_fill(mask == 0, 0), mask


def timed_generate(model, ids, mask, new_tokens, use_cache):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, use_cache=use_cache, pad_token_id=0)
    return out, time.perf_counter() - t0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="32 new tokens, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 32, 1
    torch.set_num_threads(1)
    model, ids, mask = build()
    timed_generate(model, ids, mask, 4, True)  # warm-up
    times = {True: [], False: []}
    outputs = {}
    for _ in range(args.repeats):
        for use_cache in (False, True):
            outputs[use_cache], seconds = timed_generate(model, ids, mask, args.new_tokens, use_cache)
            times[use_cache].append(seconds)
    same = torch.equal(outputs[True], outputs[False])
    ratio = min(times[False]) / min(times[True])
    print(f"Ouro generate, batch 2 (one row left-padded), {args.new_tokens} new tokens, hidden 256, 4 layers x "
          "4 loops")
    print(f"  uncached: {min(times[False]):.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times[False])})")
    print(f"  cached:   {min(times[True]):.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times[True])})")
    print(f"  identical tokens: {same}")
    print(f"  speed-up: {ratio:.1f}x  (target >= {TARGET:.0f}x: {'PASS' if ratio >= TARGET and same else 'FAIL'})")
    return {"uncached_s": min(times[False]), "cached_s": min(times[True]), "ratio": ratio, "identical": same}


if __name__ == "__main__":
    main()
