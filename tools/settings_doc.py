"""Writes ``docs/settings.md``, the reference of every setting, from the settings tables in the code.

    python -m tools.settings_doc           # rewrite docs/settings.md
    python -m tools.settings_doc --check   # exit 1 if docs/settings.md differs from what the code gives

Names and defaults come from the code: ``FP_DEFAULTS`` (``hf_fixedpoint/core/fp_settings.py``), ``FPSA_DEFAULTS``
(``fp_fpsa_settings.py``), each family's config for its own defaults of the ``fp_*`` knobs, and the signatures of
``OuroConfig`` and ``AttractorConfig`` for those families' own knobs, and the signatures of ``FPRMConfig``,
``TRMConfig`` and ``URMConfig`` for every field of the puzzle families. The allowed values are read from the validators
themselves: each knob is given a value no validator accepts, and the ``ValueError`` it raises names the allowed
values. Only the descriptions are written here (``DESCRIPTIONS``, keyed by knob name); a knob without one is an
error, so a new knob in the code fails ``tests/test_docs.py`` until it is described.
"""

import argparse
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "settings.md"

# What each knob does, keyed by name. ``allowed`` is only given where the validator's message cannot say it.
DESCRIPTIONS = {
    "fp_solver": "Forward solver. `picard_adaptive` relaxes only the entries whose residual reverses sign (a secant "
                 "estimate of the step); `fpopt` is FPRM's damped step with patience decay; `anderson` and `broyden` "
                 "are quasi-Newton.",
    "fp_solver_kwargs": {"text": "Extra arguments of the solver, e.g. `{\"m\": 5}` (Anderson history), "
                                 "`{\"damping\": 0.8}` (Picard), `{\"memory\": 20}` (Broyden). Unknown keys are an "
                                 "error naming the solver's arguments.",
                         "allowed": "a dict of the solver's arguments, or None"},
    "fp_tol": "Convergence tolerance on the residual (see `fp_stop_mode`, `fp_norm`).",
    "fp_stop_mode": "`rel`: residual relative to the iterate's norm; `abs`: absolute residual.",
    "fp_norm": "Norm of the residual: `l2`, `linf`, or `token_linf` (the largest per-token relative l-inf "
               "residual).",
    "fp_max_iter": "Cap on function evaluations of one solve in training (and in eval when `fp_eval_max_iter` is "
                   "None). Per call it caps the solve in train and eval mode alike.",
    "fp_eval_max_iter": "Cap in `eval()` mode: more test-time compute without retraining. None: `fp_max_iter`.",
    "fp_min_iter": "Iterations run before convergence is tested. Must not exceed the caps.",
    "fp_stop_fraction": "Stop the solve once at most this fraction of entries is unconverged (0: wait for all).",
    "fp_return": "For unconverged entries: the `best` iterate seen (smallest residual) or the `last` one.",
    "fp_check_every": "How often the host reads the solve's convergence state: every k iterations (1: after every "
                      "one, the solve stops as soon as it may; k > 1: an entry may run up to k - 1 more iterations). "
                      "0: never inside the solve, which runs its whole budget with finished entries frozen on the "
                      "device and reads once after the loop (NaN/Inf); the forward then compiles as one graph, and "
                      "the Attractor LM and SELF-LLaMA build their causal mask without transformers' host-read "
                      "shortcut ([gpu.md](gpu.md)).",
    "fp_backward": "Gradient mode: `ift` (implicit function theorem, adjoint solved by a solver), `phantom` "
                   "(a few damped steps from the fixed point), `one_step` (Jacobian-free), `bptt` (backprop "
                   "through the unrolled solve).",
    "fp_backward_solver": "`ift`: solver of the adjoint system.",
    "fp_backward_tol": "`ift`: adjoint tolerance. None: `fp_tol`.",
    "fp_backward_max_iter": "`ift`: adjoint cap. None: `fp_max_iter`.",
    "fp_backward_solver_kwargs": {"text": "`ift`: extra arguments of the adjoint solver (as `fp_solver_kwargs`).",
                                  "allowed": "a dict of the solver's arguments, or None"},
    "fp_backward_steps": {"text": "`phantom` / `bptt`: number of differentiated steps (`bptt`: None unrolls the "
                                  "whole solve).",
                          "allowed": "integer in [1, inf); None with `fp_backward=\"bptt\"`"},
    "fp_backward_damping": "`phantom` / `bptt`: step size of the differentiated steps.",
    "fpsa_update": "Form of the FPSA iteration: `residual_norm` (the paper's, the residual goes through the "
                   "layer's output norm) or `plain`.",
    "fpsa_update_scale": "Share of `W_O O` the iterate re-injects (1: the paper's form; 0.5 helps retrofitted "
                         "decoders converge).",
    "fpsa_step_norm": "`tanh` bounds each step, `O <- O + tanh(F(O) - O)`; same fixed points.",
    "fpsa_learn_temperature": "Learn a per-head attention temperature (initialised to 1).",
    "fpsa_spectral_norm": "Spectral normalisation of `W_Q`, `W_K` (`qk`) and also `W_O` (`qko`).",
    "fpsa_adjoint_mask": "`ift` backward: implicit term only for converged (token, head) entries.",
    "fpsa_halting": "`tolerance`: stop on `fp_tol`; `learned`: FPSA-LH's halting gate with ACT.",
    "fpsa_ponder_budget": "Learned halting: target mean iterations per (token, head).",
    "fpsa_ponder_weight": "Learned halting: weight of the ponder cost above the budget in the loss.",
    "fpsa_halt_threshold": "Learned halting: ACT threshold (1 - eps).",
    "fpsa_halt_unit": "What halts: each (token, head) on its own change (`head`), all heads of a token (`token`), "
                      "or each token on the relative change of its iterate (`state`).",
    "fpsa_jac_weight": "Training: weight of the Jacobian penalty of each layer's FPSA map (0: none). Needs "
                       "`fpsa_halting=\"tolerance\"`.",
    "fpsa_jac_norm": "Jacobian penalty: Hutchinson `||J||_F^2 / n` (`frobenius`) or `relu(rho(J) - target)^2` "
                     "(`spectral`).",
    "fpsa_jac_target": "Spectral penalty: the spectral radius left unpenalised.",
    "total_ut_steps": {"text": "Loops of the layer stack.", "per_call": "total_ut_steps"},
    "early_exit_threshold": {"text": "Q-exit: each token is decoded from the first loop whose cumulative exit "
                                     "probability reaches it (1.0: in practice the last loop); None decodes the last "
                                     "loop.", "per_call": "exit_threshold"},
    "early_exit_step": {"text": "Decode this loop (0-based) for every token; None: the exit rules decide.",
                        "per_call": "exit_at_step"},
    "early_exit_tol": {"text": "A token also exits at the first loop (from the second) whose relative state change "
                               "is below it; None disables the rule.", "per_call": "exit_tol"},
    "early_exit_mode": {"text": "`select` computes every loop and decodes the exit loop (as upstream); `skip` stops "
                                "each token at its exit loop at inference and saves the compute.",
                        "per_call": "exit_mode"},
    "exit_loss": "Training loss with `labels`: `expected_logits` (upstream), `expected_loss` (paper stage I, with "
                 "`entropy_weight`) or `last` (the last loop's cross-entropy).",
    "entropy_weight": "Weight of the exit distribution's entropy bonus in `expected_loss`.",
    "trained_loops": {"text": "Loop counts the model was trained with (the recipes write it); None: "
                              "`total_ut_steps` is the largest. Used by the depth guard.",
                      "allowed": "None, an integer k >= 1, or [lo, hi] with 1 <= lo <= hi"},
    "readout_iters": {"text": "Solver iterations of a call: None solves to the fixed point (the `fp_*` settings), 0 "
                              "decodes the backbone's proposal without solving, k caps the solve at k iterations. "
                              "`unrolled_iters=k` (per call only) runs exactly k iterations as one compilable graph.",
                      "per_call": "readout_iters"},
    "loop_guard_tol": "Depth guard: a call deeper than `trained_loops` whose state keeps changing by more than this "
                      "warns once (`LoopDepthWarning`); None disables it.",
    # The puzzle families (FPRM, TRM, URM): every field of their configs.
    "vocab_size": "Token vocabulary (from the dataset's `PuzzleMetadata`).",
    "seq_len": "Puzzle length (from the dataset's `PuzzleMetadata`). Inputs may be longer (length generalization) "
               "unless a layer is tied to the length (`mlp_t`, `conv=\"2d\"`, `pos_encodings=\"learned\"`).",
    "hidden_size": "Width of the state.",
    "num_attention_heads": "Attention heads; must divide `hidden_size`.",
    "expansion": "SwiGLU expansion of the width.",
    "mlp_multiple_of": "The SwiGLU width is rounded up to a multiple of this (256 in the research code).",
    "num_puzzle_identifiers": "Rows of the puzzle-id embedding table (from the dataset); a checkpoint loads only "
                              "with its own count.",
    "puzzle_emb_len": "Prefix positions `P` of the puzzle embedding (0 disables it).",
    "puzzle_emb_ndim": {"text": "Width of the puzzle embedding; None: `hidden_size`.",
                        "allowed": "integer in [1, `puzzle_emb_len * hidden_size`], or None"},
    "pos_encodings": "`rope`: rotary attention; `learned`: a learned embedding per position added to the input "
                     "injection (TRM/HRM's `learned`; inputs of length `seq_len` only); `none`: no positions.",
    "causal": "Causal attention (position t sees <= t), the state-tracking set-up; the Q-halt head then reads the "
              "last position. Not with `mlp_t` or `conv=\"2d\"`.",
    "rope_theta": "Base of the rotary encoding.",
    "rms_norm_eps": "Epsilon of the RMS norms.",
    "forward_dtype": "Activation dtype (weights stay float32).",
    "grid_shape": {"text": "`[rows, cols]` of the puzzle grid, needed by `conv=\"2d\"` (rows x cols must equal "
                           "`seq_len`).",
                   "allowed": "None, or [rows, cols] of positive integers"},
    "halt_max_steps": "ACT supervision steps per puzzle: a slot always halts after this many (at evaluation every "
                      "slot runs them all, so batches stay in lockstep).",
    "halt_exploration_prob": "Training: probability per slot of halting no earlier than a random step in "
                             "{2, ..., `halt_max_steps`} (TRM's exploration).",
    "loss_type": "Cross-entropy of the ACT loss head: `stablemax` (in float64) or `softmax`.",
    "q_loss_weight": "Weight of the Q-halt loss (BCE of the halt logit against 'the puzzle is exactly right').",
    "num_layers": "Blocks of the recurrent map. FPRM: pre-norm blocks of `f`; TRM: post-norm blocks of the one "
                  "network that updates both latents; URM: post-norm attention + ConvSwiGLU blocks applied per loop "
                  "`h = blocks(h + x)`.",
    "residual_scale": "FPRM: `learned` (per-channel `alpha = sigmoid(theta)`, trained) or `fixed` (kept at init).",
    "alpha_1_init": "FPRM: initial `alpha_1`, the sublayer residual scale.",
    "alpha_2_init": "FPRM: initial `alpha_2`, the state injection scale.",
    "conv": "FPRM: short depthwise convolution of the state's grid part before the injection: `none`, `1d` (causal, "
            "left padded) or `2d` (needs `grid_shape`).",
    "conv_kernel": "FPRM: kernel size of `conv` (a 2-D kernel of 17 reaches every Sudoku cell's whole row and "
                   "column; the research code's 3 only its neighbours).",
    "spectral_norm": "FPRM: spectral-normalize every linear layer of the blocks.",
    "output_norm": "FPRM: RMS-normalize the output of `f`.",
    "init_mode": "FPRM: start the solve from noise of std `init_std` (`noise`) or from a fixed random vector "
                 "(`fixed`).",
    "init_std": "FPRM: std of the initial noise.",
    "seed": {"text": "FPRM: seed of the generator of the evaluation noise (one draw shared by the batch).",
             "allowed": "any integer"},
    "bptt_window": "FPRM: solver steps with gradient per supervision step (truncated BPTT window).",
    "eval_step_decay": "FPRM: `fpopt`'s step-size decay at evaluation (training decays by "
                       "`fp_solver_kwargs[\"decay\"]`); only with `fp_solver=\"fpopt\"`.",
    "conv_skip": "FPRM: use `y + conv(y)` on the grid part instead of `conv(y)` (same maps, another initialization).",
    "init_noise": "FPRM: initial noise `truncated` (at 2 std, the research code) or `normal`.",
    "solve_mode": "FPRM: `official` steps the research code's windows and batch halting (needs `fp_solver` `fpopt` "
                  "or `picard`); `per_sample` freezes each converged puzzle and solves a call without a state with "
                  "`fixed_point` (any solver and backward mode).",
    "pad_id": "FPRM: input token of padding, left out of the `token_linf` residual; None counts every position.",
    "H_cycles": "TRM: cycles per supervision step, each of `L_cycles` updates of `z` and one of `y`; only the last "
                "carries gradient.",
    "L_cycles": "TRM: updates `z = net(z, y + x)` per cycle. URM: loops with gradient per supervision step (the "
                "loops before them run forward-only as the `fp_*` solve).",
    "mlp_t": "TRM: replace attention by a SwiGLU over the sequence axis (TRM-MLP, for Sudoku; use with "
             "`pos_encodings=\"none\"`).",
    "deq": "TRM: Attractor-reasoning, each cycle's `L_cycles` updates become a fixed-point solve of "
           "`z = net(z, y + x)` with the `fp_*` settings.",
    "jacobian_reg_weight": "TRM with `deq`: weight of the Hutchinson estimate of `||J||_F^2 / d` at the fixed point "
                           "in the training loss (0: none).",
}

