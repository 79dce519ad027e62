"""Train and evaluate a puzzle reasoner (FPRM, TRM, Attractor-reasoning, URM) with deep supervision, on CPU or GPU.

    python -m recipes.reasoning --model fprm --task a5 --output_dir runs/fprm_a5
    accelerate launch recipes/reasoning.py --model trm --task sudoku --max_steps 2000 --output_dir runs/trm_sudoku
    python -m recipes.reasoning --model trm --task sudoku --output_dir runs/trm_sudoku --resume_from_checkpoint latest

What it does, top to bottom:
1. data: ``hf_fixedpoint.puzzles.build_dataset(task, split, seed, **task_kwargs)``; one or more test sets
   (``--test_task_kwargs`` a JSON object or list of objects, e.g. A5 at 2x the training length);
2. model: the family's ``*ForPuzzles`` sized from the dataset's ``PuzzleMetadata`` (``--model_kwargs`` for any other
   config field);
3. training, as in the research code: the ACT carry persists across optimizer steps (one optimizer step = one
   supervision step for every slot; a slot takes a new puzzle when it halts), AdamATan2 on the parameters, sign-SGD
   on the touched rows of the sparse puzzle-embedding table, linear warmup then a constant learning rate, and an EMA
   of the parameters used for evaluation and export;
4. periodic evaluation (``hf_fixedpoint.puzzles.evaluation``): exact (whole-sequence) accuracy and per-cell accuracy
   both pooled over all scored cells (``cell_accuracy_pooled``) and as the mean of each puzzle's fraction
   (``cell_accuracy_per_puzzle``, the research code's ``accuracy``), and pooled over the cells whose label differs
   from the input (``cell_accuracy_changed``: Sudoku's blank cells); rows with no scored label are left out;
   iterations used versus difficulty (A5 length, Sudoku backtracks) and, for ARC, pass@1/2 after voting over the
   augmented copies (ties broken by ``sigmoid(q_halt)``). FPRM is evaluated with one full solve per puzzle
   (adaptive iterations); TRM and URM run ``halt_max_steps`` supervision steps, and their iterations are counted
   up to the first step whose Q-halt logit is positive;
5. export: ``save_pretrained`` (EMA weights) -> loads with ``AutoModelForTokenClassification.from_pretrained(dir,
   trust_remote_code=True)``; ``metrics.json`` holds every evaluation, ``iterations_vs_difficulty_<i>.png`` plots
   the last one per test set.

Checkpoints (``hf_fixedpoint.checkpointing``): atomic ``output_dir/checkpoints/step_<n>`` folders at every evaluation
(or every ``--save_every`` steps), at the end and on SIGTERM, holding the model, optimizer, schedule, RNG, EMA, the
ACT carry, the data position and the evaluations so far; ``--resume_from_checkpoint latest`` continues exactly where
the interrupted run was (``--resume_from`` is its deprecated old name).
"""

import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import HfArgumentParser, get_scheduler

from hf_fixedpoint.checkpointing import Checkpointer, Preemption, staged_folder, write_json
from hf_fixedpoint.core.fp_registry import check_choice
from hf_fixedpoint.modeling import FPRMConfig, FPRMForPuzzles, TRMConfig, TRMForPuzzles, URMConfig, URMForPuzzles
from hf_fixedpoint.optim import AdamATan2, ema_model
from hf_fixedpoint.puzzles import build_dataset
from hf_fixedpoint.puzzles.common import check_identifiers
from hf_fixedpoint.puzzles.evaluation import (
    arc_pass_at_k,
    cell_accuracy,
    changed_labels,
    exact_accuracy,
    format_table,
    iterations_vs_difficulty,
    plot_iterations_vs_difficulty,
    scored_rows,
    sequence_correct,
)
from hf_fixedpoint.recipe_args import RecipeArgs, log_scalars, progress_bar, push_output, start_run, tracking

