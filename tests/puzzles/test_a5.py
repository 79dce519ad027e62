"""A5 state tracking: the group table is A5 and labels are the running products, composed directly."""

import itertools

import numpy as np
import pytest

from hf_fixedpoint.puzzles import build_dataset
from hf_fixedpoint.puzzles.a5 import A5_ELEMENTS, MUL


def compose(p, q):
    """(p ∘ q)(i) = p(q(i)) on tuples."""
    return tuple(p[q[i]] for i in range(5))


def test_table_is_the_alternating_group():
    assert len(A5_ELEMENTS) == 60 == len(set(A5_ELEMENTS)) and A5_ELEMENTS[0] == (0, 1, 2, 3, 4)
    assert set(A5_ELEMENTS) < set(itertools.permutations(range(5)))
    assert (0, 2, 1, 3, 4) not in A5_ELEMENTS  # a transposition is odd
    for a, b in [(1, 2), (7, 30), (59, 59)]:
        assert A5_ELEMENTS[MUL[a, b]] == compose(A5_ELEMENTS[a], A5_ELEMENTS[b])
    assert all(sorted(row) == list(range(60)) for row in MUL)  # Latin square: a group table
    assert (MUL != MUL.T).any()  # non-abelian


@pytest.mark.parametrize("length", [32, 64, 128])
def test_labels_are_running_products(length):
    ds, meta = build_dataset("a5", "test", num_samples=5, length=length)
    assert meta.seq_len == length and meta.vocab_size == 61 and meta.difficulty == "length"
    for row in ds:
        assert len(row["inputs"]) == length and row["length"] == length
        state = A5_ELEMENTS[0]
        for token, label in zip(row["inputs"], row["labels"]):
            state = compose(state, A5_ELEMENTS[token - 1])
            assert A5_ELEMENTS[label - 1] == state


def test_padding_reproducibility_and_errors():
    ds, meta = build_dataset("a5", "train", num_samples=4, length=8, pad_to=12, seed=2)
    inputs, labels = np.array(ds["inputs"]), np.array(ds["labels"])
    assert meta.seq_len == 12 and (inputs[:, 8:] == meta.pad_id).all() and (labels[:, 8:] == -100).all()
    again, _ = build_dataset("a5", "train", num_samples=4, length=8, pad_to=12, seed=2)
    other, _ = build_dataset("a5", "test", num_samples=4, length=8, pad_to=12, seed=2)
    assert again["inputs"] == ds["inputs"] and other["inputs"] != ds["inputs"]
    with pytest.raises(ValueError, match="pad_to"):
        build_dataset("a5", "train", length=8, pad_to=4)
    with pytest.raises(ValueError, match="length"):
        build_dataset("a5", "train", length=0)


def test_mixed_lengths():
    ds, meta = build_dataset("a5", "train", num_samples=200, length=6, min_length=2, pad_to=8)
    inputs, labels, lengths = np.array(ds["inputs"]), np.array(ds["labels"]), np.array(ds["length"])
    assert meta.seq_len == 8 and lengths.min() == 2 and lengths.max() == 6
    for row, lab, n in zip(inputs, labels, lengths):
        assert (row[:n] > 0).all() and (row[n:] == 0).all() and (lab[n:] == -100).all()
        state = A5_ELEMENTS[0]
        for token, label in zip(row[:n], lab[:n]):
            state = compose(state, A5_ELEMENTS[token - 1])
            assert A5_ELEMENTS[label - 1] == state
    fixed, _ = build_dataset("a5", "train", num_samples=200, length=6)
    assert (np.array(fixed["inputs"])[lengths == 6] == inputs[lengths == 6, :6]).all()  # same words, cut short
    with pytest.raises(ValueError, match=r"min_length=7 is out of range"):
        build_dataset("a5", "train", length=6, min_length=7)
