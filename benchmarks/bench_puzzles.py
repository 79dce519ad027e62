"""Generation speed of the puzzle datasets (wall seconds per split, rows per second); no cache involved.

    OMP_NUM_THREADS=1 python benchmarks/bench_puzzles.py            # defaults below
    python benchmarks/bench_puzzles.py --sudoku 3000 --num_proc 2   # more / parallel Sudoku
"""

import argparse
import time

import numpy as np

from hf_fixedpoint.puzzles import build_dataset


def timed(label, task, split, **kwargs):
    start = time.perf_counter()
    ds, meta = build_dataset(task, split, **kwargs)
    seconds = time.perf_counter() - start
    extra = ""
    if meta.difficulty:
        d = np.asarray(ds[meta.difficulty])
        extra = f"  {meta.difficulty} mean {d.mean():.1f} median {np.median(d):.0f} max {d.max()}"
    print(f"{label:<44s} {len(ds):>7d} rows {seconds:7.2f} s {len(ds) / seconds:9.1f} rows/s{extra}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sudoku", type=int, default=1000)
    parser.add_argument("--num_proc", type=int, default=1)
    parser.add_argument("--maze", type=int, default=1000)
    parser.add_argument("--arc_aug", type=int, default=8)
    args = parser.parse_args()
    timed(f"sudoku generate {args.sudoku} (num_proc {args.num_proc})", "sudoku", "train", num_puzzles=args.sudoku,
          num_proc=args.num_proc)
    timed("sudoku generate 200, min_difficulty 50", "sudoku", "test", num_puzzles=200, min_difficulty=50,
          num_proc=args.num_proc)
    timed(f"sudoku {args.sudoku // 10} puzzles + 9 augmentations", "sudoku", "train", num_puzzles=args.sudoku // 10,
          num_aug=9)
    timed(f"maze generate {args.maze} (path >= 110)", "maze", "train", num_mazes=args.maze)
    timed("a5 10000 x length 32", "a5", "train", num_samples=10000, length=32)
    timed("a5 10000 x length 128", "a5", "test", num_samples=10000, length=128)
    timed(f"arc1 train, num_aug {args.arc_aug}", "arc1", "train", num_aug=args.arc_aug)
    timed(f"arc1 test, num_aug {args.arc_aug}", "arc1", "test", num_aug=args.arc_aug)


if __name__ == "__main__":
    main()