PRESETS = ("none", "official")
OPTIMIZERS = ("adamatan2", "adamw")
# --model name -> (config class, model class, config defaults)
MODELS = {
    "fprm": (FPRMConfig, FPRMForPuzzles, {}),
    "trm": (TRMConfig, TRMForPuzzles, {"deq": False}),
    "attractor": (TRMConfig, TRMForPuzzles, {"deq": True}),
    "urm": (URMConfig, URMForPuzzles, {}),
}
# A5 state tracking as in FPRM's state-tracking config: causal attention, no positional encoding and no puzzle
# embedding, so a model trained on short words runs unchanged on longer ones; FPRM adds its causal short convolution
# (kernel 4), alphas 0.5, room for more solver steps on long words and no Q-halt loss (its halting is the fixed point).
# --model_kwargs overrides any of them.
A5_DEFAULTS = {"causal": True, "pos_encodings": "none", "puzzle_emb_len": 0}
A5_FPRM_DEFAULTS = {"conv": "1d", "conv_kernel": 4, "alpha_1_init": 0.5, "alpha_2_init": 0.5, "bptt_window": 4,
                    "fp_max_iter": 128, "fp_eval_max_iter": 160, "q_loss_weight": 0.0}  # official q_loss_coeff 0

# --preset official: the research code's values (TRM README, URM scripts, FPRM cfg_pretrain_*.yaml) at their own
# scale (hidden 512, batch 768: GPU runs). Flags given on the command line and --model_kwargs entries win.
# FPRM caps *supervision steps* at max_iter (Sudoku 12, Maze 24, A5 128), each a window of n_backwards_L solver
# steps; TRM/URM run 16 supervision steps (URM also evaluates with 8 more).
OFFICIAL_FLAGS = {"hidden_size": 512, "num_attention_heads": 8, "batch_size": 768, "warmup_steps": 2000,
                  "beta1": 0.9, "beta2": 0.95, "ema_rate": 0.999, "ema_warmup": 0, "halt_max_steps": 16,
                  "loss_type": "stablemax", "lr_scheduler_type": "constant_with_warmup"}
OFFICIAL_TASK_FLAGS = {  # (--model, task family) -> optimizer and batch settings
    ("trm", "sudoku"): {"lr": 1e-4, "puzzle_emb_lr": 1e-4, "weight_decay": 1.0, "puzzle_emb_weight_decay": 1.0},
    ("trm", "maze"): {"lr": 1e-4, "puzzle_emb_lr": 1e-4, "weight_decay": 1.0, "puzzle_emb_weight_decay": 1.0},
    ("trm", "arc"): {"lr": 1e-4, "puzzle_emb_lr": 1e-2, "weight_decay": 0.1, "puzzle_emb_weight_decay": 0.1},
    ("urm", "sudoku"): {"lr": 1e-4, "weight_decay": 1.0, "batch_size": 128, "eval_extra_steps": 8},
    ("urm", "arc"): {"lr": 1e-4, "puzzle_emb_lr": 1e-2, "weight_decay": 0.1, "puzzle_emb_weight_decay": 0.1,
                     "eval_extra_steps": 8},
    ("fprm", "sudoku"): {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 1e-3, "puzzle_emb_lr": 1e-3,
                         "puzzle_emb_weight_decay": 1e-3, "halt_max_steps": 12},
    ("fprm", "maze"): {"optimizer": "adamw", "lr": 1e-4, "weight_decay": 1.0, "puzzle_emb_lr": 1e-2,
                       "puzzle_emb_weight_decay": 1.0, "halt_max_steps": 24},
    ("fprm", "a5"): {"optimizer": "adamw", "lr": 1e-4, "weight_decay": 0.01, "batch_size": 1024, "warmup_steps": 0,
                     "ema_rate": 0.0, "halt_max_steps": 128},
}
OFFICIAL_CONFIG = {  # --model -> config fields (task-specific ones in OFFICIAL_TASK_CONFIG)
    "trm": {"num_layers": 2, "puzzle_emb_len": 16, "H_cycles": 3, "L_cycles": 4, "halt_exploration_prob": 0.1,
            "mlp_multiple_of": 256, "forward_dtype": "bfloat16"},
    "urm": {"num_layers": 4, "puzzle_emb_len": 1, "L_cycles": 6, "fp_max_iter": 6, "halt_exploration_prob": 0.1,
            "mlp_multiple_of": 256, "forward_dtype": "bfloat16"},
    # FPRM's step size: the configs with a decay per mode (training 0.9, evaluation 0.99, any decrease of the residual
    # counts; the A5 config has only this form). The single-decay configs (commit 9e0ebf35: 0.99 in both modes, an
    # improvement counts above 0.01): --model_kwargs '{"fp_solver_kwargs": {"decay": 0.99, "improve_margin": 0.01}}'.
    "fprm": {"num_layers": 2, "puzzle_emb_len": 16, "solve_mode": "official", "fp_solver": "fpopt",
             "fp_norm": "token_linf", "fp_tol": 0.1, "bptt_window": 6, "init_mode": "noise", "init_noise": "truncated",
             "init_std": 6.0, "alpha_1_init": 0.75, "alpha_2_init": 0.25, "fp_eval_max_iter": 1000, "pad_id": None,
             "halt_exploration_prob": 0.0, "mlp_multiple_of": 256, "forward_dtype": "bfloat16",
             "fp_solver_kwargs": {"step_size": 1.0, "patience": 5, "decay": 0.9, "improve_margin": 0.0},
             "eval_step_decay": 0.99},
}
OFFICIAL_TASK_CONFIG = {
    ("trm", "sudoku"): {"L_cycles": 6, "mlp_t": True, "pos_encodings": "none"},  # TRM-MLP, the 87% Sudoku model
    ("fprm", "sudoku"): {"conv": "2d", "conv_kernel": 3},
    ("fprm", "maze"): {"conv": "1d", "conv_kernel": 4, "output_norm": True},
    ("fprm", "a5"): {"puzzle_emb_len": 0, "pos_encodings": "none", "causal": True, "bptt_window": 4, "conv": "1d",
                     "conv_kernel": 4, "alpha_1_init": 0.5, "alpha_2_init": 0.5, "fp_eval_max_iter": 160,
                     "q_loss_weight": 0.0},
}


