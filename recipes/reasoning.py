"""Train and evaluate a puzzle reasoner (FPRM, TRM, Attractor-reasoning, URM) with deep supervision, on CPU or GPU.

    python -m recipes.reasoning --model fprm --task a5 --output_dir runs/fprm_a5
    accelerate launch recipes/reasoning.py --model trm --task sudoku --max_steps 2000 --output_dir runs/trm_sudoku
    python -m recipes.reasoning --model attractor --task sudoku --resume_from runs/trm_sudoku/state   # resume

What it does, top to bottom:
1. data: ``hf_fixedpoint.puzzles.build_dataset(task, split, seed, **task_kwargs)``; one or more test sets
   (``--test_task_kwargs`` a JSON object or list of objects, e.g. A5 at 2x the training length);
2. model: the family's ``*ForPuzzles`` sized from the dataset's ``PuzzleMetadata`` (``--model_kwargs`` for any other
   config field);
3. training, as in the research code: the ACT carry persists across optimizer steps (one optimizer step = one
   supervision step for every slot; a slot takes a new puzzle when it halts), AdamATan2 on the parameters, sign-SGD
   on the touched rows of the sparse puzzle-embedding table, linear warmup then a constant learning rate, and an EMA
   of the parameters used for evaluation and export;
4. periodic evaluation (``hf_fixedpoint.puzzles.evaluation``): exact (whole-sequence) and per-cell accuracy,
   iterations used versus difficulty (A5 length, Sudoku backtracks) and, for ARC, pass@1/2 after voting over the
   augmented copies (ties broken by ``sigmoid(q_halt)``). FPRM is evaluated with one full solve per puzzle
   (adaptive iterations); TRM and URM run ``halt_max_steps`` supervision steps, and their iterations are counted
   up to the first step whose Q-halt logit is positive;
5. export: ``save_pretrained`` (EMA weights) -> loads with ``AutoModelForTokenClassification.from_pretrained(dir,
   trust_remote_code=True)``; ``metrics.json`` holds every evaluation, ``iterations_vs_difficulty_<i>.png`` plots
   the last one per test set.
"""

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import HfArgumentParser, get_scheduler

from hf_fixedpoint.core.fp_registry import check_choice
from hf_fixedpoint.modeling import FPRMConfig, FPRMForPuzzles, TRMConfig, TRMForPuzzles, URMConfig, URMForPuzzles
from hf_fixedpoint.optim import AdamATan2, ema_model
from hf_fixedpoint.puzzles import build_dataset
from hf_fixedpoint.puzzles.evaluation import (
    arc_pass_at_k,
    cell_accuracy,
    exact_accuracy,
    format_table,
    iterations_vs_difficulty,
    plot_iterations_vs_difficulty,
    sequence_correct,
)

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


@dataclass
class Args:
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
    resume_from: Optional[str] = field(default=None, metadata={"help": "an output_dir/state folder to resume"})
    eval_every: int = field(default=100, metadata={"help": "steps between evaluations (and state saves)"})
    seed: int = field(default=0)


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
        for name in ("num_puzzle_identifiers", "vocab_size"):
            have, want = getattr(model.config, name), getattr(meta, name)
            if have != want:
                raise ValueError(f"the dataset has {name}={want} but the checkpoint {args.init_from} was trained with "
                                 f"{name}={have}; build the data with the checkpoint's puzzle ids or train anew.")
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


def batches(ds, batch_size, device, shuffle, seed=0, drop_last=True):
    """Endless (shuffle) or one-pass iterator of batches as tensors on ``device``."""
    cols = ["inputs", "labels", "puzzle_identifiers"]
    data = ds.with_format("torch", columns=cols)
    epoch = 0
    while True:
        order = (torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed + epoch)) if shuffle
                 else torch.arange(len(ds)))
        stop = len(ds) - (len(ds) % batch_size if drop_last else 0)
        for start in range(0, stop, batch_size):
            rows = data[order[start:start + batch_size].tolist()]
            yield {k: rows[k].to(device).long() for k in cols}
        if not shuffle:
            return
        epoch += 1


