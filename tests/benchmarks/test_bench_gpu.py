"""bench_gpu on the CPU at its tiny sizes: every family's row is measured, failures and the budget land in cells, the
table and the JSON carry the header (no timing is checked)."""

import dataclasses
import json

import pytest
import torch
import transformers

from benchmarks.bench_gpu import FAMILIES, HAS_CHECK_EVERY, NO_CHECK_EVERY, SKIPPED, main, reason

TINY = ["--device", "cpu", "--tiny", "--repeats", "1"]


def host_syncs(cell, name):
    ops = cell["ops"][name]
    return ops["host_reads"] + ops["nonzero"]


def test_eager_row_of_every_family(tmp_path, capsys):
    main(TINY + ["--configs", "eager", "--json", str(tmp_path / "gpu.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "gpu.json").read_text())
    rows = {r["family"]: r["cell"] for r in data["rows"]}
    assert list(rows) == list(FAMILIES)
    for key, cell in rows.items():
        assert cell["forward_ratio"] > 0 and cell["train_ratio"] > 0, (key, cell)
        assert cell["ops"]["model"]["aten"] > 0 and "gpu_busy" not in cell
        if not FAMILIES[key].decode:  # a plain forward reads nothing back (generate's loop does)
            assert host_syncs(cell, "base") <= 2, key
    # the solve of every solver family reads its convergence test back; Ouro's fixed loops do not
    for key in ("fpsa_bert_cap4", "fpsa_bert", "fpsa_vit", "attractor", "deq_lm"):
        assert host_syncs(rows[key], "model") > host_syncs(rows[key], "base"), key
    assert host_syncs(rows["ouro"], "model") <= 1
    head = data["header"]
    assert head["torch"] == torch.__version__ and head["transformers"] == transformers.__version__
    assert f"{head['device']}, torch {torch.__version__}, transformers {transformers.__version__}" in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| model | vs | configuration | forward ms |") and len(table) == 1 + len(FAMILIES)
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_check_every_and_compiled_cells(tmp_path):
    short = ["--set", "fp_max_iter=3", "--check-every", "0"]  # a short solve: compiling its unrolled loop is quick
    rows = main(TINY + short + ["--families", "deq_lm", "ouro", "--configs", "check_every"])
    assert [(r["family"], r["config"]) for r in rows] == [("deq_lm", "check_every=0")]  # Ouro has no solve
    every0 = rows[0]["cell"]
    main(TINY + short + ["--families", "deq_lm", "--configs", "eager", "compiled", "--json", str(tmp_path / "j")])
    rows = {r["config"]: r["cell"] for r in json.loads((tmp_path / "j").read_text())["rows"]}
    if HAS_CHECK_EVERY:  # the setting reaches the model: fewer host reads than the default solve; the graph is whole
        assert host_syncs(every0, "model") < host_syncs(rows["eager"], "model")
        assert rows["compiled"]["forward_ratio"] > 0 and set(rows["compiled"]["first_calls_s"]) == {"model", "base"}
    else:
        assert every0["skipped"] == NO_CHECK_EVERY
    for what in ("forward", "train"):  # a compiled cell is measured or says why not
        assert (f"{what}_ms" in rows["compiled"]) != (f"{what}_error" in rows["compiled"])


def test_budget_skips_the_remaining_cells(capsys):
    rows = main(TINY + ["--budget-s", "0"])
    assert rows and all(r["cell"]["skipped"] == SKIPPED and "forward_ms" not in r["cell"] for r in rows)
    assert sum(SKIPPED in line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")) == len(rows)


def test_a_family_that_cannot_be_built_is_a_cell(monkeypatch):
    from benchmarks import bench_gpu

    def refused(size):
        raise ValueError("hidden_size=32 is refused")

    monkeypatch.setitem(bench_gpu.FAMILIES, "deq_lm", dataclasses.replace(FAMILIES["deq_lm"], pair=refused))
    (row,) = main(TINY + ["--families", "deq_lm", "--configs", "eager"])
    assert row["cell"]["skipped"] == "building the models failed: ValueError: hidden_size=32 is refused"


def test_reason_is_one_short_line():
    error = RuntimeError('data-dependent | branch\n  from user code:\n File "/x/fp_solvers.py", line 596, in run\n')
    assert reason(error) == "RuntimeError: data-dependent / branch (fp_solvers.py:596)"
    assert len(reason(ValueError("x" * 500))) <= 110


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        main(TINY[:3] + ["--repeats", "0"])
    with pytest.raises(ValueError, match="--check-every takes integers >= 0"):
        main(TINY + ["--check-every", "-1"])
    with pytest.raises(ValueError, match="--device 'tpu' is not a torch device"):
        main(["--device", "tpu"])
    with pytest.raises(ValueError, match=r"--set takes fixed-point settings .*, got \['fpsa_tol'\]"):
        main(TINY + ["--set", "fpsa_tol=0.1"])
    with pytest.raises(SystemExit):
        main(TINY + ["--families", "bert"])
