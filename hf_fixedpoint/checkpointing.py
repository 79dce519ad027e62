"""Checkpoints that survive a kill, for every recipe: atomic ``accelerator.save_state`` folders with a completion
record, selection of the newest *complete* one, a total limit, SIGTERM handling and atomic export folders.

A checkpoint is ``<root>/step_<n>``. ``Checkpointer.save`` lets accelerate write the training state (models,
optimizers, schedulers, RNG states, objects registered with ``accelerator.register_for_checkpointing``) into a hidden
sibling ``<root>/.step_<n>.tmp``, adds ``checkpoint.json`` (the step, whatever the recipe needs to continue, and the
size of every file) and renames the folder into place only then. A kill at any moment therefore leaves the previous
checkpoints intact and at most a hidden temporary folder, which the next save removes. ``Checkpointer.load`` checks
the record against the files before ``accelerator.load_state`` touches them, so a torn checkpoint is a clear error
(named explicitly) or skipped with a warning (``"latest"``), never a traceback from deep inside a loader.

    ckpt = Checkpointer(accelerator, args.output_dir, total_limit=args.save_total_limit)
    record = ckpt.load(args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    ...
    ckpt.save(step, data_position=...)

``staged_folder`` gives exports the same property: files are written to a staging folder and moved into the export
folder with ``config.json`` (what makes a folder loadable) removed first and put back last. ``Preemption`` turns
SIGTERM into "finish this optimizer step, save, exit with the resume command".

Needs accelerate (the ``train`` extra); ``import hf_fixedpoint`` does not import this module.
"""

import json
import logging
import os
import re
import shutil
import signal
from contextlib import contextmanager
from typing import Optional

import torch

logger = logging.getLogger(__name__)

RECORD = "checkpoint.json"
FORMAT = 1
_STEP = re.compile(r"step_(\d+)")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def write_json(path: str, data) -> None:
    """``json.dump`` to ``path`` through a temporary file and a rename: readers see the old file or the new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _files(folder: str) -> dict:
    """``{relative path: size}`` of every file under ``folder`` (the record itself excluded)."""
    out = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, folder)
            if rel != RECORD:
                out[rel] = os.path.getsize(path)
    return out


def verify(folder: str) -> dict:
    """The completion record of checkpoint ``folder`` after checking every file it lists.

    Raises:
        ValueError: naming the folder and the missing or corrupt file (no record: the save did not finish).
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"checkpoint {folder!r} does not exist or is not a folder.")
    path = os.path.join(folder, RECORD)
    try:
        with open(path) as fh:
            record = json.load(fh)
        files, step = record["files"], int(record["step"])
    except FileNotFoundError:
        raise ValueError(f"checkpoint {folder!r} is incomplete: it has no {RECORD} (the save did not finish, or it "
                         "was written by an older version); resume from an earlier step_<n> folder.") from None
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"checkpoint {folder!r}: {RECORD} is corrupt ({err}).") from None
    for rel, size in files.items():
        file = os.path.join(folder, rel)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint {folder!r} is incomplete: {rel} is missing.")
        if os.path.getsize(file) != size:
            raise ValueError(f"checkpoint {folder!r} is corrupt: {rel} has {os.path.getsize(file)} bytes, the "
                             f"save wrote {size}.")
    record["step"] = step
    return record


def checkpoint_folders(root: str) -> list:
    """``(step, path)`` of every ``root/step_<n>`` folder, newest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
             if (m := _STEP.fullmatch(name)) and os.path.isdir(os.path.join(root, name))]
    return sorted(found, reverse=True)


def latest_complete(root: str) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (None if there is none); newer incomplete or unreadable
    folders are skipped with a warning that names them."""
    for _, path in checkpoint_folders(root):
        try:
            verify(path)
            return path
        except ValueError as err:
            logger.warning(f"skipping {err}")
    return None


