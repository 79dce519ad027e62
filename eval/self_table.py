"""Accuracy, FPSA iterations and latency per task and iteration cap (the columns of Table 3 of "Change of Thought").

    python -m hf_fixedpoint.eval.self_table --model runs/self_llama --caps 1,4,16 \\
        --tasks fp_copy_mc,fp_copy_gen,fp_arith_word --limit 50

The model (a SELF-LLaMA / SELF-Mistral folder, or any LLaMA / Mistral folder loaded as one with ``--retrofit``) is
loaded once as the ``hf-fixedpoint`` lm-eval model (``FixedPointLM``). For each cap, ``fp_max_iter`` (and ``--tol``
as ``fp_tol``) become its ``fp_*`` knobs, i.e. the ``model_args`` ``fp_max_iter=K`` of a single evaluation, and
each task is evaluated on its own, so that every row has its own timing and statistics:

* the task's metrics (accuracy, exact match, perplexity...), from lm-eval;
* FPSA iterations: forward hooks on the model (``ForwardRecorder``) collect the ``fp_stats`` output of every forward
  call of the evaluation (loglikelihood batches, the prompt and every decoding step of ``generate``);
  ``FPSAStats.merge`` of them gives the median / p90 over every (layer, token, head) entry and the cap-hit rate
  (at cap 1 every entry counts as a cap hit: one step is taken and no convergence is tested);
* latency: wall and process CPU seconds spent in the model's ``forward`` during the task (lm-eval's task building,
  tokenisation and scoring excluded) and the CPU time per example (document). Run with one thread
  (``OMP_NUM_THREADS=1``) on a shared machine: the CPU time is then the latency without the waits for a core.

With ``--batch_size`` > 1 the loglikelihood batches of lm-eval are right-padded without an attention mask, so the
padding positions (which do not change the real tokens' results) are counted in the iteration statistics too; the
default batch size 1 counts real tokens only. Generation batches pass their mask and count real tokens only.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from hf_fixedpoint.eval.runner import OFFLINE_ENV, TASKS_DIR

STAT_KEYS = ("fpsa_iter_median", "fpsa_iter_p90", "fpsa_cap_hit_rate")


def load_lm(model, *, tokenizer=None, retrofit: str | None = None, batch_size: int = 1, device: str = "cpu",
            model_args: dict | None = None):
    """``FixedPointLM`` on a SELF model: a folder (with ``retrofit`` = ``llama`` / ``mistral`` a plain LLaMA /
    Mistral folder is loaded into the SELF class), or a model instance with its ``tokenizer``."""
    from transformers import AutoTokenizer

    from hf_fixedpoint.eval.lm_harness import FixedPointLM
    from hf_fixedpoint.modeling import SelfLlamaForCausalLM, SelfMistralForCausalLM

    retrofits = {"llama": SelfLlamaForCausalLM, "mistral": SelfMistralForCausalLM}
    if retrofit is not None:
        if retrofit not in retrofits:
            raise ValueError(f"retrofit={retrofit!r} is not allowed; choose one of {sorted(retrofits)} or None.")
        path = os.fspath(model)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        model = retrofits[retrofit].from_pretrained(path).eval()
    if isinstance(model, (str, os.PathLike)):
        lm = FixedPointLM(pretrained=os.fspath(model), trust_remote_code=True, device=device, batch_size=batch_size,
                          **(model_args or {}))
    else:
        lm = FixedPointLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size,
                          **(model_args or {}))
    return lm


def task_scores(results: dict) -> dict:
    """``{task: {metric: value}}`` from ``simple_evaluate`` results (stderr and bookkeeping entries dropped)."""
    return {
        task: {name.split(",")[0]: float(v) for name, v in metrics.items()
               if "," in name and "stderr" not in name and isinstance(v, (int, float))}
        for task, metrics in results["results"].items()
    }


class ForwardRecorder:
    """Forward hooks on a model that collect the ``fp_stats`` of every output and the seconds spent in ``forward``.

    Use as a context manager; ``stats`` is the list of ``FPSAStats``, ``seconds`` / ``cpu_seconds`` the summed wall
    and process CPU time of the forward calls (for ``generate``: the prompt and every decoding step, without the
    sampling bookkeeping between them). With one thread the CPU time is the latency without the time spent waiting
    for a core, the stable number on a shared machine.
    """

    def __init__(self, model):
        self.model, self.stats, self._handles = model, [], []
        self.seconds = self.cpu_seconds = 0.0
        self._start = self._cpu_start = None

    def _pre(self, module, args):
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._start
        self.cpu_seconds += time.process_time() - self._cpu_start
        stats = getattr(output, "fp_stats", None)
        if stats is None:
            raise ValueError(f"{type(module).__name__} returned no fp_stats: the iteration table needs a model whose "
                             "outputs carry FPSAStats (SelfLlamaForCausalLM, SelfMistralForCausalLM); load a plain "
                             "LLaMA / Mistral folder with retrofit='llama' / 'mistral' (--retrofit).")
        self.stats.append(stats)

    def __enter__(self):
        self._handles = [self.model.register_forward_pre_hook(self._pre), self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return False


def self_table(lm, caps, tasks, *, tol: float | None = None, limit=None) -> list:
    """One row per (task, cap): ``{"task", "cap", "metrics", "fpsa_iter_median", "fpsa_iter_p90",
    "fpsa_cap_hit_rate", "forward_calls", "examples", "seconds", "model_seconds", "model_cpu_seconds",
    "cpu_ms_per_example"}`` (``seconds``: the whole evaluation; ``model_*``: inside ``forward``)."""
    for var in OFFLINE_ENV:
        os.environ.setdefault(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
    from hf_fixedpoint.eval.lm_harness import validate_fp_knobs

    caps = [int(c) for c in caps]
    if not caps or min(caps) < 1:
        raise ValueError(f"caps={caps!r} must be a non-empty list of iteration caps >= 1.")
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    rows = []
    for cap in caps:
        knobs = {"fp_max_iter": cap} if tol is None else {"fp_max_iter": cap, "fp_tol": tol}
        lm.fp_overrides = validate_fp_knobs(lm.model.config, knobs)
        for task in tasks:
            start = time.perf_counter()
            with ForwardRecorder(lm.model) as rec:
                out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                              log_samples=False)
            seconds = time.perf_counter() - start
            summary = FPSAStats.merge(rec.stats).summary()
            examples = out["n-samples"][task]["effective"]
            rows.append({"task": task, "cap": cap, "metrics": task_scores(out)[task],
                         **{k: summary[k] for k in STAT_KEYS}, "forward_calls": len(rec.stats), "examples": examples,
                         "seconds": seconds, "model_seconds": rec.seconds, "model_cpu_seconds": rec.cpu_seconds,
                         "cpu_ms_per_example": 1e3 * rec.cpu_seconds / max(examples, 1)})
    return rows


def format_table(rows: list) -> str:
    """Markdown table: task, cap, metrics, median / p90 iterations, cap-hit rate, latency."""
    lines = ["| task | cap | metrics | median iters | p90 iters | cap-hit | forward s (wall) | forward CPU s | "
             "CPU ms / example |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        metrics = ", ".join(f"{k} {v:.3f}" for k, v in r["metrics"].items())
        lines.append(f"| {r['task']} | {r['cap']} | {metrics} | {r['fpsa_iter_median']:g} | {r['fpsa_iter_p90']:g} | "
                     f"{r['fpsa_cap_hit_rate']:.3f} | {r['model_seconds']:.1f} | {r['model_cpu_seconds']:.1f} | "
                     f"{r['cpu_ms_per_example']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="saved SELF model with its tokenizer (or see --retrofit)")
    parser.add_argument("--retrofit", choices=["llama", "mistral"], default=None,
                        help="load a plain LLaMA / Mistral folder as SELF-LLaMA / SELF-Mistral (no conversion)")
    parser.add_argument("--caps", default="1,4,16", help="comma-separated fp_max_iter values")
    parser.add_argument("--tol", type=float, default=None, help="fp_tol for every cap (default: the config's)")
    parser.add_argument("--tasks", default="fp_copy_mc,fp_copy_gen", help="comma-separated lm-eval tasks")
    parser.add_argument("--limit", type=int, default=None, help="examples per task")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    caps = [int(x) for x in args.caps.split(",") if x.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    lm = load_lm(args.model, retrofit=args.retrofit, batch_size=args.batch_size, device=args.device)
    rows = self_table(lm, caps, tasks, tol=args.tol, limit=args.limit)
    print(format_table(rows))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(rows, fh, indent=2)
    return rows


if __name__ == "__main__":
    main()
