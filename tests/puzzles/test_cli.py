"""``python -m hf_fixedpoint.puzzles``: builds splits and saves them in either format; save_split / load_saved."""

import json

import numpy as np
import pytest

from hf_fixedpoint.puzzles import build_dataset, load_research_format, load_saved
from hf_fixedpoint.puzzles.__main__ import main


def test_cli_hf_format_round_trips(tmp_path, capsys):
    main(["a5", "--out", str(tmp_path), "--kwargs", '{"num_samples": 6}', "--train_kwargs", '{"length": 4}',
          "--test_kwargs", '{"length": 9}', "--seed", "3"])
    assert "a5 test: 6 rows, seq_len 9" in capsys.readouterr().out
    for split, length in (("train", 4), ("test", 9)):
        ds, meta = load_saved(tmp_path / split)
        direct, direct_meta = build_dataset("a5", split, seed=3, num_samples=6, length=length)
        assert ds["inputs"] == direct["inputs"] and ds["labels"] == direct["labels"] and meta == direct_meta


def test_cli_research_format(tmp_path):
    main(["maze", "--out", str(tmp_path), "--splits", "test", "--format", "research",
          "--kwargs", '{"num_mazes": 2, "min_path_length": 30}'])
    assert json.loads((tmp_path / "test" / "dataset.json").read_text())["seq_len"] == 900
    ds, _ = load_research_format(tmp_path, "test")
    direct, _ = build_dataset("maze", "test", num_mazes=2, min_path_length=30)
    assert np.array_equal(np.array(ds["labels"]), np.array(direct["labels"]))


def test_cli_and_loader_errors(tmp_path):
    with pytest.raises(SystemExit, match="not valid JSON"):
        main(["a5", "--out", str(tmp_path), "--kwargs", "{num_samples: 3}"])
    with pytest.raises(SystemExit, match="JSON object"):
        main(["a5", "--out", str(tmp_path), "--kwargs", "[3]"])
    with pytest.raises(SystemExit):
        main(["chess", "--out", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="puzzle_metadata.json"):
        load_saved(tmp_path / "nothing")
