"""Section (c) of ``benchmarks/bench_fpsa.py`` (``python -m benchmarks.bench_fpsa --dispatch``): the encoder solve's
dense dispatch, ``fp_fpsa.DENSE_OPEN_FRACTION``. See that module's docstring; every number printed is measured here.
"""

import contextlib
import math
import time

import torch

# (name, batch, tokens, width, heads): the FPSA-ViT digits model of bench_fpsa_convergence (8x8 images, patch 2, one
# [CLS]; its test batch) and MiniLM at two lengths (bench_fpsa's batch).
CALL_SHAPES = (("T=17  ViT digits", 128, 17, 64, 4), ("T=64  MiniLM", 4, 64, 384, 12),
               ("T=128 MiniLM", 4, 128, 384, 12))
FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.1)
CALLS_PER_SAMPLE = 10  # evaluations timed together per repeat (one is a fraction of a millisecond at T=17)
# The whole-forward modes: open-token path whenever a token is frozen, the code before the rule (dense only with every
# token open), every evaluation dense, and the module's own value (None).
MODES = {"sparse-always": math.inf, "before (1.0)": 1.0, "dense-always": 0.0, "rule": None}


def _copies():
    from hf_fixedpoint.core import fp_fpsa
    from hf_fixedpoint.modeling.fpsa_bert import fp_fpsa as bert_copy
    from hf_fixedpoint.modeling.fpsa_vit import fp_fpsa as vit_copy

    return fp_fpsa, bert_copy, vit_copy


@contextlib.contextmanager
def dense_open_fraction(value):
    """Set ``DENSE_OPEN_FRACTION`` in the core and the FPSA-BERT / FPSA-ViT copies (None: leave it)."""
    mods = _copies()
    old = [m.DENSE_OPEN_FRACTION for m in mods]
    try:
        for m in mods:
            m.DENSE_OPEN_FRACTION = m.DENSE_OPEN_FRACTION if value is None else value
        yield
    finally:
        for m, v in zip(mods, old):
            m.DENSE_OPEN_FRACTION = v


def _layer(B, T, D, H):
    """One random BERT attention layer's FPSA map (``sparse_f``) and its arguments at the first step's output."""
    from transformers import BertConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.bert.modeling_bert import BertSelfAttention, BertSelfOutput

    from hf_fixedpoint.core import fp_fpsa

    torch.manual_seed(0)
    config = BertConfig(hidden_size=D, num_attention_heads=H, intermediate_size=4 * D)
    att, out = BertSelfAttention(config).eval(), BertSelfOutput(config).eval()
    d = D // H

    def split(t):
        return t.view(*t.shape[:-1], -1, d).transpose(1, 2)

    fmap = fp_fpsa._LayerMap(att, lambda z: split(att.query(z)), lambda z: split(att.key(z)), out.dense,
                             out.LayerNorm, ALL_ATTENTION_FUNCTIONS["sdpa"], att.scaling, None, None,
                             fp_fpsa.FPSAOptions(), torch.float32)
    f = fp_fpsa._open_tokens_map(fmap.state, fmap.scaled_query, fmap.key, fmap.attend_rows, fmap.step_norm)
    x = torch.randn(B, T, D)
    v = split(att.value(x))
    o = fmap.attend(x, v, None, ())[0]
    keys, stale = torch.empty(B, H, T, d), torch.ones(B, T, dtype=torch.bool)
    f(o, x, v, None, keys, stale)  # fills the key cache
    return f, (o, x, v, None, keys, stale)


def per_call(repeats, shapes=CALL_SHAPES):
    """Min process CPU time (one thread: the time without the waits for a core) of one evaluation, open-token path
    vs dense map, by open-token fraction: ``{(name, frac): ratio}``."""
    print(f"\n(c1) one evaluation of the encoder map, open-token path (sparse) vs dense map, process CPU time, min of "
          f"{repeats} interleaved repeats of {CALLS_PER_SAMPLE} calls, 1 thread, no grad")
    print(f"    {'shape':18s} {'B':>4s} {'open':>5s} {'sparse ms':>9s} {'dense ms':>9s} {'sparse/dense':>12s}")
    ratios = {}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, B, T, D, H in shapes:
            f, args = _layer(B, T, D, H)
            stale = args[-1]
            for frac in FRACTIONS:
                tokens = torch.zeros(B * T, dtype=torch.bool)
                tokens[torch.randperm(B * T, generator=g)[:max(1, round(frac * B * T))]] = True
                tokens = tokens.view(B, T)
                active = tokens[..., None].expand(B, T, H)  # the solver's (token, head) mask
                best = {}
                for rep in range(repeats + 1):  # round 0 warms up
                    for mode in ("sparse-always", "dense-always"):
                        with dense_open_fraction(MODES[mode]):
                            t0 = time.process_time()
                            for _ in range(CALLS_PER_SAMPLE):
                                stale.copy_(tokens)  # steady state: the previous call's open tokens
                                f(*args, active=active)
                            dt = (time.process_time() - t0) / CALLS_PER_SAMPLE
                        best[mode] = min(best.get(mode, math.inf), dt) if rep else math.inf
                sp, de = best["sparse-always"], best["dense-always"]
                ratios[(name, frac)] = sp / de
                print(f"    {name:18s} {B:4d} {frac:5.2f} {1e3 * sp:9.3f} {1e3 * de:9.3f} {sp / de:12.2f}")
    return ratios


