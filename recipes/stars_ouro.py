"""STARS on Ouro: Jacobian spectral-radius regularization + random loop counts make a looped LM keep its accuracy when
it is run for more loops than it was trained with.

    accelerate launch recipes/stars_ouro.py                     # the embedded default (below), a few minutes on CPU
    python -m recipes.stars_ouro --output_dir runs/stars_ouro   # the same in one process
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/stars_ouro.py   # 2-process CPU DDP
    accelerate launch --config_file recipes/configs/fsdp.yaml recipes/stars_ouro.py --reg_product jvp \
        --model <dir> --dataset <file>                         # FSDP2 on GPUs (see docs/scale-out.md)

Default (no --model): the paper's section-4 testbed at CPU scale. A tiny Ouro-architecture model (one weight-tied layer
looped ``train_loops`` times, sandwich norms, final norm after every loop) is trained from scratch on generated
multi-digit addition (numbers written least significant digit first) twice: once with STARS (loop counts drawn from a
log-normal per step, JSRR with weight ``reg_weight`` after ``reg_warmup_steps``) and once as the plain fixed-loop
baseline. Both are then scored by exact match at loop counts from 1 to 4x ``train_loops``; the recipe prints a table,
writes ``accuracy_vs_loops.png`` and ``metrics.json``, and saves both models (``stars/``, ``baseline/``) so that
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads them with torch + transformers only.
``--exit_loss expected_loss`` trains the exit gate with the LM (Ouro's stage I); ``--gate_stage 2`` then trains the
gate alone on the frozen LM (Ouro's stage II, ``adaptive_gate_loss``), also on a saved model (``--gate_from DIR``).

Fine-tuning (``--model <hub id or dir> --dataset <hub id or local json/jsonl/csv/parquet>``), as the paper fine-tuned
Ouro-1.4B: chat-formatted data (system prompt, user = question column, assistant = answer column, or a ``messages``
column), loss on assistant tokens only, bf16 weights, gradient checkpointing, AdamW, warmup-stable-decay schedule,
one loop count per micro-batch (log-normal mu 1.7, sigma 0.4, clipped to [1, 16]), gradient accumulation, periodic
``accelerator.save_state`` checkpoints and ``--resume_from_checkpoint``.
"""

import math
import os
import string
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from packaging.version import Version
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, PreTrainedTokenizerFast
from transformers.optimization import get_wsd_schedule

from hf_fixedpoint.checkpointing import Checkpointer, Preemption, Stateful, epoch_loader, staged_folder, write_json
from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from hf_fixedpoint.modeling.ouro.configuration_ouro import EXIT_LOSSES
from hf_fixedpoint.modeling.ouro.modeling_ouro import adaptive_gate_loss
from hf_fixedpoint.recipe_args import RecipeArgs, end_tracking, log_scalars, push_output, start_run, tracking
from hf_fixedpoint.stars import STARSRegularizer, loop_sampler

logger = get_logger(__name__)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM_PROMPT = "You are a helpful assistant that can assist users with reasoning."
EVAL_SEED = 10**6 + 7  # the held-out addition problems (tools/vllm_addition.py scores the same ones)


