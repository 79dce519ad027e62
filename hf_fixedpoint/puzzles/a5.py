"""A5 state tracking: a word of A5 permutations, labelled at every position with its running product.

A5 (the 60 even permutations of 5 points) is the smallest non-solvable group, so tracking the running product
needs sequential computation that a fixed-depth transformer cannot express for unbounded lengths — the standard
length-generalisation probe for looped models. Train at ``length=32``, test at 64 or 128.

Tokens: PAD 0; group element ``k`` (index in :data:`A5_ELEMENTS`, lexicographic order of the tuples) is token
``k + 1``; token 1 is the identity. Position ``t`` of ``labels`` holds ``g_1 ∘ g_2 ∘ … ∘ g_t`` where
``(p ∘ q)(i) = p(q(i))``; as arrays ``compose(p, q) = p[q]``.
"""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np

from ..core.fp_registry import check_number
from .common import IGNORE_LABEL_ID, PuzzleMetadata, register_task, split_rng


def _is_even(p) -> bool:
    inversions = sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p)))
    return inversions % 2 == 0


A5_ELEMENTS = tuple(p for p in itertools.permutations(range(5)) if _is_even(p))
"""The 60 elements of A5 as tuples ``p`` with ``p[i]`` = image of point ``i``; index 0 is the identity."""

_INDEX = {p: k for k, p in enumerate(A5_ELEMENTS)}
_PERMS = np.array(A5_ELEMENTS)
# MUL[a, b] = index of A5_ELEMENTS[a] ∘ A5_ELEMENTS[b]
MUL = np.array([[_INDEX[tuple(_PERMS[a][_PERMS[b]])] for b in range(60)] for a in range(60)], dtype=np.int64)


def running_products(elements: np.ndarray) -> np.ndarray:
    """``[N, L]`` element indices -> ``[N, L]`` indices of their prefix products (vectorised over N)."""
    out = np.empty_like(elements)
    state = np.zeros(elements.shape[0], dtype=np.int64)  # identity
    for t in range(elements.shape[1]):
        state = MUL[state, elements[:, t]]
        out[:, t] = state
    return out


@register_task("a5")
def build_a5(split: str, *, seed: int = 0, num_samples: int = 10000, length: int = 32,
             min_length: Optional[int] = None, pad_to: Optional[int] = None):
    """``num_samples`` uniform random words of ``length`` A5 elements.

    ``min_length``: draw each word's length uniformly from ``[min_length, length]`` instead (the FPRM code's
    ``strict_len=False``: short words teach the group table, long ones the iteration). ``pad_to``: pad every row to
    this length (PAD inputs, -100 labels) so splits of different lengths share one ``seq_len``. Extra column
    ``length`` (the difficulty measure).
    """
    check_number(num_samples, "num_samples", low=1, integer=True)
    check_number(length, "length", low=1, integer=True)
    if min_length is not None:
        check_number(min_length, "min_length", low=1, high=length, integer=True)
    seq_len = length if pad_to is None else pad_to
    check_number(seq_len, "pad_to", low=length, integer=True)
    rng = split_rng("a5", split, seed)
    elements = rng.integers(0, 60, size=(num_samples, length))
    lengths = (np.full(num_samples, length, dtype=np.int64) if min_length is None
               else rng.integers(min_length, length + 1, size=num_samples))
    inside = np.arange(length)[None, :] < lengths[:, None]
    inputs = np.zeros((num_samples, seq_len), dtype=np.int32)
    labels = np.full((num_samples, seq_len), IGNORE_LABEL_ID, dtype=np.int32)
    inputs[:, :length] = np.where(inside, elements + 1, 0)
    labels[:, :length] = np.where(inside, running_products(elements) + 1, IGNORE_LABEL_ID)
    columns = {
        "inputs": inputs,
        "labels": labels,
        "puzzle_identifiers": np.zeros(num_samples, dtype=np.int64),
        "length": lengths,
        "group": np.arange(num_samples, dtype=np.int64),
    }
    names = ("<pad>",) + tuple("".join(map(str, p)) for p in A5_ELEMENTS)
    meta = PuzzleMetadata(task="a5", vocab_size=61, seq_len=seq_len, num_groups=num_samples, difficulty="length",
                          token_names=names)
    return columns, meta