@dataclass
class Args(RecipeArgs):  # --seed, --resume_from_checkpoint, --report_to, --push_to_hub, ...: docs/recipes.md
    model: str = field(default="fprm", metadata={"help": f"one of {sorted(MODELS)}"})
    task: str = field(default="a5", metadata={"help": "puzzle task: sudoku, maze, a5, arc1, arc2"})
    task_kwargs: str = field(default='{"num_samples": 200000, "length": 8}',
                             metadata={"help": "JSON options of build_dataset for the training split"})
    test_task_kwargs: str = field(default='[{"num_samples": 256, "length": 8}, {"num_samples": 256, "length": 16}]',
                                  metadata={"help": "JSON object or list of objects: one test set each"})
    output_dir: str = field(default="runs/reasoning", metadata={"help": "checkpoint, state and metrics go here"})
    max_steps: int = field(default=300, metadata={"help": "optimizer steps (= supervision steps)"})
    max_train_seconds: Optional[float] = field(default=None, metadata={
        "help": "also stop after this many seconds of training (evaluations excluded): matched-time comparisons"})
    batch_size: int = field(default=64, metadata={"help": "puzzle slots per process"})
    eval_batch_size: int = field(default=256, metadata={"help": "puzzles per evaluation batch"})
    lr: float = field(default=1e-3, metadata={"help": "AdamATan2 learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay"})
    beta1: float = field(default=0.9)
    beta2: float = field(default=0.95)
    puzzle_emb_lr: float = field(default=1e-2, metadata={"help": "sign-SGD learning rate of the puzzle table"})
    puzzle_emb_weight_decay: float = field(default=0.1)
    warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps"})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={
        "help": "transformers scheduler after the warmup: constant_with_warmup (the research code), cosine, linear, "
                "... (decays over --max_steps)"})
    ema_rate: float = field(default=0.999, metadata={"help": "EMA decay of the parameters; 0 disables the EMA"})
    ema_warmup: int = field(default=10, metadata={"help": "EMA decay after n updates: min(ema_rate, (1 + n) / "
                                                          "(ema_warmup + n)); 0: the plain EMA"})
    hidden_size: int = field(default=64)
    num_attention_heads: int = field(default=4)
    num_layers: Optional[int] = field(default=None, metadata={"help": "blocks (None: the family's default)"})
    puzzle_emb_len: Optional[int] = field(default=None, metadata={
        "help": "puzzle-embedding prefix positions (0: none); None: 1, or 0 for a5"})
    halt_max_steps: Optional[int] = field(default=None, metadata={
        "help": "ACT supervision steps per puzzle; None: 8, or for FPRM enough windows to reach fp_max_iter solver "
                "steps (the research code caps supervision steps at max_iter, so the solver-step cap binds)"})
    loss_type: Optional[str] = field(default=None, metadata={
        "help": "stablemax or softmax; None: softmax for a5 (60 answer classes, where stablemax's linear tail learns "
                "the group table far slower), the research code's stablemax otherwise"})
    model_kwargs: str = field(default="{}", metadata={"help": "JSON: any other config field (e.g. conv, L_cycles)"})
    init_from: Optional[str] = field(default=None, metadata={"help": "start from a saved model (fine-tuning)"})
    resume_from: Optional[str] = field(default=None, metadata={"help": "deprecated name of --resume_from_checkpoint"})
    eval_every: int = field(default=100, metadata={"help": "steps between evaluations"})
    save_every: int = field(default=0, metadata={"help": "steps between checkpoints (0: at every evaluation); "
                                                         "always at the end"})
    save_total_limit: int = field(default=2, metadata={"help": "keep the newest N complete checkpoints (0: all)"})
    optimizer: str = field(default="adamatan2", metadata={
        "help": "adamatan2 (TRM, URM) or adamw (FPRM's configs)"})
    eval_extra_steps: int = field(default=0, metadata={
        "help": "TRM/URM: evaluate with this many supervision steps beyond halt_max_steps (URM reports +8)"})
    eval_blank_id: bool = field(default=False, metadata={
        "help": "also evaluate with every puzzle id set to the blank id 0 (results under 'blank_id'): how much of "
                "the score the learned per-puzzle embedding carries (ARC)"})
    preset: str = field(default="none", metadata={
        "help": "official: the research code's values for --model and --task (see OFFICIAL_*); flags given "
                "explicitly and --model_kwargs entries win. none: the flags as given"})


