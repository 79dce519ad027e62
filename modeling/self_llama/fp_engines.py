# Source of truth: hf_fixedpoint/core/fp_engines.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Refusing generic inference-engine backends that would run a model wrongly.

Inference engines (vLLM's ``TransformersForCausalLM``, and others built the same way) serve a remote-code model they
do not know by running its transformers modules with their own paged attention, after asking the model class
``is_backend_compatible()``. Such a backend keeps one KV-cache entry per attention module and calls each module once
per token: a looped model (one module applied once per loop) overwrites its own cache, and a fixed-point attention
(one module solved by iteration) breaks the engine. Transformers itself never asks the question, so answering it with
an error changes nothing for transformers' own attention handling (``attn_implementation="sdpa"`` / ``"eager"``).

``EngineGuardMixin`` answers it with an ``UnsupportedBackendError`` naming the family, why, and how to install the
package's vLLM plugin, which serves the family natively.
"""

# The package whose vLLM plugin serves the families natively.
PACKAGE = "hf-fixedpoint"
PLUGIN_HINT = (f"Serve it with {PACKAGE}'s vLLM plugin: `pip install {PACKAGE}` into vLLM's environment (vLLM loads "
               "the plugin by itself through its `vllm.general_plugins` entry point), then start vLLM again")


class UnsupportedBackendError(ValueError):
    """A generic engine backend asked to run a model it would run wrongly."""


class EngineGuardMixin:
    """Mixed into a family's ``PreTrainedModel``: ``is_backend_compatible()`` raises ``UnsupportedBackendError``.

    A family sets ``_engine_refusal`` to the reason a generic backend cannot run it; the message adds how to install
    the package's vLLM plugin, which serves every family that mixes this in natively.
    """

    _engine_refusal = "it is not a standard transformer"

    @classmethod
    def is_backend_compatible(cls):
        raise UnsupportedBackendError(
            f"{cls.__name__} ({PACKAGE}) cannot run on a generic Transformers backend of an inference engine (such as "
            f"vLLM's TransformersForCausalLM): {cls._engine_refusal}. {PLUGIN_HINT}.")


__all__ = ["PACKAGE", "PLUGIN_HINT", "EngineGuardMixin", "UnsupportedBackendError"]
