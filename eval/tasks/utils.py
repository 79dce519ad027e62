"""Dataset loader for the packaged offline tasks (referenced from the YAML files as ``!function utils.load_local``).

lm-eval 0.4.13 calls ``custom_dataset(**metadata, **dataset_kwargs)`` instead of ``datasets.load_dataset``. The
``data_files`` in ``dataset_kwargs`` are resolved against this folder, not the working directory, so the tasks work
from anywhere (and from an installed wheel). The jsonl files are read directly: no Hub access, no datasets cache.
"""

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_local(data_files=None, **_metadata):
    """``{split: relative jsonl path}`` -> ``datasets.DatasetDict`` (extra metadata keys are ignored)."""
    if not data_files:
        raise ValueError("load_local needs dataset_kwargs.data_files, e.g. {test: fp_text_ppl.jsonl}.")
    if isinstance(data_files, str):
        data_files = {"test": data_files}
    splits = {}
    for split, path in data_files.items():
        full = path if os.path.isabs(path) else os.path.join(HERE, path)
        splits[split] = datasets.Dataset.from_list(_read_jsonl(full))
    return datasets.DatasetDict(splits)