OURO_KNOBS = ("total_ut_steps", "early_exit_threshold", "early_exit_step", "early_exit_tol", "early_exit_mode",
              "exit_loss", "entropy_weight", "trained_loops", "loop_guard_tol")
ATTRACTOR_KNOBS = ("readout_iters",)
BAD_VALUES = ("\x00not-a-value", -10**9)


def _text(name: str) -> str:
    entry = DESCRIPTIONS.get(name)
    if entry is None:
        raise KeyError(f"{name} has no description: add it to DESCRIPTIONS in tools/settings_doc.py")
    return entry if isinstance(entry, str) else entry["text"]


def allowed_values(name: str, check) -> str:
    """The allowed values of ``name``, read from the ``ValueError`` that ``check(value)`` raises on bad values."""
    entry = DESCRIPTIONS.get(name)
    if isinstance(entry, dict) and "allowed" in entry:
        return entry["allowed"]
    kind, span = "", ""
    for bad in BAD_VALUES:
        try:
            check(bad)
        except ValueError as error:
            message = str(error)
        else:
            continue
        if not message.startswith(name):
            raise ValueError(f"the error for a bad {name} names another field: {message}")
        if "must be True or False" in message:
            return "`True`, `False`"
        listed = re.search(r"Allowed values: (.*?)\.?$", message)
        if listed:
            return ", ".join(f"`{v.strip()}`" for v in listed.group(1).split(","))
        if not kind:
            kind = "integer" if "must be an integer" in message else "number" if "must be a number" in message else ""
        lies = re.search(r"allowed values lie in (\S+, \S+?)\.?$", message)
        span = span or (lies.group(1) if lies else "")
    if not span:
        raise ValueError(f"the validator of {name} names no allowed values; give 'allowed' in DESCRIPTIONS")
    try:
        check(None)
        none = ", or None"
    except (ValueError, TypeError):
        none = ""
    return f"{kind or 'number'} in {span}{none}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _fp_sections() -> list:
    from hf_fixedpoint.core.fp_fpsa_settings import FPSA_DEFAULTS, check_fpsa_settings
    from hf_fixedpoint.core.fp_settings import FP_DEFAULTS, check_fp_settings

    lines = ["## `fp_*`: the fixed-point solve (every family except Ouro)", "",
             "Set in the config, at load (`from_pretrained(dir, fp_tol=1e-5)`), by assignment (`config.fp_tol = "
             "1e-5`), per call (`model(ids, fp_max_iter=64)`, `generate(ids, fp_tol=1e-5)`; also "
             "`fp_overrides={...}`) and in lm-eval `model_args`. Defaults of the families that differ are in the "
             "next table.", "", _row(["setting", "default", "allowed values", "what it does"]),
             _row(["---"] * 4)]
    for name, default in FP_DEFAULTS.items():
        allowed = allowed_values(name, lambda v, n=name: check_fp_settings({**FP_DEFAULTS, n: v}))
        lines.append(_row([f"`{name}`", f"`{default!r}`", allowed, _text(name)]))
    lines += ["", "## `fpsa_*`: FPSA-BERT, FPSA-ViT, SELF-LLaMA, SELF-Mistral", "",
              "Set in the config, at load (`from_pretrained(dir, fpsa_halt_unit=\"state\")`) or by assignment; not "
              "per call. The recipes take them as flags (`--fpsa_jac_weight 30`).", "",
              _row(["setting", "default", "allowed values", "what it does"]), _row(["---"] * 4)]
    for name, default in FPSA_DEFAULTS.items():
        allowed = allowed_values(name, lambda v, n=name: check_fpsa_settings({**FPSA_DEFAULTS, n: v}))
        lines.append(_row([f"`{name}`", f"`{default!r}`", allowed, _text(name)]))
    return lines


