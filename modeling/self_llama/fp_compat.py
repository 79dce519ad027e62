# Source of truth: hf_fixedpoint/core/fp_compat.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, transformers (this file only).
"""Differences between transformers releases, detected once from the installed transformers.

The model files call these instead of branching on version numbers: a checkpoint's code then keeps working when a
release renames or moves an API it uses. Each name below is detected from what the installed release defines (a
dataclass field, a function signature, a module), never from ``transformers.__version__``. This is the one core file
that imports transformers; the others import only torch and the standard library.

* ``CACHE_NAME``: the name of the cache in ``ModelOutput`` fields and in the keywords of transformers' own forwards:
  ``"past_key_values"`` up to 5.23, ``"cache"`` from 5.24 (where ``ModelOutput`` renames ``past_key_values=`` and
  ``cache_params=`` keywords of every subclass's ``__init__`` into ``cache=``, and ``generate`` passes ``cache=``).
* ``cache_field``: class decorator for output dataclasses that declare ``past_key_values``.
* ``pop_cache``: the cache a forward was given under either name.
* ``create_causal_mask``: transformers' mask helper whatever its keyword names (``input_embeds`` / ``inputs_embeds``,
  ``past_key_values`` / ``cache``, a required ``cache_position`` up to 5.0).
* ``capture_outputs``, ``init``: transformers' output-recording decorator and initializers, under their current or
  earlier names.
* ``attention_function``: ``ALL_ATTENTION_FUNCTIONS.get_interface``, which 5.0 and older lack.
* ``require_transformers``: refuse, with the release needed, where a family uses an API an old release lacks.
* ``generate_with``, ``speculative_sampling``, ``decoder_only_output``: ``generate`` with a ``custom_generate``
  decoding callable (4.57 and later), transformers' speculative acceptance rule (whose trailing arguments changed in
  5.0) and its decoder-only output class, for ``fp_speculative``.
"""

import dataclasses
import functools
import inspect
from types import SimpleNamespace

import torch
import transformers
from transformers import cache_utils, masking_utils
from transformers.generation import utils as generation_utils
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# Looked up here, not where it is used: inside a torch.compile graph an import of transformers' lazy module fails.
_STATIC_LAYER = getattr(cache_utils, "StaticLayer", None)

try:  # 5.5 and later
    from transformers.utils.output_capturing import capture_outputs
except ImportError:  # 4.57, 5.0: the same decorator under its earlier name
    from transformers.utils.generic import check_model_inputs as capture_outputs

try:  # 5.0 and later: initializers that leave weights loaded from a checkpoint alone
    from transformers import initialization as init
except ImportError:  # 4.57: torch's own (there, weights from a checkpoint are set after initialization)

    def _copy_(tensor, other):
        with torch.no_grad():
            return tensor.copy_(other)

    init = SimpleNamespace(constant_=torch.nn.init.constant_, copy_=_copy_)

_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
CACHE_NAME = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"


def cache_field(cls):
    """Rename a ``past_key_values`` field of an output class to ``CACHE_NAME``; apply below ``@dataclass``.

    From 5.24 ``ModelOutput`` turns a ``past_key_values=`` keyword into ``cache=`` before the dataclass ``__init__``
    sees it, and reads ``.past_key_values`` through a property returning ``.cache``: a class declaring its own
    ``past_key_values`` field then rejects every construction. Renamed here, the field keeps its place (the tuple
    order of ``return_dict=False`` is unchanged) and both spellings work on every release.
    """
    if CACHE_NAME != "past_key_values" and "past_key_values" in cls.__dict__.get("__annotations__", {}):
        annotations = cls.__dict__["__annotations__"]
        cls.__annotations__ = {(CACHE_NAME if k == "past_key_values" else k): v for k, v in annotations.items()}
        default = cls.__dict__["past_key_values"]
        delattr(cls, "past_key_values")
        setattr(cls, CACHE_NAME, default)
    return cls


def pop_cache(past_key_values, kwargs: dict):
    """The cache passed as ``past_key_values`` or, as ``generate`` does from 5.24, as ``cache`` (popped from
    ``kwargs``)."""
    cache = kwargs.pop("cache", None)
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("Pass the cache once: `cache` and `past_key_values` are two names for it.")
    return past_key_values if cache is None else cache


_MASK_PARAMS = inspect.signature(masking_utils.create_causal_mask).parameters


def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids=None,
                       host_reads: bool = True, **kwargs):
    """``transformers.masking_utils.create_causal_mask`` with this release's keyword names. ``host_reads=False``
    (a forward at ``fp_check_every=0``) turns off transformers' shortcut that reads a 2-d padding mask on the host to
    hand SDPA ``is_causal`` instead of a mask (one or two reads per forward): the mask is built, as under
    ``torch.compile``, where the release lets the caller choose (``allow_is_causal_skip``)."""
    if not host_reads and "allow_is_causal_skip" in _MASK_PARAMS:
        kwargs["allow_is_causal_skip"] = False
    embeds_name = "inputs_embeds" if "inputs_embeds" in _MASK_PARAMS else "input_embeds"
    cache_name = "cache" if "cache" in _MASK_PARAMS else "past_key_values"
    kwargs.update({embeds_name: inputs_embeds, cache_name: past_key_values})
    cache_position = _MASK_PARAMS.get("cache_position")
    if cache_position is not None and cache_position.default is inspect.Parameter.empty:
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        kwargs["cache_position"] = torch.arange(past, past + inputs_embeds.shape[1], device=inputs_embeds.device)
    return masking_utils.create_causal_mask(config=config, attention_mask=attention_mask, position_ids=position_ids,
                                            **kwargs)


