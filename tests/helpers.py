"""Small helpers shared by several test files."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast


def train_bpe_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` in about a second, with <unk> <s> </s> <pad>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=256)


def family_tester(config_class):
    """An instance of the family's tester class (``tests/models/<type>/test_modeling_<type>.py``): its tiny config
    (``get_config(**overrides)``) and inputs (``prepare_inputs(config)``)."""
    import importlib

    name = config_class.model_type
    module = importlib.import_module(f"tests.models.{name}.test_modeling_{name}")
    return next(cls for cls in vars(module).values()
                if getattr(cls, "config_class", None) is config_class and hasattr(cls, "prepare_inputs"))()


# ---------------------------------------------------------------------------------------------------------------------
# Fault injection for the kill-and-resume tests of the recipes (in-process runs, ``monkeypatch.context()``).


class Killed(BaseException):
    """Stands for SIGKILL: a BaseException, so nothing in a recipe catches it and no clean-up code runs after it."""


def kill_during_save(mp, call: int):
    """The ``call``-th ``Accelerator.save_state`` writes its files, cuts its weights file in half and dies."""
    import os

    from accelerate import Accelerator

    real, count = Accelerator.save_state, [0]

    def save_state(self, output_dir=None, **kwargs):
        count[0] += 1
        out = real(self, output_dir, **kwargs)
        if count[0] == call:
            weights = os.path.join(output_dir, "model.safetensors")
            with open(weights, "r+b") as fh:
                fh.truncate(os.path.getsize(weights) // 2)
            raise Killed(f"killed during save {call} ({output_dir})")
        return out

    mp.setattr(Accelerator, "save_state", save_state)


def kill_at_step(mp, step: int):
    """Die right after the ``step``-th optimizer step of the process, before its checkpoint (if any) is written:
    ``Preemption.requested`` is asked once after every optimizer step."""
    from hf_fixedpoint.checkpointing import Preemption

    count = [0]

    def requested(self):
        count[0] += 1
        if count[0] == step:
            raise Killed(f"killed after optimizer step {step}")
        return self.flag

    mp.setattr(Preemption, "requested", requested)


def sigterm_at_step(mp, step: int):
    """Send this process SIGTERM during the ``step``-th optimizer step (a scheduler's preemption notice)."""
    import os
    import signal

    from hf_fixedpoint.checkpointing import Preemption

    real, count = Preemption.requested, [0]

    def requested(self):
        count[0] += 1
        if count[0] == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    mp.setattr(Preemption, "requested", requested)


def kill_in(mp, owner, name: str):
    """``owner.name`` (e.g. an export function) dies as soon as it is called."""
    def dies(*args, **kwargs):
        raise Killed(f"killed in {name}")

    mp.setattr(owner, name, dies)


def same_weights(a, b) -> bool:
    """Whether two ``model.safetensors`` files hold bitwise-equal tensors."""
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    import torch

    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def kill_each(main, faults):
    """``main("--resume_from_checkpoint", "latest")`` once under each fault (a function of a ``MonkeyPatch``), each
    run being killed (``Killed``) or preempted (``SystemExit``); the next run resumes where the last one died."""
    import pytest

    for fault in faults:
        with pytest.MonkeyPatch.context() as mp:
            fault(mp)
            with pytest.raises((Killed, SystemExit)):
                main("--resume_from_checkpoint", "latest")


def tear_then_resume(main, folder):
    """Cut checkpoint ``folder``'s weights file short (a kill in the middle of a save): resuming from it by name is a
    ``ValueError`` naming the folder and the file; ``latest`` skips it (with a warning) and finishes the run."""
    import os
    import re

    import pytest

    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as fh:
        fh.truncate(64)
    with pytest.raises(ValueError, match=re.escape(os.path.basename(folder)) + r".*model\.safetensors"):
        main("--resume_from_checkpoint", folder)
    main("--resume_from_checkpoint", "latest")


def run_recipe(monkeypatch, module, *argv):
    """``module.main()`` in this process, with ``sys.argv`` set to ``argv`` and a fresh accelerate state."""
    import sys

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    monkeypatch.setattr(sys, "argv", [module.__name__, *map(str, argv)])
    return module.main()


def assert_survives_kills(main, tmp_path, faults, torn=None, weights="model.safetensors"):
    """The uninterrupted ``main(out)`` in ``tmp_path/reference``; then ``main(tmp_path/run, ...)`` killed by each
    fault in turn and resumed with ``latest``; then (``torn``: a checkpoint folder relative to the run) that
    checkpoint torn and the run finished (``tear_then_resume``). The exported ``weights`` (relative to the output
    folder) must equal the reference's bitwise. Returns the two output folders."""
    reference, out = tmp_path / "reference", tmp_path / "run"
    main(reference)
    kill_each(lambda *flags: main(out, *flags), faults)
    if torn is None:
        main(out, "--resume_from_checkpoint", "latest")
    else:
        tear_then_resume(lambda *flags: main(out, *flags), out / torn)
    assert same_weights(reference / weights, out / weights)
    return reference, out


def run_two_processes(module: str, *argv, tmp_path, timeout: int = 900):
    """``recipes/<module>.py`` launched on two CPU processes (gloo DDP) with ``accelerate launch``; returns the
    finished ``subprocess.CompletedProcess``. ``--multi_gpu`` with ``ACCELERATE_USE_CPU=1`` is the flag combination
    that really gives two CPU processes (``--cpu`` alone gives one)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", f"recipes/{module}.py",
           *map(str, argv)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf_home")}
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def scalar_names(logging_dir) -> set:
    """The scalar tags in the TensorBoard event files under ``logging_dir``."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    names = set()
    for events in Path(logging_dir).rglob("events.out.tfevents.*"):
        names |= set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    return names