@torch.no_grad()
def evaluate(model, ds, meta, args, device):
    """Exact and cell accuracy, iterations used versus difficulty and, for ARC, pass@k with augmentation voting."""
    model.eval()
    preds, labels, scores, iters = [], [], [], []
    for b in batches(ds, args.eval_batch_size, device, shuffle=False, drop_last=False):
        if args.model == "fprm":  # one full solve: iterations adapt to the puzzle
            out = model(b["inputs"], b["puzzle_identifiers"])
            used = out.iterations
        else:  # the research code's evaluation: halt_max_steps steps; iterations counted up to the first Q-halt
            carry = model.initial_carry(b["inputs"].shape[0], device)
            used = None
            for _ in range(model.config.halt_max_steps):
                out = model(b["inputs"], b["puzzle_identifiers"], carry=carry)
                carry = out.carry
                first = (out.q_halt_logits > 0) if used is None else (out.q_halt_logits > 0) & (used < 0)
                used = torch.where(first, carry["iterations"], -1 if used is None else used)
            used = torch.where(used < 0, carry["iterations"], used)
        preds.append(out.logits.argmax(-1).cpu())
        labels.append(b["labels"].cpu())
        scores.append(torch.sigmoid(out.q_halt_logits).cpu())
        iters.append(used.cpu())
    preds, labels, scores, iters = (torch.cat(t) for t in (preds, labels, scores, iters))
    correct = sequence_correct(preds, labels)
    result = {"exact_accuracy": exact_accuracy(preds, labels), "cell_accuracy": cell_accuracy(preds, labels),
              "iterations_mean": iters.float().mean().item(), "num_puzzles": len(preds)}
    if meta.difficulty and meta.difficulty in ds.column_names:
        result["iterations_vs_difficulty"] = iterations_vs_difficulty(iters, ds[meta.difficulty], correct)
    if args.task.startswith("arc"):
        result.update(arc_pass_at_k(ds, preds, scores, ks=(1, 2)))
    model.train()
    return result


