"""hf_fixedpoint.hub: export (merge LoRA, fold parametrizations), verify_self_contained, model cards, push_to_hub.

The round trip that matters runs in a fresh process where hf_fixedpoint cannot be imported: the checkpoint must load
with torch + transformers and ``trust_remote_code=True`` alone.
"""

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest.mock import MagicMock, patch

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import OfflineModeIsEnabled
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_fixedpoint import hub
from hf_fixedpoint.modeling import DEQLMConfig, DEQLMForCausalLM

FAMILY_DIR = Path(inspect.getfile(DEQLMForCausalLM)).parent
VENDORED = sorted(p.name for p in FAMILY_DIR.glob("fp_*.py"))
EVAL_RESULT = {"task_type": "text-generation", "dataset_type": "wikitext", "dataset_name": "WikiText-2",
               "metric_type": "perplexity", "metric_value": 12.3, "dataset_split": "test"}


def tiny_model(**fp):
    """Tiny DEQ-LM. Tests that compare different weight layouts (merged vs. adapter, folded vs. parametrized) pass a
    tight tolerance so the solves converge and rounding differences cannot change where the solver stops."""
    config = DEQLMConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                         **{"fp_max_iter": 20, **fp})
    return DEQLMForCausalLM(config)


CONVERGED = {"fp_max_iter": 40, "fp_tol": 1e-6}


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    return hub.export(tiny_model(), tmp_path_factory.mktemp("saved") / "ckpt")


CHILD = textwrap.dedent(
    """
    import json, sys

    class BlockHFFixedpoint:  # the checkpoint must not need the library (or its bare `modeling` folder)
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("hf_fixedpoint", "modeling"):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, BlockHFFixedpoint())
    try:
        import hf_fixedpoint  # noqa: F401
        sys.exit("the import blocker does not work")
    except ImportError:
        pass

    import torch
    from transformers import AutoModelForCausalLM

    ckpt, io_file, result_file = sys.argv[1:]
    io = torch.load(io_file)
    model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    with torch.no_grad():
        max_diff = (model(input_ids=io["input_ids"]).logits - io["logits"]).abs().max().item()
    model.train()
    model(input_ids=io["input_ids"], labels=io["input_ids"]).loss.backward()
    grad = model.model.block.attn.q_proj.weight.grad
    json.dump({"module": type(model).__module__, "max_diff": max_diff, "grad_norm": grad.norm().item(),
               "library_loaded": sorted(m for m in sys.modules if m.partition(".")[0] == "hf_fixedpoint")},
              open(result_file, "w"))
    """
)


def test_export_loads_in_fresh_process_without_hf_fixedpoint(tmp_path):
    model = tiny_model().eval()
    ids = torch.randint(0, 99, (2, 7))
    ckpt = hub.export(model, tmp_path / "ckpt")
    torch.save({"input_ids": ids, "logits": logits(model, ids)}, tmp_path / "io.pt")
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "cwd").mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(ckpt), str(tmp_path / "io.pt"),
                           str(tmp_path / "result.json")], cwd=tmp_path / "cwd", env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["module"].startswith("transformers_modules."), result["module"]
    assert result["library_loaded"] == []
    assert result["max_diff"] <= 1e-6
    assert 0 < result["grad_norm"] < float("inf")


