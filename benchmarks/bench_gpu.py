"""The GPU table: every family's forward and training step against its plain counterpart, with and without host reads
inside the solve, eager and compiled, in one run of a few minutes.

    python -m benchmarks.bench_gpu                              # on a CUDA machine: the whole table, <= 280 s
    python -m benchmarks.bench_gpu --json gpu.json              # also write every cell to a file
    python -m benchmarks.bench_gpu --families fpsa_bert_cap4 ouro --configs eager compiled
    python -m benchmarks.bench_gpu --configs compiled --set fp_backward=phantom   # a training step that compiles whole
    python -m benchmarks.bench_gpu --device cpu --tiny --repeats 1   # the CPU dry run the test suite does

Random models of a small realistic size (``SIZES["gpu"]``: width 768, 4 layers, 12 heads, MLP 3072, vocab 8192, batch
8, sequence 128, ViT on 224-pixel images in 16-pixel patches; ``--tiny``: width 32, 2 layers) are built here from
their configs (nothing is downloaded). Each family is measured against a plain model of the same width:

* ``fpsa_bert_cap4`` / ``fpsa_bert``: FPSA-BERT at ``fp_max_iter=4`` / at its defaults vs BERT (sequence
  classification, the same sizes);
* ``fpsa_vit``: FPSA-ViT vs ViT (image classification);
* ``self_llama``: SELF-LLaMA vs Llama; the forward column is cached greedy decoding (``generate`` of ``new_tokens``
  tokens after a ``prompt``-token prompt, the prefill included), the training step is on the whole sequence;
* ``attractor``: Attractor LM (``layers - 1`` backbone layers, one attractor layer) vs a Llama with ``layers`` layers;
* ``deq_lm``: DEQ-LM (one weight-tied block) vs a one-layer Llama;
* ``ouro``: Ouro with ``layers // 2`` layers looped 4 times vs a Llama with 4x as many layers (the same layer
  applications per token, unshared weights).

Configurations (``--configs``), in this order, every family through one configuration before the next starts:
``eager`` (the defaults), ``check_every=k`` for each ``k`` of ``--check-every`` (default 4 and 0; eager with
``fp_check_every=k`` per call: the solve reads its convergence state on the host every ``k`` iterations, ``0``: never
inside its loop; solver families only, so Ouro has no such rows; on a version without the setting the cells say so),
and ``compiled``: ``torch.compile(fullgraph=True)`` with ``fp_check_every=0``, on CUDA ``mode="reduce-overhead"`` (CUDA
graphs; ``--compile-backend`` picks another, e.g. ``cudagraphs``: CUDA graphs without inductor's code generation,
which compiles faster), on a CPU ``backend="eager"`` (dynamo's graph capture without
code generation: it checks that the model compiles whole, its times are not a compiled model's). The plain model runs
in the same configuration (eager, or compiled the same way). Decoding compiles through ``generate``'s static cache
(``cache_implementation="static"``, ``compile_config``).

Every cell: forward latency (no grad) and training-step time (forward + backward + AdamW step) of the model and of
its counterpart, measured interleaved in one process (``time_interleaved``: warm-up, then ``--repeats`` rounds, every
timed call between two device synchronisations) and compared as a ratio of minimums; what one forward launches
(``count_ops``): on CUDA the kernels, stream synchronisations and the GPU's busy share (GPU kernel time of one profiled
forward over the forward's minimum wall time); on a CPU the aten ops and the ops that would synchronise on a GPU
(``aten::_local_scalar_dense`` and ``aten::nonzero``), no busy share. The compiled configuration's first calls
(compilation, CUDA-graph recording) are timed apart. A measurement that fails (a graph break under ``fullgraph``, a
refused static cache, an unknown setting) puts its reason in its cell and the run goes on. After ``--budget-s`` seconds
the remaining cells are skipped and marked so. ``--set fp_key=value`` adds a per-call fixed-point setting to every
solver family's calls (e.g. ``fp_backward=phantom``: the ``ift`` backward, most families' default, breaks a
``fullgraph`` training step). Prints one markdown table; ``--json`` writes the cells. Correctness on a GPU (logits
against the CPU's, training, generated tokens) is ``tools/gpu_smoke.py``'s; nothing here checks it.
"""

