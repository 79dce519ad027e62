"""Test-time scaling: evaluate a looped model at several loop counts with lm-eval, as a table and a plot.

    python -m hf_fixedpoint.eval.loop_sweep --model_dir runs/stars_ouro/stars --loops 1,2,4,8,16 \\
        --tasks fp_arith_word --output_dir runs/sweep

The model is loaded once as the ``hf-fixedpoint`` lm-eval model (``FixedPointLM``); the loop count is one of its
per-call knobs (a named parameter of the model's ``forward``, ``total_ut_steps`` for Ouro; ``--knob`` for other
families), changed between evaluations, so every forward and ``generate`` call of lm-eval runs that many loops. The
default task, ``fp_arith_word``, is 100 generated arithmetic word problems packaged with hf-fixedpoint (offline).
The equivalent single evaluation from the command line is ``--model_args pretrained=DIR,total_ut_steps=K``.

Accuracy against compute (Ouro's early exit, ``exit_mode="skip"``):

    python -m hf_fixedpoint.eval.loop_sweep --model_dir DIR --loops 1,2,4,8 --exit_thresholds 0.5,0.9 \\
        --exit_tols 0.2,0.1 --output_dir runs/sweep

evaluates the fixed loop counts (the reference curve) and, at ``--exit_loops`` loops (default the largest of
``--loops``), each gate threshold and state-change tolerance with ``exit_mode="skip"``, through the same lm-eval
model, and plots each score against the mean loops actually run per decoded token, read from the model's outputs
(``exit_loop``, see ``LoopMeter``): ``accuracy_vs_compute.png`` and ``compute.json``.
"""

from __future__ import annotations

import argparse
import json
import os

from hf_fixedpoint.eval.runner import OFFLINE_ENV, TASKS_DIR


def loop_sweep(model, loops, tasks=("fp_arith_word",), *, tokenizer=None, knob: str = "total_ut_steps", limit=None,
               batch_size: int = 8, device: str = "cpu", model_args: dict | None = None) -> dict:
    """Scores per loop count: ``{task: {metric: {loops: value}}}``.

    Args:
        model: a saved looped model with its tokenizer (a folder, loaded with ``trust_remote_code=True``), or a model
            instance together with ``tokenizer``.
        loops: loop counts to evaluate.
        knob: the ``forward`` parameter that sets the loop count.
        limit, batch_size, device: as for ``lm_eval.simple_evaluate``.
        model_args: extra ``FixedPointLM`` arguments.
    """
    loops = [int(k) for k in loops]
    if not loops or min(loops) < 1:
        raise ValueError(f"loops={loops!r} must be a non-empty list of counts >= 1.")
    lm, manager = _harness(model, tokenizer, device, batch_size, model_args, [knob])
    scores: dict = {}
    for k in loops:
        lm.forward_kwargs[knob] = k
        for task, metrics in _evaluate(lm, manager, tasks, limit).items():
            for name, value in metrics.items():
                scores.setdefault(task, {}).setdefault(name, {})[k] = value
    return scores


def _harness(model, tokenizer, device, batch_size, model_args, knobs):
    """The ``FixedPointLM`` of ``model`` and the task manager of the packaged tasks; every name in ``knobs`` must be
    a per-call parameter of the model's ``forward``."""
    for var in OFFLINE_ENV:
        os.environ.setdefault(var, "1")
    from lm_eval.tasks import TaskManager

    from hf_fixedpoint.eval.lm_harness import FixedPointLM, forward_knob_names

    if isinstance(model, (str, os.PathLike)):
        lm = FixedPointLM(pretrained=os.fspath(model), trust_remote_code=True, device=device, batch_size=batch_size,
                          **(model_args or {}))
    else:
        lm = FixedPointLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size,
                          **(model_args or {}))
    for knob in knobs:
        if knob not in forward_knob_names(lm.model):
            raise ValueError(f"knob={knob!r} is not a parameter of {type(lm.model).__name__}.forward; per-call "
                             f"knobs: {sorted(forward_knob_names(lm.model))}.")
    return lm, TaskManager(include_path=TASKS_DIR, include_defaults=False)