def test_import_hub_does_not_import_peft():
    code = "import sys, hf_fixedpoint.hub; assert 'peft' not in sys.modules, 'peft imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_export_merges_lora(tmp_path):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model(**CONVERGED),
                                LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    ids = torch.randint(0, 99, (2, 7))
    expected = logits(peft_model, ids)
    with peft_model.disable_adapter():
        assert not torch.allclose(logits(peft_model, ids), expected, atol=1e-3)  # the adapter does something

    ckpt = hub.export(peft_model, tmp_path / "merged")
    assert not [f for f in os.listdir(ckpt) if f.startswith("adapter_")]
    assert not [k for k in load_file(ckpt / "model.safetensors") if "lora_" in k or "base_layer" in k]
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["DEQLMForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    assert type(reloaded) is DEQLMForCausalLM
    torch.testing.assert_close(logits(reloaded, ids), expected, atol=1e-5, rtol=0)


def test_export_refuses_unmerged_peft_model(tmp_path):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model(), LoraConfig(target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="PEFT wrapper"):
        hub.export(peft_model, tmp_path / "out", merge_lora=False)
    assert not (tmp_path / "out").exists()


def test_export_folds_parametrizations(tmp_path):
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import spectral_norm

    model = tiny_model(**CONVERGED)
    up_proj = spectral_norm(model.model.block.mlp.up_proj)
    ids = torch.randint(0, 99, (2, 7))
    expected = logits(model.eval(), ids)
    model.train()  # in train mode every weight access would run another power iteration; export folds the eval weight

    ckpt = hub.export(model, tmp_path / "folded")
    assert not parametrize.is_parametrized(up_proj) and model.training
    keys = load_file(ckpt / "model.safetensors")
    assert "model.block.mlp.up_proj.weight" in keys
    assert not [k for k in keys if "parametrizations." in k]
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    torch.testing.assert_close(logits(reloaded, ids), expected, atol=1e-5, rtol=0)


def test_export_refuses_unfolded_parametrizations(tmp_path):
    from torch.nn.utils.parametrizations import spectral_norm

    model = tiny_model()
    spectral_norm(model.model.block.mlp.up_proj)
    with pytest.raises(ValueError, match=r"parametrizations\.weight\.original"):
        hub.export(model, tmp_path / "out", fold_parametrizations=False)


def test_verify_rejects_solver_missing_from_vendored_registry():
    from hf_fixedpoint.modeling.deq_lm.fp_solvers import SOLVERS

    model = tiny_model()
    with pytest.raises(ValueError, match="fp_solver='newton' is not a known solver"):
        model.config.fp_solver = "newton"  # an assignment is checked
    model.config.__dict__["fp_solver"] = "newton"  # bypasses the config's own validation
    with pytest.raises(ValueError, match="fp_solver='newton'") as info:
        hub.verify_self_contained(model)
    assert all(repr(name) in str(info.value) for name in SOLVERS.names())
    assert "fp_solvers.py" in str(info.value)


def test_verify_rejects_solver_registered_at_run_time():
    from hf_fixedpoint.modeling.deq_lm.fp_backward import BACKWARDS

    BACKWARDS.register("my_backward", lambda *a, **k: None)  # lives in this process only
    try:
        model = tiny_model()
        model.config.fp_backward = "my_backward"
        with pytest.raises(ValueError, match="registered at run time"):
            hub.verify_self_contained(model)
    finally:
        BACKWARDS._items.pop("my_backward")


def test_verify_rejects_unregistered_model_class():
    model = tiny_model()
    with patch.object(DEQLMForCausalLM, "_auto_class", None):
        with pytest.raises(ValueError, match="register_for_auto_class"):
            hub.verify_self_contained(model)


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing_sibling", r"fp_solvers\.py is missing \(needed by [^)]*fp_settings\.py"),
        ("missing_modeling_file", r"modeling_deq_lm\.py is missing \(needed by config\.json auto_map"),
        ("no_auto_map", "config.json has no auto_map"),
        ("imports_library", "modeling_deq_lm.py imports hf_fixedpoint"),
        ("adapter_file", "adapter_config.json is present"),
    ],
)
def test_verify_rejects_broken_folder(saved_dir, tmp_path, case, match):
    hub.verify_self_contained(saved_dir)  # the intact folder passes
    folder = Path(shutil.copytree(saved_dir, tmp_path / "ckpt"))
    if case == "missing_sibling":
        (folder / "fp_solvers.py").unlink()
    elif case == "missing_modeling_file":
        (folder / "modeling_deq_lm.py").unlink()
    elif case == "no_auto_map":
        config = json.loads((folder / "config.json").read_text())
        del config["auto_map"]
        (folder / "config.json").write_text(json.dumps(config))
    elif case == "imports_library":
        with open(folder / "modeling_deq_lm.py", "a") as f:
            f.write("\nfrom hf_fixedpoint.core import SOLVERS\n")
    elif case == "adapter_file":
        (folder / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=match):
        hub.verify_self_contained(folder)


def test_model_card():
    card = hub.model_card(tiny_model(), model_id="user/deq-lm-tiny", datasets=["wikitext"],
                          eval_results=[EVAL_RESULT], description="A tiny DEQ-LM.")
    data = card.data
    assert data.tags == ["hf-fixedpoint", "fixed-point", "custom_code", "deq_lm"]
    assert (data.library_name, data.pipeline_tag, data.license) == ("transformers", "text-generation", "apache-2.0")
    assert data.eval_results[0].metric_value == 12.3
    assert "model-index:" in str(card)
    assert 'AutoModelForCausalLM.from_pretrained("user/deq-lm-tiny", trust_remote_code=True)' in card.text
    assert '| `fp_solver` | `"anderson"` |' in card.text and "| `fp_max_iter` | `20` |" in card.text


