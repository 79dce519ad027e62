"""Shared pieces of the puzzle data layer: metadata, the task registry, seeding, dihedral transforms.

Every task returns ``datasets.Dataset`` rows in the token format of the TRM/HRM research code (PAD = 0, one
``puzzle_identifiers`` id per row, id 0 = blank) with labels already mapped to ``-100`` where they are not
supervised, so a batch can go straight into a cross-entropy loss.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import numpy as np

from ..core.fp_registry import Registry, check_choice

IGNORE_LABEL_ID = -100
SPLITS = ("train", "test")

TASKS = Registry("puzzle task")
"""``name -> builder``; a builder is ``fn(split, *, seed, **task_kwargs) -> (columns, PuzzleMetadata)``."""

# Version of the generators' output. Bump it when a generator changes so old caches are not reused.
DATA_VERSION = 2  # 2: ARC metadata holds identifiers_sha256


@dataclass
class PuzzleMetadata:
    """What a model needs to know about a puzzle dataset; store it in the model config with :meth:`to_dict`.

    ``vocab_size`` counts every token id including PAD; ``seq_len`` is the length of ``inputs`` / ``labels``;
    ``num_puzzle_identifiers`` is the size of the puzzle-embedding table (id 0 = ``blank_identifier_id``);
    ``grid_shape`` is ``(rows, cols)`` when ``seq_len`` is a row-major grid (2-D convolution variants), else None.
    ``num_groups`` counts original puzzles (augmented copies share a group). ``difficulty`` names the column that
    measures difficulty (used by :func:`hf_fixedpoint.puzzles.evaluation.iterations_vs_difficulty`).
    ``identifiers_sha256``: fingerprint of what each puzzle id means (ARC: task and augmentation per id, see
    :func:`identifiers_fingerprint`); None where every row uses the blank id. A model config stores it with the
    rest of the metadata, and :func:`check_identifiers` compares it with new data.
    """

    task: str
    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int = 1
    pad_id: int = 0
    ignore_label_id: int = IGNORE_LABEL_ID
    blank_identifier_id: int = 0
    grid_shape: Optional[Tuple[int, int]] = None
    split: str = "train"
    num_examples: int = 0
    num_groups: int = 0
    difficulty: Optional[str] = None
    token_names: Optional[Tuple[str, ...]] = None
    build_kwargs: dict = field(default_factory=dict)
    identifiers_sha256: Optional[str] = None

    def __post_init__(self):
        if self.grid_shape is not None:
            self.grid_shape = tuple(int(s) for s in self.grid_shape)
            if self.grid_shape[0] * self.grid_shape[1] != self.seq_len:
                raise ValueError(f"grid_shape={self.grid_shape} does not multiply to seq_len={self.seq_len}.")
        if self.token_names is not None:
            self.token_names = tuple(self.token_names)
            if len(self.token_names) != self.vocab_size:
                raise ValueError(f"token_names has {len(self.token_names)} entries, vocab_size={self.vocab_size}.")

    def to_dict(self) -> dict:
        """JSON-serialisable dict (tuples become lists), e.g. for ``config.puzzle_metadata``."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict) -> "PuzzleMetadata":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"PuzzleMetadata.from_dict got unknown keys {unknown}. Allowed keys: {sorted(names)}.")
        return cls(**d)


def identifiers_fingerprint(names) -> str:
    """sha256 (hex) of the names of puzzle ids 1, 2, ... in order (id 0 is the blank id)."""
    return hashlib.sha256(json.dumps(list(names)).encode()).hexdigest()


def check_identifiers(expected, actual, expected_name: str = "the checkpoint",
                      actual_name: str = "the dataset") -> None:
    """Raise a ValueError when two :class:`PuzzleMetadata` (or their ``to_dict()``) give puzzle ids other meanings.

    Compares ``num_puzzle_identifiers`` and ``identifiers_sha256``; a side without a fingerprint (data built
    before it existed, or a task without puzzle ids) is compared by the number of ids only.
    """
    get = (lambda m, k: m.get(k)) if isinstance(expected, dict) else getattr
    get_b = (lambda m, k: m.get(k)) if isinstance(actual, dict) else getattr
    n_a, n_b = get(expected, "num_puzzle_identifiers"), get_b(actual, "num_puzzle_identifiers")
    h_a, h_b = get(expected, "identifiers_sha256"), get_b(actual, "identifiers_sha256")
    if n_a != n_b or (h_a is not None and h_b is not None and h_a != h_b):
        raise ValueError(
            f"{actual_name} numbers its puzzles differently from {expected_name}: num_puzzle_identifiers {n_b} vs "
            f"{n_a}, identifiers_sha256 {h_b} vs {h_a}. Puzzle ids depend on the task selection (task_ids, "
            f"max_tasks), num_aug and seed; build {actual_name} with the options of {expected_name} "
            f"({get(expected, 'build_kwargs')}).")


