"""The per-request Ouro settings a vLLM request may carry in ``SamplingParams.extra_args``, their check, and the
engine-start checks the solving families share (no vLLM import: the checks are tested without it). An export the
native model would serve differently from transformers is refused when vLLM builds its engine config (before any
worker starts), with a ``ValueError`` naming the setting and the values allowed; ``knobs``' config hooks call these."""

PLUGIN = "hf-fixedpoint's vLLM plugin"
KEYS = ("total_ut_steps", "exit_threshold")


def check_request(extra_args, loops) -> dict:
    """The Ouro settings of a request's ``extra_args`` (the keys present), validated; ``loops``: the engine's loop
    count, None when unknown here (then only the lower bound is checked). ``total_ut_steps`` None means the engine's
    loops; ``exit_threshold`` None means no threshold (the token's last loop is decoded)."""
    extra = extra_args or {}
    settings = {k: extra[k] for k in KEYS if k in extra}
    depth = settings.get("total_ut_steps")
    if depth is not None:
        high = "" if loops is None else (f" to {loops} (the engine's total_ut_steps; start vLLM with "
                                         "hf_overrides={'total_ut_steps': k} for deeper requests)")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1 or (loops and depth > loops):
            raise ValueError(f"extra_args['total_ut_steps']={depth!r} is not allowed. Allowed values: an integer "
                             f"from 1{high}.")
    threshold = settings.get("exit_threshold")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"extra_args['exit_threshold']={threshold!r} is not allowed. Allowed values: a number "
                             "in [0, 1], or None (decode the last loop).")
    return settings


def check_stop_fraction(config) -> None:
    """Refuse ``fp_stop_fraction`` other than 0: vLLM solves the tokens of every request in a batch together, and a
    share of open entries counted over the batch would make a request's tokens depend on its batch-mates."""
    fraction = getattr(config, "fp_stop_fraction", 0.0)
    if fraction:
        raise ValueError(f"fp_stop_fraction={fraction!r} is not served by {PLUGIN} for "
                         f"{type(config).__name__}: it stops the solve once that fraction of the batch's tokens is "
                         "left, so a request's tokens would depend on the other requests of the batch. Allowed "
                         "values: 0.0 (start vLLM with hf_overrides={'fp_stop_fraction': 0.0}).")


def check_engine(hf_config, tensor_parallel_size: int) -> None:
    """Refuse what a per-token solve in vLLM (SELF's FPSA, DEQ-LM's block) cannot run as transformers does."""
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not served by {PLUGIN} for "
                         f"{type(hf_config).__name__}: each rank would judge the fixed-point solve's convergence "
                         "on its own and stop joining the all-reduce of the iterate while the others go on. Allowed "
                         "values: 1.")
    check_stop_fraction(hf_config)


__all__ = ["KEYS", "PLUGIN", "check_engine", "check_request", "check_stop_fraction"]
