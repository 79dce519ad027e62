"""Build puzzle splits once and save them: ``python -m hf_fixedpoint.puzzles TASK --out DIR [options]``.

``--format hf`` (default) writes ``DIR/<split>/`` with ``Dataset.save_to_disk`` plus ``puzzle_metadata.json``
(read back with :func:`hf_fixedpoint.puzzles.load_saved`); ``--format research`` writes the HRM/TRM layout
(:func:`hf_fixedpoint.puzzles.export_research_format`) for the original training scripts. Example:

    python -m hf_fixedpoint.puzzles sudoku --out data/sudoku --kwargs '{"num_puzzles": 3000}' \\
        --test_kwargs '{"num_puzzles": 500, "min_difficulty": 20}' --num_proc 2
"""

import argparse
import json
import os

from .common import TASKS, build_dataset, save_split
from .research_format import export_research_format


def _json(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} must be a JSON object of build_dataset options, got {text!r}.")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hf_fixedpoint.puzzles", description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=TASKS.names())
    parser.add_argument("--out", required=True, help="output folder; one sub-folder per split")
    parser.add_argument("--splits", nargs="+", default=["train", "test"], choices=["train", "test"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", default="hf", choices=["hf", "research"])
    parser.add_argument("--kwargs", default="{}", help="JSON options of build_dataset for every split")
    parser.add_argument("--train_kwargs", default="{}", help="JSON options for the train split only")
    parser.add_argument("--test_kwargs", default="{}", help="JSON options for the test split only")
    parser.add_argument("--num_proc", type=int, default=None, help="worker processes (sudoku generation)")
    args = parser.parse_args(argv)
    common = _json(args.kwargs, "--kwargs")
    if args.num_proc is not None:
        common["num_proc"] = args.num_proc
    for split in args.splits:
        kwargs = {**common, **_json(getattr(args, f"{split}_kwargs"), f"--{split}_kwargs")}
        ds, meta = build_dataset(args.task, split, seed=args.seed, **kwargs)
        if args.format == "hf":
            folder = save_split(ds, meta, os.path.join(args.out, split))
        else:
            folder = export_research_format(ds, meta, args.out, split)
        print(f"{args.task} {split}: {len(ds)} rows, seq_len {meta.seq_len}, vocab {meta.vocab_size}, "
              f"{meta.num_puzzle_identifiers} puzzle ids -> {folder}")


if __name__ == "__main__":
    main()