def _family_defaults() -> list:
    from hf_fixedpoint.core.fp_settings import FP_DEFAULTS
    from hf_fixedpoint.modeling import FAMILIES

    lines = ["## Family defaults of the `fp_*` settings", "",
             "A family's config starts from these values instead of the table above (a saved `config.json` keeps "
             "the values it was saved with).", "", _row(["family", "defaults that differ"]), _row(["---"] * 2)]
    for config_class, _ in FAMILIES:
        config = config_class()
        if not hasattr(config, "fp_solver"):
            continue
        diffs = [f"`{k}={getattr(config, k)!r}`" for k in FP_DEFAULTS if getattr(config, k) != FP_DEFAULTS[k]]
        lines.append(_row([f"`{config_class.model_type}`", ", ".join(diffs) or "none"]))
    return lines


def _family_section(title: str, intro: str, config_class, model_class, knobs, tiny: dict) -> list:
    """One family's own knobs: default from the config's signature, allowed values from its validator, the per-call
    name (checked against ``model_class.forward``) and the description from ``DESCRIPTIONS``."""
    params = inspect.signature(config_class.__init__).parameters
    forward = inspect.signature(model_class.forward).parameters
    lines = [title, "", intro, "", _row(["setting", "default", "allowed values", "per call", "what it does"]),
             _row(["---"] * 5)]
    for name in knobs:
        entry = DESCRIPTIONS.get(name)
        per_call = entry.get("per_call", "") if isinstance(entry, dict) else ""
        if per_call and per_call not in forward:
            raise ValueError(f"{name}: {model_class.__name__}.forward has no keyword {per_call!r}")
        allowed = allowed_values(name, lambda v, n=name: config_class(**tiny, **{n: v}))
        lines.append(_row([f"`{name}`", f"`{params[name].default!r}`", allowed, f"`{per_call}`" if per_call else "",
                           _text(name)]))
    return lines


