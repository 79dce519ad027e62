"""Turn a research-code checkpoint of TRM, URM or FPRM into this project's ``*ForPuzzles`` model.

    python -m hf_fixedpoint.puzzles.convert --checkpoint ckpt/step_65104 --config ckpt/all_config.yaml \\
        --dataset_json data/sudoku-extreme-1k-aug-1000/test/dataset.json --output_dir converted/trm_sudoku

``--checkpoint`` is the research code's ``torch.save(model.state_dict())`` (keys such as
``_orig_mod.model.inner.L_level.layers.0.self_attn.qkv_proj.weight``); ``--config`` the run's ``all_config.yaml``
(its ``arch`` section); ``--dataset_json`` the data's metadata (``vocab_size``, ``seq_len``,
``num_puzzle_identifiers``; without it they are read off the tensors, and ``--seq_len`` is needed). The family comes
from ``arch.name`` (``--arch`` overrides it). ``pos_encodings`` ``rope``, ``learned`` (its table
``embed_pos.embedding_weight`` becomes ``trunk.input.embed_pos``) and ``none`` carry over. Options the models here do
not have (spectral-norm linears, input-dependent residual scales, FPRM's ``mlp_t``, ...) are refused with their name.
The Q head's second (Q-continue) output is dropped: the research code's default ``no_ACT_continue=True`` never uses
it. The result is checked by loading every tensor strictly; save it with ``save_pretrained`` (``--output_dir``).
"""

import argparse
import math
import warnings
from typing import Optional

import torch

from ..modeling import FPRMConfig, FPRMForPuzzles, TRMConfig, TRMForPuzzles, URMConfig, URMForPuzzles

ARCHS = ("trm", "urm", "fprm")
LOSSES = {"stablemax_cross_entropy": "stablemax", "softmax_cross_entropy": "softmax"}
PREFIXES = ("_orig_mod.", "model.", "inner.")
LAYER_KEYS = {"self_attn.qkv_proj.weight": "mixer.qkv_proj.weight", "self_attn.o_proj.weight": "mixer.o_proj.weight",
              "mlp_t.gate_up_proj.weight": "mixer.mlp.gate_up_proj.weight",
              "mlp_t.down_proj.weight": "mixer.mlp.down_proj.weight",
              "mlp.gate_up_proj.weight": "mlp.gate_up_proj.weight", "mlp.down_proj.weight": "mlp.down_proj.weight",
              "mlp.dwconv.weight": "mlp.conv.weight",
              "mlp.dwconv.bias": "mlp.conv.bias"}
SHARED_KEYS = {"embed_tokens.embedding_weight": "model.trunk.input.embed_tokens.weight",
               "embed_pos.embedding_weight": "model.trunk.input.embed_pos.weight",
               "puzzle_emb.weights": "model.trunk.input.puzzle_emb.weights", "lm_head.weight": "heads.lm_head.weight",
               "H_init": "model.y_init", "L_init": "model.z_init", "init_hidden": "model.h_init",
               "L_optimizer.init_vec": "model.y_init", "L_level.conv.weight": "model.conv.conv.weight"}
# Buffers of the research code that hold no model state (FPRM's weight-dropout masks, sparse-embedding scratch).
SKIPPED_SUFFIXES = (".mask", "puzzle_emb.local_weights", "puzzle_emb.local_ids")
# FPRM's step-size fields in the research code's two config versions: one decay for training and evaluation, with a
# new lowest residual counted only 0.01 below the best (commit 9e0ebf35), or a decay per mode and any decrease
# counted (e.g. commit 68e118cd).
SINGLE_DECAY, SINGLE_DECAY_MARGIN = "stepsize_decay", 1e-2
SPLIT_DECAY = ("stepsize_decay_train", "stepsize_decay_eval")
STEP_FIELDS = ("stepsize", "decay_patience", SINGLE_DECAY, *SPLIT_DECAY)
STEP_FIELD_WORDS = ("stepsize", "decay", "patience", "margin")


