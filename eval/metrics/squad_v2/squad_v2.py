"""SQuAD v2.0 metric as an `evaluate` module, loadable offline from its path.

    import evaluate
    from hf_fixedpoint.eval.local_metrics import metric_path
    squad_v2 = evaluate.load(metric_path("squad_v2"))
    squad_v2.compute(
        predictions=[{"id": "q1", "prediction_text": "Denver Broncos", "no_answer_probability": 0.0}],
        references=[{"id": "q1", "answers": {"text": ["Denver Broncos"], "answer_start": [177]}}])

Implements the official SQuAD 2.0 evaluation (Rajpurkar et al. 2018): answers are normalised (lower case, punctuation
removed, articles a/an/the removed, whitespace collapsed); exact match and token-level F1 take the maximum over the
gold answers; an unanswerable question has the single gold answer "" and scores 1 only for an empty prediction. A
prediction whose ``no_answer_probability`` exceeds ``no_answer_threshold`` counts as "no answer". Besides the
overall ``exact`` / ``f1`` / ``total`` it reports the ``HasAns_*`` and ``NoAns_*`` splits and the best no-answer
threshold (``best_exact``, ``best_exact_thresh``, ``best_f1``, ``best_f1_thresh``), like the official script.
"""

import collections
import re
import string

import datasets
import evaluate

_INPUTS = """
Args:
    predictions: list of {"id": str, "prediction_text": str, "no_answer_probability": float}.
    references: list of {"id": str, "answers": {"text": list[str], "answer_start": list[int]}}; an empty ``text``
        list marks an unanswerable question.
    no_answer_threshold: predictions with ``no_answer_probability`` above it count as "no answer" (default 1.0).
Returns: exact, f1, total; HasAns_exact/f1/total and NoAns_exact/f1/total where such questions exist; best_exact,
    best_exact_thresh, best_f1, best_f1_thresh. Scores are percentages.
"""

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text):
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace (official SQuAD rule)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_score(gold, pred):
    return float(normalize_answer(gold) == normalize_answer(pred))


def f1_score(gold, pred):
    """Token-level F1 of the normalised answers; two empty answers agree (1.0), one empty answer scores 0."""
    gold_tokens, pred_tokens = normalize_answer(gold).split(), normalize_answer(pred).split()
    if not gold_tokens or not pred_tokens:
        return float(gold_tokens == pred_tokens)
    common = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def best_threshold(scores, no_answer_probs, has_answer, predicted_text):
    """Sweep the no-answer threshold over the sorted probabilities; start from answering nothing at all."""
    current = best = sum(not has for has in has_answer.values())
    best_thresh = 0.0
    for qid in sorted(scores, key=lambda q: no_answer_probs[q]):
        if has_answer[qid]:
            current += scores[qid]
        elif predicted_text[qid]:
            current -= 1
        if current > best:
            best, best_thresh = current, no_answer_probs[qid]
    return 100.0 * best / len(scores), float(best_thresh)


class SquadV2(evaluate.Metric):
    """Exact match and F1 for SQuAD 2.0 style extractive QA with unanswerable questions."""

    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="Rajpurkar, Jia and Liang, Know What You Don't Know, ACL 2018",
            inputs_description=_INPUTS,
            features=datasets.Features({
                "predictions": {"id": datasets.Value("string"), "prediction_text": datasets.Value("string"),
                                "no_answer_probability": datasets.Value("float32")},
                "references": {"id": datasets.Value("string"),
                               "answers": datasets.Sequence({"text": datasets.Value("string"),
                                                             "answer_start": datasets.Value("int32")})},
            }),
        )

    def _compute(self, predictions, references, no_answer_threshold=1.0):
        preds = {p["id"]: p for p in predictions}
        missing = [r["id"] for r in references if r["id"] not in preds]
        if missing:
            raise ValueError(f"predictions lack the reference ids {missing[:5]} (every reference needs a prediction)")
        exact, f1, has_answer, probs, texts = {}, {}, {}, {}, {}
        for ref in references:
            qid, pred = ref["id"], preds[ref["id"]]
            golds = [t for t in ref["answers"]["text"] if normalize_answer(t)] or [""]
            has_answer[qid] = golds != [""]
            probs[qid], texts[qid] = float(pred["no_answer_probability"]), pred["prediction_text"]
            exact[qid] = max(exact_score(g, texts[qid]) for g in golds)
            f1[qid] = max(f1_score(g, texts[qid]) for g in golds)

        def thresholded(raw):
            return {q: float(not has_answer[q]) if probs[q] > no_answer_threshold else s for q, s in raw.items()}

        exact_t, f1_t = thresholded(exact), thresholded(f1)
        result = {"exact": 100.0 * sum(exact_t.values()) / len(exact_t),
                  "f1": 100.0 * sum(f1_t.values()) / len(f1_t), "total": len(exact_t)}
        for prefix, want in (("HasAns", True), ("NoAns", False)):
            qids = [q for q in exact_t if has_answer[q] == want]
            if qids:
                result[f"{prefix}_exact"] = 100.0 * sum(exact_t[q] for q in qids) / len(qids)
                result[f"{prefix}_f1"] = 100.0 * sum(f1_t[q] for q in qids) / len(qids)
                result[f"{prefix}_total"] = len(qids)
        result["best_exact"], result["best_exact_thresh"] = best_threshold(exact, probs, has_answer, texts)
        result["best_f1"], result["best_f1_thresh"] = best_threshold(f1, probs, has_answer, texts)
        return result
