"""hf-fixedpoint's vLLM plugin: native vLLM models for the package's looped LMs.

vLLM finds it through the package's entry points (``pip install hf-fixedpoint`` into vLLM's environment is all it
takes): ``vllm.general_plugins`` calls ``register`` in every vLLM process, and ``vllm.logits_processors`` loads
``knobs.OuroRequestKnobs``, which carries the per-request settings (``SamplingParams(extra_args=...)``) to the model.
Nothing here is imported by ``import hf_fixedpoint``; this package imports vLLM.

Served natively: Ouro (``OuroForCausalLM``: the package's exports and the released ``ByteDance/Ouro-*`` checkpoints);
SELF-LLaMA and SELF-Mistral (``self_fpsa``: the FPSA solve per new token against the cached, converged keys).
The other causal-LM families are refused by their exports' own ``is_backend_compatible()`` (``fp_engines``), with the
reason, instead of running wrongly on vLLM's generic Transformers backend.
"""

OURO_ARCHITECTURE = "OuroForCausalLM"
SELF_ARCHITECTURES = ("SelfLlamaForCausalLM", "SelfMistralForCausalLM")


def register() -> None:
    """Register the native models with vLLM's model registry (vLLM calls this in each of its processes)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(OURO_ARCHITECTURE, "hf_fixedpoint.vllm_plugin.ouro:OuroForCausalLM")
    from .knobs import register_config_hook

    register_config_hook(OURO_ARCHITECTURE)
    for architecture in SELF_ARCHITECTURES:
        ModelRegistry.register_model(architecture, "hf_fixedpoint.vllm_plugin.self_fpsa:SelfFPSAForCausalLM")
    from .self_fpsa_config import register_config_hooks

    register_config_hooks(SELF_ARCHITECTURES)


__all__ = ["OURO_ARCHITECTURE", "SELF_ARCHITECTURES", "register"]
