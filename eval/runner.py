"""Offline evaluation with lm-eval: ``evaluate_offline(model_dir, tasks, ...)`` on the packaged tasks.

``TASKS_DIR`` holds the packaged tasks (``fp_text_ppl``, ``fp_copy_mc``, ``fp_copy_gen``; tag ``fp_offline``). Their
data are small jsonl files next to the YAML files and load from any working directory.
"""

from __future__ import annotations

import os

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE")


def evaluate_offline(
    model_dir,
    tasks,
    *,
    model_args: dict | str | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 8,
    device: str = "cpu",
    include_path=None,
    include_defaults: bool = False,
    **simple_evaluate_kwargs,
) -> dict:
    """Evaluate a saved hf-fixedpoint checkpoint with lm-eval's ``simple_evaluate`` and model ``hf-fixedpoint``.

    Args:
        model_dir: a local checkpoint folder (``save_pretrained`` output with its tokenizer); loaded with
            ``trust_remote_code=True``.
        tasks: task names, a list or a comma-separated string (e.g. ``["fp_text_ppl"]`` or ``"fp_offline"``).
        model_args: extra ``model_args`` for ``FixedPointLM`` (dict, or ``"k=v,k2=v2"``), e.g. ``{"fp_max_iter": 4}``.
        limit: examples per task (``None``: all).
        batch_size: lm-eval batch size.
        device: torch device (default ``cpu``).
        include_path: extra task folders, searched after the packaged ``TASKS_DIR``.
        include_defaults: also index lm-eval's built-in tasks (slower; most need the Hub).
        **simple_evaluate_kwargs: passed on (``num_fewshot``, ``log_samples``, ...; ``log_samples`` defaults to False).

    Returns:
        the dict returned by ``lm_eval.simple_evaluate`` (scores under ``results[task][metric + ",none"]``).

    The offline variables (``HF_HUB_OFFLINE=1`` ...) are set if unset; they fully apply only when this runs before
    ``huggingface_hub`` / ``datasets`` are imported, so set them in the environment for strict offline runs.
    """
    for var in OFFLINE_ENV:
        os.environ.setdefault(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import simple_parse_args_string

    from hf_fixedpoint.eval import lm_harness  # noqa: F401  (registers "hf-fixedpoint")

    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    if isinstance(model_args, str):
        model_args = simple_parse_args_string(model_args)
    args = {"pretrained": os.path.abspath(os.fspath(model_dir)), "trust_remote_code": True, **(model_args or {})}
    if include_path is None:
        extra = []
    elif isinstance(include_path, (list, tuple)):
        extra = [os.fspath(p) for p in include_path]
    else:
        extra = [os.fspath(include_path)]
    task_manager = TaskManager(include_path=[TASKS_DIR, *extra], include_defaults=include_defaults)
    simple_evaluate_kwargs.setdefault("log_samples", False)
    return lm_eval.simple_evaluate(
        model="hf-fixedpoint",
        model_args=args,
        tasks=list(tasks),
        task_manager=task_manager,
        device=device,
        batch_size=batch_size,
        limit=limit,
        **simple_evaluate_kwargs,
    )


__all__ = ["OFFLINE_ENV", "TASKS_DIR", "evaluate_offline"]
