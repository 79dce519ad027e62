"""Test-time scaling: evaluate a looped model at several loop counts with lm-eval, as a table and a plot.

    python -m hf_fixedpoint.eval.loop_sweep --model_dir runs/stars_ouro/stars --loops 1,2,4,8,16 \\
        --tasks fp_arith_word --output_dir runs/sweep

The model is loaded once as the ``hf-fixedpoint`` lm-eval model (``FixedPointLM``); the loop count is one of its
per-call knobs (a named parameter of the model's ``forward``, ``total_ut_steps`` for Ouro; ``--knob`` for other
families), changed between evaluations, so every forward and ``generate`` call of lm-eval runs that many loops. The
default task, ``fp_arith_word``, is 100 generated arithmetic word problems packaged with hf-fixedpoint (offline).
The equivalent single evaluation from the command line is ``--model_args pretrained=DIR,total_ut_steps=K``.
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
    for var in OFFLINE_ENV:
        os.environ.setdefault(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hf_fixedpoint.eval.lm_harness import FixedPointLM, forward_knob_names

    loops = [int(k) for k in loops]
    if not loops or min(loops) < 1:
        raise ValueError(f"loops={loops!r} must be a non-empty list of counts >= 1.")
    if isinstance(model, (str, os.PathLike)):
        lm = FixedPointLM(pretrained=os.fspath(model), trust_remote_code=True, device=device, batch_size=batch_size,
                          **(model_args or {}))
    else:
        lm = FixedPointLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size,
                          **(model_args or {}))
    if knob not in forward_knob_names(lm.model):
        raise ValueError(f"knob={knob!r} is not a parameter of {type(lm.model).__name__}.forward; per-call knobs: "
                         f"{sorted(forward_knob_names(lm.model))}.")
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    scores: dict = {}
    for k in loops:
        lm.forward_kwargs[knob] = k
        out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                      log_samples=False)
        for task, metrics in out["results"].items():
            for name, value in metrics.items():
                # metrics are "name,filter"; skip their stderr and bookkeeping entries (alias, sample_len)
                if "," not in name or "stderr" in name or not isinstance(value, (int, float)):
                    continue
                scores.setdefault(task, {}).setdefault(name.split(",")[0], {})[k] = float(value)
    return scores


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="saved looped model with its tokenizer")
    parser.add_argument("--loops", default="1,2,4,8", help="comma-separated loop counts")
    parser.add_argument("--tasks", default="fp_arith_word", help="comma-separated lm-eval tasks")
    parser.add_argument("--knob", default="total_ut_steps", help="forward parameter that sets the loop count")
    parser.add_argument("--limit", type=int, default=None, help="examples per task")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output_dir", default=None, help="where sweep.json and sweep.png go")
    args = parser.parse_args(argv)
    loops = [int(x) for x in args.loops.split(",") if x.strip()]
    tasks = [t for t in args.tasks.split(",") if t.strip()]
    scores = loop_sweep(args.model_dir, loops, tasks, knob=args.knob, limit=args.limit, batch_size=args.batch_size,
                        device=args.device)
    print(format_table(scores))
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "sweep.json"), "w") as fh:
            json.dump(scores, fh, indent=2)
        print(plot_sweep(scores, os.path.join(args.output_dir, "sweep.png")))
    return scores


if __name__ == "__main__":
    main()