import argparse
import dataclasses
import datetime
import json
import os
import re
import time

import torch
import transformers

from benchmarks.bench_fpsa import count_ops
from benchmarks.bench_fpsa_convergence import check_device, device_sync, parse_set, time_interleaved
from hf_fixedpoint.core.fp_settings import FP_DEFAULTS


@dataclasses.dataclass(frozen=True)
class Size:
    width: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int
    image: int
    patch: int
    prompt: int
    new_tokens: int


SIZES = {"gpu": Size(width=768, layers=4, heads=12, intermediate=3072, vocab=8192, batch=8, seq=128, image=224,
                     patch=16, prompt=64, new_tokens=16),
         "tiny": Size(width=32, layers=2, heads=4, intermediate=64, vocab=99, batch=8, seq=16, image=16, patch=4,
                      prompt=8, new_tokens=4)}

CONFIGS = ("eager", "check_every", "compiled")  # --configs; check_every: one row per --check-every value
SKIPPED = "skipped: over --budget-s"
HAS_CHECK_EVERY = "fp_check_every" in FP_DEFAULTS
NO_CHECK_EVERY = "n/a: this version has no fp_check_every"


def llama(s, layers, cls_name="LlamaForCausalLM", **extra):
    """A Llama-style model of width ``s.width`` with ``layers`` layers (``cls_name``: a transformers class of the
    Llama family that takes the config's fields)."""
    config = transformers.LlamaConfig(vocab_size=s.vocab, hidden_size=s.width, intermediate_size=s.intermediate,
                                      num_hidden_layers=layers, num_attention_heads=s.heads,
                                      num_key_value_heads=s.heads, max_position_embeddings=max(512, s.seq),
                                      pad_token_id=0, eos_token_id=None, **extra)
    return getattr(transformers, cls_name)(config)


def bert_pair(s):
    from hf_fixedpoint.modeling import FPSABertConfig, FPSABertForSequenceClassification

    kw = dict(vocab_size=s.vocab, hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
              intermediate_size=s.intermediate, max_position_embeddings=max(512, s.seq), num_labels=2)
    return (FPSABertForSequenceClassification(FPSABertConfig(**kw)),
            transformers.BertForSequenceClassification(transformers.BertConfig(**kw)))


def vit_pair(s):
    from hf_fixedpoint.modeling import FPSAViTConfig, FPSAViTForImageClassification

    kw = dict(hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
              intermediate_size=s.intermediate, image_size=s.image, patch_size=s.patch, num_labels=10)
    return (FPSAViTForImageClassification(FPSAViTConfig(**kw)),
            transformers.ViTForImageClassification(transformers.ViTConfig(**kw)))


def self_llama_pair(s):
    from hf_fixedpoint.modeling import SelfLlamaConfig, SelfLlamaForCausalLM

    base = llama(s, s.layers)
    return SelfLlamaForCausalLM(SelfLlamaConfig(**base.config.to_dict())), base


def attractor_pair(s):
    from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM

    config = AttractorConfig(vocab_size=s.vocab, hidden_size=s.width, intermediate_size=s.intermediate,
                             num_attention_heads=s.heads, num_backbone_layers=max(1, s.layers - 1),
                             num_attractor_layers=1, max_position_embeddings=max(512, s.seq), pad_token_id=0,
                             eos_token_id=None)
    return AttractorForCausalLM(config), llama(s, max(1, s.layers - 1) + 1)


def deq_pair(s):
    from hf_fixedpoint.modeling import DEQLMConfig, DEQLMForCausalLM

    config = DEQLMConfig(vocab_size=s.vocab, hidden_size=s.width, intermediate_size=s.intermediate,
                         num_attention_heads=s.heads, max_position_embeddings=max(512, s.seq), pad_token_id=0,
                         eos_token_id=None)
    return DEQLMForCausalLM(config), llama(s, 1)


