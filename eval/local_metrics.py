"""The project's own `evaluate` metric modules (``eval/metrics/<name>/<name>.py``), loadable without the Hub.

``evaluate.load("glue", ...)`` and ``evaluate.load("squad_v2")`` fetch their scripts from the Hub and fail offline;
``evaluate.load(<folder>)`` runs a local module instead. These helpers give the installed folder of each module.
"""

from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent / "metrics"
METRICS = ("glue", "squad_v2")


def metric_path(name):
    """Folder of the metric module ``name`` (pass it to ``evaluate.load``)."""
    if name not in METRICS:
        raise ValueError(f"metric name must be one of {list(METRICS)}, got {name!r}")
    return str(METRICS_DIR / name)


def load_metric(name, config_name=None, **kwargs):
    """``evaluate.load`` of the project's metric module ``name`` (e.g. ``load_metric("glue", "cola")``)."""
    import evaluate

    return evaluate.load(metric_path(name), config_name, **kwargs)