@dataclass
class Args(RecipeArgs):  # --seed, --report_to, --push_to_hub, ...: docs/recipes.md
    output_dir: str = field(default="runs/stars_ouro", metadata={"help": "where models, metrics and the plot go"})
    # --- STARS
    reg_weight: float = field(default=0.1, metadata={"help": "lambda: (1 - lambda) * LM loss + lambda * JSRR"})
    reg_warmup_steps: int = field(default=450, metadata={"help": "optimizer steps before JSRR is added"})
    reg_iters: int = field(default=1, metadata={"help": "power iterations (1 = Frobenius-type estimate)"})
    reg_product: str = field(default="vjp", metadata={"help": "vjp (public code), jvp (paper), double_backward"})
    reg_max_batch: Optional[int] = field(default=32, metadata={"help": "sequences the JSRR linearizes at (the "
                                                                        "first ones of the batch; 0: all)"})
    sampler: str = field(default="lognormal", metadata={"help": "loop sampler: fixed, lognormal, poisson, "
                                                                 "exponential, uniform, or a preset"})
    sampler_mu: Optional[float] = field(default=None, metadata={"help": "lognormal mu (default: log train_loops, "
                                                                         "or 1.7 when fine-tuning)"})
    sampler_sigma: Optional[float] = field(default=None, metadata={"help": "lognormal sigma (0.6; 0.4 fine-tuning)"})
    min_loops: int = field(default=1, metadata={"help": "smallest sampled loop count"})
    max_loops: Optional[int] = field(default=None, metadata={"help": "largest sampled loop count (default: 4 x "
                                                                      "train_loops, or 16 when fine-tuning)"})
    # --- addition (default mode)
    digits: int = field(default=3, metadata={"help": "digits per operand"})
    train_loops: int = field(default=4, metadata={"help": "loops of the baseline and mean scale of the sampler"})
    max_steps: int = field(default=1500, metadata={"help": "optimizer steps per run"})
    batch_size: int = field(default=128, metadata={"help": "sequences per step and process"})
    lr: float = field(default=3e-3, metadata={"help": "peak AdamW learning rate"})
    hidden_size: int = field(default=128, metadata={"help": "model width; head dim = hidden_size / num_heads (32 by "
                                                               "default, one vLLM's CPU attention serves)"})
    init_std: float = field(default=0.2, metadata={"help": "initializer_range; the tiny model learns addition "
                                                            "much faster with 0.2 than with Ouro's 0.02"})
    num_layers: int = field(default=1, metadata={"help": "layers in the looped stack"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    exit_loss: str = field(default="last", metadata={"help": "training loss: last (the last loop's), expected_loss "
                                                              "(Ouro stage I, trains the exit gate: sum_t p_t CE_t - "
                                                              "entropy_weight * H(p)) or expected_logits"})
    entropy_weight: float = field(default=0.0, metadata={"help": "beta of --exit_loss expected_loss"})
    gate_stage: int = field(default=1, metadata={"help": "1: train with --exit_loss only; 2: then Ouro's stage II: "
                                                          "the LM frozen, the exit gate alone trained for "
                                                          "--gate_steps with BCE(1 - lambda_t, sigmoid(k (I_t - "
                                                          "gamma))), I_t the LM-loss improvement of loop t"})
    gate_from: Optional[str] = field(default=None, metadata={"help": "--gate_stage 2 on this saved model (a "
                                                                      "recipe output folder) instead of training "
                                                                      "one; --runs names the output folder"})
    gate_steps: int = field(default=300, metadata={"help": "stage-II optimizer steps"})
    gate_lr: float = field(default=3e-3, metadata={"help": "stage-II AdamW learning rate of the gate"})
    gate_loops: Optional[int] = field(default=None, metadata={"help": "loops of the stage-II forward (default: "
                                                                       "the largest sampled / trained count)"})
    gate_k: float = field(default=50.0, metadata={"help": "stage II: sharpness k of the target sigmoid"})
    gate_gamma: float = field(default=0.005, metadata={"help": "stage II: improvement threshold gamma"})
    eval_size: int = field(default=1000, metadata={"help": "held-out problems per loop count"})
    eval_loops: Optional[str] = field(default=None, metadata={"help": "comma-separated loop counts (default: 1, "
                                                                       "2, ..., 4 x train_loops)"})
    runs: str = field(default="stars,baseline", metadata={"help": "which runs: stars, baseline or both"})
    log_every: int = field(default=100, metadata={"help": "steps between log lines"})
    # --- fine-tuning mode
    model: Optional[str] = field(default=None, metadata={"help": "pretrained Ouro (hub id or dir): fine-tune it"})
    dataset: Optional[str] = field(default=None, metadata={"help": "hub id or local json/jsonl/csv/parquet file"})
    dataset_split: str = field(default="train", metadata={"help": "split to train on"})
    question_column: str = field(default="problem", metadata={"help": "user turn (unless a messages column)"})
    answer_column: str = field(default="solution", metadata={"help": "assistant turn"})
    system_prompt: str = field(default=SYSTEM_PROMPT, metadata={"help": "system turn ('' for none)"})
    max_samples: Optional[int] = field(default=None, metadata={"help": "use at most this many examples"})
    max_seq_length: int = field(default=2048, metadata={"help": "truncate longer sequences"})
    micro_batch_size: int = field(default=1, metadata={"help": "sequences per micro-batch and process"})
    gradient_accumulation_steps: int = field(default=32, metadata={"help": "micro-batches per optimizer step"})
    epochs: int = field(default=1, metadata={"help": "passes over the data"})
    finetune_lr: float = field(default=1e-6, metadata={"help": "peak learning rate when fine-tuning"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "WSD warm-up share of the steps"})
    decay_ratio: float = field(default=0.1, metadata={"help": "WSD decay share of the steps"})
    min_lr_ratio: float = field(default=0.001, metadata={"help": "WSD final lr / peak lr"})
    bf16: bool = field(default=True, metadata={"help": "bf16 weights (bf16-true, no autocast)"})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "recompute layers in the backward"})
    # --- checkpoints (both modes)
    save_every: int = field(default=300, metadata={"help": "optimizer steps between resumable checkpoints (and one "
                                                            "at the end of each run)"})
    save_total_limit: int = field(default=2, metadata={"help": "keep the newest N complete checkpoints (0: all)"})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={"help": "'latest' (the newest complete "
                                                                                   "checkpoint; none: start fresh) "
                                                                                   "or a checkpoints/.../step_<n> "
                                                                                   "folder"})