def task_family(task):
    """``arc1``/``arc2`` -> ``arc``; the other tasks are their own family."""
    return "arc" if task.startswith("arc") else task


def apply_preset(args, given):
    """``--preset official``: fill the research code's flag values (not those in ``given``) and put its config values
    under ``--model_kwargs`` (entries given there win). Combinations the research code has no values for fail."""
    if args.preset == "none":
        return args
    key = (args.model, task_family(args.task))
    if key not in OFFICIAL_TASK_FLAGS:
        raise ValueError(f"--preset official has no research-code values for --model {args.model} --task "
                         f"{args.task}; available: {sorted(OFFICIAL_TASK_FLAGS)}.")
    for name, value in {**OFFICIAL_FLAGS, **OFFICIAL_TASK_FLAGS[key]}.items():
        if name not in given:
            setattr(args, name, value)
    config = {**OFFICIAL_CONFIG[args.model], **OFFICIAL_TASK_CONFIG.get(key, {})}
    if key[0] == "fprm":  # max_iter supervision steps of bptt_window solver steps each
        config["fp_max_iter"] = args.halt_max_steps * config["bptt_window"]
    if "num_layers" not in given:
        args.num_layers = config.pop("num_layers")
    if "puzzle_emb_len" not in given:
        args.puzzle_emb_len = config.pop("puzzle_emb_len")
    config = {k: v for k, v in config.items() if k not in ("num_layers", "puzzle_emb_len")}
    args.model_kwargs = json.dumps({**config, **parse_json(args.model_kwargs, "model_kwargs")})
    return args


def parse_json(text, name):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--{name} is not valid JSON ({err}): {text!r}") from None