def _own_sections() -> list:
    from hf_fixedpoint.modeling import AttractorConfig, AttractorForCausalLM, OuroConfig, OuroForCausalLM

    ouro = _family_section(
        "## Ouro: loops and early exit",
        "Ouro has no `fp_*` settings. Set in the config, at load (`from_pretrained(dir, total_ut_steps=8)`, also as "
        "lm-eval `model_args`) or by assignment; the per-call name, where there is one, is a keyword of `forward` "
        "and `generate`.", OuroConfig, OuroForCausalLM, OURO_KNOBS,
        dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
             num_key_value_heads=1))
    attractor = _family_section(
        "## Attractor LM: the readout",
        "Besides the `fp_*` settings. Set in the config, at load or by assignment, and per call on `forward` and "
        "`generate`.", AttractorConfig, AttractorForCausalLM, ATTRACTOR_KNOBS,
        dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1))
    return ouro + [""] + attractor


def _puzzle_fields() -> dict:
    """Every field of the puzzle families' configs (their signatures, less ``**kwargs``), in order: the fields all
    three share, then each family's own; each mapped to ``{config class: default}``."""
    from hf_fixedpoint.modeling import FPRMConfig, TRMConfig, URMConfig

    fields = {}
    for config_class in (FPRMConfig, TRMConfig, URMConfig):
        for param in list(inspect.signature(config_class.__init__).parameters.values())[1:]:
            if param.kind is not inspect.Parameter.VAR_KEYWORD:
                fields.setdefault(param.name, {})[config_class] = param.default
    shared = [name for name, defaults in fields.items() if len(defaults) == 3]
    return {name: fields[name] for name in shared + [n for n in fields if n not in shared]}