def main(argv=None):
    """Run the recipe; ``argv`` defaults to the command line."""
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(args=argv)  # unknown flags are errors
    check_choice(args.model, "--model", sorted(MODELS))
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(args.seed)
    accelerator.print(f"args: {json.dumps(asdict(args))}")

    # 1. Data.
    train_ds, meta = build_dataset(args.task, "train", seed=args.seed, **parse_json(args.task_kwargs, "task_kwargs"))
    test_kwargs = parse_json(args.test_task_kwargs, "test_task_kwargs")
    test_sets = []
    for kw in test_kwargs if isinstance(test_kwargs, list) else [test_kwargs]:
        ds, test_meta = build_dataset(args.task, "test", seed=args.seed, **kw)
        test_sets.append((json.dumps(kw, sort_keys=True), ds, test_meta))
    accelerator.print(f"data: {args.task} train {len(train_ds)} puzzles, seq_len {meta.seq_len}, vocab "
                      f"{meta.vocab_size}, {meta.num_puzzle_identifiers} puzzle ids; test sets "
                      f"{[(name, len(ds)) for name, ds, _ in test_sets]}")

    # 2. Model, optimizers, schedule, EMA.
    model = build_model(args, meta).train()  # from_pretrained (--init_from) returns a model in eval mode
    accelerator.print(f"model: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    optimizer = AdamATan2(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                          weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.max_steps)
    ema = ema_model(model, args.ema_rate, args.ema_warmup).to(accelerator.device) if args.ema_rate > 0 else None
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    raw = accelerator.unwrap_model(model)
    puzzle_emb = raw.model.trunk.input.puzzle_emb

    start_step, history = 0, []
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        with open(os.path.join(args.resume_from, "progress.json")) as fh:
            progress = json.load(fh)
        start_step, history = progress["step"], progress["history"]
        accelerator.print(f"resumed from {args.resume_from} at step {start_step}")

    def eval_model():  # the EMA copy holds the averaged parameters and the current puzzle table
        return raw if ema is None else ema.module

    def run_evals(step):
        results = {name: evaluate(eval_model(), ds, m, args, accelerator.device) for name, ds, m in test_sets}
        history.append({"step": step, **results})
        for name, r in results.items():
            arc = "".join(f" {k} {r[k]:.3f}" for k in ("pass@1", "pass@2") if k in r)
            accelerator.print(f"eval step {step} {name}: exact {r['exact_accuracy']:.3f} cell "
                              f"{r['cell_accuracy']:.3f} iterations {r['iterations_mean']:.1f}{arc}")
            if "iterations_vs_difficulty" in r:
                accelerator.print(format_table(r["iterations_vs_difficulty"]))

    # 3. Training: the carry persists across optimizer steps (deep supervision).
    stream = batches(train_ds, args.batch_size, accelerator.device, shuffle=True,
                     seed=args.seed + 1000 * accelerator.process_index + start_step)
    carry = raw.initial_carry(args.batch_size, accelerator.device)
    halted_exact, halted_n = 0.0, 0
    t0, train_seconds = time.time(), 0.0
    bar = tqdm(range(start_step + 1, args.max_steps + 1), disable=not accelerator.is_local_main_process,
               desc=f"{args.model}/{args.task}", initial=start_step, total=args.max_steps)
    for step in bar:
        t_step = time.time()
        b = next(stream)
        out = model(b["inputs"], b["puzzle_identifiers"], b["labels"], carry=carry)
        carry = out.carry
        if not torch.isfinite(out.loss):
            raise FloatingPointError(f"the loss is {out.loss.item()} at step {step}; lower --lr or resume from the "
                                     f"last state in {os.path.join(args.output_dir, 'state')} with other settings.")
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
        # Metrics on the puzzles that just halted (their final answer), as in the research code.
        done = carry["halted"]
        halted_exact += float(out.metrics["exact"][done].float().sum())
        halted_n += int(done.sum())
        bar.set_postfix(loss=f"{out.loss.item():.3f}", exact=f"{halted_exact / max(halted_n, 1):.3f}")
        train_seconds += time.time() - t_step
        out_of_time = args.max_train_seconds is not None and train_seconds >= args.max_train_seconds
        if args.max_train_seconds is not None and accelerator.num_processes > 1:  # every process stops together
            out_of_time = bool(accelerator.reduce(torch.tensor(float(out_of_time), device=accelerator.device),
                                                  "max") > 0)
        if step % args.eval_every == 0 or step == args.max_steps or out_of_time:
            accelerator.print(f"step {step} loss {out.loss.item():.4f} train exact (halted) "
                              f"{halted_exact / max(halted_n, 1):.3f} ({train_seconds:.0f}s training, "
                              f"{time.time() - t0:.0f}s in all)")
            halted_exact, halted_n = 0.0, 0
            run_evals(step)
            state_dir = os.path.join(args.output_dir, "state")
            accelerator.save_state(state_dir)
            if accelerator.is_main_process:
                with open(os.path.join(state_dir, "progress.json"), "w") as fh:
                    json.dump({"step": step, "history": history}, fh)
        if out_of_time:
            accelerator.print(f"stopping at step {step}: {train_seconds:.0f}s of training (--max_train_seconds)")
            break
    if start_step >= args.max_steps:
        run_evals(start_step)

    # 5. Export the (EMA) model with its code, and the metrics.
    if accelerator.is_main_process:
        final = eval_model()
        final.save_pretrained(args.output_dir)
        metrics = {"args": asdict(args), "train_seconds": train_seconds, "wall_seconds": time.time() - t0,
                   "history": history, "final": history[-1] if history else None}
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as fh:
            json.dump(metrics, fh, indent=1)
        # One curve per test set: iterations used (and exact accuracy) against difficulty.
        for i, (name, _, test_meta) in enumerate(test_sets):
            rows = history[-1][name].get("iterations_vs_difficulty") if history else None
            if rows:
                plot_iterations_vs_difficulty(rows, os.path.join(args.output_dir, f"iterations_vs_difficulty_{i}.png"),
                                              title=f"{args.model} {name}", difficulty_name=test_meta.difficulty)
        accelerator.print(f"saved to {args.output_dir}: AutoModelForTokenClassification.from_pretrained("
                          f"{args.output_dir!r}, trust_remote_code=True)")


if __name__ == "__main__":
    main()
