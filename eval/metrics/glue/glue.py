"""GLUE metrics as an `evaluate` module, loadable offline from its path.

    import evaluate
    from hf_fixedpoint.eval.local_metrics import metric_path
    glue = evaluate.load(metric_path("glue"), "mrpc")
    glue.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])   # {'accuracy': 0.75, 'f1': 0.666...}

The Hub module ``evaluate.load("glue", ...)`` cannot be reached offline, so the project ships its own. The metric per
task follows the GLUE benchmark: Matthews correlation for CoLA and the AX diagnostic set, Pearson and Spearman
correlation for STS-B, accuracy and F1 (positive class 1) for MRPC and QQP, accuracy for every other task (SST-2,
MNLI matched / mismatched, QNLI, RTE, WNLI, HANS). Result keys match the Hub module (``spearmanr`` included).
"""

import datasets
import evaluate
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

_METRICS = {
    "cola": ("matthews",), "ax": ("matthews",), "stsb": ("pearson", "spearmanr"), "mrpc": ("accuracy", "f1"),
    "qqp": ("accuracy", "f1"), "sst2": ("accuracy",), "mnli": ("accuracy",), "mnli_matched": ("accuracy",),
    "mnli_mismatched": ("accuracy",), "qnli": ("accuracy",), "rte": ("accuracy",), "wnli": ("accuracy",),
    "hans": ("accuracy",),
}

_INPUTS = """
Args:
    predictions: predicted labels (int), or predicted scores (float) for ``stsb``.
    references: gold labels (int), or gold scores (float) for ``stsb``.
Returns: ``matthews_correlation`` (cola, ax); ``pearson`` and ``spearmanr`` (stsb); ``accuracy`` and ``f1`` (mrpc,
    qqp); ``accuracy`` (all other tasks).
"""


class Glue(evaluate.Metric):
    """The metric of one GLUE task, chosen by the config name (``evaluate.load(path, "<task>")``)."""

    def _info(self):
        if self.config_name not in _METRICS:
            raise KeyError(f"GLUE config_name must be one of {sorted(_METRICS)}, got {self.config_name!r}")
        value = "float32" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=__doc__, citation="Wang et al., GLUE, ICLR 2019", inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value(value), "references": datasets.Value(value)}),
            format="numpy",
        )

    def _compute(self, predictions, references):
        names = _METRICS[self.config_name]
        if "pearson" in names:
            return {"pearson": float(pearsonr(predictions, references)[0]),
                    "spearmanr": float(spearmanr(predictions, references)[0])}
        if "matthews" in names:
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        result = {"accuracy": float((predictions == references).mean())}
        if "f1" in names:
            result["f1"] = float(f1_score(references, predictions))
        return result