def detect_arch(arch_cfg: dict) -> str:
    """``trm``, ``urm`` or ``fprm`` from ``arch.name`` (e.g. ``recursive_reasoning.trm@TinyRecursiveReasoning...``)."""
    name = str(arch_cfg.get("name", "")).split("@")[0].lower()
    for arch, marker in (("fprm", "fprm"), ("urm", "urm"), ("trm", "trm")):
        if marker in name.split(".")[-1]:
            return arch
    raise ValueError(f"cannot tell the family from arch.name={arch_cfg.get('name')!r}; pass --arch "
                     f"({', '.join(ARCHS)}).")


def _refuse(cfg: dict, checks: dict) -> None:
    """``checks``: field -> (allowed value(s), default); a field set otherwise is an error naming it."""
    for name, (allowed, default) in checks.items():
        value = cfg.get(name, default)
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise ValueError(f"the checkpoint's {name}={value!r} has no counterpart here (supported: {allowed!r}).")


def _shared_fields(cfg: dict, meta: dict) -> dict:
    hidden = cfg["hidden_size"]
    ndim = cfg.get("puzzle_emb_ndim", 0)
    length = cfg.get("puzzle_emb_len", 0) or -(ndim // -hidden)
    _refuse(cfg, {"pos_encodings": (("rope", "learned", "none"), "rope")})
    loss = cfg.get("loss", {}).get("loss_type", "stablemax_cross_entropy")
    if loss not in LOSSES:
        raise ValueError(f"the checkpoint's loss.loss_type={loss!r} has no counterpart here ({sorted(LOSSES)}).")
    return {"vocab_size": meta["vocab_size"], "seq_len": meta["seq_len"],
            "num_puzzle_identifiers": meta["num_puzzle_identifiers"], "hidden_size": hidden,
            "num_attention_heads": cfg["num_heads"], "expansion": float(cfg["expansion"]), "mlp_multiple_of": 256,
            "puzzle_emb_len": length if ndim > 0 else 0, "puzzle_emb_ndim": ndim or None,
            "pos_encodings": cfg.get("pos_encodings", "rope"), "rope_theta": cfg.get("rope_theta", 10000.0),
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5), "forward_dtype": cfg.get("forward_dtype", "bfloat16"),
            "loss_type": LOSSES[loss], "q_loss_weight": cfg.get("loss", {}).get("q_loss_coeff", 0.5)}


