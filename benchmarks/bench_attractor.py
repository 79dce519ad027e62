"""Attractor LM costs, measured side by side in one run (CPU by default, CUDA when available).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_attractor            # all three parts
    python -m benchmarks.bench_attractor --only generate --new_tokens 128

1. ``generate``: greedy decoding of ``--new_tokens`` tokens with the KV cache vs without it (the whole prefix
   re-solved at every step); the tokens must be identical. Target: the cache is >= 5x faster at 128 new tokens.
2. ``memory``: training memory as the iteration cap grows (T_max 8 -> 64, every iteration run: ``fp_tol`` is out of
   reach). Measured as the bytes autograd saves for the backward (on CUDA also the peak allocated memory); backprop
   through the loop (``bptt``) is printed as the contrast. Target: one_step at T_max 64 <= 1.1x T_max 8.
3. ``step_time``: one training step (forward + backward) with ``one_step``, ``phantom`` (k=2) and ``ift`` (Anderson
   adjoint) on the same model and batch, relative to one_step (the paper reports 1.0x / 1.4x / 2.7x).
"""

import argparse
import statistics
import time

import torch

from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM


def build(device, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    kwargs = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
              "num_backbone_layers": 2, "num_attractor_layers": 1, "max_position_embeddings": 512}
    return AttractorForCausalLM(AttractorConfig(**{**kwargs, **overrides})).to(device, dtype)


def bench_generate(device, new_tokens, prompt_len, batch, repeats):
    model = build(device, hidden_size=256, intermediate_size=1024).eval()
    ids = torch.randint(0, 512, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    times, outs = {True: [], False: []}, {}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(repeats):  # interleaved; the fastest of the repeats is the least disturbed by machine load
            for use_cache in (True, False):
                t0 = time.perf_counter()
                outs[use_cache] = model.generate(ids, use_cache=use_cache, **kw)
                times[use_cache].append(time.perf_counter() - t0)
    same = torch.equal(outs[True], outs[False])
    cached, uncached = min(times[True]), min(times[False])
    print(f"[generate] batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, best of {repeats}: cached "
          f"{cached:.2f}s, uncached {uncached:.2f}s, speed-up {uncached / cached:.1f}x, identical tokens: {same}")


def saved_bytes(fn):
    """Bytes of the tensors autograd saves for the backward while ``fn`` runs (each storage counted once)."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def bench_memory(device, batch, seq_len):
    ids = torch.randint(0, 512, (batch, seq_len), generator=torch.Generator().manual_seed(2)).to(device)
    rows = {}
    for backward in ("one_step", "bptt"):
        for t_max in (8, 64):
            extra = {"fp_backward_steps": None} if backward == "bptt" else {}
            model = build(device, fp_max_iter=t_max, fp_tol=1e-30, fp_backward=backward, **extra).train()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            out, nbytes = saved_bytes(lambda: model(ids, labels=ids, use_cache=False))
            out.loss.backward()
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
            assert out.fp_stats.nfe == t_max
            rows[backward, t_max] = (nbytes, peak)
            peak_txt = f", CUDA peak {peak / 2**20:.1f} MiB" if peak is not None else ""
            print(f"[memory] {backward:8s} T_max {t_max:2d}: saved for backward {nbytes / 2**20:.2f} MiB{peak_txt}")
    for backward in ("one_step", "bptt"):
        ratio = rows[backward, 64][0] / rows[backward, 8][0]
        peak_ratio = (f", CUDA peak ratio {rows[backward, 64][1] / rows[backward, 8][1]:.2f}x"
                      if device.type == "cuda" else "")
        print(f"[memory] {backward}: T_max 64 / T_max 8 = {ratio:.2f}x{peak_ratio}")


def bench_step_time(device, batch, seq_len, repeats):
    ids = torch.randint(0, 512, (batch, seq_len), generator=torch.Generator().manual_seed(3)).to(device)
    modes = {"one_step": {}, "phantom": {"fp_backward_steps": 2}, "ift": {}}
    models = {m: build(device, fp_backward=m, **kw).train() for m, kw in modes.items()}
    times = {m: [] for m in modes}
    for r in range(repeats + 1):
        for mode, model in models.items():  # interleaved, so machine load affects every mode alike
            model.zero_grad()
            t0 = time.perf_counter()
            out = model(ids, labels=ids, use_cache=False)
            out.loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:  # the first round is a warm-up
                times[mode].append(time.perf_counter() - t0)
            if r == repeats:
                s = out.fp_stats.summary()
                print(f"[step_time] {mode:8s}: median {statistics.median(times[mode]) * 1e3:.1f} ms, forward nfe "
                      f"{s['fp_nfe']:.0f}, adjoint nfe {s.get('fp_backward_nfe', 0):.0f}")
    base = statistics.median(times["one_step"])
    print("[step_time] relative to one_step: " + " / ".join(
        f"{m} {statistics.median(t) / base:.2f}x" for m, t in times.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("generate", "memory", "step_time"), default=None)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.only in (None, "generate"):
        bench_generate(device, args.new_tokens, args.prompt_len, args.batch, max(1, args.repeats // 2))
    if args.only in (None, "memory"):
        bench_memory(device, args.batch, args.seq_len)
    if args.only in (None, "step_time"):
        bench_step_time(device, args.batch, args.seq_len, args.repeats)


if __name__ == "__main__":
    main()