def ouro_pair(s):
    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM

    layers = max(1, s.layers // 2)
    config = OuroConfig(vocab_size=s.vocab, hidden_size=s.width, intermediate_size=s.intermediate,
                        num_hidden_layers=layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
                        max_position_embeddings=max(512, s.seq), total_ut_steps=4, pad_token_id=0, eos_token_id=None)
    return OuroForCausalLM(config), llama(s, 4 * layers)


def text_inputs(s, labels):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, s.vocab, (s.batch, s.seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return batch, {**batch, "labels": ids if labels == "lm" else torch.arange(s.batch) % 2}


def image_inputs(s, labels):
    pixels = torch.randn(s.batch, 3, s.image, s.image, generator=torch.Generator().manual_seed(0))
    return {"pixel_values": pixels}, {"pixel_values": pixels, "labels": torch.arange(s.batch) % 10}


@dataclasses.dataclass(frozen=True)
class Family:
    label: str  # the model and the setting every call of this row passes
    base_label: str
    pair: callable  # Size -> (model, plain counterpart), both fresh from random initialisation
    inputs: callable  # (Size, labels kind) -> (forward batch, training batch)
    labels: str = "lm"  # "lm": the input ids; else class labels
    knobs: dict = dataclasses.field(default_factory=dict)
    solver: bool = True  # has a fixed-point solve, so takes fp_check_every
    decode: bool = False  # the forward column is cached greedy decoding


FAMILIES = {
    "fpsa_bert_cap4": Family("FPSA-BERT, fp_max_iter=4", "BERT", bert_pair, text_inputs, "class",
                             {"fp_max_iter": 4}),
    "fpsa_bert": Family("FPSA-BERT, default", "BERT", bert_pair, text_inputs, "class"),
    "fpsa_vit": Family("FPSA-ViT", "ViT", vit_pair, image_inputs, "class"),
    "self_llama": Family("SELF-LLaMA, cached decode", "Llama", self_llama_pair, text_inputs, decode=True),
    "attractor": Family("Attractor LM", "Llama (backbone + attractor layers)", attractor_pair, text_inputs),
    "deq_lm": Family("DEQ-LM", "Llama, 1 layer", deq_pair, text_inputs),
    "ouro": Family("Ouro, 4 loops", "Llama, 4x the layers", ouro_pair, text_inputs, solver=False),
}


def compile_settings(device, backend=None):
    """The ``torch.compile`` arguments of the ``compiled`` configuration: on CUDA inductor with CUDA graphs
    (``mode="reduce-overhead"``), on a CPU dynamo's capture alone (``backend="eager"``), unless ``backend`` says."""
    cuda = torch.device(device).type == "cuda"
    backend = backend or ("inductor" if cuda else "eager")
    return {"fullgraph": True, "backend": backend, **({"mode": "reduce-overhead"} if backend == "inductor" and cuda
                                                       else {})}


def generate_compile_config(settings):
    """``generate``'s ``CompileConfig`` for ``compile_settings``; told to compile on a CPU too."""
    config = transformers.CompileConfig(fullgraph=True, backend=settings["backend"], mode=settings.get("mode"))
    config._compile_all_devices = True  # generate compiles on GPUs only unless told (not an __init__ argument)
    return config


def forward_fn(fam, size, model, batch, knobs, settings):
    """The no-grad call of a cell: ``model`` (compiled when ``settings``) on ``batch`` with the per-call ``knobs``;
    for a decoding row greedy ``generate`` of ``size.new_tokens`` tokens (static cache when compiled)."""
    if fam.decode:
        prompt = {k: v[:, :size.prompt] for k, v in batch.items()}
        extra = {"cache_implementation": "static", "compile_config": generate_compile_config(settings)} if settings \
            else {}
        if knobs:  # generate passes on the named forward arguments; every setting goes through fp_overrides
            extra["fp_overrides"] = knobs
        return lambda: model.generate(**prompt, max_new_tokens=size.new_tokens, min_new_tokens=size.new_tokens,
                                      do_sample=False, pad_token_id=0, **extra)
    return step_fn(model, batch, knobs, settings)


def step_fn(target, batch, knobs, settings, optimizer=None):
    """One call of ``target`` (a module, compiled when ``settings``) on ``batch`` with ``knobs``; with an
    ``optimizer``, a training step instead: forward, the loss's backward and the optimizer's step."""
    def call():
        if settings:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: CUDA graphs may overwrite the last one's outputs
        if optimizer is None:
            return target(**batch, **knobs)
        with torch.enable_grad():  # time_interleaved times under no_grad
            target(**batch, **knobs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return call


def reason(error):
    """A failure as one short line for a table cell: its type, first line and, for a graph break, the innermost
    frame of the user code where it happened (outside installed packages where there is one)."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0].replace("Consider annotating your code using torch._check*(). ", "") if lines else ""
    out = f"{type(error).__name__}: {first}"  # (dynamo's data-dependent guard message starts with that advice)
    out = out if len(out) <= 110 else out[:107] + "..."
    frames = re.findall(r'File "([^"]+)", line (\d+)', text)
    ours = [f for f in frames if "-packages" not in f[0]] or frames
    if ours:
        out += f" ({os.path.basename(ours[-1][0])}:{ours[-1][1]})"
    return out.replace("|", "/")


def timed(fns, repeats, device, warmups):
    """Minimum seconds of each of ``fns`` (name -> callable), interleaved (``time_interleaved``), and the seconds of
    its ``warmups`` calls before (compilation, CUDA-graph recording) with the number of graphs dynamo compiled in
    them."""
    from torch._dynamo.utils import counters

    sync, first, graphs = device_sync(device), {}, {}
    with torch.no_grad():
        for name, fn in fns.items():
            sync()
            t0, g0 = time.perf_counter(), counters["stats"]["unique_graphs"]
            for _ in range(warmups):
                fn()
            sync()
            first[name], graphs[name] = time.perf_counter() - t0, counters["stats"]["unique_graphs"] - g0
    times, _ = time_interleaved(fns, repeats, device)
    return {name: min(t) for name, t in times.items()}, first, graphs


def measure_forward(cell, fam, size, targets, batch, settings, device, repeats):
    """Forward latency of model and base (``cell["forward_ms"]``, ratio, first calls when compiled), then what one
    forward of each launches (``cell["ops"]``) and, on CUDA, the GPU's busy share."""
    fns = {name: forward_fn(fam, size, target, batch, knobs, settings) for name, (target, knobs) in targets.items()}
    try:
        mins, first, graphs = timed(fns, repeats, device, warmups=3 if settings else 0)
        if settings and fam.decode and not all(graphs.values()):
            raise RuntimeError(f"generate ran without compiling its forward (graphs compiled: {graphs})")
    except Exception as e:  # a graph break, a refused setting: the reason goes into the cell
        cell["forward_error"] = reason(e)
        return
    cell["forward_ms"] = {name: 1e3 * t for name, t in mins.items()}
    cell["forward_ratio"] = mins["model"] / mins["base"]
    if settings:
        cell["first_calls_s"] = first
    try:
        with torch.no_grad():
            cell["ops"] = {name: count_ops(fn, device)[0] for name, fn in fns.items()}
    except Exception as e:
        cell["ops_error"] = reason(e)
        return
    if torch.device(device).type == "cuda":
        cell["gpu_busy"] = {name: c["gpu_ms"] / cell["forward_ms"][name] for name, c in cell["ops"].items()}


def measure_train(cell, targets, batch, settings, device, repeats):
    """Training-step time of model and base: forward, backward and an AdamW step (``cell["train_ms"]``, ratio)."""
    fns = {}
    for name, (target, knobs) in targets.items():
        target.train()
        optimizer = torch.optim.AdamW(target.parameters(), lr=1e-6)  # a tiny step: the weights barely move
        fns[name] = step_fn(target, batch, knobs, settings, optimizer)
    try:
        mins, first, _ = timed(fns, repeats, device, warmups=3 if settings else 0)
    except Exception as e:
        cell["train_error"] = reason(e)
        return
    finally:
        for target, _ in targets.values():
            target.eval()
            target.zero_grad(set_to_none=True)
    cell["train_ms"] = {name: 1e3 * t for name, t in mins.items()}
    cell["train_ratio"] = mins["model"] / mins["base"]
    if settings:
        cell["first_train_calls_s"] = first


def configurations(configs, check_every):
    """The table's configurations in order, each with its per-call settings: ``configs`` (of ``CONFIGS``), the
    ``check_every`` one once for each value of ``check_every``."""
    out = {"eager": {}} if "eager" in configs else {}
    if "check_every" in configs:
        out.update({f"check_every={k}": {"fp_check_every": k} for k in check_every})
    if "compiled" in configs:
        out["compiled"] = {"fp_check_every": 0}
    return out


def measure_cell(fam, size, pair, inputs, config, config_knobs, settings, device, repeats):
    """One row of the table: ``fam``'s model against its counterpart in ``config`` (its per-call settings
    ``config_knobs``, ``--set`` ones included)."""
    model, base = pair
    knobs = {**fam.knobs, **(config_knobs if fam.solver else {})}
    if "fp_check_every" in knobs and not HAS_CHECK_EVERY:
        if config != "compiled":
            return {"skipped": NO_CHECK_EVERY}
        del knobs["fp_check_every"]  # compiled with the solve's defaults
    settings = settings if config == "compiled" else None
    cell = {}
    wrap = (lambda m: torch.compile(m, **settings)) if settings else (lambda m: m)
    compiled = {"model": (wrap(model), knobs), "base": (wrap(base), {})}
    # decoding compiles inside generate; the training step runs the (compiled) modules like the other rows
    measure_forward(cell, fam, size, {"model": (model, knobs), "base": (base, {})} if fam.decode else compiled,
                    inputs[0], settings, device, repeats)
    measure_train(cell, compiled, inputs[1], settings, device, repeats)
    return cell


def header(args, device, size):
    cuda = torch.device(device).type == "cuda"
    name = torch.cuda.get_device_name(torch.device(device)) if cuda else f"CPU ({torch.get_num_threads()} threads)"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": name,
            "torch": torch.__version__, "transformers": transformers.__version__, "dtype": args.dtype,
            "size": "tiny" if args.tiny else "gpu", "sizes": dataclasses.asdict(size),
            "compile": compile_settings(device, args.compile_backend), "fp_check_every": HAS_CHECK_EVERY,
            "set": args.set,
            "repeats": args.repeats,
            "budget_s": args.budget_s}


def fmt_pair(values, fmt):
    return f"{fmt(values['model'])} / {fmt(values['base'])}"


def row_cells(cell, cuda):
    """The table's measurement columns of one cell: a number pair, a failure reason or ``-``."""
    if "skipped" in cell:
        return [cell["skipped"]] + ["-"] * 7
    ms = lambda v: f"{v:.2f}"  # noqa: E731
    out = [fmt_pair(cell["forward_ms"], ms) if "forward_ms" in cell else cell.get("forward_error", "-"),
           f"{cell['forward_ratio']:.2f}x" if "forward_ratio" in cell else "-",
           fmt_pair(cell["train_ms"], ms) if "train_ms" in cell else cell.get("train_error", "-"),
           f"{cell['train_ratio']:.2f}x" if "train_ratio" in cell else "-"]
    if "ops" in cell:
        key = "kernels" if cuda else "aten"
        out.append(fmt_pair({k: c[key] for k, c in cell["ops"].items()}, str))
        syncs = {k: c["syncs"] if cuda else c["host_reads"] + c["nonzero"] for k, c in cell["ops"].items()}
        out.append(fmt_pair(syncs, str))
    else:
        out += [cell.get("ops_error", "-"), "-"]
    out.append(fmt_pair(cell["gpu_busy"], lambda v: f"{100 * v:.0f}%") if "gpu_busy" in cell else "-")
    first = [cell[k] for k in ("first_calls_s", "first_train_calls_s") if k in cell]
    out.append(fmt_pair({k: sum(f[k] for f in first) for k in ("model", "base")}, lambda v: f"{v:.1f}") if first
               else "-")
    return out


def print_table(head, rows, cuda):
    print(f"\nbench_gpu, {head['date']}: {head['device']}, torch {head['torch']}, transformers "
          f"{head['transformers']}, {head['dtype']}, sizes {head['size']} {head['sizes']}, compiled = "
          f"torch.compile({', '.join(f'{k}={v!r}' for k, v in head['compile'].items())}), "
          f"{head['repeats']} repeats" + (f", every solver family with {head['set']}" if head["set"] else "") +
          ("" if head["fp_check_every"] else
                                          "; no fp_check_every in this version: compiled rows use the defaults") +
          "\n")
    kernels, syncs = ("kernels", "syncs") if cuda else ("aten ops", "host syncs")
    print(f"| model | vs | configuration | forward ms | forward x | train step ms | train x | {kernels} | {syncs} | "
          "GPU busy | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = row_cells(r["cell"], cuda)
        print(f"| {r['model']} | {r['base']} | {r['config']} | " + " | ".join(cells) + " |")
    print(f"\nEach pair: the model / its counterpart; x: the model's minimum over its counterpart's. {kernels} and "
          f"{syncs}: one forward (decoding rows: one generate call)" +
          ("; GPU busy: GPU kernel time over the forward's minimum wall time" if cuda else
           f"; {syncs}: aten::_local_scalar_dense + aten::nonzero, which synchronise on a GPU") +
          "; compile s: the compiled rows' first three forward and training calls (compilation, CUDA-graph "
          "recording).")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="width 32, 2 layers: the CPU dry run of the test suite")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds of each measurement")
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="seconds after which the remaining cells are skipped (a started cell finishes)")
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--check-every", nargs="+", type=int, default=[4, 0],
                   help="the fp_check_every values of the check_every configuration, one row each")
    p.add_argument("--compile-backend", default=None, choices=["inductor", "cudagraphs", "aot_eager", "eager"],
                   help="torch.compile backend of the compiled configuration (default: inductor with CUDA graphs on "
                        "CUDA, eager on a CPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--set", action="append", default=[], metavar="fp_key=value",
                   help="a per-call fixed-point setting of every solver-family call (repeatable; values parsed as "
                        "JSON), e.g. --set fp_backward=phantom")
    p.add_argument("--json", default=None, help="also write the header and every cell to this file")
    args = p.parse_args(argv)
    args.set = parse_set(args.set)
    unknown = sorted(set(args.set) - set(FP_DEFAULTS))
    if unknown:
        raise ValueError(f"--set takes fixed-point settings {sorted(FP_DEFAULTS)}, got {unknown}")
    check_device(args.device)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.check_every) < 0:
        raise ValueError(f"--check-every takes integers >= 0 (0: never inside the solve), got {args.check_every}")
    return args


