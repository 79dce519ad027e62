"""The flags every recipe shares (``hf_fixedpoint/recipe_args.py``, ``docs/recipes.md``): ``--report_to tensorboard``
writes the loss, learning rate and fixed-point statistics as scalars; ``--push_to_hub`` uploads the export through
``hf_fixedpoint.hub`` (the Hub API mocked at the HTTP boundary, as in ``tests/test_hub.py``); bad values fail before
any work."""

import importlib
import json
import os
from pathlib import Path
from unittest.mock import MagicMock, patch

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.utils import filter_repo_objects

from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
from hf_fixedpoint.core.fp_stats import FixedPointStats
from hf_fixedpoint.recipe_args import RecipeArgs, fp_scalars, report_trackers
from tests.helpers import run_recipe, scalar_names
from tests.recipes.test_self_lora import tiny_llama  # noqa: F401  (fixture)

RECIPES = {"stars_ouro": "Args", "train_deq_lm": "Args", "attractor_lm": "Args", "reasoning": "Args",
           "fpsa_vit": "ViTArgs", "fpsa_glue": "GlueArgs", "fpsa_squad": "SquadArgs", "self_lora": "SelfLoraArgs"}
FP_SCALARS = {"fp/iter_mean", "fp/iter_p90", "fp/cap_hit_rate"}


def test_every_recipe_takes_the_common_flags():
    assert sorted(RECIPES) == sorted(p.stem for p in Path("recipes").glob("*.py") if p.stem != "__init__")
    for module, args_class in RECIPES.items():
        assert issubclass(getattr(importlib.import_module(f"recipes.{module}"), args_class), RecipeArgs), module


def _tiny_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(Path(json.__file__).read_text() * 3)
    return str(path)


# (recipe, its tiny settings, the export folder relative to output_dir, the scalars it must log)
RUNS = {
    "train_deq_lm": (lambda tmp: ["--max_steps", 2, "--batch_size", 2, "--seq_length", 16, "--hidden_size", 16,
                                  "--fp_max_iter", 4], ".", {"train/loss", "train/lr", *FP_SCALARS}),
    "stars_ouro": (lambda tmp: ["--max_steps", 2, "--reg_warmup_steps", 1, "--batch_size", 8, "--hidden_size", 16,
                                "--eval_size", 8, "--eval_loops", "1,2"], "stars",
                   {f"{run}/train/{k}" for run in ("stars", "baseline") for k in ("loss", "lr", "loops")}
                   | {"stars/train/jsrr"}),
    "attractor_lm": (lambda tmp: ["--corpus", _tiny_corpus(tmp), "--max_steps", 2, "--batch_size", 2,
                                  "--seq_length", 32, "--hidden_size", 32, "--vocab_size", 300, "--eval_batches", 1,
                                  "--fp_max_iter", 4], ".", {"train/loss", "train/lr", *FP_SCALARS}),
    "reasoning": (lambda tmp: ["--model", "fprm", "--task", "a5", "--task_kwargs", '{"num_samples": 16, "length": 4}',
                               "--test_task_kwargs", '{"num_samples": 8, "length": 4}', "--batch_size", 4,
                               "--eval_batch_size", 8, "--hidden_size", 16, "--num_attention_heads", 2,
                               "--halt_max_steps", 2, "--warmup_steps", 1, "--num_layers", 1, "--max_steps", 2,
                               "--eval_every", 2, "--model_kwargs", '{"fp_max_iter": 3, "mlp_multiple_of": 8}'],
                  ".", {"train/loss", "train/lr", *FP_SCALARS}),
    # the FPSA recipes (fpsa_glue, fpsa_squad, self_lora too) share this path: hf_fixedpoint.fpsa_training
    "fpsa_vit": (lambda tmp: ["--max_steps", 2, "--logging_steps", 1, "--fp_max_iter", 3,
                              "--per_device_train_batch_size", 8, "--hidden_size", 16, "--num_attention_heads", 2,
                              "--num_hidden_layers", 1], ".", {"train/loss", "train/lr", *FP_SCALARS}),
}


@pytest.mark.parametrize("recipe", sorted(RUNS))
def test_report_to_tensorboard_and_push_to_hub(recipe, tmp_path, monkeypatch):
    """One tiny run per training loop: TensorBoard event files under output_dir/logs with the loss, learning rate
    and fixed-point statistics; the export uploaded with a model card and without the training state."""
    tiny, folder, scalars = RUNS[recipe]
    out = tmp_path / "run"
    sent = {}

    def fake_upload(**kwargs):
        root = Path(kwargs["folder_path"])
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
        sent.update(kwargs, files=set(filter_repo_objects(files, ignore_patterns=kwargs["ignore_patterns"])),
                    readme=(root / "README.md").read_text())
        return MagicMock(commit_url="https://huggingface.co/user/tiny/commit/0")

    module = importlib.import_module(f"recipes.{recipe}")
    with patch.object(HfApi, "create_repo", return_value=MagicMock(repo_id="user/tiny")) as create_repo, \
            patch.object(HfApi, "upload_folder", side_effect=fake_upload):
        run_recipe(monkeypatch, module, "--output_dir", out, *tiny(tmp_path), "--report_to", "tensorboard",
                   "--push_to_hub", "--hub_model_id", "user/tiny", "--hub_private_repo", "true", "--hub_token", "t0k")
    assert scalars <= scalar_names(out / "logs"), scalar_names(out / "logs")
    create_repo.assert_called_once_with("user/tiny", private=True, exist_ok=True)
    assert sent["folder_path"] == out / folder and sent["repo_id"] == "user/tiny"
    assert {"config.json", "model.safetensors", "README.md"} <= sent["files"]
    assert any(f.startswith("modeling_") for f in sent["files"]), sent["files"]
    assert not any(f.startswith(("checkpoints/", "step_")) for f in sent["files"]), sent["files"]
    card = ModelCard(sent["readme"])
    assert {"hf-fixedpoint", "custom_code"} <= set(card.data.tags) and card.data.model_name == "user/tiny"
    assert "t0k" not in (out / folder / "README.md").read_text()


