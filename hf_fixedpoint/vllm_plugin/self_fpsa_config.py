"""What the native SELF-LLaMA / SELF-Mistral serve, checked when vLLM builds its engine config (before any worker
starts): an export it would serve differently from transformers is refused with a ``ValueError`` naming the setting and
the values allowed. ``check_engine`` imports nothing from vLLM (tested without it); ``SelfFPSAConfigHook`` is the
per-architecture hook vLLM runs (``MODELS_CONFIG_MAP``)."""

import logging

from .settings import check_stop_fraction

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, whose handlers vLLM configures

PLUGIN = "hf-fixedpoint's vLLM plugin"


def check_engine(hf_config, tensor_parallel_size: int) -> None:
    """Refuse what the vLLM solve cannot run as transformers does."""
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not served by {PLUGIN} for "
                         f"{type(hf_config).__name__}: each rank would halt its own heads' fixed-point solve and stop "
                         "joining the all-reduce of the iterate while the others go on. Allowed values: 1.")
    check_stop_fraction(hf_config)


class SelfFPSAConfigHook:
    """vLLM's config hook for the SELF architectures: the checks above, and eager execution (the number of solve
    iterations depends on the data, which neither a CUDA graph nor vLLM's compiled graph can hold)."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model_config = vllm_config.model_config
        check_engine(model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)
        if not model_config.enforce_eager:
            logger.warning("%s: %s runs eagerly (enforce_eager=True): its fixed-point solves stop when they converge.",
                        PLUGIN, model_config.architecture)
            model_config.enforce_eager = True


__all__ = ["SelfFPSAConfigHook", "check_engine"]