def build_model(args, meta):
    """The family's model sized from the dataset metadata, or ``--init_from`` checked against it."""
    config_class, model_class, defaults = MODELS[args.model]
    if args.init_from:  # --model_kwargs and --halt_max_steps override the checkpoint's config (validated)
        overrides = parse_json(args.model_kwargs, "model_kwargs")
        if args.halt_max_steps is not None:
            overrides["halt_max_steps"] = args.halt_max_steps
        config = config_class.from_pretrained(args.init_from)
        config = config_class(**{**config.to_dict(), **overrides}) if overrides else config
        model = model_class.from_pretrained(args.init_from, config=config)
        if model.config.vocab_size != meta.vocab_size:
            raise ValueError(f"the dataset has vocab_size={meta.vocab_size} but the checkpoint {args.init_from} was "
                             f"trained with vocab_size={model.config.vocab_size}; build the data of the checkpoint's "
                             "task or train anew.")
        trained_on = getattr(model.config, "puzzle_metadata", None) or {}
        trained_on = {**trained_on, "num_puzzle_identifiers": model.config.num_puzzle_identifiers}
        check_identifiers(trained_on, meta, f"the checkpoint {args.init_from}", "the training data")
        if meta.identifiers_sha256 is not None and trained_on.get("identifiers_sha256") is None:
            warnings.warn(f"the checkpoint {args.init_from} does not record what its puzzle ids mean "
                          "(identifiers_sha256); check that the data uses the same task_ids, max_tasks, num_aug and "
                          "seed.", stacklevel=2)
        return model
    if meta.task == "a5":
        defaults = {**defaults, **A5_DEFAULTS, **(A5_FPRM_DEFAULTS if args.model == "fprm" else {})}
    emb_len = args.puzzle_emb_len if args.puzzle_emb_len is not None else defaults.get("puzzle_emb_len", 1)
    kwargs = {**defaults, "vocab_size": meta.vocab_size, "seq_len": meta.seq_len, "hidden_size": args.hidden_size,
              "num_attention_heads": args.num_attention_heads, "num_puzzle_identifiers": meta.num_puzzle_identifiers,
              "puzzle_emb_len": emb_len, "halt_max_steps": 8 if args.halt_max_steps is None else args.halt_max_steps,
              "grid_shape": list(meta.grid_shape) if meta.grid_shape else None, "puzzle_metadata": meta.to_dict(),
              "loss_type": args.loss_type or ("softmax" if meta.task == "a5" else "stablemax")}
    if args.num_layers is not None:
        kwargs["num_layers"] = args.num_layers
    extra = parse_json(args.model_kwargs, "model_kwargs")
    kwargs.update(extra)
    config = config_class(**kwargs)
    if args.model == "fprm" and args.halt_max_steps is None and "halt_max_steps" not in extra:
        config = config_class(**{**kwargs, "halt_max_steps": -(-config.fp_max_iter // config.bptt_window)})
    return model_class(config)


def batches(ds, batch_size, device, shuffle, seed=0, drop_last=True, skip=0):
    """Endless (shuffle) or one-pass iterator of batches as tensors on ``device``, after the first ``skip`` batches
    (the data position of a resumed run: each epoch's order is a function of (seed, epoch))."""
    cols = ["inputs", "labels", "puzzle_identifiers"]
    data = ds.with_format("torch", columns=cols)
    stop = len(ds) - (len(ds) % batch_size if drop_last else 0)
    per_epoch = max(1, -(-stop // batch_size))
    epoch, skip = divmod(skip, per_epoch) if shuffle else (0, skip)
    while True:
        order = (torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed + epoch)) if shuffle
                 else torch.arange(len(ds)))
        for start in range(skip * batch_size, stop, batch_size):
            rows = data[order[start:start + batch_size].tolist()]
            yield {k: rows[k].to(device).long() for k in cols}
        if not shuffle:
            return
        epoch, skip = epoch + 1, 0


class Carry:
    """The ACT carry between optimizer steps, saved with each checkpoint (one file per process)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"carry": self.value}

    def load_state_dict(self, state):
        self.value = state["carry"]


def supervised_eval(model, b, device, steps):
    """The research code's evaluation of TRM/URM: ``steps`` supervision steps for every slot (``halt_max_steps``
    raised to ``steps`` meanwhile); iterations counted up to the first positive Q-halt logit."""
    carry = model.initial_carry(b["inputs"].shape[0], device)
    used, cap = None, model.config.halt_max_steps
    model.config.halt_max_steps = steps
    try:
        for _ in range(steps):
            out = model(b["inputs"], b["puzzle_identifiers"], carry=carry)
            carry = out.carry
            first = (out.q_halt_logits > 0) if used is None else (out.q_halt_logits > 0) & (used < 0)
            used = torch.where(first, carry["iterations"], -1 if used is None else used)
    finally:
        model.config.halt_max_steps = cap
    return out, torch.where(used < 0, carry["iterations"], used)


@torch.no_grad()
def evaluate(model, ds, meta, args, device, blank_id=False):
    """Exact and cell accuracy, iterations used versus difficulty and, for ARC, pass@k with augmentation voting;
    ``blank_id``: every row's puzzle id replaced by the blank id 0."""
    model.eval()
    preds, labels, scores, iters, inputs = [], [], [], [], []
    for b in progress_bar(batches(ds, args.eval_batch_size, device, shuffle=False, drop_last=False), "eval",
                          total=-(-len(ds) // args.eval_batch_size), leave=False):
        if blank_id:
            b["puzzle_identifiers"] = torch.zeros_like(b["puzzle_identifiers"])
        if args.model == "fprm":  # one full solve: iterations adapt to the puzzle
            out = model(b["inputs"], b["puzzle_identifiers"])
            used = out.iterations
        else:
            out, used = supervised_eval(model, b, device, model.config.halt_max_steps + args.eval_extra_steps)
        preds.append(out.logits.argmax(-1).cpu())
        labels.append(b["labels"].cpu())
        inputs.append(b["inputs"].cpu())
        scores.append(torch.sigmoid(out.q_halt_logits).cpu())
        iters.append(used.cpu())
    preds, labels, scores, iters, inputs = (torch.cat(t) for t in (preds, labels, scores, iters, inputs))
    scored = scored_rows(labels)  # rows with no scored label are left out of every metric, as in the research code
    correct = sequence_correct(preds, labels)
    result = {"exact_accuracy": exact_accuracy(preds, labels),
              "cell_accuracy_pooled": cell_accuracy(preds, labels, average="pooled"),
              "cell_accuracy_per_puzzle": cell_accuracy(preds, labels, average="per_puzzle"),
              "cell_accuracy_changed": cell_accuracy(preds, changed_labels(inputs, labels), average="pooled"),
              "iterations_mean": iters.float().mean().item(), "num_puzzles": len(preds)}
    if meta.difficulty and meta.difficulty in ds.column_names:
        difficulty = np.asarray(ds[meta.difficulty])
        result["iterations_vs_difficulty"] = iterations_vs_difficulty(iters.numpy()[scored], difficulty[scored],
                                                                      correct[scored])
    if args.task.startswith("arc"):
        result.update(arc_pass_at_k(ds, preds, scores, ks=(1, 2)))
    model.train()
    return result


def parse_args(argv=None):
    """The flags (unknown ones are errors), checked before any work; ``--resume_from`` still works, with a warning."""
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(args=argv)
    check_choice(args.model, "--model", sorted(MODELS))
    check_choice(args.preset, "--preset", PRESETS)
    check_choice(args.optimizer, "--optimizer", OPTIMIZERS)
    if args.eval_extra_steps < 0:
        raise ValueError(f"--eval_extra_steps must be >= 0, got {args.eval_extra_steps}.")
    given = {a[2:].split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
    args = apply_preset(args, given)
    if args.resume_from is not None:
        warnings.warn("--resume_from is deprecated; use --resume_from_checkpoint (a checkpoints/step_<n> folder or "
                      "'latest').", FutureWarning, stacklevel=2)
        if args.resume_from_checkpoint not in (None, args.resume_from):
            raise ValueError("--resume_from (deprecated) and --resume_from_checkpoint disagree; give only the latter.")
        args.resume_from_checkpoint, args.resume_from = args.resume_from, None
    for name in ("save_every", "save_total_limit"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}.")
    return args


def build_data(args):
    """1. Data: the training split and its metadata, and ``(name, dataset, metadata)`` per test set."""
    train_ds, meta = build_dataset(args.task, "train", seed=args.seed, **parse_json(args.task_kwargs, "task_kwargs"))
    test_kwargs = parse_json(args.test_task_kwargs, "test_task_kwargs")
    test_sets = []
    for kw in test_kwargs if isinstance(test_kwargs, list) else [test_kwargs]:
        ds, test_meta = build_dataset(args.task, "test", seed=args.seed, **kw)
        if test_meta.identifiers_sha256 is not None:  # ARC: the test rows must use the training split's puzzle ids
            check_identifiers(meta, test_meta, "the training split (--task_kwargs)",
                              f"the test set {json.dumps(kw)} (--test_task_kwargs)")
        test_sets.append((json.dumps(kw, sort_keys=True), ds, test_meta))
    return train_ds, meta, test_sets


def main(argv=None):
    """Run the recipe; ``argv`` defaults to the command line."""
    args = parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), **tracking(args))
    set_seed(args.seed)
    start_run(accelerator, args)

    # 1. Data.
    train_ds, meta, test_sets = build_data(args)
    accelerator.print(f"data: {args.task} train {len(train_ds)} puzzles, seq_len {meta.seq_len}, vocab "
                      f"{meta.vocab_size}, {meta.num_puzzle_identifiers} puzzle ids; test sets "
                      f"{[(name, len(ds)) for name, ds, _ in test_sets]}")

    # 2. Model, optimizers, schedule, EMA.
    model = build_model(args, meta).train()  # from_pretrained (--init_from) returns a model in eval mode
    accelerator.print(f"model: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    optimizer_class = AdamATan2 if args.optimizer == "adamatan2" else torch.optim.AdamW
    optimizer = optimizer_class(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                                weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.max_steps)
    ema = ema_model(model, args.ema_rate, args.ema_warmup).to(accelerator.device) if args.ema_rate > 0 else None
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    raw = accelerator.unwrap_model(model)
    eval_model = raw if ema is None else ema.module  # the EMA copy holds the averaged parameters and the table

    # Resume: accelerate restores model, optimizer, schedule, RNG and EMA; the checkpointer the ACT carry; the record
    # the data position (= step), the evaluations and the running training metrics.
    carry = Carry(raw.initial_carry(args.batch_size, accelerator.device))
    ckpt = Checkpointer(accelerator, os.path.join(args.output_dir, "checkpoints"), args.save_total_limit,
                        objects={"carry": carry})
    record = ckpt.load(args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    progress = {"step": 0, "history": [], "train_seconds": 0.0, "halted_exact": 0.0, "halted_n": 0}
    progress.update({k: v for k, v in (record or {}).items() if k in progress})

    def run_evals(step):
        results = {name: evaluate(eval_model, ds, m, args, accelerator.device) for name, ds, m in test_sets}
        for name, ds, m in test_sets if args.eval_blank_id else ():
            blank = evaluate(eval_model, ds, m, args, accelerator.device, blank_id=True)
            results[name]["blank_id"] = {k: v for k, v in blank.items() if k != "iterations_vs_difficulty"}
        progress["history"].append({"step": step, **results})
        for name, r in results.items():
            arc = "".join(f" {k} {r[k]:.3f}" for k in ("pass@1", "pass@2") if k in r)
            arc += "".join(f" (blank id: {k} {r['blank_id'][k]:.3f})" for k in ("exact_accuracy", "pass@2")
                           if k in r.get("blank_id", {}))
            accelerator.print(f"eval step {step} {name}: exact {r['exact_accuracy']:.3f} cell (pooled) "
                              f"{r['cell_accuracy_pooled']:.3f} cell (per-puzzle mean) "
                              f"{r['cell_accuracy_per_puzzle']:.3f} cell (changed) {r['cell_accuracy_changed']:.3f} "
                              f"iterations {r['iterations_mean']:.1f}{arc}")
            if "iterations_vs_difficulty" in r:
                accelerator.print(format_table(r["iterations_vs_difficulty"]))

    # 3.-4. Training with periodic evaluation.
    t0 = time.time()
    train_loop(args, accelerator, (model, optimizer, scheduler, ema, carry), train_ds, progress, ckpt, run_evals)
    history = progress["history"]
    if not history or history[-1]["step"] != progress["step"]:  # e.g. resumed from a SIGTERM checkpoint at the end
        run_evals(progress["step"])

    export(args, accelerator, eval_model, test_sets, progress, time.time() - t0)
    accelerator.end_training()  # closes the --report_to trackers


def export(args, accelerator, eval_model, test_sets, progress, wall_seconds):
    """5. Export the (EMA) model with its code, and the metrics; staged, so a kill never leaves a half export. Then
    ``--push_to_hub``."""
    history = progress["history"]
    if accelerator.is_main_process:
        with staged_folder(args.output_dir) as stage:
            eval_model.save_pretrained(stage)
            write_json(os.path.join(stage, "metrics.json"), {
                "args": args.to_dict(), "train_seconds": progress["train_seconds"], "wall_seconds": wall_seconds,
                "history": history, "final": history[-1] if history else None})
            # One curve per test set: iterations used (and exact accuracy) against difficulty.
            for i, (name, _, test_meta) in enumerate(test_sets):
                rows = history[-1][name].get("iterations_vs_difficulty") if history else None
                if rows:
                    plot_iterations_vs_difficulty(rows, os.path.join(stage, f"iterations_vs_difficulty_{i}.png"),
                                                  title=f"{args.model} {name}", difficulty_name=test_meta.difficulty)
        accelerator.print(f"saved to {args.output_dir}: AutoModelForTokenClassification.from_pretrained("
                          f"{args.output_dir!r}, trust_remote_code=True)")
    push_output(args, accelerator, eval_model, args.output_dir,
                description=f"{args.model} trained on {args.task} puzzles (recipes/reasoning.py).")


def train_loop(args, accelerator, parts, train_ds, progress, ckpt, run_evals):
    """3. Training: the carry persists across optimizer steps (deep supervision). From ``progress["step"]`` to
    ``max_steps`` or the time budget; evaluates, checkpoints (also on SIGTERM, then exits) and updates ``progress``."""
    carry, start = parts[-1], progress["step"]
    stream = batches(train_ds, args.batch_size, accelerator.device, shuffle=True,
                     seed=args.seed + 1000 * accelerator.process_index, skip=start)
    t0 = time.time()
    budget = args.max_train_seconds
    timed_out = start > 0 and budget is not None and progress["train_seconds"] >= budget
    steps = range(start + 1, args.max_steps + 1) if not timed_out else range(0)  # a resumed run out of time: done
    bar = tqdm(steps, disable=not accelerator.is_local_main_process, desc=f"{args.model}/{args.task}",
               initial=start, total=args.max_steps)
    with Preemption(accelerator) as preemption:
        for step in bar:
            t_step = time.time()
            out = supervision_step(args, accelerator, parts, next(stream), step)
            # Metrics on the puzzles that just halted (their final answer), as in the research code.
            done = carry.value["halted"]
            progress["halted_exact"] += float(out.metrics["exact"][done].float().sum())
            progress["halted_n"] += int(done.sum())
            train_exact = progress["halted_exact"] / max(progress["halted_n"], 1)
            bar.set_postfix(loss=f"{out.loss.item():.3f}", exact=f"{train_exact:.3f}")
            log_scalars(accelerator, step, out.loss.item(), parts[2].get_last_lr()[0], out.fp_stats)
            progress["train_seconds"] += time.time() - t_step
            out_of_time = args.max_train_seconds is not None and progress["train_seconds"] >= args.max_train_seconds
            if args.max_train_seconds is not None and accelerator.num_processes > 1:  # every process stops together
                out_of_time = bool(accelerator.reduce(torch.tensor(float(out_of_time), device=accelerator.device),
                                                      "max") > 0)
            evaluated = step % args.eval_every == 0 or step == args.max_steps or out_of_time
            if evaluated:
                accelerator.print(f"step {step} loss {out.loss.item():.4f} train exact (halted) {train_exact:.3f} "
                                  f"({progress['train_seconds']:.0f}s training, {time.time() - t0:.0f}s in all)")
                progress["halted_exact"], progress["halted_n"] = 0.0, 0
                run_evals(step)
            progress["step"] = step
            stop = preemption.requested()
            if (step % args.save_every == 0 if args.save_every else evaluated) or stop:
                folder = ckpt.save(**progress)  # progress["step"] is the step
                if stop:
                    preemption.exit(folder)
            if out_of_time:
                accelerator.print(f"stopping at step {step}: {progress['train_seconds']:.0f}s of training "
                                  "(--max_train_seconds)")
                break
    bar.close()


def supervision_step(args, accelerator, parts, b, step):
    """One optimizer step (one supervision step for every slot): AdamATan2, sign-SGD on the touched puzzle-table
    rows, schedule, EMA; advances the carry and returns the model output."""
    model, optimizer, scheduler, ema, carry = parts
    raw = accelerator.unwrap_model(model)
    puzzle_emb = raw.model.trunk.input.puzzle_emb
    out = model(b["inputs"], b["puzzle_identifiers"], b["labels"], carry=carry.value)
    carry.value = out.carry
    if not torch.isfinite(out.loss):
        raise FloatingPointError(f"the loss is {out.loss.item()} at step {step}; lower --lr or resume from the "
                                 f"last checkpoint in {os.path.join(args.output_dir, 'checkpoints')} with other "
                                 "settings.")
    accelerator.backward(out.loss)
    optimizer.step()
    grad = None if puzzle_emb is None or puzzle_emb.local_weights is None else puzzle_emb.local_weights.grad
    if grad is not None:  # sign-SGD on the puzzle-embedding rows this batch touched
        ids = puzzle_emb.local_ids
        if accelerator.num_processes > 1:
            ids, grad = accelerator.gather(ids), accelerator.gather(grad)
        factor = scheduler.get_last_lr()[0] / args.lr if args.lr > 0 else 1.0
        puzzle_emb.sign_sgd_step(args.puzzle_emb_lr * factor, args.puzzle_emb_weight_decay, ids, grad)
    scheduler.step()
    optimizer.zero_grad()
    if ema is not None:
        ema.update_parameters(raw)
    return out


if __name__ == "__main__":
    main()