def config_from_official(arch: str, cfg: dict, meta: dict):
    """This project's config for the research code's ``arch`` section ``cfg`` and the data's ``meta``."""
    shared = _shared_fields(cfg, meta)
    if arch == "trm":
        _refuse(cfg, {"no_ACT_continue": (True, True)})
        return TRMConfig(**shared, num_layers=cfg["L_layers"], H_cycles=cfg["H_cycles"], L_cycles=cfg["L_cycles"],
                         mlp_t=bool(cfg.get("mlp_t", False)), halt_max_steps=cfg["halt_max_steps"],
                         halt_exploration_prob=cfg["halt_exploration_prob"])
    if arch == "urm":
        forward_only = (cfg["H_cycles"] - 1) * cfg["L_cycles"]
        if forward_only < 1:
            raise ValueError(f"H_cycles={cfg['H_cycles']}: URM here runs at least one forward-only loop.")
        return URMConfig(**shared, num_layers=cfg["num_layers"], L_cycles=cfg["L_cycles"], fp_max_iter=forward_only,
                         halt_max_steps=cfg["loops"], halt_exploration_prob=0.1)
    _refuse(cfg, {"norm_type": ("pre-norm", "pre-norm"), "norm_placement": (("none", "output"), "none"),
                  "residual_scale": (("input-independent", "fixed"), "input-independent"),
                  "outer_only": (False, False), "mlp_t": (False, False), "conv_bias": (False, False),
                  "conv_type": (("none", "conv1d", "conv2d"), "none"), "softmax_temp": (1.0, 1.0),
                  "use_spec_norm_linear": (False, False), "normalize_input_injection": (False, False),
                  "additive_noise_std": (0.0, 0.0), "halting_mechanism": ("fixed_point", "fixed_point")})
    for name in ("variational_dropout", "weight_dropout", "jacobian_reg"):
        if cfg.get(name, 0.0) not in (0.0, "none"):
            warnings.warn(f"{name}={cfg[name]!r} is a training-time option with no counterpart here; the converted "
                          "model computes the same evaluation outputs but trains without it.", stacklevel=2)
    if cfg.get("max_iter_dist", "gamma") != "det":
        warnings.warn(f"max_iter_dist={cfg.get('max_iter_dist', 'gamma')!r} draws the training cap at random; the "
                      "converted model uses max_iter as a fixed cap.", stacklevel=2)
    conv = {"none": "none", "conv1d": "1d", "conv2d": "2d"}[cfg.get("conv_type", "none")]
    side = math.isqrt(meta["seq_len"])
    # Training: max_iter supervision steps of n_backwards_L solver steps; evaluation: one solver step per call, for
    # max_iter_eval calls (max_iter without it).
    window, max_iter = cfg.get("n_backwards_L", cfg.get("L_cycles", 6)), cfg["max_iter"]
    solver, eval_decay = _fprm_step_size(cfg)
    return FPRMConfig(**shared, num_layers=cfg["L_layers"], causal=bool(cfg.get("causal", False)),
                      residual_scale="learned" if cfg.get("residual_scale") != "fixed" else "fixed",
                      alpha_1_init=cfg["alpha_1_init"], alpha_2_init=cfg["alpha_2_init"], conv=conv,
                      conv_kernel=cfg.get("conv_kernel_size", 3), grid_shape=[side, side] if conv == "2d" else None,
                      output_norm=cfg.get("norm_placement") == "output", init_std=cfg.get("init_std", 1.0),
                      init_mode="fixed" if cfg.get("fixed_init") else "noise", bptt_window=window,
                      eval_step_decay=eval_decay, solve_mode="official", pad_id=None,
                      fp_solver="fpopt", fp_norm="token_linf", fp_tol=cfg.get("fp_thresh", 0.1),
                      fp_solver_kwargs=solver, fp_max_iter=max_iter * window, halt_max_steps=max_iter,
                      fp_eval_max_iter=cfg.get("max_iter_eval") or max_iter, halt_exploration_prob=0.0)


def _fprm_step_size(cfg: dict) -> tuple:
    """``(fp_solver_kwargs, eval_step_decay)`` of ``fpopt`` for either research-config version (``STEP_FIELDS``);
    a step-size field of neither version, or fields of both, is an error naming them."""
    unknown = [k for k in cfg if k not in STEP_FIELDS and not k.endswith("weight_decay")
               and any(word in k for word in STEP_FIELD_WORDS)]
    if unknown:
        raise ValueError(f"the checkpoint's {unknown[0]}={cfg[unknown[0]]!r} has no counterpart here (the research "
                         f"code's step-size fields: {', '.join(STEP_FIELDS)}).")
    split = [k for k in SPLIT_DECAY if k in cfg]
    if SINGLE_DECAY in cfg and split:
        raise ValueError(f"the checkpoint sets {SINGLE_DECAY} and {' / '.join(split)}: no research version has both "
                         f"(one decay for both modes, or {' / '.join(SPLIT_DECAY)}).")
    solver = {"step_size": cfg.get("stepsize", 1.0), "patience": cfg.get("decay_patience", 5)}
    if SINGLE_DECAY in cfg:
        decay = cfg[SINGLE_DECAY]
        return {**solver, "decay": decay, "improve_margin": SINGLE_DECAY_MARGIN}, decay
    if not split:
        raise ValueError(f"the checkpoint's config names no step-size decay ({SINGLE_DECAY}, or "
                         f"{' / '.join(SPLIT_DECAY)}), so the research version that wrote it is unknown.")
    train, evaluation = (cfg.get(k, default) for k, default in zip(SPLIT_DECAY, (0.9, 0.99)))  # research defaults
    return {**solver, "decay": train, "improve_margin": 0.0}, evaluation