SUPPORT = {"date": "2026-11-25", "saved_with": "5.23.0", "torch": "2.13.0", "releases": [
    {"transformers": "4.57.6", "newest": False, "ok": 1, "total": 2,
     "families": {"deq_lm": "ok", "fpsa_vit": "refused: FPSA-ViT needs transformers>=5.12 (x is missing)"}},
    {"transformers": "5.24.0", "newest": True, "ok": 1, "total": 2,
     "families": {"deq_lm": "ok", "fpsa_vit": "failed: FPSAViTModel: forward: TypeError"}}]}


def test_support_table_from_the_measured_file():
    table = hub.support_table(SUPPORT)
    assert "| family | 4.57.6 | 5.24.0 (newest) |" in table
    assert "| `fpsa_vit` | no: refuses at load, needs >= 5.12 | **fails** |" in table
    assert "| classes that load and match | 1 / 2 | 1 / 2 |" in table
    assert hub.support_table(SUPPORT, family="deq_lm").splitlines()[2:] == ["| 4.57.6 | yes |",
                                                                             "| 5.24.0 (newest) | yes |"]


def test_model_card_carries_the_family_support_table(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "SUPPORT_FILE", tmp_path / "compat_support.json")
    assert "## transformers releases" not in hub.model_card(tiny_model(), model_id="u/m").text
    (tmp_path / "compat_support.json").write_text(json.dumps(SUPPORT))
    text = hub.model_card(tiny_model(), model_id="u/m").text
    assert "## transformers releases" in text and "| 5.24.0 (newest) | yes |" in text


def test_push_to_hub_uploads_self_contained_folder():
    model = tiny_model()
    card = hub.model_card(model, model_id="user/deq-lm-tiny", eval_results=[EVAL_RESULT])
    uploaded = {}

    def fake_upload(**kwargs):
        folder = Path(kwargs["folder_path"])
        uploaded.update(kwargs, files=sorted(os.listdir(folder)), readme=(folder / "README.md").read_text())
        return "commit-info"

    with patch.object(HfApi, "create_repo", return_value=MagicMock(repo_id="user/deq-lm-tiny")) as create_repo, \
            patch.object(HfApi, "upload_folder", side_effect=fake_upload):
        out = hub.push_to_hub(model, "user/deq-lm-tiny", model_card=card, private=True, commit_message="msg")

    assert out == "commit-info"
    create_repo.assert_called_once_with("user/deq-lm-tiny", private=True, exist_ok=True)
    assert (uploaded["repo_id"], uploaded["commit_message"]) == ("user/deq-lm-tiny", "msg")
    expected = {"config.json", "model.safetensors", "README.md", "configuration_deq_lm.py", "modeling_deq_lm.py",
                *VENDORED}
    assert expected <= set(uploaded["files"]), uploaded["files"]
    readme = ModelCard(uploaded["readme"])
    assert {"hf-fixedpoint", "fixed-point", "custom_code", "deq_lm"} <= set(readme.data.tags)
    assert readme.data.eval_results[0].metric_type == "perplexity"
    assert "model-index:" in uploaded["readme"]


def test_push_to_hub_of_an_export_folder_leaves_the_training_state_out(saved_dir, tmp_path):
    """A recipe's output_dir: the export plus resumable checkpoints (optimizer, RNG) and maybe a half-written stage."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(shutil.copytree(saved_dir, tmp_path / "run"))
    for name in ("checkpoints/step_4/optimizer.bin", "checkpoints/step_4/model.safetensors", ".staging/config.json",
                 "step_2/optimizer.bin", ".step_3.tmp/model.safetensors"):  # the FPSA recipes' step_<n> at the top
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    (folder / "metrics.json").write_text("{}")
    sent = {}
    with patch.object(HfApi, "create_repo", return_value=MagicMock(repo_id="user/run")), \
            patch.object(HfApi, "upload_folder", side_effect=lambda **kw: sent.update(kw)):
        hub.push_to_hub(folder, "user/run")
    files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    uploaded = set(filter_repo_objects(files, ignore_patterns=sent["ignore_patterns"]))  # what upload_folder keeps
    assert uploaded == set(os.listdir(saved_dir)) | {"metrics.json"}
    with pytest.raises(ValueError, match="tokenizer= and model_card= are for a model being exported"):
        hub.push_to_hub(folder, "user/run", model_card="# card")


def test_push_to_hub_offline_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OfflineModeIsEnabled, match="HF_HUB_OFFLINE") as info:
        hub.push_to_hub(tiny_model(), "user/deq-lm-tiny")
    assert "hub.export" in str(info.value)
