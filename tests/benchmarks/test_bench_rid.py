"""RID benchmark: the task generator's invariants and a smoke run of the three models."""

import torch

from benchmarks.bench_rid import main, rid_batch


def test_rid_batch_invariants():
    g = torch.Generator().manual_seed(0)
    for k in (0, 1, 7):
        ids, labels = rid_batch(256, k, 5, g)
        assert ids.shape == labels.shape == (256, k + 3)
        assert (labels[:, :-1] == -100).all() and ids.min() >= 1 and ids.max() <= 5
        keys, values = ids[:, -1], labels[:, -1]
        before = ids[:, :-1]
        assert ((before == keys[:, None]).sum(1) == 1).all()  # the key occurs exactly once before the query
        where = (before == keys[:, None]).float().argmax(1)
        assert (before[torch.arange(256), where + 1] == values).all() and (values != keys).all()
        if k:  # every place and every non-key symbol occurs: the answer is not given away by position or symbol
            assert len(set(where.tolist())) == k + 1
            assert set(values.tolist()) == set(range(1, 6))


def test_smoke_run_reports_every_model(capsys):
    results = main(["--steps", "2", "--max_distractors", "4", "--eval_distractors", "2", "4", "--eval_size", "16",
                    "--hidden_size", "16", "--log_every", "1"])
    assert set(results) == {"TF-1L", "TF-2L", "FPSA-1L"} and all(set(r) == {2, 4} for r in results.values())
    out = capsys.readouterr().out
    assert "FPSA-1L - TF-1L at K=4 (largest trained)" in out and "cap-hit" in out
