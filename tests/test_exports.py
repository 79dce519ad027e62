"""Exports as a Hugging Face user meets them: one tiny export per family (and per head), loaded in a fresh process that
has torch and transformers but cannot import hf_fixedpoint, with the everyday calls -- the ``pipeline`` of every task
the family serves, ``AutoModel`` and every sibling head from a head's export, ``device_map="auto"``.

One child process checks every family (a process start costs more than all the checks); each family's test reads its
part of the child's report and compares it with the same calls made here with the package imported.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import BertTokenizer, pipeline

from hf_fixedpoint import hub
from hf_fixedpoint.modeling import FAMILIES
from tests.helpers import family_tester, train_bpe_tokenizer

LM_FAMILIES = ("attractor_lm", "deq_lm", "ouro", "self_llama", "self_mistral")
PUZZLE_FAMILIES = ("fprm", "trm", "urm")
PROMPTS = ["the cat sat", "on the mat the"]
BERT_WORDS = ["the", "a", "cat", "sat", "on", "mat", "paris", "is", "in", "france", "where", "dog", "capital", "of"]
BERT_TASKS = {  # task -> (Auto class, pipeline inputs, pipeline keyword arguments)
    "text-classification": ("AutoModelForSequenceClassification", ["the cat sat on the mat", "a dog"], {}),
    "feature-extraction": ("AutoModel", ["the cat sat"], {}),
    "token-classification": ("AutoModelForTokenClassification", ["the cat sat in paris"], {}),
    "fill-mask": ("AutoModelForMaskedLM", ["the cat [MASK] on the mat"], {"top_k": 2}),
}
# transformers 5 removed the question-answering pipeline: the QA export is checked by its span logits.
QUESTION = ("where is the cat", "the cat sat on the mat in paris")

CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys, traceback

    class Block(importlib.abc.MetaPathFinder):  # a Hub user does not have the library (nor its bare folders)
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("hf_fixedpoint", "modeling", "tests"):
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, Block())
    import torch, transformers
    from transformers import pipeline

    def run(check):
        kind = check["kind"]
        if kind == "pipeline":
            pipe = pipeline(check["task"], model=check["dir"], trust_remote_code=True)
            return {"class": type(pipe.model).__name__, "module": type(pipe.model).__module__,
                    "output": pipe(check["inputs"], **check["kwargs"])}
        if kind == "auto":
            model = getattr(transformers, check["auto"]).from_pretrained(check["dir"], trust_remote_code=True)
            return {"class": type(model).__name__, "module": type(model).__module__}
        if kind == "device_map":
            model = getattr(transformers, check["auto"]).from_pretrained(check["dir"], trust_remote_code=True,
                                                                         device_map="auto").eval()
            io = torch.load(check["io"])
            with torch.no_grad():
                out = model(**io["inputs"])
            diffs = {k: (out[k] - v).abs().max().item() for k, v in io["outputs"].items()}
            return {"class": type(model).__name__, "device": str(next(model.parameters()).device), "diffs": diffs}
        raise ValueError(kind)

    checks = json.load(open(sys.argv[1]))
    report = {}
    for family, items in checks.items():
        report[family] = []
        for check in items:
            try:
                report[family].append({"ok": True, **run(check)})
            except Exception as err:  # the traceback's end and the message (some list every known config class)
                where = "".join(traceback.format_tb(err.__traceback__)[-2:])
                report[family].append({"ok": False, "error": f"{where}{type(err).__name__}: {str(err)[:800]}"})
    report["_library_loaded"] = sorted(m for m in sys.modules if m.partition(".")[0] == "hf_fixedpoint")
    json.dump(report, open(sys.argv[2], "w"), default=float)
    """
)


def plain(value):
    """Pipeline output as JSON data (numpy scalars and arrays, tensors -> lists and floats)."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else float(v)))


def assert_same(got, want, path="output"):
    """Equal structure, equal strings and integers, floats within 1e-5 (the same code and weights on one CPU)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: {got} != {want}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5), f"{path}: {got} != {want}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def bert_tokenizer():
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]
    return BertTokenizer(vocab={w: i for i, w in enumerate(words)})


