"""Kill a tiny run at deterministic moments (inside a checkpoint save, at a step boundary, during the export, on
SIGTERM), resume it with ``--resume_from_checkpoint latest`` until it finishes, and compare the exported weights with
the uninterrupted run's: bitwise on CPU in fp32 (issue 21).

The runs are in-process (``main()``) with the accelerate state reset between them; ``tests.helpers`` holds the fault
injection. The main job (the STARS addition demo) and the FPSA loop (``fpsa_vit``, which ``fpsa_glue``,
``fpsa_squad`` and ``self_lora`` share) run in the default suite.
"""

import json
import os
import sys

import pytest

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState  # noqa: E402

from hf_fixedpoint import fpsa_training  # noqa: E402
from recipes import fpsa_vit, stars_ouro  # noqa: E402
from tests.helpers import (  # noqa: E402
    Killed,
    kill_at_step,
    kill_during_save,
    kill_each,
    kill_in,
    same_weights,
    sigterm_at_step,
    tear_then_resume,
)


def run_vit(out, monkeypatch, *extra):
    # 512 images per step: 3 steps per epoch, so step 4 crosses an epoch boundary.
    argv = ["--output_dir", out, "--max_steps", 5, "--checkpointing_steps", 1, "--logging_steps", 1,
            "--fp_max_iter", 3, "--per_device_train_batch_size", 512, "--hidden_size", 16,
            "--num_attention_heads", 2, "--num_hidden_layers", 1, *extra]
    AcceleratorState._reset_state(True)
    monkeypatch.setattr(sys, "argv", ["fpsa_vit", *map(str, argv)])
    fpsa_vit.main()


def until_done(run, out, monkeypatch, faults):
    """Run with each fault in turn (each must kill the run), then resume once more without one."""
    kill_each(lambda *flags: run(out, monkeypatch, *flags), faults)
    run(out, monkeypatch, "--resume_from_checkpoint", "latest")


def reference(tmp_path_factory, run, name):
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        run(out, mp)
    return out


def train_log(folder):
    return [(r["step"], r["loss"]) for r in json.loads((folder / "metrics.json").read_text())["train_log"]]


@pytest.fixture(scope="module")
def vit_reference(tmp_path_factory):
    return reference(tmp_path_factory, run_vit, "vit_reference")


def test_fpsa_killed_anywhere_and_resumed_ends_with_the_uninterrupted_weights(vit_reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    until_done(run_vit, out, monkeypatch, [
        lambda mp: kill_during_save(mp, 2),   # torn step_2 (mid-epoch); step_1 is the newest complete one
        lambda mp: kill_at_step(mp, 2),       # resumed at 1, killed after step 3 (the epoch's last) before its save
        lambda mp: kill_during_save(mp, 2),   # resumed at 2, dies saving step 4: resumes at the epoch boundary (3)
        lambda mp: sigterm_at_step(mp, 1),    # preempted at step 4: saved, exit with the resume command
        lambda mp: kill_in(mp, fpsa_training, "export"),  # trained and saved step 5, killed in the export
    ])
    assert same_weights(vit_reference / "model.safetensors", out / "model.safetensors")
    assert train_log(out) == train_log(vit_reference)  # each step logged once, with the same loss
    assert sorted(d for d in os.listdir(out) if d.startswith("step_")) == ["step_4", "step_5"]  # save_total_limit 2


def test_fpsa_resumed_from_its_last_checkpoint_exports_the_trained_model(vit_reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        kill_in(mp, fpsa_training, "export")
        with pytest.raises(Killed):
            run_vit(out, monkeypatch)
    assert not (out / "model.safetensors").exists()
    run_vit(out, monkeypatch, "--resume_from_checkpoint", out / "step_5")
    assert same_weights(vit_reference / "model.safetensors", out / "model.safetensors")


def test_fpsa_torn_newest_checkpoint(vit_reference, tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        kill_in(mp, fpsa_training, "export")
        with pytest.raises(Killed):
            run_vit(out, monkeypatch)
    weights = out / "step_5" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"step_5.*model\.safetensors has \d+ bytes"):
        run_vit(out, monkeypatch, "--resume_from_checkpoint", out / "step_5")
    run_vit(out, monkeypatch, "--resume_from_checkpoint", "latest")  # skips step_5 with a warning, redoes step 5
    assert "skipping checkpoint" in caplog.text and "step_5" in caplog.text
    assert same_weights(vit_reference / "model.safetensors", out / "model.safetensors")


# --------------------------------------------------------------------------------------------------- STARS addition
def run_addition(out, monkeypatch, *extra):
    AcceleratorState._reset_state(True)
    stars_ouro.main([str(a) for a in ["--output_dir", out, "--max_steps", 4, "--reg_warmup_steps", 1,
                                      "--batch_size", 8, "--hidden_size", 16, "--eval_size", 20, "--eval_loops",
                                      "1,2", "--log_every", 1, "--save_every", 1, *extra]])


@pytest.fixture(scope="module")
def addition_reference(tmp_path_factory):
    return reference(tmp_path_factory, run_addition, "addition_reference")


def test_addition_demo_killed_anywhere_and_resumed(addition_reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    until_done(run_addition, out, monkeypatch, [
        lambda mp: kill_during_save(mp, 2),   # stars: torn step_2, resumes at 1
        lambda mp: kill_at_step(mp, 3),       # stars: killed after step 4, before the final save
        lambda mp: kill_in(mp, stars_ouro, "exact_match"),  # stars trained and saved, killed in its evaluation
        lambda mp: kill_during_save(mp, 3),   # stars resumed at the end; baseline dies saving step 3
        lambda mp: sigterm_at_step(mp, 1),    # baseline preempted at step 3
        lambda mp: kill_in(mp, stars_ouro, "write_json"),  # both exported, killed writing metrics.json
    ])
    for run in ("stars", "baseline"):
        assert same_weights(addition_reference / run / "model.safetensors", out / run / "model.safetensors")
    got, want = (json.loads((d / "metrics.json").read_text())["exact_match"] for d in (out, addition_reference))
    assert got == want


def test_addition_demo_torn_newest_checkpoint_and_resume_at_the_end(addition_reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run_addition(out, monkeypatch)
    # stars resumes at its end; baseline skips its torn step_4 and redoes step 4
    tear_then_resume(lambda *flags: run_addition(out, monkeypatch, *flags),
                     out / "checkpoints" / "baseline" / "step_4")
    for run in ("stars", "baseline"):
        assert same_weights(addition_reference / run / "model.safetensors", out / run / "model.safetensors")
