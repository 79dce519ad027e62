"""Decoding speed of Ouro and the Attractor LM: dynamic cache in eager mode against a static cache with a compiled
forward, batch 1 and 8.

    python -m benchmarks.bench_decode                      # both models; CPU, one thread (needs a C++ compiler)
    python -m benchmarks.bench_decode --models attractor   # one model
    python -m benchmarks.bench_decode --device cuda        # on a GPU
    python -m benchmarks.bench_decode --quick              # fewer tokens, one repeat

Random models (float32, vocab 4096, hidden 256) greedily generate ``--new_tokens`` tokens after prompts of 32 tokens
(at batch 8 every other row left-padded by 8): Ouro with 4 layers and 4 loops; the Attractor LM with 2 backbone
layers and 1 attractor layer, solved with its defaults (Anderson, ``fp_tol=3e-4``, at most 12 iterations). Modes, in
one run:

* ``dynamic eager``: ``generate``'s default ``DynamicCache``, no compilation;
* ``static compiled``: ``cache_implementation="static"``, and ``generate`` compiles the decoding forward with
  ``torch.compile`` (its ``CompileConfig``; on CPU ``_compile_all_devices``). It must give the dynamic run's tokens.
  The Attractor's solve reads one number per iteration on the host, so its compiled step breaks into several graphs;
* Attractor only, ``static compiled, unrolled k``: the same with ``unrolled_iters=k`` (exactly ``k`` plain attractor
  steps, no convergence test: one graph per step), ``k`` the most iterations the solve took on any prompt token of
  the batch (measured here, not set). Other tokens than the solve's are possible; the run reports whether they agree.

The first static call of a mode (compilation) is timed apart; afterwards runs alternate between the modes, so
background load hits all alike, and tokens per second of the fastest runs are compared: the printed ratio is each mode
over dynamic eager per batch size. No target: the issue asks for the measurement.
"""

import argparse
import math
import time

import torch
from transformers import CompileConfig, StaticCache

from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM, OuroConfig, OuroForCausalLM

VOCAB = 4096


def build(name, device):
    torch.manual_seed(0)
    if name == "ouro":
        config = OuroConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                            total_ut_steps=4, pad_token_id=0, eos_token_id=None)
        return OuroForCausalLM(config).eval().to(device)
    config = AttractorConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                             num_backbone_layers=2, num_attractor_layers=1, max_position_embeddings=512,
                             pad_token_id=0, eos_token_id=None)
    return AttractorForCausalLM(config).eval().to(device)


def prompts(batch, device):
    ids = torch.randint(1, VOCAB, (batch, 32), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    mask[1::2, :8] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def compile_config():
    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True  # generate compiles on GPUs only unless told (not an __init__ argument)
    return config


def generate(model, ids, mask, new_tokens, static, extra):
    kwargs = {"cache_implementation": "static", "compile_config": compile_config()} if static else {}
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs, **extra)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def modes(name, model, ids, mask):
    """(label, static, extra generate kwargs, must give the dynamic eager tokens)."""
    out = [("dynamic eager", False, {}, True), ("static compiled", True, {}, True)]
    if name == "attractor":
        with torch.no_grad():
            k = int(model(ids, attention_mask=mask, use_cache=False).fp_stats.nstep[mask.bool()].max())
        out.append((f"static compiled, unrolled {k}", True, {"unrolled_iters": k}, False))
    return out


def explain_step(model, ids, extra):
    """Graphs and graph breaks of one decoding step with a filled static cache (``torch._dynamo.explain``)."""
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 1)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, **extra)
        position = torch.full((ids.shape[0], 1), ids.shape[1], device=ids.device)
        explained = torch._dynamo.explain(model)(ids[:, -1:], past_key_values=cache, use_cache=True,
                                                 position_ids=position, **extra)
    torch._dynamo.reset()
    where = sorted({f"{r.user_stack[-1].filename.split('/')[-1]}:{r.user_stack[-1].lineno}"
                    for r in explained.break_reasons if r.user_stack})
    return f"{explained.graph_count} graph(s), {explained.graph_break_count} break(s){' at ' if where else ''}" + \
        ", ".join(where)


def run_batch(name, model, batch, args):
    ids, mask = prompts(batch, args.device)
    table = modes(name, model, ids, mask)
    if batch == args.batches[0]:
        for label, static, extra, _ in table[1:]:
            print(f"{name} {label}: a decoding step at batch {batch} traces as {explain_step(model, ids, extra)}")
    compile_seconds = {}
    for label, static, extra, _ in table:
        if static:  # compiles
            _, compile_seconds[label] = generate(model, ids, mask, args.new_tokens, static, extra)
    generate(model, ids, mask, 4, False, {})  # warm-up
    best, outs = {label: math.inf for label, *_ in table}, {}
    for _ in range(args.repeats):
        for label, static, extra, _ in table:
            outs[label], seconds = generate(model, ids, mask, args.new_tokens, static, extra)
            best[label] = min(best[label], seconds)
    base = batch * args.new_tokens / best["dynamic eager"]
    print(f"{name} batch {batch}: dynamic eager {base:8.1f} tok/s")
    ok = True
    for label, static, _, required in table[1:]:
        rate = batch * args.new_tokens / best[label]
        same = torch.equal(outs[label], outs["dynamic eager"])
        ok = ok and (same or not required)
        print(f"    {label:32s} {rate:8.1f} tok/s | ratio {rate / base:.2f}x | first call with compilation "
              f"{compile_seconds[label]:.1f} s | same tokens as dynamic eager: {same}")
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", choices=["ouro", "attractor"], default=["ouro", "attractor"])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--quick", action="store_true", help="16 new tokens, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"decode: {args.new_tokens} new tokens, torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    results = []
    for name in args.models:
        model = build(name, args.device)
        results += [run_batch(name, model, batch, args) for batch in args.batches]
        torch._dynamo.reset()  # the next model compiles afresh
    if not all(results):
        raise SystemExit("FAIL: a static compiled run generated other tokens than the dynamic eager run")


if __name__ == "__main__":
    main()