def on(device, dtype, batch):
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}


def build(pairs, fam, size, device, dtype):
    """``fam``'s (model, counterpart) on ``device``, built once and shared by the rows of one pair (FPSA-BERT's two),
    or the exception that building raised."""
    if fam.pair not in pairs:
        torch.manual_seed(0)
        try:
            pairs[fam.pair] = tuple(m.to(device, dtype).eval() for m in fam.pair(size))
        except Exception as e:  # e.g. a config a transformers release refuses: the row says so, the others run
            pairs[fam.pair] = e
    return pairs[fam.pair]


def main(argv=None):
    args = parse_args(argv)
    device, dtype, size = args.device, getattr(torch, args.dtype), SIZES["tiny" if args.tiny else "gpu"]
    cuda = torch.device(device).type == "cuda"
    torch._dynamo.config.recompile_limit = 64  # one code object (e.g. Llama's forward) serves several models here
    settings, head = compile_settings(device, args.compile_backend), header(args, device, size)
    deadline, pairs, rows = time.perf_counter() + args.budget_s, {}, []
    configs = {name: {**args.set, **knobs} for name, knobs in configurations(args.configs, args.check_every).items()}
    for config, config_knobs in configs.items():
        for key in args.families:
            fam = FAMILIES[key]
            if config.startswith("check_every") and not fam.solver:
                continue  # no solve: nothing to check
            row = {"family": key, "model": fam.label, "base": fam.base_label, "config": config}
            if time.perf_counter() > deadline:
                row["cell"] = {"skipped": SKIPPED}
            elif isinstance(pair := build(pairs, fam, size, device, dtype), Exception):
                row["cell"] = {"skipped": f"building the models failed: {reason(pair)}"}
            else:
                inputs = tuple(on(device, dtype, b) for b in fam.inputs(size, fam.labels))
                t0 = time.perf_counter()
                row["cell"] = measure_cell(fam, size, pair, inputs, config, config_knobs, settings, device,
                                           args.repeats)
                row["cell"]["seconds"] = time.perf_counter() - t0
            print(f"{config:14s} {fam.label:28s} {row['cell'].get('seconds', 0):5.1f} s: " +
                  " | ".join(row_cells(row["cell"], cuda)), flush=True)
            rows.append(row)
    order = {k: i for i, k in enumerate(FAMILIES)}
    rows.sort(key=lambda r: (order[r["family"]], list(configs).index(r["config"])))
    print_table(head, rows, cuda)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": head, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