def attention_function(implementation, default):
    """The attention function registered as ``implementation`` (``default`` for eager), as ``get_interface``."""
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, default)
    return default if implementation in (None, "eager") else ALL_ATTENTION_FUNCTIONS[implementation]


def is_static_layer(layer) -> bool:
    """A full-attention ``StaticLayer`` (preallocated keys, its length a device counter), not a sliding window."""
    return (_STATIC_LAYER is not None and type(layer) is _STATIC_LAYER
            and torch.is_tensor(getattr(layer, "cumulative_length", None)))


def is_dynamic_layer(layer) -> bool:
    """A ``DynamicLayer`` (sliding-window ones included): its keys grow by concatenation and crop from the end."""
    return isinstance(layer, cache_utils.DynamicLayer)


@functools.lru_cache(maxsize=1)
def sliding_window_rollback() -> bool:
    """Whether this transformers' sliding-window cache layer can record its past for a roll-back and still hand
    attention only the keys its mask covers. Probed on a two-token window: transformers 5.16 records the past but
    returns all of it, which the window's mask does not cover (a shape error inside attention)."""
    layer_class = getattr(cache_utils, "DynamicSlidingWindowLayer", None)
    if layer_class is None or not hasattr(layer_class, "activate_past_recording"):
        return False
    try:
        layer = layer_class(sliding_window=2)
        layer.activate_past_recording()
        layer.update(torch.zeros(1, 1, 3, 1), torch.zeros(1, 1, 3, 1))
        keys, _ = layer.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
    except Exception:  # another layer API: no roll-back
        return False
    return keys.shape[-2] == 2


def require_dynamic_cache(cache, family: str, reason: str, static: bool = False) -> None:
    """Refuse a cache other than a ``DynamicCache`` of ``DynamicLayer`` s (``StaticCache``, ``generate(...,
    cache_implementation="static")``, an offloaded or quantized cache): a ``ValueError`` naming ``family``, the cache
    it got and ``reason`` (why the family cannot use it), instead of a failure deep inside transformers. With
    ``static``, a ``StaticCache`` of full-attention layers is accepted too."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if cache is None:
        return
    if static and all(is_static_layer(layer) for layer in cache.layers):
        return
    if not isinstance(cache, DynamicCache) or not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        also = " or a StaticCache without sliding-window layers" if static else ""
        raise ValueError(f"{family} needs a DynamicCache{also}; got {type(cache).__name__}: {reason}. Use the default "
                         "cache (generate(..., cache_implementation=None)) or past_key_values=DynamicCache().")


def require_transformers(minimum: str, family: str, reason: str) -> None:
    """Raise ``ImportError`` naming the release ``family`` needs; call it where an API it uses is detected missing.

    The version number appears in the message only, never in the test that led here.
    """
    raise ImportError(f"{family} needs transformers>={minimum}: in the installed transformers "
                      f"{transformers.__version__}, {reason}. Upgrade with: pip install -U 'transformers>={minimum}'")


def generate_with(model, decoding, *args, **kwargs):
    """``GenerationMixin.generate`` (not a model's override of it) running ``decoding`` as its decoding method (a
    ``custom_generate`` callable, which ``generate`` takes from 4.57)."""
    mixin = generation_utils.GenerationMixin
    if not hasattr(mixin, "_extract_generation_mode_kwargs"):  # the custom_generate callable's keyword extraction
        require_transformers("4.57", "draft_depth (self-speculative decoding)",
                             "generate takes no custom_generate callable")
    return mixin.generate(model, *args, custom_generate=decoding, **kwargs)


def speculative_sampling(drafts, draft_scores, target_scores):
    """transformers' speculative acceptance rule (``_speculative_sampling``, Leviathan et al. 2023, algorithm 1) for
    one row: ``drafts`` ``(1, k)``, their processed scores ``(1, k, V)`` and the full model's ``(1, k + 1, V)``.
    Returns the kept tokens ``(1, m)`` and the accepted drafts' count."""
    rule = generation_utils._speculative_sampling
    # releases before 5.0 take is_done_candidate (a draft that hit the end token: no bonus token; not used here)
    extra = (False,) if "is_done_candidate" in inspect.signature(rule).parameters else ()
    return rule(drafts, draft_scores, drafts.shape[1], target_scores, *extra)


def decoder_only_output(**fields):
    """transformers' ``GenerateDecoderOnlyOutput`` of ``fields`` (for ``fp_speculative``, which imports only torch)."""
    return generation_utils.GenerateDecoderOnlyOutput(**fields)


__all__ = [
    "CACHE_NAME",
    "attention_function",
    "cache_field",
    "capture_outputs",
    "create_causal_mask",
    "decoder_only_output",
    "generate_with",
    "init",
    "is_dynamic_layer",
    "is_static_layer",
    "pop_cache",
    "require_dynamic_cache",
    "require_transformers",
    "sliding_window_rollback",
    "speculative_sampling",
]
