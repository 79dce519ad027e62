"""The flags every recipe under ``recipes/`` shares, and what they do: ``--output_dir``, ``--seed``,
``--resume_from_checkpoint``, ``--report_to`` (accelerate trackers), ``--push_to_hub`` / ``--hub_model_id`` /
``--hub_token`` / ``--hub_private_repo`` (upload through ``hf_fixedpoint.hub`` at the end of training).

A recipe's argument dataclass inherits ``RecipeArgs`` (overriding a default, e.g. ``output_dir``, by redeclaring the
field), passes ``tracking(args)`` to its ``Accelerator``, calls ``start_run`` once, ``log_scalars`` at its log
steps, ``end_tracking`` at the end and ``push_output`` after its export. The flags are documented in
``docs/recipes.md``. Needs accelerate (the ``train`` extra); ``import hf_fixedpoint`` does not import this module.
"""

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

REPORT_TO_NONE = ("none", "")


@dataclass
class RecipeArgs:
    """Options every recipe takes, named as ``transformers.TrainingArguments`` names them."""

    output_dir: str = field(default="runs/recipe", metadata={"help": "checkpoints, metrics and the exported model"})
    seed: int = field(default=0, metadata={"help": "random seed (initialisation, data order, dropout)"})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={
        "help": "'latest' (the newest complete checkpoint of output_dir; none yet: start fresh) or a step_<n> folder "
                "written by an earlier run"})
    report_to: str = field(default="none", metadata={
        "help": "accelerate trackers for the loss, learning rate and fixed-point statistics: 'none', 'all' (every "
                "installed one) or a comma-separated list, e.g. 'tensorboard' (logs under output_dir)"})
    push_to_hub: bool = field(default=False, metadata={"help": "upload the exported model (self-contained remote "
                                                               "code, model card) to the Hub at the end"})
    hub_model_id: Optional[str] = field(default=None, metadata={"help": "repository to push to, 'user/name' "
                                                                         "(default: the output_dir's name)"})
    hub_token: Optional[str] = field(default=None, metadata={"help": "Hub token (default: the cached login)"})
    hub_private_repo: Optional[bool] = field(default=None, metadata={"help": "create the repository private "
                                                                             "(default: the Hub's default)"})

    def to_dict(self) -> dict:
        """The flags as a dict for logs and ``metrics.json``, the Hub token masked (as ``TrainingArguments``)."""
        return {**asdict(self), **({"hub_token": "<HUB_TOKEN>"} if self.hub_token else {})}

    def __post_init__(self):
        report_trackers(self)  # unknown or uninstalled trackers fail before any work
        if self.hub_model_id is not None and not self.push_to_hub:
            raise ValueError("--hub_model_id is set but --push_to_hub is not: add --push_to_hub to upload.")