def check_args(args):
    """Bad flag values fail before any work, naming the flag."""
    if (args.model is None) != (args.dataset is None):
        raise ValueError("--model and --dataset go together (fine-tuning); give both or neither (addition demo).")
    for name in ("max_steps", "batch_size", "digits", "train_loops", "eval_size", "micro_batch_size",
                 "gradient_accumulation_steps", "epochs", "save_every", "hidden_size", "num_layers", "num_heads",
                 "log_every", "min_loops", "reg_iters", "max_seq_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    if args.exit_loss not in EXIT_LOSSES:
        raise ValueError(f"--exit_loss={args.exit_loss!r}: allowed values are {', '.join(EXIT_LOSSES)}.")
    if args.entropy_weight < 0:
        raise ValueError(f"--entropy_weight must be >= 0, got {args.entropy_weight}.")
    check_gate_args(args)
    if args.save_total_limit < 0:
        raise ValueError(f"--save_total_limit must be >= 0 (0: keep all), got {args.save_total_limit}.")
    if args.reg_warmup_steps < 0 or (args.reg_max_batch or 0) < 0:
        raise ValueError("--reg_warmup_steps and --reg_max_batch must be >= 0.")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or set(runs) - {"stars", "baseline"}:
        raise ValueError(f"--runs={args.runs!r}: allowed values are 'stars', 'baseline' or 'stars,baseline'.")
    if not 0 <= args.warmup_ratio + args.decay_ratio <= 1:
        raise ValueError("--warmup_ratio + --decay_ratio must lie in [0, 1].")
    sampler(args)  # unknown sampler names / options raise here
    regularizer(args)
    eval_loop_counts(args)


def check_gate_args(args):
    """The stage-II flags (``--gate_*``)."""
    if args.gate_stage not in (1, 2):
        raise ValueError(f"--gate_stage={args.gate_stage}: allowed values are 1 (the --exit_loss training only) and "
                         "2 (then Ouro's stage II, the gate alone).")
    if args.gate_stage == 2 and args.model is not None:
        raise ValueError("--gate_stage 2 runs in the addition demo (no --model / --dataset).")
    if args.gate_from is not None and args.gate_stage != 2:
        raise ValueError("--gate_from needs --gate_stage 2 (it loads a model to train the gate of).")
    if args.gate_from is not None and len([r for r in args.runs.split(",") if r.strip()]) != 1:
        raise ValueError(f"--gate_from takes one --runs name (the output folder), got --runs={args.runs!r}.")
    for name in ("gate_steps", "gate_loops"):
        if getattr(args, name) is not None and getattr(args, name) < (1 if name == "gate_steps" else 2):
            raise ValueError(f"--{name} must be >= {1 if name == 'gate_steps' else 2}, got {getattr(args, name)}.")
    for name in ("gate_lr", "gate_k"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name} must be > 0, got {getattr(args, name)}.")
    if args.gate_gamma < 0:
        raise ValueError(f"--gate_gamma must be >= 0, got {args.gate_gamma}.")


def check_engine(args, accelerator):
    """What the launch engine allows: under FSDP the JSRR must use the forward-mode product. The reverse-mode products
    (vjp, double_backward) run a backward pass inside the forward, which fires FSDP's backward hooks (gradient
    reduce-scatter) early; the run then crashes in the real backward (measured with FSDP2 on CPU, tests/recipes/
    test_fsdp.py)."""
    if accelerator.distributed_type != DistributedType.FSDP or args.reg_weight == 0:
        return
    if args.reg_product != "jvp":
        raise ValueError(f"--reg_product {args.reg_product} cannot run under FSDP (its backward pass inside the "
                         "forward fires FSDP's gradient hooks early); use --reg_product jvp (the paper's product).")
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if getattr(plugin, "reshard_after_forward", False) is True and Version(torch.__version__).release < (2, 13):
        raise ValueError(f"the jvp JSRR under FSDP with resharding after the forward crashes on torch "
                         f"{torch.__version__} (a torch.func.jvp through resharded FSDP2 parameters ends in a "
                         "segmentation fault or 'setStorage: ... out of bounds for storage of size 0' on 2.11; it "
                         "runs on 2.13): set fsdp_reshard_after_forward: false in the accelerate config, or use torch "
                         ">= 2.13.")


def sampler(args):
    """The STARS loop sampler (same draw on every rank for a step)."""
    finetune = args.model is not None
    lo, hi = loop_range(args)
    kw = {"min_loops": lo, "max_loops": hi, "seed": args.seed}
    if args.sampler == "lognormal":
        default_mu = 1.7 if finetune else math.log(args.train_loops)
        kw["mu"] = args.sampler_mu if args.sampler_mu is not None else default_mu
        kw["sigma"] = args.sampler_sigma if args.sampler_sigma is not None else (0.4 if finetune else 0.6)
    elif args.sampler == "fixed":
        kw["loops"] = args.train_loops
    return loop_sampler(args.sampler, **kw)


def loop_range(args):
    """The smallest and largest loop count the STARS sampler draws."""
    return args.min_loops, args.max_loops or (16 if args.model is not None else 4 * args.train_loops)


def trained_loops(args, run):
    """The loop counts a run trains with, recorded as ``config.trained_loops`` (Ouro's depth guard reads it)."""
    if run == "baseline" or args.sampler == "fixed":
        return [args.train_loops, args.train_loops]
    return list(loop_range(args))


def regularizer(args):
    return STARSRegularizer(reg_weight=args.reg_weight, warmup_steps=args.reg_warmup_steps, n_iter=args.reg_iters,
                            product=args.reg_product, max_batch=args.reg_max_batch or None, seed=args.seed)


def eval_loop_counts(args):
    if args.eval_loops is None:
        return list(range(1, 4 * args.train_loops + 1))
    counts = [int(x) for x in args.eval_loops.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(f"--eval_loops={args.eval_loops!r} must list loop counts >= 1.")
    return counts


# ---------------------------------------------------------------------------------------------------------- data
def char_tokenizer():
    """Character-level tokenizer over printable ASCII plus ChatML specials (offline, deterministic)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable[:95]) + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters are joined as they are ("1631", not "1 6 3 1")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", model_max_length=4096, padding_side="left")
    fast.chat_template = CHATML
    return fast


def addition_batch(n, digits, generator, tokenizer):
    """``n`` problems ``a+b=c`` plus EOS, every number zero-padded and written least significant digit first (so
    the digits to add sit at a fixed offset from each other); labels only on ``c`` and EOS."""
    hi = 10**digits
    a = torch.randint(0, hi, (n,), generator=generator)
    b = torch.randint(0, hi, (n,), generator=generator)
    def rev(n, width):  # least significant digit first, zero-padded
        return str(n).zfill(width)[::-1]

    texts = [f"{rev(x, digits)}+{rev(y, digits)}={rev(x + y, digits + 1)}" for x, y in zip(a.tolist(), b.tolist())]
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(list(t)) + [tokenizer.eos_token_id] for t in texts])
    labels = ids.clone()
    labels[:, : 2 * digits + 2] = -100  # the prompt "a+b=" is not a target
    return ids, labels


@torch.no_grad()
def exact_match(model, ids, labels, loops, batch=500):
    """Greedy exact match = every answer token is the argmax given the correct prefix (one forward per batch)."""
    model.eval()
    hits = 0
    for i in range(0, len(ids), batch):
        x, y = ids[i : i + batch].to(model.device), labels[i : i + batch].to(model.device)
        pred = model(x, total_ut_steps=loops, use_cache=False).logits[:, :-1].argmax(-1)
        target, mask = y[:, 1:], y[:, 1:] != -100
        hits += int(((pred == target) | ~mask).all(-1).sum())
    model.train()
    return hits / len(ids)


# ---------------------------------------------------------------------------------------------------------- addition
def resume_spec(args, run):
    """What ``run`` resumes from: ``--resume_from_checkpoint`` when it is ``latest`` or one of this run's folders
    (``checkpoints/<run>/step_<n>``); the run's newest complete checkpoint when the folder belongs to the other run."""
    spec = args.resume_from_checkpoint
    if spec is None or spec == "latest":
        return spec
    return spec if os.path.basename(os.path.dirname(os.path.normpath(spec))) == run else "latest"


def freeze_unused_exit_gate(model):
    """Freeze the early-exit gate when the training loss never reads it (``exit_loss="last"``: the last loop's
    logits). DDP needs every trainable parameter to get a gradient in each step (its all-reduce waits for them), and
    one process trained the gate no more than this: AdamW skips parameters without a gradient."""
    if model.config.exit_loss == "last":
        model.model.early_exit_gate.requires_grad_(False)
    return model


def train_addition(args, accelerator, tokenizer, run):
    """Train one tiny Ouro from scratch: ``run="stars"`` (sampled loops + JSRR) or ``"baseline"`` (fixed loops).

    Checkpoints go to ``output_dir/checkpoints/<run>/step_<n>`` every ``save_every`` steps and at the end; a resumed
    run (data stream, RNG, optimizer and schedule restored) ends with the uninterrupted run's weights."""
    set_seed(args.seed)
    accelerator.free_memory()  # save_state saves every prepared object: only this run's
    config = OuroConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                        intermediate_size=4 * args.hidden_size, num_hidden_layers=args.num_layers,
                        num_attention_heads=args.num_heads, num_key_value_heads=args.num_heads,
                        max_position_embeddings=64, rope_theta=10000.0, initializer_range=args.init_std,
                        total_ut_steps=args.train_loops, trained_loops=trained_loops(args, run),
                        early_exit_threshold=None, exit_loss=args.exit_loss, entropy_weight=args.entropy_weight,
                        tie_word_embeddings=True, use_cache=True, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = freeze_unused_exit_gate(OuroForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.max_steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / args.max_steps, 1.0)))))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    stars = regularizer(args)
    draw = sampler(args)
    g = torch.Generator().manual_seed(args.seed * 1000 + accelerator.process_index + 1)  # a data stream per rank
    ckpt = Checkpointer(accelerator, os.path.join(args.output_dir, "checkpoints", run), args.save_total_limit,
                        objects={"data": Stateful(stream=g)})
    record = ckpt.load(resume_spec(args, run)) if args.resume_from_checkpoint else None
    start, seconds = (record["step"], record["seconds"]) if record else (0, 0.0)
    bar = tqdm(range(start, args.max_steps), desc=run, disable=not accelerator.is_local_main_process)
    t0 = time.time() - seconds
    with Preemption(accelerator) as preemption:
        for step in bar:
            ids, labels = addition_batch(args.batch_size, args.digits, g, tokenizer)
            loops = draw(step) if run == "stars" else args.train_loops
            out = model(ids.to(accelerator.device), labels=labels.to(accelerator.device), total_ut_steps=loops,
                        use_cache=False)
            loss, reg = stars(accelerator.unwrap_model(model), out, step) if run == "stars" else (out.loss, None)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            bar.set_postfix(loss=f"{out.loss.item():.3f}", loops=loops)
            log_scalars(accelerator, step + 1, out.loss.item(), scheduler.get_last_lr()[0], prefix=f"{run}/",
                        loops=loops, **({} if reg is None else {"jsrr": reg.item()}))
            if (step + 1) % args.log_every == 0 or step + 1 == args.max_steps:
                logger.info(f"[{run}] step {step + 1} lm_loss {out.loss.item():.4f} "
                            f"jsrr {'-' if reg is None else f'{reg.item():.4f}'} loops {loops} "
                            f"({time.time() - t0:.0f}s)", main_process_only=True)
            stop = preemption.requested()
            if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps or stop:
                folder = ckpt.save(step + 1, seconds=time.time() - t0)
                if stop:
                    preemption.exit(folder)
    return accelerator.unwrap_model(model), time.time() - t0