def register_task(name: str):
    """Decorator adding a builder to :data:`TASKS`."""
    return TASKS.register(name)


def split_rng(task: str, split: str, seed: int) -> np.random.Generator:
    """Independent, reproducible generator per ``(task, split, seed)``; train and test never share draws."""
    check_choice(split, "split", SPLITS)
    key = zlib.crc32(task.encode())
    return np.random.default_rng(np.random.SeedSequence([int(seed), SPLITS.index(split), key]))


# Options that change how fast a split is built, not what it contains: left out of the cache key.
_SPEED_ONLY_KWARGS = ("num_proc",)


def _cache_path(cache_dir, task: str, split: str, seed: int, kwargs: dict) -> str:
    kwargs = {k: v for k, v in kwargs.items() if k not in _SPEED_ONLY_KWARGS}
    blob = json.dumps({"v": DATA_VERSION, "task": task, "split": split, "seed": seed, "kw": kwargs}, sort_keys=True,
                      default=str)
    return os.path.join(os.fspath(cache_dir), f"{task}-{split}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}")


def _to_dataset(columns: dict):
    """An in-memory ``datasets.Dataset`` built straight from numpy through Arrow (25x faster than ``from_dict``).

    2-D arrays become fixed-length lists (``inputs``/``labels`` int32, others int64), 1-D arrays int64 or bool
    values, Python lists of strings string values.
    """
    import datasets
    import pyarrow as pa

    arrays, features = {}, {}
    for name, col in columns.items():
        if isinstance(col, np.ndarray) and col.ndim == 2:
            value = "int32" if name in ("inputs", "labels") else "int64"
            flat = pa.array(np.ascontiguousarray(col, dtype=value).reshape(-1))
            arrays[name] = pa.FixedSizeListArray.from_arrays(flat, col.shape[1])
            features[name] = datasets.List(datasets.Value(value), length=col.shape[1])
        elif isinstance(col, np.ndarray):
            value = "bool" if col.dtype.kind == "b" else "int64"
            arrays[name] = pa.array(col.astype(value))
            features[name] = datasets.Value(value)
        else:
            arrays[name] = pa.array(list(col), type=pa.string())
            features[name] = datasets.Value("string")
    features = datasets.Features(features)
    return datasets.Dataset(pa.table(arrays).cast(features.arrow_schema), info=datasets.DatasetInfo(features=features))


def build_dataset(task: str, split: str, *, seed: int = 0, cache_dir=None, **task_kwargs):
    """Build one split of a puzzle task: returns ``(datasets.Dataset, PuzzleMetadata)``.

    Columns: ``inputs`` and ``labels`` (``seq_len`` ints each; unsupervised label positions hold
    ``metadata.ignore_label_id`` = -100), ``puzzle_identifiers`` (int), plus task columns (``difficulty``,
    ``group``, ``aug_id``...). The same ``(task, split, seed, task_kwargs)`` always gives the same rows.
    ``cache_dir``: if given, the built split is saved there (``save_to_disk``) and reloaded on the next call with
    the same arguments; the save is atomic, so processes of a distributed run may share one ``cache_dir``.
    Task options are listed in ``docs/puzzles.md`` and in each builder's docstring.
    """
    builder: Callable = TASKS.get(task)
    check_choice(split, "split", SPLITS)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}.")
    seed = int(seed)
    cacheable = cache_dir is not None and not any(k.endswith("path") and v is not None for k, v in task_kwargs.items())
    if cacheable:
        path = _cache_path(cache_dir, task, split, seed, task_kwargs)
        if os.path.exists(os.path.join(path, METADATA_FILE)):
            return load_saved(path)
    columns, meta = builder(split, seed=seed, **task_kwargs)
    ds = _to_dataset(columns)
    if ds.features["inputs"].length != meta.seq_len or ds.features["labels"].length != meta.seq_len:
        raise ValueError(f"the {task!r} builder returned rows that are not seq_len={meta.seq_len} long.")
    meta.split, meta.num_examples = split, len(ds)
    meta.build_kwargs = json.loads(json.dumps({"seed": seed, **task_kwargs}, default=str))
    if cacheable:
        save_split(ds, meta, path, overwrite=False)
    return ds, meta


