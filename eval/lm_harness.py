"""lm-evaluation-harness model ``hf-fixedpoint``: ``HFLM`` plus per-call fixed-point knobs.

Registration (plugin style)
---------------------------
lm-eval 0.4.13 has no entry-point discovery for models: a model name exists once the module that defines it has
been imported. ``import hf_fixedpoint.eval.lm_harness`` registers ``hf-fixedpoint`` (and, through
``hf_fixedpoint.modeling``, registers every hf-fixedpoint family with the transformers Auto classes).

Python::

    import lm_eval
    import hf_fixedpoint.eval.lm_harness  # noqa: F401  (registers "hf-fixedpoint")

    lm_eval.simple_evaluate(model="hf-fixedpoint",
                            model_args={"pretrained": "runs/deq_lm_demo", "trust_remote_code": True, "fp_max_iter": 8},
                            tasks=["fp_text_ppl"], device="cpu",
                            task_manager=lm_eval.tasks.TaskManager(include_path=hf_fixedpoint.eval.runner.TASKS_DIR))

or, shorter and offline, ``hf_fixedpoint.eval.runner.evaluate_offline(model_dir, ["fp_text_ppl"], ...)``.

Command line: the stock ``lm_eval`` command does not import plugins, so use the wrapper, which imports this module,
adds ``--include_path <packaged tasks>`` when no include path is given, and then runs lm_eval's own CLI::

    python -m hf_fixedpoint.eval.run_lm_eval run --model hf-fixedpoint \\
        --model_args pretrained=runs/deq_lm_demo,trust_remote_code=True,fp_max_iter=8,fp_tol=1e-3 \\
        --tasks fp_text_ppl,fp_copy_mc --device cpu --batch_size 8

(``--tasks fp_offline`` runs every packaged task.)

Runtime knobs
-------------
``model_args`` may carry, besides the usual ``HFLM`` arguments:

* any ``fp_*`` key, e.g. ``fp_max_iter=8``, ``fp_tol=1e-3``, ``fp_solver=picard``. The keys are checked against
  the ``fp_*`` settings of the model's config (an unknown key is a ``ValueError`` that lists the valid ones) and the
  values by the library's own rules, right after loading. They reach every forward and ``generate`` call
  as ``fp_overrides={...}``; the model's ``forward`` must have an ``fp_overrides`` parameter.
* any other key that is a named parameter of the model class's ``forward`` (e.g. ``num_loops`` for looped families).
  It is passed by name to every forward and ``generate`` call.

Neither kind is applied to the config: the saved config is loaded as is and the knobs act per call, so one
checkpoint is evaluated at several compute budgets without rewriting it. A knob that is also a config setting with a
check (Ouro's ``total_ut_steps``, Attractor LM's ``readout_iters``) is checked right after loading as the config
checks it. Keys of neither kind go to ``from_pretrained`` as with the stock ``hf`` model. A per-call ``fp_max_iter``
caps the solve in ``eval()`` mode too (it replaces the config's ``fp_eval_max_iter``; ``fp_settings.call_knobs``).

Other differences from ``hf``: ``device`` defaults to ``cuda`` when available and ``cpu`` otherwise (a requested
``cuda`` device falls back to ``cpu`` with a warning when CUDA is unavailable, e.g. the CLI's default ``cuda:0``);
``generate`` uses the KV cache only where the model's config says ``use_cache=True`` (families whose cached
generation is tested equal to uncached: Ouro, Attractor LM, and SELF-LLaMA / SELF-Mistral where their solves converge,
see ``docs/self_llama.md``); otherwise the whole prefix is recomputed; the model SHA of a local directory is not
looked up on the Hub.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import stop_sequences_criteria

import hf_fixedpoint.modeling  # noqa: F401  (registers the families with the transformers Auto classes)
from hf_fixedpoint.core.fp_settings import FP_DEFAULTS, fp_settings

logger = logging.getLogger(__name__)

# forward() parameters that carry inputs or control outputs: never treated as runtime knobs.
NOT_KNOBS = frozenset({
    "self", "input_ids", "attention_mask", "inputs_embeds", "labels", "position_ids", "past_key_values",
    "use_cache", "cache_position", "return_dict", "output_attentions", "output_hidden_states", "logits_to_keep",
    "num_logits_to_keep", "token_type_ids", "head_mask", "fp_overrides",
})
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def forward_parameters(model_or_class) -> set:
    """Named parameters of ``forward`` (``*args`` / ``**kwargs`` excluded)."""
    params = inspect.signature(model_or_class.forward).parameters
    return {name for name, p in params.items() if p.kind in _NAMED}


def forward_knob_names(model_or_class) -> set:
    """Parameters of ``forward`` that ``model_args`` may set per call (inputs and output switches excluded)."""
    return forward_parameters(model_or_class) - NOT_KNOBS


def valid_fp_keys(config) -> list:
    """The ``fp_*`` settings a config knows."""
    return sorted(k for k in config.to_dict() if k.startswith("fp_"))


def validate_fp_knobs(config, knobs: dict) -> dict:
    """Check ``fp_*`` knobs against ``config``; return a copy. Unknown keys raise ``ValueError`` listing valid ones."""
    valid = valid_fp_keys(config)
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        model_type = getattr(config, "model_type", type(config).__name__)
        raise ValueError(
            f"Unknown fixed-point knob(s) {unknown} for model_type={model_type!r}. "
            f"Valid fp_ keys: {valid if valid else 'none (this config has no fp_ settings)'}."
        )
    if knobs and set(knobs) <= set(FP_DEFAULTS):
        fp_settings(config, knobs)  # value checks (types, ranges, solver names) with the library's messages
    return dict(knobs)


def check_forward_knobs(config, knobs: dict) -> None:
    """Check the forward-parameter knobs that are also config settings as the config checks them (``check_setting``
    of the families' configs: Ouro's ``total_ut_steps=0`` is a ValueError at load, not at the first call)."""
    check = getattr(config, "check_setting", None)
    if check is not None:
        for key, value in knobs.items():
            check(key, value)


def default_device(device) -> str:
    """``None`` -> ``cuda`` if available else ``cpu``; a ``cuda`` request without CUDA -> ``cpu`` (with a warning)."""
    cuda = torch.cuda.is_available()
    if device is None:
        return "cuda" if cuda else "cpu"
    device = str(device)
    if device.startswith("cuda") and not cuda:
        logger.warning("device=%r requested but CUDA is not available; using cpu.", device)
        return "cpu"
    return device


@register_model("hf-fixedpoint")
class FixedPointLM(HFLM):
    """``HFLM`` whose forward and ``generate`` calls carry the ``fp_*`` and forward-parameter knobs of ``model_args``.

    Attributes:
        fp_overrides: the ``fp_*`` knobs, passed as ``fp_overrides=`` to every call.
        forward_kwargs: the other forward-parameter knobs, passed by name to every call.
    """

    def __init__(self, pretrained, device: str | None = None, **kwargs):
        self.fp_overrides = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("fp_")]}
        self.forward_kwargs = {}
        device = default_device(device)
        if not isinstance(pretrained, str):
            # A model instance: HFLM does not call _create_model, so the knobs are split and checked here.
            model_knobs = forward_knob_names(pretrained)
            self.forward_kwargs = {k: kwargs.pop(k) for k in [k for k in kwargs if k in model_knobs]}
            self._check_fp_knobs(pretrained.config, pretrained)
            check_forward_knobs(pretrained.config, self.forward_kwargs)
            hflm_params = set(inspect.signature(HFLM.__init__).parameters)
            ignored = sorted(k for k in kwargs if k not in hflm_params)
            if ignored:
                logger.warning("Ignoring %s: not HFLM arguments nor parameters of %s.forward.",
                               ignored, type(pretrained).__name__)
        super().__init__(pretrained=pretrained, device=device, **kwargs)

    # ------------------------------------------------------------------ loading
    def _check_fp_knobs(self, config, model_or_class):
        if not self.fp_overrides:
            return
        self.fp_overrides = validate_fp_knobs(config, self.fp_overrides)
        if "fp_overrides" not in forward_parameters(model_or_class):
            name = getattr(model_or_class, "__name__", type(model_or_class).__name__)
            raise ValueError(f"{name}.forward has no fp_overrides parameter, so the knobs "
                             f"{sorted(self.fp_overrides)} cannot be applied per call.")

    def _create_model(self, pretrained: str, **kwargs) -> None:
        # HFLM passes every model_arg it does not know to from_pretrained. Knobs are per call, not load arguments:
        # load with HFLM's own arguments, then take the knobs out of the extras; reload only if some extras remain
        # (genuine from_pretrained arguments, e.g. a config override).
        named = set(inspect.signature(HFLM._create_model).parameters) - {"self", "pretrained", "kwargs"}
        base = {k: v for k, v in kwargs.items() if k in named}
        extras = {k: v for k, v in kwargs.items() if k not in named}
        super()._create_model(pretrained, **base)
        model = self._model.get_base_model() if hasattr(self._model, "get_base_model") else self._model
        self._check_fp_knobs(self.config, model)
        knobs = forward_knob_names(model)
        self.forward_kwargs.update({k: v for k, v in extras.items() if k in knobs})
        check_forward_knobs(self.config, self.forward_kwargs)
        load_kwargs = {k: v for k, v in extras.items() if k not in knobs}
        if load_kwargs:
            super()._create_model(pretrained, **base, **load_kwargs)

    # ------------------------------------------------------------------ calls
    def call_kwargs(self) -> dict:
        """Keyword arguments added to every forward / generate call (fresh copies)."""
        kw = dict(self.forward_kwargs)
        if self.fp_overrides:
            kw["fp_overrides"] = dict(self.fp_overrides)
        return kw

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        with (
            torch.no_grad(),
            torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                           enabled=self.mixed_precision_dtype is not None),
        ):
            if attn_mask is not None or labels is not None:  # seq2seq path of HFLM
                return self.model(input_ids=inps, attention_mask=attn_mask, labels=labels, **self.call_kwargs()).logits
            return self.model(inps, **self.call_kwargs()).logits

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        # Same sampling defaults as HFLM: temperature 0 -> greedy.
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        do_sample = generation_kwargs.get("do_sample")
        if (temp := generation_kwargs.get("temperature")) == 0.0 and do_sample is None:
            generation_kwargs["do_sample"] = do_sample = False
        if do_sample is False and temp == 0.0:
            generation_kwargs.pop("temperature", None)
        # The model's own setting unless the task asks: families without a KV cache set use_cache=False.
        use_cache = generation_kwargs.pop("use_cache", getattr(self.model.config, "use_cache", False))
        generation_kwargs.update(self.call_kwargs())
        stopping_criteria = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], context.shape[0])
        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            return self.model.generate(
                input_ids=context,
                max_length=max_length,
                stopping_criteria=stopping_criteria,
                pad_token_id=self.tokenizer.pad_token_id,
                use_cache=use_cache,
                **generation_kwargs,
            )

    # ------------------------------------------------------------------ reporting
    def get_model_info(self) -> dict:
        """HFLM's model info (no Hub SHA lookup for a local directory) plus the knobs in use."""
        local = isinstance(self.pretrained, str) and os.path.isdir(self.pretrained)
        if local and not self.peft and not self.delta:
            model = self._model
            info = {
                "model_num_parameters": sum(p.numel() for p in model.parameters()),
                "model_dtype": getattr(model, "dtype", ""),
                "model_revision": self.revision,
                "model_sha": "",
            }
        else:
            info = super().get_model_info()
        info["fp_overrides"] = dict(self.fp_overrides)
        info["forward_kwargs"] = dict(self.forward_kwargs)
        return info


__all__ = [
    "FixedPointLM",
    "check_forward_knobs",
    "default_device",
    "forward_knob_names",
    "valid_fp_keys",
    "validate_fp_knobs",
]