def test_hub_model_id_defaults_to_the_output_dir_name(tmp_path, monkeypatch):
    from recipes import train_deq_lm

    with patch.object(HfApi, "create_repo", return_value=MagicMock(repo_id="user/deq")) as create_repo, \
            patch.object(HfApi, "upload_folder", return_value=MagicMock(commit_url=None)):
        run_recipe(monkeypatch, train_deq_lm, "--output_dir", tmp_path / "deq", "--max_steps", 1, "--batch_size", 2,
                   "--seq_length", 16, "--hidden_size", 16, "--fp_max_iter", 2, "--push_to_hub")
    create_repo.assert_called_once_with("deq", private=None, exist_ok=True)
    assert not (tmp_path / "deq" / "logs").exists()  # no --report_to: no trackers


@pytest.mark.parametrize("flags, message", [
    (dict(report_to="tensorbord"), "--report_to='tensorbord': 'tensorbord' is not a tracker; allowed values"),
    (dict(report_to="tensorboard,wandb"), None),  # accepted only where wandb is installed
    (dict(hub_model_id="user/x"), "--hub_model_id is set but --push_to_hub is not"),
])
def test_bad_common_flags(flags, message):
    if message is None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            with pytest.raises(ValueError, match="the 'wandb' tracker is not installed"):
                RecipeArgs(**flags)
            return
        pytest.skip("wandb is installed")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        RecipeArgs(**flags)


def test_report_to_names():
    assert report_trackers(RecipeArgs()) == [] and report_trackers(RecipeArgs(report_to="none")) == []
    assert report_trackers(RecipeArgs(report_to=" TensorBoard ")) == ["tensorboard"]
    assert "tensorboard" in report_trackers(RecipeArgs(report_to="all"))
    assert RecipeArgs(hub_token="secret").to_dict()["hub_token"] == "<HUB_TOKEN>"


def test_fp_scalars_of_solver_and_fpsa_stats():
    # two solves (e.g. two layers): 8 entries, the two at the cap (8) unconverged
    solves = [FixedPointStats(nstep=torch.tensor(n), residual=torch.zeros(4), converged=torch.tensor(c), nfe=8,
                              solver="anderson", tol=1e-3, stop_mode="rel")
              for n, c in (([1, 2, 3, 4], [True] * 4), ([5, 6, 8, 8], [True, True, False, False]))]
    assert fp_scalars(solves) == {"fp/iter_mean": 4.625, "fp/iter_p90": 8.0,
                                  "fp/cap_hit_rate": 0.25}
    assert fp_scalars(None) == {} and fp_scalars([]) == {}
    stats = FPSAStats(max_iter=4)
    assert fp_scalars(stats) == {}
    stats.iterations_per_layer.append(torch.tensor([[[1, 3], [3, 4]]]))  # (B, T, H) of one layer; 4 is the cap
    stats.converged_per_layer.append(torch.tensor([[[True, True], [True, False]]]))
    summary = stats.summary()
    assert fp_scalars(stats) == {"fp/iter_mean": summary["fpsa_iter_mean"], "fp/iter_p90": summary["fpsa_iter_p90"],
                                 "fp/cap_hit_rate": summary["fpsa_cap_hit_rate"]}
    assert fp_scalars(stats)["fp/iter_mean"] == 2.75 and fp_scalars(stats)["fp/cap_hit_rate"] == 0.25


def test_no_hub_token_in_logs_or_metrics(tmp_path, monkeypatch, capsys):
    from recipes import stars_ouro

    run_recipe_args = ["--output_dir", tmp_path / "s", "--max_steps", 1, "--batch_size", 4, "--hidden_size", 16,
                       "--eval_size", 4, "--eval_loops", "1", "--runs", "baseline", "--hub_token", "s3cret"]
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    stars_ouro.main([str(a) for a in run_recipe_args])
    assert "s3cret" not in capsys.readouterr().out
    assert "s3cret" not in (tmp_path / "s" / "metrics.json").read_text()
    assert os.path.isdir(tmp_path / "s" / "baseline")


def test_self_lora_pushes_the_merged_export(tiny_llama, tmp_path):  # noqa: F811
    """The LoRA recipe's output_dir also holds the adapter (adapter/): the upload is the merged model at the root."""
    from tests.recipes.test_self_lora import run, small

    sent = {}

    def fake_upload(**kwargs):
        root = Path(kwargs["folder_path"])
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
        sent.update(files=set(filter_repo_objects(files, ignore_patterns=kwargs["ignore_patterns"])))
        return MagicMock(commit_url=None)

    with patch.object(HfApi, "create_repo", return_value=MagicMock(repo_id="user/self")), \
            patch.object(HfApi, "upload_folder", side_effect=fake_upload):
        run(small(tmp_path / "out", tiny_llama, steps=1, extra=["--push_to_hub", "--hub_model_id", "user/self",
                                                                "--report_to", "tensorboard"]))
    assert {"config.json", "model.safetensors", "README.md", "adapter/adapter_config.json"} <= sent["files"]
    assert "adapter_config.json" not in sent["files"]  # the root loads as a full model, not as an adapter
    assert not any(f.startswith("step_") for f in sent["files"])  # the FPSA recipes' checkpoints stay local
    assert {"train/loss", "train/lr", *FP_SCALARS} <= scalar_names(tmp_path / "out" / "logs")
