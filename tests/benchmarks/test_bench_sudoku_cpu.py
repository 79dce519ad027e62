"""Sudoku CPU benchmark: matched parameter counts, and a smoke run of every model through the recipe (seconds)."""

from benchmarks.bench_sudoku_cpu import VARIANTS, build_parser, main, matched_hidden
from hf_fixedpoint.puzzles import build_dataset


def test_hidden_sizes_match_fprm_parameters_within_ten_percent():
    _, meta = build_dataset("sudoku", "train", num_puzzles=1, num_blanks=1)
    args = build_parser().parse_args(["--hidden", "64", "--heads", "4"])
    target, sizes = matched_hidden(args, meta)
    assert set(sizes) == set(VARIANTS) and sizes["fprm"] == (64, target)
    for name, (hidden, params) in sizes.items():
        assert hidden % 4 == 0 and abs(params - target) <= 0.1 * target, (name, hidden, params, target)


def test_smoke_run_prints_one_row_per_model(tmp_path, capsys):
    rows = main(["--models", *VARIANTS, "--blanks", "5", "--minutes", "0", "--max_steps", "2", "--hidden", "16",
                 "--heads", "2", "--batch_size", "2", "--train_puzzles", "4", "--num_aug", "0", "--test_puzzles", "2",
                 "--cross_eval", "--output_dir", str(tmp_path)])
    names = [r[1] for r in rows]
    assert names[:2] == ["fprm", "fprm eval per_sample"] and "fprm_per_sample eval official" in names
    assert set(VARIANTS) <= set(names) and len(rows) == len(VARIANTS) + 3
    for blanks, _, _, params, _, steps, result, _ in rows:
        assert blanks == 5 and steps == 2 and params > 0
        assert 0 <= result["exact_accuracy"] <= 1 and 0 <= result["cell_accuracy_changed"] <= 1
        assert result["iterations_mean"] >= 1
    out = capsys.readouterr().out
    assert "| blanks | model | hidden | params |" in out and out.count("| 5 | ") == len(rows)