def strip_prefixes(state_dict: dict) -> dict:
    """Drop the wrappers' key prefixes (``_orig_mod.`` of torch.compile, ``model.`` of the loss head, ``inner.``)."""
    out = {}
    for key, value in state_dict.items():
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def state_dict_from_official(arch: str, state_dict: dict, config) -> dict:
    """This project's state dict for the research code's ``state_dict`` (prefixes stripped or not)."""
    sd = strip_prefixes(state_dict)
    out, unknown = {}, []
    layer_prefix = "layers." if arch == "urm" else "L_level.layers."
    for key, value in sd.items():
        value = value.float() if value.is_floating_point() else value
        if key.endswith(SKIPPED_SUFFIXES):
            continue
        if key in SHARED_KEYS:
            out[SHARED_KEYS[key]] = value
        elif key.startswith("q_head."):  # (2, D) / (2,): keep the Q-halt row
            out[f"heads.{key}"] = value[:1]
        elif key.startswith(layer_prefix):
            index, _, rest = key[len(layer_prefix):].partition(".")
            if rest not in LAYER_KEYS:
                unknown.append(key)
                continue
            out[f"model.layers.{index}.{LAYER_KEYS[rest]}"] = value
        elif key in ("L_level.alpha_1_param", "L_level.alpha_2_param"):
            continue  # stacked below
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"tensors with no counterpart in {arch.upper()} here: {unknown}.")
    if arch == "fprm":
        alphas = [sd[f"L_level.alpha_{i}_param"].float() for i in (1, 2)]
        if config.residual_scale == "fixed":  # the research code stores the alphas themselves, as scalars
            alphas = [a.logit().expand(config.hidden_size) for a in alphas]
        out["model.alpha_logits"] = torch.stack(alphas)
    return out


def _metadata(state_dict: dict, dataset_json: Optional[dict], seq_len: Optional[int]) -> dict:
    if dataset_json is not None:
        return dataset_json
    sd = strip_prefixes(state_dict)
    if seq_len is None:
        raise ValueError("pass the data's dataset.json (or seq_len): the checkpoint does not record the puzzle "
                         "length.")
    table = sd.get("puzzle_emb.weights")
    return {"vocab_size": sd["embed_tokens.embedding_weight"].shape[0], "seq_len": seq_len,
            "num_puzzle_identifiers": table.shape[0] if table is not None else 1}


def convert(state_dict: dict, all_config: dict, dataset_json: Optional[dict] = None, seq_len: Optional[int] = None,
            arch: Optional[str] = None):
    """The ``*ForPuzzles`` model holding a research-code checkpoint (``state_dict``, ``all_config`` = the parsed
    ``all_config.yaml``), every tensor loaded strictly."""
    cfg = all_config.get("arch", all_config)
    arch = arch or detect_arch(cfg)
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not allowed. Allowed values: {', '.join(ARCHS)}.")
    config = config_from_official(arch, cfg, _metadata(state_dict, dataset_json, seq_len))
    model = {"trm": TRMForPuzzles, "urm": URMForPuzzles, "fprm": FPRMForPuzzles}[arch](config)
    mapped = state_dict_from_official(arch, state_dict, config)
    if arch == "fprm" and config.init_mode == "noise":  # no fixed start vector in the checkpoint: keep the drawn one
        mapped.setdefault("model.y_init", model.model.y_init)
    model.load_state_dict(mapped, strict=True)
    return model.eval()


def main(argv=None):
    import json

    import yaml

    parser = argparse.ArgumentParser(prog="python -m hf_fixedpoint.puzzles.convert",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the research code's saved state dict")
    parser.add_argument("--config", required=True, help="the run's all_config.yaml")
    parser.add_argument("--output_dir", required=True, help="save_pretrained goes here")
    parser.add_argument("--dataset_json", default=None, help="the data's dataset.json (vocab, seq_len, ids)")
    parser.add_argument("--seq_len", type=int, default=None, help="puzzle length, without --dataset_json")
    parser.add_argument("--arch", choices=ARCHS, default=None, help="family (default: from arch.name)")
    args = parser.parse_args(argv)
    with open(args.config) as f:
        all_config = yaml.safe_load(f)
    meta = None
    if args.dataset_json:
        with open(args.dataset_json) as f:
            meta = json.load(f)
    state_dict = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    model = convert(state_dict, all_config, meta, args.seq_len, args.arch)
    model.save_pretrained(args.output_dir)
    print(f"saved {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters) to "
          f"{args.output_dir}")


if __name__ == "__main__":
    main()
