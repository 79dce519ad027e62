"""hf_fixedpoint/checkpointing.py: atomic save, completion record, newest-complete selection, torn folders, total
limit, SIGTERM, staged exports and logs trimmed on resume (a tiny linear model on CPU)."""

import json
import logging
import os
import signal

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration  # noqa: E402

from hf_fixedpoint import checkpointing  # noqa: E402
from hf_fixedpoint.checkpointing import (  # noqa: E402
    Checkpointer,
    Preemption,
    Stateful,
    epoch_loader,
    latest_complete,
    staged_folder,
    trim_jsonl,
    verify,
)


@pytest.fixture
def setup():
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def step(model, optimizer):
    model(torch.randn(4, 3)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_save_is_complete_and_load_restores_state_and_record(setup, tmp_path):
    accelerator, model, optimizer = setup
    ckpt = Checkpointer(accelerator, tmp_path)
    step(model, optimizer)
    folder = ckpt.save(1, history=[{"step": 1}])
    assert sorted(os.listdir(tmp_path)) == ["step_1"]  # no temporary folder left
    record = verify(folder)
    assert record["step"] == 1 and record["history"] == [{"step": 1}]
    assert {"model.safetensors", "optimizer.bin"} <= set(record["files"])
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    step(model, optimizer)
    assert ckpt.load("latest")["step"] == 1
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_crash_inside_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(setup, tmp_path, monkeypatch):
    accelerator, model, optimizer = setup
    ckpt = Checkpointer(accelerator, tmp_path)
    step(model, optimizer)
    ckpt.save(1)
    real = accelerator.save_state

    def torn_save(output_dir):  # the model file is written, then the process dies
        real(output_dir)
        os.remove(os.path.join(output_dir, "optimizer.bin"))
        raise KeyboardInterrupt("killed during the save")

    monkeypatch.setattr(accelerator, "save_state", torn_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2)
    assert sorted(os.listdir(tmp_path)) == [".step_2.tmp", "step_1"]
    assert latest_complete(tmp_path).endswith("step_1")
    monkeypatch.setattr(accelerator, "save_state", real)
    ckpt.save(2)
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]


def test_torn_newest_is_skipped_with_a_warning_and_named_explicitly_is_a_value_error(setup, tmp_path, caplog):
    accelerator, model, optimizer = setup
    ckpt = Checkpointer(accelerator, tmp_path, total_limit=0)
    for n in (1, 2, 3):
        step(model, optimizer)
        ckpt.save(n)
    weights = tmp_path / "step_3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut in half
    (tmp_path / "step_2" / "optimizer.bin").unlink()
    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        assert ckpt.load("latest")["step"] == 1
    assert "step_3" in caplog.text and "model.safetensors" in caplog.text and "step_2" in caplog.text
    with pytest.raises(ValueError, match=r"step_3.*corrupt: model\.safetensors"):
        ckpt.load(tmp_path / "step_3")
    with pytest.raises(ValueError, match=r"step_2.*incomplete: optimizer\.bin is missing"):
        ckpt.load(tmp_path / "step_2")
    (tmp_path / "step_1" / "checkpoint.json").unlink()  # an unfinished save (or an older version's folder)
    with pytest.raises(ValueError, match=r"step_1.*incomplete: it has no checkpoint\.json"):
        ckpt.load(str(tmp_path / "step_1"))
    assert ckpt.load("latest") is None  # nothing complete: a fresh start