def report_trackers(args) -> list:
    """The accelerate tracker names of ``--report_to``; a ``ValueError`` names an unknown or uninstalled one."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    names = [n.strip().lower() for n in str(args.report_to).split(",") if n.strip()]
    if not names or names == ["none"]:
        return []
    available = [str(getattr(t, "value", t)) for t in get_available_trackers()]
    if names == ["all"]:
        return available
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(f"--report_to={args.report_to!r}: {name!r} is not a tracker; allowed values are "
                             f"'none', 'all' or a comma-separated list of {sorted(LOGGER_TYPE_TO_CLASS)}.")
        if name not in available:
            raise ValueError(f"--report_to={args.report_to!r}: the {name!r} tracker is not installed (installed: "
                             f"{sorted(available) or 'none'}); `pip install {name}` or leave it out.")
    return names


def tracking(args) -> dict:
    """``Accelerator`` keyword arguments for ``--report_to``: the trackers, writing under ``output_dir``."""
    trackers = report_trackers(args)
    return {"log_with": trackers, "project_dir": args.output_dir} if trackers else {}


def start_run(accelerator, args, project_name: str = "logs") -> None:
    """What every recipe prints first (its flags, the Hub token masked, and the processes it runs on), then
    ``accelerator.init_trackers`` with the flags as the trackers' configuration (TensorBoard writes its event files
    to ``output_dir/logs``; no trackers without ``--report_to``)."""
    accelerator.print(f"args: {json.dumps(args.to_dict(), default=str)}")
    accelerator.print(f"processes: {accelerator.num_processes} ({accelerator.distributed_type})")
    if not accelerator.log_with:
        return
    config = {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}  # scalars only
    accelerator.init_trackers(project_name, config=config)


def end_tracking(accelerator) -> None:
    """Flush and close the trackers (``accelerator.end_training``); a no-op without ``--report_to``."""
    if accelerator.log_with:
        accelerator.end_training()


def fp_scalars(stats) -> dict:
    """The fixed-point statistics every recipe logs: ``fp/iter_mean``, ``fp/iter_p90`` (iterations per solved
    entry) and ``fp/cap_hit_rate`` (entries that stopped at the iteration cap without meeting the tolerance).

    ``stats``: an ``FPSAStats`` (FPSA families), a ``FixedPointStats`` or a list of them (one per layer or per step),
    or ``None`` (``{}``).
    """
    if stats is None:
        return {}
    if hasattr(stats, "iterations_per_layer"):  # FPSA: per (layer, token, head), padding excluded
        if not stats.iterations_per_layer:
            return {}
        summary = stats.summary()
        return {"fp/iter_mean": summary["fpsa_iter_mean"], "fp/iter_p90": summary["fpsa_iter_p90"],
                "fp/cap_hit_rate": summary["fpsa_cap_hit_rate"]}
    solves = [s for s in (stats if isinstance(stats, (list, tuple)) else [stats]) if s is not None]
    if not solves:
        return {}
    nstep = torch.cat([s.nstep.detach().flatten().double().cpu() for s in solves])
    converged = torch.cat([s.converged.detach().flatten().cpu() for s in solves])
    return {"fp/iter_mean": float(nstep.mean()), "fp/iter_p90": float(torch.quantile(nstep, 0.9)),
            "fp/cap_hit_rate": float((~converged.bool()).double().mean())}


def log_scalars(accelerator, step: int, loss: float, lr: float, stats=None, prefix: str = "", **extra) -> None:
    """Log ``train/loss``, ``train/lr``, the ``fp_scalars`` of ``stats`` (or a ready ``fp_scalars`` dict) and any
    ``extra`` scalars (named ``train/<key>``) to the trackers at optimizer step ``step``; ``prefix`` is put before
    every name (a recipe that trains several models in one run logs each under its own)."""
    if not accelerator.log_with:
        return
    values = {"train/loss": float(loss), "train/lr": float(lr),
              **(stats if isinstance(stats, dict) else fp_scalars(stats)),
              **{f"train/{k}": float(v) for k, v in extra.items()}}
    accelerator.log({prefix + k: v for k, v in values.items()}, step=step)


def progress_bar(iterable, desc: str, **kwargs):
    """``tqdm`` over ``iterable`` on the local main process only (the other processes would print the same bar)."""
    from accelerate import PartialState
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, disable=not PartialState().is_local_main_process, **kwargs)


def hub_repo_id(args) -> str:
    """``--hub_model_id``, or the name of ``output_dir`` (as ``transformers.TrainingArguments`` does)."""
    return args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))


def push_output(args, accelerator, model, folder, description: Optional[str] = None):
    """With ``--push_to_hub``: upload the export ``folder`` (written by ``model.save_pretrained`` or
    ``hub.export``) through ``hf_fixedpoint.hub.push_to_hub``, which checks that it loads as self-contained remote
    code and leaves the training state (``checkpoints/``) out. A ``README.md`` model card
    (``hub.model_card``) is added to the folder first when it has none. Main process only; returns the
    ``CommitInfo`` there, ``None`` elsewhere or without ``--push_to_hub``."""
    if not args.push_to_hub:
        return None
    info = None
    if accelerator.is_main_process:
        from hf_fixedpoint import hub

        repo_id = hub_repo_id(args)
        readme = os.path.join(folder, "README.md")
        if not os.path.exists(readme):
            hub.model_card(accelerator.unwrap_model(model), model_id=repo_id, description=description).save(readme)
        info = hub.push_to_hub(folder, repo_id, private=args.hub_private_repo, token=args.hub_token)
        accelerator.print(f"pushed {folder} to {getattr(info, 'commit_url', None) or repo_id}")
    accelerator.wait_for_everyone()
    return info


__all__ = ["RecipeArgs", "end_tracking", "fp_scalars", "hub_repo_id", "log_scalars", "progress_bar", "push_output",
           "report_trackers", "start_run", "tracking"]