METADATA_FILE = "puzzle_metadata.json"


def save_split(dataset, metadata: PuzzleMetadata, folder, overwrite: bool = True) -> str:
    """Save a split to ``folder`` (``Dataset.save_to_disk`` + ``puzzle_metadata.json``); returns ``folder``.

    Written to a temporary folder first and renamed, so readers never see a half-written split. With
    ``overwrite=False`` an existing ``folder`` wins (processes that build the same split concurrently).
    """
    folder = os.fspath(folder)
    tmp = f"{folder}.tmp-{os.getpid()}"
    dataset.save_to_disk(tmp)
    with open(os.path.join(tmp, METADATA_FILE), "w") as f:
        json.dump(metadata.to_dict(), f)
    if overwrite and os.path.exists(folder):
        shutil.rmtree(folder)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process saved the same split first; both copies are identical
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_saved(folder):
    """``(datasets.Dataset, PuzzleMetadata)`` saved by :func:`save_split` (or ``python -m hf_fixedpoint.puzzles``)."""
    import datasets

    path = os.path.join(os.fspath(folder), METADATA_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {folder} is not a split saved by save_split.")
    with open(path) as f:
        metadata = PuzzleMetadata.from_dict(json.load(f))
    return datasets.load_from_disk(os.fspath(folder)), metadata


CSV_COLUMNS = {"source": ("source",), "q": ("q", "question", "puzzle", "quizzes"),
               "a": ("a", "answer", "solution", "solutions"), "rating": ("rating", "difficulty")}


def read_puzzle_csv(path, required=("q", "a")) -> dict:
    """Columns of a research-format puzzle CSV (``source,q,a,rating``, one header line) as lists of strings.

    Header names may use common aliases (``question``/``answer``...); a 4-column header with none of them is read
    positionally as ``source,q,a,rating``, like the research builders do. Missing optional columns are absent
    from the result. Raises ValueError naming the file and line for a missing required column, a row with the
    wrong number of fields, or an empty file.
    """
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file; expected a header line (source,q,a,rating) and puzzle rows.")
        lowered = [h.strip().lower() for h in header]
        index = {key: next((lowered.index(a) for a in aliases if a in lowered), None)
                 for key, aliases in CSV_COLUMNS.items()}
        if all(v is None for v in index.values()) and len(header) == 4:
            index = dict(zip(CSV_COLUMNS, range(4)))
        missing = [key for key in required if index[key] is None]
        if missing:
            raise ValueError(f"{path}: the header {header!r} has no column {missing} (expected source,q,a,rating; "
                             f"aliases: {', '.join(f'{k}={list(v)}' for k, v in CSV_COLUMNS.items())}).")
        out = {key: [] for key, i in index.items() if i is not None}
        for line, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise ValueError(f"{path}, line {line}: has {len(row)} fields, the header has {len(header)}.")
            for key in out:
                out[key].append(row[index[key]])
    if not out[required[0]]:
        raise ValueError(f"{path}: no puzzles after the header.")
    return out


# ------------------------------------------------------------------------------------------------------------
# Dihedral group of the square, in the research code's numbering (so ARC "t" ids mean the same thing):
# 0 identity, 1 rot90, 2 rot180, 3 rot270 (counter-clockwise, np.rot90), 4 left-right flip, 5 up-down flip,
# 6 transpose, 7 anti-transpose.
DIHEDRAL_INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)


def dihedral(grid: np.ndarray, t: int) -> np.ndarray:
    """Apply dihedral transform ``t`` (0..7) to the last two axes of ``grid``."""
    check_choice(t, "dihedral transform id", range(8))
    axes = (-2, -1)
    if t < 4:
        return np.rot90(grid, k=t, axes=axes)
    if t == 4:
        return np.flip(grid, axis=-1)
    if t == 5:
        return np.flip(grid, axis=-2)
    if t == 6:
        return np.swapaxes(grid, -1, -2)
    return np.flip(np.rot90(grid, k=1, axes=axes), axis=-1)


def inverse_dihedral(grid: np.ndarray, t: int) -> np.ndarray:
    """Undo :func:`dihedral` ``t``."""
    return dihedral(grid, DIHEDRAL_INVERSE[t])