def _puzzle_section() -> list:
    from hf_fixedpoint.modeling import FPRMConfig, TRMConfig, URMConfig

    families = (FPRMConfig, TRMConfig, URMConfig)
    lines = ["## Puzzle families: FPRM, TRM, URM", "",
             "Every field of their configs, besides the `fp_*` settings (their defaults are in the table above). Set "
             "in the config, at load (`from_pretrained(dir, halt_max_steps=32)`) or by assignment, checked against "
             "the other fields each time; not per call. "
             "`recipes/reasoning.py` takes `hidden_size`, `num_attention_heads`, `num_layers`, `puzzle_emb_len`, "
             "`halt_max_steps` and `loss_type` as flags (its task presets set some of them) and any other field "
             "as JSON (`--model_kwargs '{\"conv\": \"2d\"}'`). A dash: the family has no such field.", "",
             _row(["setting", "FPRM", "TRM", "URM", "allowed values", "what it does"]), _row(["---"] * 6)]
    for name, defaults in _puzzle_fields().items():
        owner = next(c for c in families if c in defaults)
        allowed = allowed_values(name, lambda v, n=name, c=owner: c(**{n: v}))
        cells = [f"`{defaults[c]!r}`" if c in defaults else "—" for c in families]
        lines.append(_row([f"`{name}`", *cells, allowed, _text(name)]))
    return lines


