"""bench_fpsa --dispatch (section (c)): the constant is set in every copy and restored; both branches of a tiny map
agree on the open tokens; the per-call table runs (no timing is checked)."""

import math

import torch

from benchmarks.bench_fpsa_dispatch import FRACTIONS, _copies, _layer, dense_open_fraction, per_call


def test_dense_open_fraction_sets_every_copy_and_restores():
    before = [m.DENSE_OPEN_FRACTION for m in _copies()]
    assert len(set(map(id, _copies()))) == 3 and len(set(before)) == 1
    with dense_open_fraction(math.inf):
        assert all(m.DENSE_OPEN_FRACTION == math.inf for m in _copies())
    with dense_open_fraction(None):
        assert [m.DENSE_OPEN_FRACTION for m in _copies()] == before
    assert [m.DENSE_OPEN_FRACTION for m in _copies()] == before


def test_both_branches_agree_on_the_open_tokens():
    f, args = _layer(3, 6, 8, 2)
    stale = args[-1]
    tokens = torch.zeros(3, 6, dtype=torch.bool)
    tokens[0, :2] = tokens[2, 4] = True
    out = {}
    with torch.no_grad():
        for value in (math.inf, 0.0):
            with dense_open_fraction(value):
                stale.fill_(True)
                out[value] = f(*args, active=tokens[..., None].expand(3, 6, 2))
    torch.testing.assert_close(out[math.inf][tokens], out[0.0][tokens], rtol=1e-5, atol=1e-6)


def test_per_call_table_smoke(capsys):
    ratios = per_call(1, shapes=(("tiny", 2, 5, 8, 2),))
    assert set(ratios) == {("tiny", f) for f in FRACTIONS} and all(r > 0 for r in ratios.values())
    assert "sparse/dense" in capsys.readouterr().out
