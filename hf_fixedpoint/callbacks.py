"""``transformers.Trainer`` integration: the fixed-point statistics of the training forwards in the Trainer logs.

Example:
    >>> from transformers import Trainer
    >>> from hf_fixedpoint.callbacks import FixedPointStatsCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FixedPointStatsCallback()])

Every ``logging_steps`` the training log (``trainer.state.log_history`` and the callbacks after this one: the
printer, the progress bar) gains the mean over the steps since the last log of the model output's
``fp_stats.summary()``: ``fp_nstep_mean``, ``fp_converged_fraction``, ... for a ``FixedPointStats``;
``fpsa_iter_mean``, ``fpsa_iter_p90``, ``fpsa_cap_hit_rate``, ... for FPSA. The ``report_to`` integrations are
called before user callbacks, so they do not see these keys; ``trainer.state.log_history`` has them.
"""

from transformers import TrainerCallback


class FixedPointStatsCallback(TrainerCallback):
    """Averages ``output.fp_stats.summary()`` over the training forwards between two logs and adds it to the log."""

    def __init__(self):
        self._sums, self._count, self._handle = {}, 0, None

    def _record(self, module, args, output):
        stats = getattr(output, "fp_stats", None)
        if not module.training or stats is None or not hasattr(stats, "summary"):
            return
        for key, value in stats.summary().items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value)
        self._count += 1

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self._handle is None and model is not None:
            self._handle = model.register_forward_hook(self._record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Training logs carry "loss"; evaluation logs ("eval_loss", ...) keep their own keys.
        if not self._count or logs is None or "loss" not in logs:
            return
        means = {key: total / self._count for key, total in self._sums.items()}
        logs.update(means)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(means)
        self._sums, self._count = {}, 0

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


__all__ = ["FixedPointStatsCallback"]
