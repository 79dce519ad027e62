"""hf-fixedpoint's vLLM plugin: native vLLM models for the package's looped LMs.

vLLM finds it through the package's entry points (``pip install hf-fixedpoint`` into vLLM's environment is all it
takes): ``vllm.general_plugins`` calls ``register`` in every vLLM process, and ``vllm.logits_processors`` loads
``knobs.OuroRequestKnobs``, which carries the per-request settings (``SamplingParams(extra_args=...)``) to the model.
Nothing here is imported by ``import hf_fixedpoint``; this package imports vLLM.

Served natively, all five causal-LM families: Ouro (``OuroForCausalLM``: the package's exports and the released
``ByteDance/Ouro-*`` checkpoints), Attractor LM (``AttractorForCausalLM``: the attractor solve per new token, its keys
at the fixed point), SELF-LLaMA and SELF-Mistral (``self_fpsa``: the FPSA solve per new token against the cached,
converged keys) and DEQ-LM (``DEQLMForCausalLM``: the block's fixed point per new token against the earlier tokens'
converged keys). Without the plugin, their exports refuse vLLM's generic Transformers backend by their own
``is_backend_compatible()`` (``fp_engines``), with the reason and how to install the plugin, instead of running
wrongly.
"""

OURO_ARCHITECTURE = "OuroForCausalLM"
ATTRACTOR_ARCHITECTURE = "AttractorForCausalLM"
DEQ_LM_ARCHITECTURE = "DEQLMForCausalLM"
SELF_ARCHITECTURES = ("SelfLlamaForCausalLM", "SelfMistralForCausalLM")


def register() -> None:
    """Register the native models with vLLM's model registry (vLLM calls this in each of its processes)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(OURO_ARCHITECTURE, "hf_fixedpoint.vllm_plugin.ouro:OuroForCausalLM")
    from .knobs import AttractorConfigHook, SolveConfigHook, register_config_hook

    register_config_hook(OURO_ARCHITECTURE)
    ModelRegistry.register_model(ATTRACTOR_ARCHITECTURE, "hf_fixedpoint.vllm_plugin.attractor:AttractorForCausalLM")
    register_config_hook(ATTRACTOR_ARCHITECTURE, AttractorConfigHook)
    for architecture in SELF_ARCHITECTURES:
        ModelRegistry.register_model(architecture, "hf_fixedpoint.vllm_plugin.self_fpsa:SelfFPSAForCausalLM")
        register_config_hook(architecture, SolveConfigHook)
    ModelRegistry.register_model(DEQ_LM_ARCHITECTURE, "hf_fixedpoint.vllm_plugin.deq_lm:DEQLMForCausalLM")
    register_config_hook(DEQ_LM_ARCHITECTURE, SolveConfigHook)


__all__ = ["ATTRACTOR_ARCHITECTURE", "DEQ_LM_ARCHITECTURE", "OURO_ARCHITECTURE", "SELF_ARCHITECTURES", "register"]
