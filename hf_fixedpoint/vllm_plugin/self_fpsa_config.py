"""What the native SELF-LLaMA / SELF-Mistral serve, checked when vLLM builds its engine config (before any worker
starts): an export it would serve differently from transformers is refused with a ``ValueError`` naming the setting and
the values allowed. ``check_engine`` imports nothing from vLLM (tested without it); ``knobs.SelfFPSAConfigHook``, the
per-architecture hook vLLM runs (``MODELS_CONFIG_MAP``), calls it."""

from .settings import check_stop_fraction

PLUGIN = "hf-fixedpoint's vLLM plugin"


def check_engine(hf_config, tensor_parallel_size: int) -> None:
    """Refuse what the vLLM solve cannot run as transformers does."""
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not served by {PLUGIN} for "
                         f"{type(hf_config).__name__}: each rank would halt its own heads' fixed-point solve and stop "
                         "joining the all-reduce of the iterate while the others go on. Allowed values: 1.")
    check_stop_fraction(hf_config)


__all__ = ["check_engine"]