def save(model, folder, processor=None):
    hub.export(model.eval(), folder)
    if processor is not None:
        processor.save_pretrained(folder)
    return str(folder)


def io_file(model, inputs, folder):
    """Inputs and tensor outputs of ``model`` for the ``device_map="auto"`` check."""
    with torch.no_grad():
        out = model(**inputs)
    path = os.path.join(folder, "io.pt")
    torch.save({"inputs": inputs, "outputs": {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}}, path)
    return path


def sibling_checks(config_class, folder):
    """``AutoModel`` and every head of the family, each loaded from one head's export."""
    return [{"kind": "auto", "auto": auto, "dir": folder, "expect": ref.rpartition(".")[2]}
            for auto, ref in config_class.family_auto_map.items() if auto != "AutoConfig"]


def lm_checks(config_class, models, root):
    tok = train_bpe_tokenizer(PROMPTS * 4, vocab_size=300)
    tester = family_tester(config_class)
    lm_class = dict((a.__name__, m) for a, m in models)["AutoModelForCausalLM"]
    model = lm_class(tester.get_config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                       eos_token_id=tok.eos_token_id)).eval()
    folder = save(model, root / "lm", tok)
    assert (root / "lm" / "generation_config.json").is_file()  # the special tokens generate needs
    kwargs = {"max_new_tokens": 4, "do_sample": False}
    want = plain(pipeline("text-generation", model=model, tokenizer=tok)(PROMPTS, **kwargs))
    checks = [{"kind": "pipeline", "task": "text-generation", "dir": folder, "inputs": PROMPTS, "kwargs": kwargs,
               "want": want, "expect": lm_class.__name__}]
    ids = tok(PROMPTS[:1], return_tensors="pt")["input_ids"]
    device = {"kind": "device_map", "auto": "AutoModelForCausalLM", "dir": folder,
              "io": io_file(model, {"input_ids": ids}, root), "expect": lm_class.__name__}
    return checks + sibling_checks(config_class, folder) + [device]


def bert_checks(config_class, models, root):
    tok = bert_tokenizer()
    tester = family_tester(config_class)
    by_auto = {a.__name__: m for a, m in models}
    labels = {"id2label": {0: "negative", 1: "positive"}, "label2id": {"negative": 0, "positive": 1}}
    checks, folders = [], {}
    for task, (auto, inputs, kwargs) in BERT_TASKS.items():
        torch.manual_seed(0)
        config = tester.get_config(vocab_size=len(tok), **(labels if task == "text-classification" else {}))
        model = by_auto[auto](config).eval()
        folders[task] = folder = save(model, root / task, tok)
        want = plain(pipeline(task, model=model, tokenizer=tok)(inputs, **kwargs))
        checks.append({"kind": "pipeline", "task": task, "dir": folder, "inputs": inputs, "kwargs": kwargs,
                       "want": want, "expect": by_auto[auto].__name__})
        if task == "text-classification":
            enc = dict(tok(inputs, padding=True, return_tensors="pt"))
            checks.append({"kind": "device_map", "auto": auto, "dir": folder, "io": io_file(model, enc, root / task),
                           "expect": by_auto[auto].__name__})
    qa = by_auto["AutoModelForQuestionAnswering"](tester.get_config(vocab_size=len(tok))).eval()
    folder = save(qa, root / "question-answering", tok)
    checks.append({"kind": "device_map", "auto": "AutoModelForQuestionAnswering", "dir": folder,
                   "io": io_file(qa, dict(tok(*QUESTION, return_tensors="pt")), root / "question-answering"),
                   "expect": type(qa).__name__})
    return checks + sibling_checks(config_class, folders["text-classification"])