def _forward_table(title, run, repeats):
    """Min wall time and min process CPU time of ``run()`` per mode over interleaved repeats; prints them, their
    ratios to dense-always, and the max |difference| of the outputs against dense-always. With one thread the CPU time
    is the wall time without the waits for a core: the steadier number on a shared machine."""
    print(f"\n{title}")
    outs, times, cpu = {}, {m: [] for m in MODES}, {m: [] for m in MODES}
    with torch.no_grad():
        for m, value in MODES.items():  # warm-up, and the outputs
            with dense_open_fraction(value):
                outs[m] = run()
        for _ in range(repeats):
            for m, value in MODES.items():
                with dense_open_fraction(value):
                    t0, c0 = time.perf_counter(), time.process_time()
                    run()
                    times[m].append(time.perf_counter() - t0)
                    cpu[m].append(time.process_time() - c0)
    dense, dense_cpu = min(times["dense-always"]), min(cpu["dense-always"])
    for m in MODES:
        diff = float((outs[m] - outs["dense-always"]).abs().max())
        print(f"    {m:14s} wall {1e3 * min(times[m]):8.2f} ms  x dense {min(times[m]) / dense:5.2f}   "
              f"cpu {1e3 * min(cpu[m]):8.2f} ms  x dense {min(cpu[m]) / dense_cpu:5.2f}   "
              f"max |out - dense| {diff:.1e}")
    return {m: (min(times[m]) / dense, min(cpu[m]) / dense_cpu) for m in MODES}


def _trained_vit(epochs):
    from benchmarks.bench_fpsa_convergence import TASK_KNOBS, train_vit
    from recipes.fpsa_vit import image_collate, load_digits_split

    (x_train, y_train), (x_test, y_test) = load_digits_split(0.2, 0)
    collate = image_collate(8, 1)
    model, seconds, _ = train_vit(TASK_KNOBS["vit"], 0, (x_train, y_train), collate,
                                  dict(image_size=8, patch_size=2, num_channels=1),
                                  int(epochs * math.ceil(len(x_train) / 64)))
    test = [collate(list(zip(x_test[i:i + 128], y_test[i:i + 128]))) for i in range(0, len(x_test), 128)]
    for b in test:
        b.pop("labels")
    return model.eval(), test, seconds


def dispatch(path, tok, repeats, batch_size, vit_epochs):
    from benchmarks.bench_fpsa import SEQ_LEN, TEXT
    from hf_fixedpoint.core import fp_fpsa
    from hf_fixedpoint.modeling import FPSABertModel

    torch.set_num_threads(1)
    print(f"(c) dense dispatch: DENSE_OPEN_FRACTION = {fp_fpsa.DENSE_OPEN_FRACTION} (rule: dense while at least this "
          "fraction of the working tokens is open)")
    per_call(repeats)
    batch = tok([TEXT * 4] * batch_size, truncation=True, max_length=SEQ_LEN, padding="max_length",
                return_tensors="pt")
    bert = FPSABertModel.from_pretrained(path).eval()
    bert_ratios = _forward_table(f"(c2) FPSA-BERT no-grad forward, {path}, batch {tuple(batch['input_ids'].shape)}, "
                                 f"min of {repeats} interleaved repeats",
                                 lambda: bert(**batch).last_hidden_state, repeats)
    vit, test, seconds = _trained_vit(vit_epochs)
    vit_ratios = _forward_table(f"(c3) FPSA-ViT digits ({vit_epochs:g} epochs, trained here in {seconds:.0f} s), "
                                f"no-grad forward of the {sum(len(b['pixel_values']) for b in test)} test images "
                                f"in batches of 128, min of {repeats} interleaved repeats",
                                lambda: torch.cat([vit(**b).logits for b in test]), repeats)
    return bert_ratios, vit_ratios