def test_total_limit_keeps_the_newest_complete_ones_until_a_successor_is_complete(setup, tmp_path, monkeypatch):
    accelerator, model, optimizer = setup
    ckpt = Checkpointer(accelerator, tmp_path, total_limit=2)
    for n in range(1, 5):
        ckpt.save(n)
    assert sorted(os.listdir(tmp_path)) == ["step_3", "step_4"]
    monkeypatch.setattr(accelerator, "save_state", lambda d: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(5)
    assert sorted(os.listdir(tmp_path)) == ["step_3", "step_4"]
    with pytest.raises(ValueError, match="save_total_limit"):
        Checkpointer(accelerator, tmp_path, total_limit=-1)


def test_saving_a_step_again_replaces_it(setup, tmp_path):
    accelerator, model, optimizer = setup
    ckpt = Checkpointer(accelerator, tmp_path)
    ckpt.save(1, note="first")
    ckpt.save(1, note="second")
    assert sorted(os.listdir(tmp_path)) == ["step_1"] and verify(tmp_path / "step_1")["note"] == "second"


def test_stateful_objects_round_trip(setup, tmp_path):
    accelerator, _, _ = setup
    g = torch.Generator().manual_seed(3)
    ckpt = Checkpointer(accelerator, tmp_path, objects={"data": Stateful(stream=g)})
    torch.rand(5, generator=g)
    ckpt.save(1)
    want = torch.rand(5, generator=g)
    ckpt.load("latest")
    assert torch.equal(torch.rand(5, generator=g), want)


@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_epoch_loader_skips_into_the_same_epochs_shuffle(epoch):
    # A resumed run's rest of an epoch: the seedable sampler's shuffle of that epoch, not of epoch 0 (accelerate
    # before 1.15 reset the sampler to epoch 0 when the loader from skip_first_batches started).
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(12), batch_size=4, shuffle=True))
    whole = [b.tolist() for b in epoch_loader(accelerator, loader, epoch)]
    rest = [b.tolist() for b in epoch_loader(accelerator, loader, epoch, skip=1)]
    assert rest == whole[1:] and sorted(sum(whole, [])) == list(range(12))
    assert [b.tolist() for b in epoch_loader(accelerator, loader, epoch)] == whole  # the skip left the epoch as it was


def test_automatic_checkpoint_naming_is_refused(tmp_path):
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                            automatic_checkpoint_naming=True))
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        Checkpointer(accelerator, tmp_path)


def test_sigterm_sets_a_flag_and_exit_says_how_to_resume(setup):
    accelerator, _, _ = setup
    before = signal.getsignal(signal.SIGTERM)
    with Preemption(accelerator) as preemption:
        assert not preemption.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested()
        with pytest.raises(SystemExit, match="resume_from_checkpoint latest"):
            preemption.exit("out/step_3")
    assert signal.getsignal(signal.SIGTERM) is before


def test_staged_folder_never_leaves_a_half_export(tmp_path, monkeypatch):
    dest = tmp_path / "export"
    with staged_folder(dest) as stage:
        for name in ("config.json", "model.safetensors", "README.md"):
            (open(os.path.join(stage, name), "w")).write("old")
    (dest / "step_1").mkdir()  # checkpoints beside the export are left alone
    with pytest.raises(RuntimeError):
        with staged_folder(dest) as stage:
            (open(os.path.join(stage, "model.safetensors"), "w")).write("new")
            raise RuntimeError("killed while writing")
    assert (dest / "model.safetensors").read_text() == "old" and (dest / "config.json").exists()

    real, moved = os.replace, []

    def dies_after_one_move(src, dst):
        if moved:
            raise KeyboardInterrupt("killed while moving")
        moved.append(dst)
        real(src, dst)

    with pytest.raises(KeyboardInterrupt):
        with staged_folder(dest) as stage:
            for name in ("config.json", "model.safetensors", "README.md"):
                (open(os.path.join(stage, name), "w")).write("new")
            monkeypatch.setattr(checkpointing.os, "replace", dies_after_one_move)
    monkeypatch.setattr(checkpointing.os, "replace", real)
    assert not (dest / "config.json").exists()  # does not load as a model: never old weights with a new config
    with staged_folder(dest) as stage:
        for name in ("config.json", "model.safetensors"):
            (open(os.path.join(stage, name), "w")).write("newer")
    assert sorted(os.listdir(dest)) == ["README.md", "config.json", "model.safetensors", "step_1"]
    assert (dest / "config.json").read_text() == "newer"


def test_trim_jsonl_keeps_each_step_once(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    trim_jsonl(str(log), 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
