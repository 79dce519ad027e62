"""Every family on a GPU: the checks that need one, for a machine that has one (never part of the test suite).

    python tools/gpu_smoke.py                  # on a CUDA machine, from the repo root
    SMOKE_DEV=cpu python tools/gpu_smoke.py    # a dry run of the same checks with CPU in place of CUDA
    SMOKE_FAMILIES=fprm,ouro python tools/gpu_smoke.py    # some families only

For each family's tiny test config (``tests/models/<family>``): the float32 logits on the device against CPU
(max |diff| < 1e-3), three ``transformers.Trainer`` steps on the device in float32 and in bf16 (finite losses, the
fixed-point statistics in the logs), and for the causal LMs greedy ``generate`` of a left-padded batch on the device
against CPU (equal tokens; Ouro with per-token early exit, ``exit_mode="skip"``). Prints one PASS / FAIL line a check
and a summary; the results of the last GPU run are in docs/gpu.md ("Results"). Speed (latency, training steps,
kernels and synchronisations against plain models) is measured by ``benchmarks/bench_gpu.py``, not here.
"""

import copy
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_fixedpoint.callbacks import FixedPointStatsCallback  # noqa: E402
from hf_fixedpoint.modeling import (  # noqa: E402
    AttractorForCausalLM,
    DEQLMForCausalLM,
    FPRMForPuzzles,
    FPSABertForSequenceClassification,
    FPSAViTForImageClassification,
    OuroForCausalLM,
    SelfLlamaForCausalLM,
    SelfMistralForCausalLM,
    TRMForPuzzles,
    URMForPuzzles,
)
from tests.models.attractor_lm import test_modeling_attractor_lm as attractor_tests  # noqa: E402
from tests.models.deq_lm import test_modeling_deq_lm as deq_tests  # noqa: E402
from tests.models.fprm import test_modeling_fprm as fprm_tests  # noqa: E402
from tests.models.fpsa_bert import test_modeling_fpsa_bert as bert_tests  # noqa: E402
from tests.models.fpsa_vit import test_modeling_fpsa_vit as vit_tests  # noqa: E402
from tests.models.ouro import test_modeling_ouro as ouro_tests  # noqa: E402
from tests.models.self_llama import test_modeling_self_llama as llama_tests  # noqa: E402
from tests.models.self_mistral import test_modeling_self_mistral as mistral_tests  # noqa: E402
from tests.models.trm import test_modeling_trm as trm_tests  # noqa: E402
from tests.models.urm import test_modeling_urm as urm_tests  # noqa: E402

N = 8
DEV = os.environ.get('SMOKE_DEV', 'cuda')


def tokens(vocab, length=6, seed=0):
    return torch.randint(1, vocab, (N, length), generator=torch.Generator().manual_seed(seed))