def knob_names() -> set:
    """Every knob the reference covers, from the code's tables and the puzzle configs' signatures."""
    from hf_fixedpoint.core.fp_fpsa_settings import FPSA_DEFAULTS
    from hf_fixedpoint.core.fp_settings import FP_DEFAULTS

    return set(FP_DEFAULTS) | set(FPSA_DEFAULTS) | set(OURO_KNOBS) | set(ATTRACTOR_KNOBS) | set(_puzzle_fields())


def render() -> str:
    head = ["# Settings reference", "",
            "<!-- Generated by `python -m tools.settings_doc` from the settings tables in the code; do not edit. -->",
            "", "Every setting is checked wherever it enters (constructor, assignment, `from_pretrained`, each call, "
            "lm-eval `model_args`): an unknown key or a value outside the allowed ones is a `ValueError` naming the "
            "key and the allowed values. A language or vision model's architecture fields (hidden size, layers, ...) "
            "are described in its config class's docstring; the puzzle families' fields are all listed here.", ""]
    body = _fp_sections() + [""] + _family_defaults() + [""] + _own_sections() + [""] + _puzzle_section()
    return "\n".join(head + body) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/settings.md is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if DOC.read_text() != text:
            print("docs/settings.md differs from the code: run `python -m tools.settings_doc`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
