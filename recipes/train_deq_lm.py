"""Train the reference DEQ-LM end to end on CPU: corpus -> tokenizer -> fixed-point LM -> eval -> self-contained save.

    python -m recipes.train_deq_lm --output_dir runs/deq_lm_demo                 # one process
    accelerate launch -m recipes.train_deq_lm --output_dir runs/deq_lm_demo      # any accelerate set-up
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m recipes.train_deq_lm  # 2-process DDP

The corpus is the docstrings of a fixed list of standard-library modules (offline, deterministic); a byte-level BPE
tokenizer is trained on it with `tokenizers`. The model is solved with Anderson and trained with implicit gradients.
At the end the recipe reports held-out perplexity before and after training, and at 1 vs ``fp_max_iter`` solver
iterations (a fixed-point model gets better with more test-time iterations), then saves a checkpoint that loads with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` where hf-fixedpoint is not installed.

Checkpoints (``hf_fixedpoint.checkpointing``): atomic ``output_dir/checkpoints/step_<n>`` folders every
``--save_every`` steps, at the end and on SIGTERM; ``--resume_from_checkpoint latest`` continues with the
uninterrupted run's data stream, RNG, optimizer and schedule.
"""

import importlib
import inspect
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import HfArgumentParser, PreTrainedTokenizerFast

from hf_fixedpoint import merge_stats
from hf_fixedpoint.checkpointing import Checkpointer, Preemption, Stateful, staged_folder
from hf_fixedpoint.modeling import DEQLMConfig, DEQLMForCausalLM
from hf_fixedpoint.recipe_args import RecipeArgs, end_tracking, log_scalars, push_output, start_run, tracking

CORPUS_MODULES = ["argparse", "collections", "csv", "datetime", "decimal", "email", "fractions", "functools", "heapq",
                  "http.client", "inspect", "json", "logging", "pathlib", "pickle", "random", "re", "statistics",
                  "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
                  "uuid", "zipfile"]


