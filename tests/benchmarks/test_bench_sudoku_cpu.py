"""Sudoku CPU benchmark: matched parameter counts, and a smoke run of every model through the recipe (seconds)."""

import torch

from benchmarks.bench_sudoku_cpu import VARIANTS, alone_in_unit, build_parser, main, matched_hidden
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
                 "--cross_eval", "--breakdown", "--output_dir", str(tmp_path)])
    names = [r[1] for r in rows]
    assert names[:2] == ["fprm", "fprm eval per_sample"] and "fprm_per_sample eval official" in names
    cross = sum(model == "fprm" for model, _ in VARIANTS.values())  # --cross_eval: one more row per FPRM variant
    assert set(VARIANTS) <= set(names) and len(rows) == len(VARIANTS) + cross
    for blanks, _, _, params, _, steps, result, _ in rows:
        assert blanks == 5 and steps == 2 and params > 0
        assert 0 <= result["exact_accuracy"] <= 1 and 0 <= result["cell_accuracy_changed"] <= 1
        assert result["iterations_mean"] >= 1
    out = capsys.readouterr().out
    assert "| blanks | model | hidden | params |" in out and "| blanks | model | row | column | box | none |" in out
    assert out.count("| 5 | ") == len(rows) + len(VARIANTS)  # one breakdown row per trained model


def test_alone_in_unit():
    labels = torch.arange(81).view(1, 81) % 9 + 1
    inputs = labels.clone()
    inputs[0, [0, 1, 40, 80]] = 0  # (0,0) and (0,1): one row and box; (4,4) alone everywhere; (8,8) alone too
    inputs[0, 72] = 0  # (8,0): shares row 8 with (8,8) and column 0 with (0,0)
    groups = alone_in_unit(inputs, labels)
    assert groups["row"][0].nonzero().flatten().tolist() == [40]
    assert groups["column"][0].nonzero().flatten().tolist() == [1, 40, 80]
    assert groups["box"][0].nonzero().flatten().tolist() == [40, 72, 80]
