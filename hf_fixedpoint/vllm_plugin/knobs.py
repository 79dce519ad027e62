"""Per-request Ouro settings in vLLM: ``SamplingParams(extra_args={"total_ut_steps": k, "exit_threshold": q})``.

vLLM hands a model only the batch's tokens, never the requests' ``SamplingParams``. Its logits processors do see
them: every processor's ``update_state`` learns which request sits in which batch row before each forward pass, and
its ``validate_params`` checks each request as it arrives (a bad value is a ``ValueError``, an HTTP 400 when served).
``OuroRequestKnobs`` is such a processor that changes no logits: it keeps each row's settings, and the model reads
them per token (rows are mapped to tokens through the attention metadata's ``query_start_loc``).

The largest allowed ``total_ut_steps`` is the engine's loop count (the config's ``total_ut_steps``, e.g. from
``hf_overrides``): the paged KV cache holds one slot per (loop, layer) for that many loops. The front-end learns it
from ``OuroConfigHook``, which vLLM runs on the engine's config when it is built (in the front-end process).

With speculative decoding (``speculative_config``), vLLM builds no custom logits processor (``build_logitsprocs`` in
``vllm/v1/sample/logits_processor/__init__.py``: only its min-tokens one), so the model never sees the requests'
settings; ``validate_params``, which vLLM's front-end still calls, refuses them then instead of serving every request
at the engine's loop count.

``AttractorConfigHook`` and ``SolveConfigHook`` are the Attractor LM's and SELF's / DEQ-LM's: they refuse, at engine
start, the settings their native models do not serve (subclasses of vLLM's ``VerifyAndUpdateConfig``, as vLLM's own
hooks).
"""

import logging
import math

from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .settings import check_engine, check_request, check_stop_fraction

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, whose handlers vLLM configures

# The Ouro engine configured in this process, for validate_params: its loop count (None: none), and whether it
# decodes speculatively.
_SERVED = {"loops": None, "speculative": False}


class OuroConfigHook(VerifyAndUpdateConfig):
    """Ouro's config hook: refuses the settings the native Ouro does not serve, and records the engine's loop count
    for the request checks of this process."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        config = vllm_config.model_config.hf_config
        if getattr(config, "early_exit_mode", "select") != "select":
            raise ValueError(f"early_exit_mode={config.early_exit_mode!r} is not served by hf-fixedpoint's vLLM "
                             "plugin: an exited token's deeper cache slots would hold copies of its exit loop's keys, "
                             "which the paged cache does not do. Allowed values: 'select' (start vLLM with "
                             "hf_overrides={'early_exit_mode': 'select'}); 'skip' runs with transformers.")
        if getattr(config, "early_exit_step", None) is not None:
            raise ValueError(f"early_exit_step={config.early_exit_step!r} is not served by hf-fixedpoint's vLLM "
                             "plugin. Allowed values: None (start vLLM with hf_overrides={'early_exit_step': None}); "
                             "decode a given loop with extra_args={'total_ut_steps': step + 1, 'exit_threshold': "
                             "None} instead.")
        _SERVED["loops"] = int(config.total_ut_steps)
        _SERVED["speculative"] = vllm_config.speculative_config is not None


class AttractorConfigHook(VerifyAndUpdateConfig):
    """Attractor LM's config hook: refuses, at engine start, the settings the
    native Attractor LM would not serve as transformers runs them."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_stop_fraction(vllm_config.model_config.hf_config)


class SolveConfigHook(VerifyAndUpdateConfig):
    """SELF-LLaMA / SELF-Mistral's and DEQ-LM's config hook: ``settings.check_engine``, and eager execution (the number
    of solve iterations depends on the data, which neither a CUDA graph nor vLLM's compiled graph can hold)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model_config = vllm_config.model_config
        check_engine(model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)
        if not model_config.enforce_eager:
            logger.warning("hf-fixedpoint's vLLM plugin: %s runs eagerly (enforce_eager=True): its fixed-point solves "
                           "stop when they converge.", model_config.architecture)
            model_config.enforce_eager = True


def register_config_hook(architecture: str, hook=OuroConfigHook) -> None:
    """Add ``hook`` to vLLM's table of per-architecture config hooks."""
    from vllm.model_executor.models import config as model_configs

    model_configs.MODELS_CONFIG_MAP[architecture] = hook


class OuroRequestKnobs(LogitsProcessor):
    """Keeps each batch row's Ouro settings; leaves the logits alone. ``current`` is the newest one built in this
    process: the one of the engine whose model reads it (one engine per worker process)."""

    current = None

    @classmethod
    def validate_params(cls, sampling_params):
        settings = check_request(sampling_params.extra_args, _SERVED["loops"])
        if settings and _SERVED["loops"] is None:
            raise ValueError(f"extra_args {sorted(settings)} are per-request settings of hf-fixedpoint's Ouro "
                             "models; the model served here is not one.")
        if settings and _SERVED["speculative"]:
            raise ValueError(f"extra_args {sorted(settings)} are not served with speculative decoding: vLLM builds no "
                             "custom logits processor when speculative_config is set, so the model would never see "
                             "them. Allowed values: no per-request settings; set the engine's loops with "
                             "hf_overrides={'total_ut_steps': k}, or serve without speculative_config.")

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows = {}  # batch row -> settings dict, for the rows of requests that set any
        OuroRequestKnobs.current = self

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits):
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for row, params, _, _ in batch_update.added:
            settings = check_request(params.extra_args, None) if params is not None else {}
            if settings:
                self.rows[row] = settings
            else:
                self.rows.pop(row, None)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if second is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = second

    def per_row(self, num_rows: int, loops: int, threshold):
        """``(depths, thresholds)``: lists over the ``num_rows`` batch rows, with the defaults (the engine's
        ``loops``, the config's ``threshold``; None as ``inf``, which never fires) where a request sets nothing."""
        default = math.inf if threshold is None else float(threshold)
        depths, thresholds = [loops] * num_rows, [default] * num_rows
        for row, settings in self.rows.items():
            if row < num_rows:
                depths[row] = settings.get("total_ut_steps", loops)
                if "exit_threshold" in settings:
                    value = settings["exit_threshold"]
                    thresholds[row] = math.inf if value is None else float(value)
        return depths, thresholds


__all__ = ["AttractorConfigHook", "OuroConfigHook", "OuroRequestKnobs", "SolveConfigHook", "register_config_hook"]