def vit_checks(config_class, models, root):
    from PIL import Image

    from recipes.fpsa_vit import image_collate, image_processor

    torch.manual_seed(0)
    config = config_class(image_size=8, patch_size=2, num_channels=3, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=37, num_labels=10,
                          id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)})
    model = models[-1][1](config).eval()
    processor = image_processor(config)
    folder = save(model, root / "vit", processor)
    pixels = np.random.default_rng(0).integers(0, 256, (4, 8, 8), dtype=np.uint8)
    images = []
    for i, p in enumerate(pixels):
        images.append(str(root / f"digit_{i}.png"))
        Image.fromarray(p, mode="L").save(images[-1])
    # What the recipe evaluates: its own collate on the same pixels scaled to [0, 1].
    batch = image_collate(8, 3)([(torch.tensor(p, dtype=torch.float32)[None] / 255, torch.tensor(0)) for p in pixels])
    with torch.no_grad():
        probs = model(pixel_values=batch["pixel_values"]).logits.softmax(-1)
    want = [[{"label": str(int(p.argmax())), "score": float(p.max())}] for p in probs]
    checks = [{"kind": "pipeline", "task": "image-classification", "dir": folder, "inputs": images,
               "kwargs": {"top_k": 1}, "want": want, "expect": type(model).__name__},
              {"kind": "pipeline", "task": "image-feature-extraction", "dir": folder, "inputs": images[:1],
               "kwargs": {}, "want": plain(pipeline("image-feature-extraction", image_processor=processor,
                                                    model=models[0][1].from_pretrained(folder).eval())(images[:1])),
               "expect": models[0][1].__name__},
              {"kind": "device_map", "auto": "AutoModelForImageClassification", "dir": folder,
               "io": io_file(model, {"pixel_values": batch["pixel_values"]}, root), "expect": type(model).__name__}]
    return checks + sibling_checks(config_class, folder)


def puzzle_checks(config_class, models, root):
    tester = family_tester(config_class)
    head = models[-1][1]
    model = head(tester.get_config()).eval()
    folder = save(model, root / "puzzle")
    device = {"kind": "device_map", "auto": "AutoModelForTokenClassification", "dir": folder,
              "io": io_file(model, tester.prepare_inputs(model.config), root), "expect": head.__name__}
    return sibling_checks(config_class, folder) + [device]


def family_checks(config_class, models, root):
    family = config_class.model_type
    root.mkdir()
    if family in LM_FAMILIES:
        return lm_checks(config_class, models, root)
    if family == "fpsa_bert":
        return bert_checks(config_class, models, root)
    if family == "fpsa_vit":
        return vit_checks(config_class, models, root)
    if family in PUZZLE_FAMILIES:
        return puzzle_checks(config_class, models, root)
    raise AssertionError(f"no export checks for the family {family!r}: add them here")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    checks = {config_class.model_type: family_checks(config_class, models, root / config_class.model_type)
              for config_class, models in FAMILIES}
    (root / "checks.json").write_text(json.dumps(checks))
    (root / "child.py").write_text(CHILD)
    (root / "cwd").mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(root / "modules"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(root / "child.py"), str(root / "checks.json"), str(root / "out.json")],
                          cwd=root / "cwd", env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((root / "out.json").read_text())
    assert result.pop("_library_loaded") == []
    return {family: list(zip(checks[family], result[family])) for family in checks}


@pytest.mark.parametrize("family", [config_class.model_type for config_class, _ in FAMILIES])
def test_export_works_without_the_library(report, family):
    for check, got in report[family]:
        what = f"{check['kind']} {check.get('task') or check.get('auto')}"
        assert got["ok"], f"{what}: {got['error']}"
        assert got["class"] == check["expect"], what
        if check["kind"] == "pipeline":
            assert got["module"].startswith("transformers_modules."), got["module"]  # the export's own code ran
            if check["want"] is not None:
                assert_same(got["output"], check["want"])
        if check["kind"] == "device_map":
            assert got["device"] == "cpu" and max(got["diffs"].values()) <= 1e-5, got


def test_complete_auto_map_keeps_entries_and_the_hub_prefix():
    from hf_fixedpoint.core.fp_registry import complete_auto_map

    family = {"AutoConfig": "configuration_x.XConfig", "AutoModel": "modeling_x.XModel",
              "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    assert complete_auto_map(None, family) == family
    # A config read from the Hub: transformers prefixed its entries with the repository; added ones get the prefix.
    hub_map = {"AutoConfig": "me/x--configuration_x.XConfig", "AutoModelForCausalLM": "me/x--modeling_x.Custom"}
    assert complete_auto_map(hub_map, family) == {**hub_map, "AutoModel": "me/x--modeling_x.XModel"}
