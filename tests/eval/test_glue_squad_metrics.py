"""The project's GLUE and SQuAD v2 `evaluate` modules load offline from their paths and give hand-computed values."""

import math

import pytest

evaluate = pytest.importorskip("evaluate")

from hf_fixedpoint.eval.local_metrics import METRICS_DIR, load_metric, metric_path  # noqa: E402

PREDS, REFS = [0, 1, 1, 0], [0, 1, 0, 0]  # TP=1, TN=2, FP=1, FN=0


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
        monkeypatch.setenv(var, "1")


def test_modules_are_package_data_files():
    assert (METRICS_DIR / "glue" / "glue.py").is_file() and (METRICS_DIR / "squad_v2" / "squad_v2.py").is_file()
    with pytest.raises(ValueError, match="metric name must be one of"):
        metric_path("sqad")


@pytest.mark.parametrize("task", ["cola", "ax"])
def test_matthews_correlation(task):
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = 2 / sqrt(2*1*3*2)
    result = load_metric("glue", task).compute(predictions=PREDS, references=REFS)
    assert result == {"matthews_correlation": pytest.approx(2 / math.sqrt(12), abs=1e-12)}


@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_accuracy_and_f1(task):
    # precision 1/2, recall 1/1 -> F1 = 2/3
    result = load_metric("glue", task).compute(predictions=PREDS, references=REFS)
    assert result == {"accuracy": 0.75, "f1": pytest.approx(2 / 3, abs=1e-12)}


@pytest.mark.parametrize("task", ["sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "hans"])
def test_accuracy_tasks(task):
    result = load_metric("glue", task).compute(predictions=[0, 1, 2, 2, 1], references=[0, 1, 2, 0, 0])
    assert result == {"accuracy": pytest.approx(0.6)}


def test_stsb_pearson_and_spearman():
    glue = load_metric("glue", "stsb")
    refs = [0.0, 1.0, 2.0, 3.0]
    assert glue.compute(predictions=[1.0, 3.0, 5.0, 7.0], references=refs) == pytest.approx(
        {"pearson": 1.0, "spearmanr": 1.0})
    assert glue.compute(predictions=[3.0, 2.0, 1.0, 0.0], references=refs) == pytest.approx(
        {"pearson": -1.0, "spearmanr": -1.0})
    # Monotone but not linear: Spearman 1, Pearson from its definition (float32 inputs, hence the tolerance).
    preds = [0.0, 1.0, 2.0, 10.0]
    mp, mr = sum(preds) / 4, sum(refs) / 4
    cov = sum((p - mp) * (r - mr) for p, r in zip(preds, refs))
    pearson = cov / math.sqrt(sum((p - mp) ** 2 for p in preds) * sum((r - mr) ** 2 for r in refs))
    result = glue.compute(predictions=preds, references=refs)
    assert result["spearmanr"] == pytest.approx(1.0) and result["pearson"] == pytest.approx(pearson, abs=1e-6)
    assert pearson < 0.95


def test_glue_unknown_task_names_the_choices():
    with pytest.raises(KeyError, match="config_name must be one of .*'cola'"):
        load_metric("glue", "colaa")


def _squad_inputs():
    predictions = [
        {"id": "q1", "prediction_text": "Broncos", "no_answer_probability": 0.0},          # EM 1 via "the Broncos"
        {"id": "q2", "prediction_text": "Santa Clara", "no_answer_probability": 0.1},      # EM 0, F1 0.8
        {"id": "q3", "prediction_text": "Levi", "no_answer_probability": 0.2},             # unanswerable, answered
        {"id": "q4", "prediction_text": "", "no_answer_probability": 0.9},                 # unanswerable, abstained
    ]
    references = [
        {"id": "q1", "answers": {"text": ["Denver Broncos", "the Broncos!"], "answer_start": [0, 7]}},
        {"id": "q2", "answers": {"text": ["Santa Clara, California"], "answer_start": [3]}},
        {"id": "q3", "answers": {"text": [], "answer_start": []}},
        {"id": "q4", "answers": {"text": ["The"], "answer_start": [0]}},  # normalises to "" -> unanswerable
    ]
    return predictions, references


def test_squad_v2_scores_and_splits():
    predictions, references = _squad_inputs()
    result = load_metric("squad_v2").compute(predictions=predictions, references=references)
    expected = {"exact": 50.0, "f1": 70.0, "total": 4, "HasAns_exact": 50.0, "HasAns_f1": 90.0, "HasAns_total": 2,
                "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2,
                # threshold sweep from "answer nothing" (2 of 4): q1 +1 -> 3; q2 +0 (EM) / +0.8 (F1); q3 -1; q4 0
                "best_exact": 75.0, "best_exact_thresh": 0.0, "best_f1": 95.0, "best_f1_thresh": 0.1}
    assert result == pytest.approx(expected, abs=1e-6)


def test_squad_v2_no_answer_threshold():
    predictions, references = _squad_inputs()
    result = load_metric("squad_v2").compute(predictions=predictions, references=references, no_answer_threshold=0.15)
    # q3 (0.2) and q4 (0.9) now count as "no answer" -> both correct; q1, q2 unchanged
    assert result["exact"] == pytest.approx(75.0) and result["f1"] == pytest.approx(95.0)
    assert result["NoAns_exact"] == 100.0 and result["HasAns_f1"] == pytest.approx(90.0)


def test_squad_v2_normalisation_and_missing_prediction():
    squad = load_metric("squad_v2")
    refs = [{"id": "a", "answers": {"text": ["An apple, a day."], "answer_start": [0]}}]
    preds = [{"id": "a", "prediction_text": "  apple   DAY", "no_answer_probability": 0.0}]
    assert squad.compute(predictions=preds, references=refs)["exact"] == 100.0
    with pytest.raises(ValueError, match="lack the reference ids"):
        squad.compute(predictions=[{**preds[0], "id": "b"}], references=refs)