@dataclass
class Args(RecipeArgs):  # --seed, --resume_from_checkpoint, --report_to, --push_to_hub, ...: docs/recipes.md
    output_dir: str = field(default="runs/deq_lm_demo", metadata={"help": "where the checkpoint and metrics go"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=16, metadata={"help": "sequences per step and process"})
    seq_length: int = field(default=64, metadata={"help": "tokens per training sequence"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate"})
    vocab_size: int = field(default=512, metadata={"help": "BPE vocabulary size"})
    hidden_size: int = field(default=64, metadata={"help": "model width"})
    fp_solver: str = field(default="anderson", metadata={"help": "forward solver"})
    fp_backward: str = field(default="ift", metadata={"help": "backward mode"})
    fp_max_iter: int = field(default=20, metadata={"help": "solver cap"})
    fp_tol: float = field(default=1e-3, metadata={"help": "relative residual tolerance"})
    log_every: int = field(default=25, metadata={"help": "steps between log lines"})
    save_every: int = field(default=0, metadata={"help": "steps between resumable checkpoints (0: only at the end)"})
    save_total_limit: int = field(default=2, metadata={"help": "keep the newest N complete checkpoints (0: all)"})


def build_corpus():
    texts = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
            if doc and getattr(obj, "__module__", "").startswith(name.split(".")[0]):
                texts.append(doc)
    return "\n\n".join(texts)


def train_tokenizer(text, vocab_size):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=512)


@torch.no_grad()
def perplexity(model, data, seq_length, fp_overrides=None):
    model.eval()
    blocks = data[: (len(data) // seq_length) * seq_length].view(-1, seq_length)
    losses = [model(b, labels=b, fp_overrides=fp_overrides).loss for b in blocks.split(16)]
    model.train()
    return math.exp(torch.stack(losses).mean().item())


def train(args, accelerator, prepared, train_ids):
    """The training loop: random windows of the training tokens, a different stream per process (saved with the
    checkpoints); resumes from ``--resume_from_checkpoint``. Returns the training seconds."""
    model, optimizer, scheduler = prepared
    g = torch.Generator().manual_seed(args.seed + accelerator.process_index)
    ckpt = Checkpointer(accelerator, os.path.join(args.output_dir, "checkpoints"), args.save_total_limit,
                        objects={"data": Stateful(stream=g)})
    record = ckpt.load(args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    start, seconds = (record["step"], record["seconds"]) if record else (0, 0.0)
    t0 = time.time() - seconds
    bar = tqdm(range(start + 1, args.max_steps + 1), initial=start, total=args.max_steps, desc="train",
               disable=not accelerator.is_local_main_process)
    with Preemption(accelerator) as preemption:
        for step in bar:
            starts = torch.randint(0, len(train_ids) - args.seq_length, (args.batch_size,), generator=g)
            batch = torch.stack([train_ids[s : s + args.seq_length] for s in starts]).to(accelerator.device)
            out = model(batch, labels=batch)
            accelerator.backward(out.loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            bar.set_postfix(loss=f"{out.loss.item():.3f}")
            log_scalars(accelerator, step, out.loss.item(), scheduler.get_last_lr()[0], out.fp_stats)
            if step % args.log_every == 0 or step == args.max_steps:
                s = merge_stats([out.fp_stats])
                accelerator.print(f"step {step:4d} loss {out.loss.item():.3f} fp_nfe {s['fp_nfe']:.0f} "
                                  f"converged {s['fp_converged_fraction']:.2f} "
                                  f"adjoint_nfe {s.get('fp_backward_nfe', 0):.0f} "
                                  f"({time.time() - t0:.0f}s)")
            stop = preemption.requested()
            if (args.save_every and step % args.save_every == 0) or step == args.max_steps or stop:
                folder = ckpt.save(step, seconds=time.time() - t0)
                if stop:
                    preemption.exit(folder)
    return time.time() - t0


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()  # unknown flags are errors
    for name in ("save_every", "save_total_limit"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}.")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), **tracking(args))
    set_seed(args.seed)
    start_run(accelerator, args)

    # Data: tokenize the corpus once; the last 10% of tokens are held out.
    text = build_corpus()
    tokenizer = train_tokenizer(text, args.vocab_size)
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    accelerator.print(f"corpus: {len(text)} chars, {len(ids)} tokens, vocab {len(tokenizer)}")

    config = DEQLMConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                         intermediate_size=4 * args.hidden_size, num_attention_heads=4,
                         max_position_embeddings=max(256, args.seq_length), fp_solver=args.fp_solver,
                         fp_backward=args.fp_backward, fp_max_iter=args.fp_max_iter, fp_tol=args.fp_tol,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = DEQLMForCausalLM(config)
    ppl_init = perplexity(model, val_ids, args.seq_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    prepared = accelerator.prepare(model, optimizer, scheduler)
    train_seconds = train(args, accelerator, prepared, train_ids)

    # Evaluation: perplexity after training, and with a single solver iteration instead of fp_max_iter.
    model = accelerator.unwrap_model(prepared[0])
    metrics = {"val_ppl_init": ppl_init, "val_ppl": perplexity(model, val_ids, args.seq_length),
               "val_ppl_1_iter": perplexity(model, val_ids, args.seq_length, {"fp_max_iter": 1}),
               "train_seconds": train_seconds}
    accelerator.print("metrics: " + json.dumps({k: round(v, 3) for k, v in metrics.items()}))

    # Save: a self-contained checkpoint (code + vendored solvers + auto_map) and the tokenizer.
    if accelerator.is_main_process:  # staged: a kill here leaves a folder that does not load, never a mix
        with staged_folder(args.output_dir) as stage:
            model.save_pretrained(stage)
            tokenizer.save_pretrained(stage)
            with open(os.path.join(stage, "metrics.json"), "w") as fh:
                json.dump(metrics, fh, indent=2)
        accelerator.print(f"saved to {args.output_dir}: load with AutoModelForCausalLM.from_pretrained("
                          f"{args.output_dir!r}, trust_remote_code=True)")
    push_output(args, accelerator, model, args.output_dir, description="DEQ-LM trained by recipes/train_deq_lm.py.")
    end_tracking(accelerator)


if __name__ == "__main__":
    main()