def train_gate(args, accelerator, model, tokenizer, run):
    """Ouro's stage II: the LM frozen, the exit gate alone trained with ``adaptive_gate_loss`` on fresh addition
    batches, every loop of a ``gate_loops``-loop forward (the loop states and their losses computed without
    gradients; the gate's exit probability at loop ``t`` learns whether loop ``t`` still improved the LM loss by more
    than ``gate_gamma``). One process (the gate is a single linear layer: seconds per hundred steps)."""
    if accelerator.num_processes > 1:
        raise ValueError("--gate_stage 2 trains the gate in one process; launch without --num_processes.")
    loops = args.gate_loops or (loop_range(args)[1] if run == "stars" else args.train_loops)
    model.eval()  # the LM is frozen: inference-mode forward, gradients for the gate only
    model.requires_grad_(False)
    gate = model.model.early_exit_gate
    gate.requires_grad_(True)
    optimizer = torch.optim.AdamW(gate.parameters(), lr=args.gate_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed * 1000 + 999)  # not the LM training's data stream
    t0 = time.time()
    for step in range(args.gate_steps):
        ids, labels = addition_batch(args.batch_size, args.digits, g, tokenizer)
        ids, labels = ids.to(model.device), labels.to(model.device)
        targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
        with torch.no_grad():
            states = model.model(ids, total_ut_steps=loops, use_cache=False).loop_hidden_states
            ce = torch.stack([F.cross_entropy(model.lm_head(h).float().transpose(1, 2), targets, reduction="none")
                              for h in states], dim=-1)  # (B, S, T); ignored targets give 0
        gate_logits = gate(torch.stack(states, dim=-2).detach())[..., 0].float()  # (B, S, T)
        loss = adaptive_gate_loss(gate_logits, ce, targets != -100, k=args.gate_k, gamma=args.gate_gamma)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        log_scalars(accelerator, step + 1, loss.item(), args.gate_lr, prefix=f"{run}/gate/", loops=loops)
        if (step + 1) % args.log_every == 0 or step + 1 == args.gate_steps:
            logger.info(f"[{run} stage II] step {step + 1} gate_bce {loss.item():.4f} loops {loops} "
                        f"({time.time() - t0:.0f}s)", main_process_only=True)
    model.requires_grad_(True)
    return model, time.time() - t0