def lm_rows(c):
    ids = tokens(c.vocab_size)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def seq_rows(c):
    return {**lm_rows(c), "labels": torch.tensor([0, 1] * (N // 2))}


def image_rows(c):
    return {"pixel_values": torch.randn(N, 3, 16, 16, generator=torch.Generator().manual_seed(0)),
            "labels": torch.tensor([0, 1, 2, 0] * (N // 4))}


def puzzle_rows(c):
    return {"input_ids": tokens(c.vocab_size, 9), "puzzle_identifiers": torch.arange(N) % 3,
            "labels": tokens(c.vocab_size, 9, seed=1)}


FAMILIES = {
    "deq_lm": (DEQLMForCausalLM, deq_tests.TestDEQLM.config_kwargs, lm_rows, True),
    "attractor_lm": (AttractorForCausalLM, attractor_tests.TINY, lm_rows, True),
    "ouro": (OuroForCausalLM, ouro_tests.TINY, lm_rows, True),
    "self_llama": (SelfLlamaForCausalLM, llama_tests.TestSelfLlama.config_kwargs, lm_rows, True),
    "self_mistral": (SelfMistralForCausalLM, mistral_tests.TestSelfMistral.config_kwargs, lm_rows, True),
    "fpsa_bert": (FPSABertForSequenceClassification, bert_tests.TINY, seq_rows, False),
    "fpsa_vit": (FPSAViTForImageClassification, vit_tests.TINY, image_rows, False),
    "fprm": (FPRMForPuzzles, fprm_tests.TestFPRM.config_kwargs, puzzle_rows, False),
    "trm": (TRMForPuzzles, trm_tests.TestAttractorReasoning.config_kwargs, puzzle_rows, False),
    "urm": (URMForPuzzles, urm_tests.TestURM.config_kwargs, puzzle_rows, False),
}


def first_tensor(out):
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return out[0]


class ListData(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.rows.items()}


def check_family(name, cls, kwargs, rows_fn, causal, results):
    torch.manual_seed(0)
    model = cls(cls.config_class(**kwargs)).eval()
    rows = rows_fn(model.config)
    with torch.no_grad():
        ref = first_tensor(model(**rows)).float()
        gpu = copy.deepcopy(model).to(DEV)
        got = first_tensor(gpu(**{k: v.to(DEV) for k, v in rows.items()})).float().cpu()
    diff = (ref - got).abs().max().item()
    results.append((name, "fp32 cpu-vs-cuda max|diff|", f"{diff:.2e}", diff < 1e-3 and torch.isfinite(got).all()))
    for bf16 in (False, True):
        torch.manual_seed(0)
        m = cls(cls.config_class(**kwargs))
        args = TrainingArguments(output_dir=f"/tmp/trainer_{name}_{bf16}", max_steps=3, per_device_train_batch_size=4,
                                 logging_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no",
                                 disable_tqdm=True, bf16=bf16, use_cpu=DEV == 'cpu')
        tr = Trainer(model=m, args=args, train_dataset=ListData(rows), callbacks=[FixedPointStatsCallback()])
        t0 = time.time()
        tr.train()
        logs = [e for e in tr.state.log_history if "loss" in e]
        ok = len(logs) == 3 and all(math.isfinite(e["loss"]) for e in logs) and next(m.parameters()).device.type == DEV
        stats = {k: round(v, 3) for k, v in logs[-1].items() if k.startswith(("fp_", "fpsa_"))} if logs else {}
        results.append((name, f"Trainer cuda {'bf16' if bf16 else 'fp32'} 3 steps",
                        f"losses {[round(e['loss'], 3) for e in logs]} {stats} {time.time() - t0:.1f}s", ok))
    if causal:
        ids = tokens(model.config.vocab_size, 7, seed=3)[:3]
        mask = torch.ones_like(ids)
        ids[0, :3] = getattr(model.config, "pad_token_id", None) or 0  # left padding
        mask[0, :3] = 0
        extra = {"exit_threshold": 0.5, "exit_mode": "skip"} if name == "ouro" else {}
        pad = getattr(model.config, "pad_token_id", None) or 0
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=pad, **extra)
        with torch.no_grad():
            a = model.generate(ids, attention_mask=mask, **kw)
            b = gpu.generate(ids.to(DEV), attention_mask=mask.to(DEV), **kw).cpu()
        results.append((name, f"generate left-padded cpu==cuda {extra or ''}", str(b[:, -6:].tolist()),
                        torch.equal(a, b)))


def main():
    print("torch", torch.__version__, torch.cuda.get_device_name(0) if DEV == "cuda" else DEV, flush=True)
    results = []
    only = [f for f in os.environ.get("SMOKE_FAMILIES", "").split(",") if f]
    unknown = sorted(set(only) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"SMOKE_FAMILIES: unknown {unknown}; allowed values are {sorted(FAMILIES)}")
    for name, (cls, kwargs, rows_fn, causal) in FAMILIES.items():
        if only and name not in only:
            continue
        try:
            check_family(name, cls, kwargs, rows_fn, causal, results)
        except Exception as e:  # report and go on
            results.append((name, "EXCEPTION", f"{type(e).__name__}: {str(e)[:300]}", False))
            traceback.print_exc(limit=4)
        for r in [r for r in results if r[0] == name]:
            print(f"{'PASS' if r[3] else 'FAIL'} | {r[0]} | {r[1]} | {r[2]}", flush=True)
    print("SUMMARY", sum(bool(r[3]) for r in results), "/", len(results), "passed", flush=True)


if __name__ == "__main__":
    main()