class Checkpointer:
    """Atomic, verified ``accelerator.save_state`` checkpoints in ``root/step_<n>``.

    Args:
        accelerator: the run's accelerator; everything it was given (``prepare``, ``register_for_checkpointing``)
            is saved and restored by accelerate itself, with its save/load hooks.
        root: folder holding the ``step_<n>`` checkpoints.
        total_limit: keep the newest ``total_limit`` complete checkpoints (>= 1; 0 or None: keep all). Older ones
            are deleted only after a newer one is complete.
        objects: ``{name: object with state_dict / load_state_dict}`` saved per process next to accelerate's files
            (``<name>_<rank>.pt``), for state that belongs to this loop only (e.g. a data generator, ``Stateful``);
            objects registered with ``accelerator.register_for_checkpointing`` are saved by accelerate.
    """

    def __init__(self, accelerator, root, total_limit: Optional[int] = 2, objects: Optional[dict] = None):
        if total_limit is not None and total_limit < 0:
            raise ValueError(f"save_total_limit must be >= 0 (0: keep all), got {total_limit}.")
        if accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError("Checkpointer names its folders itself: create the Accelerator without "
                             "ProjectConfiguration(automatic_checkpoint_naming=True).")
        self.accelerator, self.root, self.total_limit = accelerator, os.fspath(root), total_limit
        self.objects = dict(objects or {})

    def _object_path(self, folder, name):
        return os.path.join(folder, f"{name}_{self.accelerator.process_index}.pt")

    def resolve(self, spec) -> Optional[str]:
        """``"latest"``: the newest complete checkpoint (None, announced, if there is none yet: a fresh start).
        A folder: itself, verified."""
        if spec is None:
            return None
        if str(spec) == "latest":
            folder = latest_complete(self.root)
            if folder is None:
                self.accelerator.print(f"--resume_from_checkpoint latest: no complete checkpoint in {self.root}; "
                                       "starting from scratch")
            return folder
        verify(spec)
        return os.fspath(spec)

    def load(self, spec) -> Optional[dict]:
        """Restore the training state from ``spec`` (a folder or ``"latest"``); its completion record, or None when
        ``"latest"`` finds no complete checkpoint (a fresh start, announced)."""
        folder = self.resolve(spec)
        if folder is None:
            return None
        record = verify(folder)
        self.accelerator.load_state(folder)
        for name, obj in self.objects.items():
            obj.load_state_dict(torch.load(self._object_path(folder, name), weights_only=False))
        record["folder"] = folder
        self.accelerator.print(f"resumed from {folder} at step {record['step']}")
        return record

    def save(self, step: int, **record) -> str:
        """Write the training state at optimizer step ``step`` plus ``record`` (JSON-serialisable) and return the
        folder. Every process calls it (accelerate writes one RNG file per process)."""
        acc = self.accelerator
        final = os.path.join(self.root, f"step_{step}")
        tmp = os.path.join(self.root, f".step_{step}.tmp")
        if acc.is_main_process:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(tmp)
        for name, obj in self.objects.items():
            torch.save(obj.state_dict(), self._object_path(tmp, name))
        acc.wait_for_everyone()
        if acc.is_main_process:
            files = _files(tmp)
            for rel in files:
                _fsync(os.path.join(tmp, rel))
            write_json(os.path.join(tmp, RECORD), {"format": FORMAT, "step": step, **record, "files": files})
            _fsync(tmp)
            if os.path.exists(final):  # the same step saved by an earlier, interrupted run: replace it
                old = os.path.join(self.root, f".step_{step}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync(self.root)
            self._prune()
        acc.wait_for_everyone()
        return final

    def _prune(self):
        """Delete stale temporary folders and the complete checkpoints beyond ``total_limit``."""
        for name in os.listdir(self.root):
            if re.fullmatch(r"\.step_\d+\.(tmp|old)", name):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        if not self.total_limit:
            return
        complete = []
        for _, path in checkpoint_folders(self.root):
            try:
                verify(path)
                complete.append(path)
            except ValueError:
                continue
        for path in complete[self.total_limit:]:
            shutil.rmtree(path, ignore_errors=True)


class Stateful:
    """Wrap RNG generators (``torch.Generator``) so ``accelerator.register_for_checkpointing`` saves and restores
    them with the rest of the training state."""

    def __init__(self, **generators):
        self.generators = generators

    def state_dict(self):
        return {k: g.get_state() for k, g in self.generators.items()}

    def load_state_dict(self, state):
        for k, g in self.generators.items():
            g.set_state(state[k])


def epoch_loader(accelerator, loader, epoch: int, skip: int = 0):
    """``loader`` (prepared by ``accelerator``) set to ``epoch`` and without its first ``skip`` batches: the rest of an
    epoch that a resumed run has partly trained on.

    With the seedable sampler, an epoch's shuffle is a function of (seed, epoch). ``accelerator.skip_first_batches``
    returns a new loader whose epoch counter starts at 0, and before accelerate 1.15 starting its iterator set the
    shared sampler to that epoch, so the rest of a later epoch came from epoch 0's shuffle. Setting the epoch on the
    returned loader as well gives the interrupted run's batches on every accelerate release.
    """
    loaders = [loader, accelerator.skip_first_batches(loader, skip)] if skip else [loader]
    for each in loaders:
        if hasattr(each, "set_epoch"):
            each.set_epoch(epoch)
    return loaders[-1]


class Preemption:
    """SIGTERM (a scheduler's preemption notice) sets a flag instead of killing the process; the training loop asks
    ``requested()`` after each optimizer step, saves a checkpoint and calls ``exit``.

    Use as a context manager around the loop; the previous handler is restored on exit.
    """

    def __init__(self, accelerator):
        self.accelerator, self.flag, self._previous = accelerator, False, None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave the default handler
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        return False

    def _handle(self, signum, frame):
        self.flag = True

    def requested(self) -> bool:
        """Whether any process received SIGTERM (the same answer on every process)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return self.flag
        flag = torch.tensor([1.0 if self.flag else 0.0], device=acc.device)
        return bool(acc.reduce(flag, reduction="sum").item() > 0)

    def exit(self, folder: str, resume_hint: str = "--resume_from_checkpoint latest"):
        """Leave the process after the preemption checkpoint ``folder`` was written, saying how to resume."""
        message = (f"SIGTERM received: saved the training state to {folder}; run the same command with "
                   f"{resume_hint} to continue.")
        self.accelerator.print(message)
        raise SystemExit(message)


@contextmanager
def staged_folder(dest, is_main_process: bool = True):
    """Write an export atomically: yields a staging folder (``dest/.staging``); on success its entries replace
    those of ``dest``. ``config.json`` is removed from ``dest`` first and moved in last, so a kill in between leaves
    a folder that does not load as a model (and the next export completes it), never one that half loads.

    Other entries of ``dest`` (e.g. ``step_<n>`` checkpoints) are left alone.
    """
    dest = os.fspath(dest)
    stage = os.path.join(dest, ".staging")
    if is_main_process:
        os.makedirs(dest, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
    yield stage
    if not is_main_process:
        return
    for base, _, names in os.walk(stage):
        for name in names:
            _fsync(os.path.join(base, name))
    entries = sorted(os.listdir(stage), key=lambda n: n == "config.json")  # config.json last
    if "config.json" in entries and os.path.exists(os.path.join(dest, "config.json")):
        os.remove(os.path.join(dest, "config.json"))
        _fsync(dest)
    for name in entries:
        target = os.path.join(dest, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(stage, name), target)
    _fsync(dest)
    shutil.rmtree(stage, ignore_errors=True)


def trim_jsonl(path: str, step: int, key: str = "step") -> None:
    """Keep the lines of a JSON-lines log with ``record[key] <= step`` (a resumed run appends from ``step + 1``, so
    each step is logged once)."""
    if not os.path.exists(path):
        return
    with open(path) as fh:
        lines = [line for line in fh if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line).get(key, 0) <= step:
                kept.append(line)
        except ValueError:  # a line torn by the kill
            continue
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.writelines(kept)
    os.replace(tmp, path)


__all__ = ["Checkpointer", "Preemption", "Stateful", "checkpoint_folders", "epoch_loader", "latest_complete",
           "staged_folder", "trim_jsonl", "verify", "write_json"]