def plot(results, counts, train_loops, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, accs in results.items():
        ax.plot(counts, [100 * accs[str(c)] for c in counts], marker="o", label=run)
    ax.axvline(train_loops, color="gray", ls="--", lw=1, label="training loops")
    ax.set_xlabel("loops at test time")
    ax.set_ylabel("exact match (%)")
    ax.set_title("Addition: exact match vs. test-time loops (Ouro)")
    ax.set_ylim(-2, 102)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def addition_demo(args, accelerator):
    tokenizer = char_tokenizer()
    eval_ids, eval_labels = addition_batch(args.eval_size, args.digits, torch.Generator().manual_seed(EVAL_SEED),
                                           tokenizer)
    counts = eval_loop_counts(args)
    results, seconds = {}, {}
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for run in runs:
        if args.gate_from is not None:
            model, seconds[run] = OuroForCausalLM.from_pretrained(args.gate_from).float().to(accelerator.device), 0.0
        else:
            model, seconds[run] = train_addition(args, accelerator, tokenizer, run)
        if args.gate_stage == 2:
            model, gate_seconds = train_gate(args, accelerator, model, tokenizer, run)
            seconds[run] += gate_seconds
        results[run] = {str(c): exact_match(model, eval_ids, eval_labels, c) for c in counts}
        if accelerator.is_main_process:  # staged: a kill here leaves a folder that does not load, never a mix
            with staged_folder(os.path.join(args.output_dir, run)) as stage:
                model.save_pretrained(stage)
                tokenizer.save_pretrained(stage)
        if run == runs[0]:  # --push_to_hub uploads the first run (STARS by default)
            push_output(args, accelerator, model, os.path.join(args.output_dir, run),
                        description=f"Ouro trained on {args.digits}-digit addition ({run}; recipes/stars_ouro.py).")
    header = "loops      " + "".join(f"{c:>7d}" for c in counts)
    lines = [header] + [f"{run:<11s}" + "".join(f"{100 * accs[str(c)]:7.1f}" for c in counts)
                        for run, accs in results.items()]
    accelerator.print(f"exact match (%) on {args.eval_size} held-out {args.digits}-digit additions, "
                      f"trained with {args.train_loops} loops:\n" + "\n".join(lines))
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        png = os.path.join(args.output_dir, "accuracy_vs_loops.png")
        plot(results, counts, args.train_loops, png + ".tmp.png")
        os.replace(png + ".tmp.png", png)
        write_json(os.path.join(args.output_dir, "metrics.json"),
                   {"exact_match": results, "train_seconds": seconds, "args": args.to_dict()})
        accelerator.print(f"saved {args.output_dir}/accuracy_vs_loops.png, metrics.json and the models "
                          f"{sorted(results)}; load one with AutoModelForCausalLM.from_pretrained("
                          f"{os.path.join(args.output_dir, next(iter(results)))!r}, trust_remote_code=True)")
    return results


# ---------------------------------------------------------------------------------------------------------- fine-tune
def load_chat_dataset(args, tokenizer):
    """Tokenized chat examples with labels on the assistant turn only."""
    from datasets import load_dataset

    ext = os.path.splitext(args.dataset)[1].lstrip(".")
    if os.path.isfile(args.dataset):
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(ext)
        if builder is None:
            raise ValueError(f"--dataset {args.dataset!r}: local files must be .json, .jsonl, .csv or .parquet.")
        data = load_dataset(builder, data_files=args.dataset, split="train")
    else:
        data = load_dataset(args.dataset, split=args.dataset_split)
    if args.max_samples:
        data = data.select(range(min(args.max_samples, len(data))))
    cols = set(data.column_names)
    if "messages" not in cols and not {args.question_column, args.answer_column} <= cols:
        raise ValueError(f"--dataset has columns {sorted(cols)}: expected 'messages' or --question_column="
                         f"{args.question_column!r} and --answer_column={args.answer_column!r}.")
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML

    def encode(example):
        if "messages" in example:
            messages = list(example["messages"])
        else:
            messages = [{"role": "user", "content": example[args.question_column]},
                        {"role": "assistant", "content": example[args.answer_column]}]
        if args.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": args.system_prompt}] + messages
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = tokenizer(full, add_special_tokens=False)["input_ids"][: args.max_seq_length]
        labels = [-100] * min(len(p_ids), len(ids)) + ids[len(p_ids):]
        return {"input_ids": ids, "labels": labels}

    return data.map(encode, remove_columns=data.column_names)


def collate(batch, pad_id):
    """Left padding (as STARS' script)."""
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id)
    labels = torch.full((len(batch), n), -100)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        ids[i, n - k :], labels[i, n - k :], mask[i, n - k :] = (torch.tensor(b["input_ids"]),
                                                                torch.tensor(b["labels"]), 1)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def finetune(args, accelerator):
    import hf_fixedpoint.modeling  # noqa: F401  (model_type "ouro" -> the native OuroForCausalLM)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    if model.config.model_type != "ouro":
        raise ValueError(f"--model {args.model!r} is a {model.config.model_type!r} model; this recipe fine-tunes "
                         "Ouro (model_type 'ouro').")
    freeze_unused_exit_gate(model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    with accelerator.main_process_first():
        data = load_chat_dataset(args, tokenizer)
    loader = torch.utils.data.DataLoader(data, batch_size=args.micro_batch_size, shuffle=True,
                                         collate_fn=lambda b: collate(b, tokenizer.pad_token_id),
                                         generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.finetune_lr, weight_decay=0.0, betas=(0.9, 0.95),
                                  eps=1e-8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    total = max(1, math.ceil(len(loader) / args.gradient_accumulation_steps) * args.epochs)
    scheduler = get_wsd_schedule(optimizer, num_warmup_steps=int(args.warmup_ratio * total),
                                 num_decay_steps=int(args.decay_ratio * total), num_training_steps=total,
                                 min_lr_ratio=args.min_lr_ratio)
    accelerator.register_for_checkpointing(scheduler)

    ckpt = Checkpointer(accelerator, os.path.join(args.output_dir, "checkpoints"), args.save_total_limit)
    record = ckpt.load(args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    step = record["step"] if record else 0
    bar = tqdm(total=total, initial=step, desc="fine-tune", disable=not accelerator.is_local_main_process)
    with Preemption(accelerator) as preemption:
        step = finetune_epochs(args, accelerator, (model, optimizer, loader, scheduler), ckpt, preemption, step,
                               total, bar)
    accelerator.wait_for_everyone()
    final = os.path.join(args.output_dir, "final")
    if accelerator.is_main_process:  # staged: a kill here leaves a folder that does not load, never a mix
        with staged_folder(final) as stage:
            accelerator.unwrap_model(model).config.trained_loops = trained_loops(args, "stars")
            accelerator.unwrap_model(model).save_pretrained(stage)
            tokenizer.save_pretrained(stage)
        accelerator.print(f"saved {final}")
    push_output(args, accelerator, model, final, description=f"Ouro fine-tuned with STARS from {args.model}.")


def finetune_epochs(args, accelerator, prepared, ckpt, preemption, step, total, bar):
    """The fine-tuning loop from optimizer step ``step``: skips the micro-batches already trained on, saves a
    checkpoint every ``save_every`` steps, at the end and on SIGTERM (then exits). Returns the last step."""
    model, optimizer, loader, scheduler = prepared
    stars = regularizer(args)
    draw = sampler(args)
    for epoch in range(args.epochs):
        skip = max(0, step * args.gradient_accumulation_steps - epoch * len(loader))
        if skip >= len(loader):
            continue
        micro = skip
        for batch in epoch_loader(accelerator, loader, epoch, skip):
            # one loop count per micro-batch, the same on every rank
            loops = draw(epoch * len(loader) + micro)
            micro += 1
            with accelerator.accumulate(model):
                out = model(**batch, total_ut_steps=loops, use_cache=False)
                loss, reg = stars(accelerator.unwrap_model(model), out, step)
                accelerator.backward(loss)
                optimizer.step()  # a no-op until the last micro-batch of the accumulation
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                scheduler.step()
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{out.loss.item():.3f}", loops=loops)
                log_scalars(accelerator, step, out.loss.item(), scheduler.get_last_lr()[0], loops=loops,
                            **({} if reg is None else {"jsrr": reg.item()}))
                logger.info(f"step {step} lm_loss {out.loss.item():.4f} "
                            f"jsrr {'-' if reg is None else f'{reg.item():.4f}'} loops {loops} "
                            f"lr {scheduler.get_last_lr()[0]:.2e}", main_process_only=True)
                stop = preemption.requested()
                if step % args.save_every == 0 or step == total or stop:
                    folder = ckpt.save(step)
                    if stop:
                        preemption.exit(folder)
    return step


def main(argv=None):
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(args=argv)  # unknown flags are errors
    check_args(args)
    accumulate = args.gradient_accumulation_steps if args.model is not None else 1
    # The seedable sampler makes each epoch's shuffle a function of (seed, epoch): a run resumed in a later epoch sees
    # the batches the interrupted one would have seen.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accumulate,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                        data_seed=args.seed), **tracking(args))
    check_engine(args, accelerator)
    start_run(accelerator, args)
    if args.model is None:
        addition_demo(args, accelerator)
    else:
        finetune(args, accelerator)
    end_tracking(accelerator)


if __name__ == "__main__":
    import logging

    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    main()