def _evaluate(lm, manager, tasks, limit) -> dict:
    """One lm-eval run with the knobs set on ``lm``: ``{task: {metric: value}}``."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False)
    scores: dict = {}
    for task, metrics in out["results"].items():
        for name, value in metrics.items():
            # metrics are "name,filter"; skip their stderr and bookkeeping entries (alias, sample_len)
            if "," not in name or "stderr" in name or not isinstance(value, (int, float)):
                continue
            scores.setdefault(task, {})[name.split(",")[0]] = float(value)
    return scores


class LoopMeter:
    """Forward hook of a looped LM that counts the loops actually run per decoded position, from each call's outputs:
    ``exit_loop + 1`` under ``exit_mode="skip"`` (each token stops at its exit loop), otherwise the number of loop
    states returned (every loop runs for every token). Decoded positions are those the call returns logits for
    (``generate`` keeps the last one: one per generated token, finished rows of a batch included)."""

    def __init__(self):
        self.loops, self.positions = 0.0, 0

    def __call__(self, module, args, kwargs, output):
        mode = kwargs.get("exit_mode") or getattr(module.config, "early_exit_mode", "select")
        exit_loop, states = getattr(output, "exit_loop", None), getattr(output, "loop_hidden_states", None)
        if mode == "skip" and exit_loop is not None:
            self.loops += float((exit_loop + 1).double().sum())
            self.positions += exit_loop.numel()
        elif states is not None and getattr(output, "logits", None) is not None:
            self.loops += float(len(states) * output.logits.shape[:2].numel())
            self.positions += output.logits.shape[:2].numel()
        else:
            raise ValueError(f"{type(module).__name__} outputs report no loops run (exit_loop / loop_hidden_states); "
                             "the compute sweep needs a looped model with an early exit (Ouro).")

    @property
    def mean(self) -> float:
        return self.loops / self.positions if self.positions else float("nan")


def exit_settings(loops, thresholds=(), tols=(), exit_loops=None) -> list:
    """``(name, kind, forward kwargs)`` of a compute sweep: every loop count in ``loops`` at full depth (the reference,
    kind ``"loops"``), then ``exit_mode="skip"`` at ``exit_loops`` loops (default ``max(loops)``) with each gate
    threshold (``"threshold"``) and each state-change tolerance (``"tol"``)."""
    loops = [int(k) for k in loops]
    if not loops or min(loops) < 1:
        raise ValueError(f"loops={loops!r} must be a non-empty list of counts >= 1.")
    depth = max(loops) if exit_loops is None else exit_loops
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"exit_loops={exit_loops!r} must be an integer >= 1.")
    for q in thresholds:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"exit threshold {q!r} must lie in [0, 1] (the gate's cumulative exit probability).")
    for t in tols:
        if t < 0:
            raise ValueError(f"exit tolerance {t!r} must be >= 0 (a relative state change).")
    out = [(f"loops={k}", "loops", {"total_ut_steps": k, "exit_mode": "select"}) for k in loops]
    out += [(f"q={q:g}", "threshold", {"total_ut_steps": depth, "exit_mode": "skip", "exit_threshold": float(q)})
            for q in thresholds]
    out += [(f"tol={t:g}", "tol", {"total_ut_steps": depth, "exit_mode": "skip", "exit_tol": float(t)})
            for t in tols]
    return out


def compute_sweep(model, settings, tasks=("fp_arith_word",), *, tokenizer=None, limit=None, batch_size: int = 8,
                  device: str = "cpu", model_args: dict | None = None) -> list:
    """Accuracy against compute: for each ``(name, kind, forward kwargs)`` of ``settings`` (``exit_settings``), the
    lm-eval scores with those knobs on every call and the mean loops actually run per decoded position, read from
    the model's outputs (``LoopMeter``). Returns ``[{"name", "kind", "kwargs", "mean_loops", "scores": {task: {metric:
    value}}}]``."""
    knobs = sorted({k for _, _, kwargs in settings for k in kwargs})
    lm, manager = _harness(model, tokenizer, device, batch_size, model_args, knobs)
    rows = []
    for name, kind, kwargs in settings:
        lm.forward_kwargs = {k: v for k, v in lm.forward_kwargs.items() if k not in knobs} | dict(kwargs)
        meter = LoopMeter()
        handle = lm.model.register_forward_hook(meter, with_kwargs=True)
        try:
            scores = _evaluate(lm, manager, tasks, limit)
        finally:
            handle.remove()
        rows.append({"name": name, "kind": kind, "kwargs": dict(kwargs), "mean_loops": meter.mean, "scores": scores})
    return rows


def format_compute_table(rows: list) -> str:
    """One row per setting: mean loops run and every (task, metric)."""
    cols = [(task, metric) for task, metrics in rows[0]["scores"].items() for metric in metrics]
    lines = [f"{'setting':<12s}{'loops run':>10s}" + "".join(f"  {t + ' / ' + m:>28s}" for t, m in cols)]
    for r in rows:
        lines.append(f"{r['name']:<12s}{r['mean_loops']:10.2f}"
                     + "".join(f"  {r['scores'][t][m]:28.3f}" for t, m in cols))
    return "\n".join(lines)


def plot_compute(rows: list, path: str, title: str = "accuracy vs. loops actually run") -> str:
    """Each (task, metric) against the mean loops run: the fixed loop counts (reference) and each exit rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"loops": "fixed loops (every loop)", "threshold": "skip, gate threshold q", "tol": "skip, state tol"}
    for task, metrics in rows[0]["scores"].items():
        for metric in metrics:
            for kind, style in (("loops", "o-"), ("threshold", "s--"), ("tol", "^:")):
                pts = sorted((r["mean_loops"], r["scores"][task][metric], r["name"])
                             for r in rows if r["kind"] == kind)
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{task} / {metric}: {labels[kind]}")
                for x, y, name in pts:
                    ax.annotate(name.split("=")[1], (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("mean loops run per decoded token")
    ax.set_ylabel("score")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(scores: dict) -> str:
    """One row per (task, metric), one column per loop count."""
    lines = []
    for task, metrics in scores.items():
        for metric, by_loops in metrics.items():
            counts = sorted(by_loops)
            if not lines:
                lines.append(f"{'task / metric':<32s}" + "".join(f"{k:>8d}" for k in counts))
            lines.append(f"{task + ' / ' + metric:<32s}" + "".join(f"{by_loops[k]:8.3f}" for k in counts))
    return "\n".join(lines)


def plot_sweep(scores: dict, path: str, title: str = "accuracy vs. loops") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for task, metrics in scores.items():
        for metric, by_loops in metrics.items():
            counts = sorted(by_loops)
            ax.plot(counts, [by_loops[k] for k in counts], marker="o", label=f"{task} / {metric}")
    ax.set_xlabel("loops at test time")
    ax.set_ylabel("score")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _floats(text: str, flag: str) -> list:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be comma-separated numbers.") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="saved looped model with its tokenizer")
    parser.add_argument("--loops", default="1,2,4,8", help="comma-separated loop counts")
    parser.add_argument("--tasks", default="fp_arith_word", help="comma-separated lm-eval tasks")
    parser.add_argument("--knob", default="total_ut_steps", help="forward parameter that sets the loop count")
    parser.add_argument("--exit_thresholds", default="", help="accuracy vs. compute (Ouro): comma-separated gate "
                        "thresholds q in [0, 1] run with exit_mode='skip'")
    parser.add_argument("--exit_tols", default="", help="accuracy vs. compute (Ouro): comma-separated state-change "
                        "tolerances >= 0 run with exit_mode='skip'")
    parser.add_argument("--exit_loops", type=int, default=None, help="full depth of the exit settings (default: the "
                        "largest of --loops)")
    parser.add_argument("--limit", type=int, default=None, help="examples per task")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output_dir", default=None, help="where sweep.json and sweep.png go (with exit settings "
                        "also compute.json and accuracy_vs_compute.png)")
    args = parser.parse_args(argv)
    loops = [int(x) for x in args.loops.split(",") if x.strip()]
    tasks = [t for t in args.tasks.split(",") if t.strip()]
    thresholds, tols = _floats(args.exit_thresholds, "--exit_thresholds"), _floats(args.exit_tols, "--exit_tols")
    rows = None
    if thresholds or tols:
        if args.knob != "total_ut_steps":
            raise ValueError(f"--knob={args.knob!r}: the exit sweep (--exit_thresholds / --exit_tols) is Ouro's and "
                             "sets total_ut_steps.")
        rows = compute_sweep(args.model_dir, exit_settings(loops, thresholds, tols, args.exit_loops), tasks,
                             limit=args.limit, batch_size=args.batch_size, device=args.device)
        scores: dict = {}
        for r in rows:
            if r["kind"] == "loops":
                for task, metrics in r["scores"].items():
                    for name, value in metrics.items():
                        scores.setdefault(task, {}).setdefault(name, {})[r["kwargs"]["total_ut_steps"]] = value
        print(format_compute_table(rows))
    else:
        scores = loop_sweep(args.model_dir, loops, tasks, knob=args.knob, limit=args.limit,
                            batch_size=args.batch_size, device=args.device)
    print(format_table(scores))
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "sweep.json"), "w") as fh:
            json.dump(scores, fh, indent=2)
        print(plot_sweep(scores, os.path.join(args.output_dir, "sweep.png")))
        if rows is not None:
            with open(os.path.join(args.output_dir, "compute.json"), "w") as fh:
                json.dump(rows, fh, indent=2)
            print(plot_compute(rows, os.path.join(args.output_dir, "accuracy_vs_compute.png")))
    return scores if rows is None else rows


if __name__ == "__main__":
    main()
