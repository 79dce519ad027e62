"""Configuration of FPRM ("Fixed-Point Reasoners: Stable and Adaptive Deep Looped Transformers", Movahedi et al.)."""

from transformers import PretrainedConfig

from .fp_backward import fixed_point  # noqa: F401  (see vendor.direct_import_problems)
from .fp_reasoning import CONV_KINDS, PuzzleConfigMixin, check_puzzle_config
from .fp_registry import check_choice, check_number, complete_auto_map
from .fp_settings import pop_fp_kwargs
from .fp_solvers import solve  # noqa: F401  (see vendor.direct_import_problems)
from .fp_stats import FixedPointStats  # noqa: F401  (see vendor.direct_import_problems)

RESIDUAL_SCALES = ("learned", "fixed")
INITS = ("noise", "fixed")
INIT_NOISES = ("truncated", "normal")
SOLVE_MODES = ("official", "per_sample")
WINDOW_SOLVERS = ("fpopt", "picard")
EVAL_STEP_DECAY = 0.99

# FPRM's solver: damped iteration with patience-based step decay on the per-token relative l-inf residual (the
# largest over tokens, as in the official code), threshold 0.1.
FPRM_FP_DEFAULTS = {"fp_solver": "fpopt", "fp_norm": "token_linf", "fp_tol": 0.1, "fp_max_iter": 48,
                    "fp_eval_max_iter": 200, "fp_backward": "bptt", "fp_backward_steps": 6}


class FPRMConfig(PuzzleConfigMixin, PretrainedConfig):
    r"""
    Shared puzzle fields (also in TRM and URM):
        vocab_size, seq_len: token vocabulary and puzzle length (from the dataset's ``PuzzleMetadata``).
        hidden_size, num_attention_heads, expansion, mlp_multiple_of: width, heads, SwiGLU expansion and the multiple
            the SwiGLU width is rounded up to (256 in the research code).
        num_puzzle_identifiers, puzzle_emb_len, puzzle_emb_ndim: puzzle-id table size, prefix positions ``P``
            (0 disables the puzzle embedding) and embedding width (None: ``hidden_size``; at most ``P * hidden``).
        pos_encodings (``rope`` | ``learned`` | ``none``: rotary attention, a learned embedding per position added
            to the input injection in its place, as TRM/HRM's ``learned``, with inputs of length ``seq_len`` only, or
            no positions), rope_theta, rms_norm_eps, forward_dtype (``float32`` | ``bfloat16`` |
            ``float64``: the activation dtype; weights stay float32), grid_shape (``[rows, cols]`` of the puzzle
            grid, needed by ``conv="2d"``).
        causal: causal attention (position ``t`` sees ``<= t``; FPRM's 1-d convolution is causal in any case), the
            state-tracking set-up where the answer at ``t`` depends on the first ``t`` inputs; the Q-halt head then
            reads the last position. Not with ``mlp_t`` or ``conv="2d"``.
        halt_max_steps, halt_exploration_prob: ACT supervision steps per puzzle and exploration probability.
        loss_type (``stablemax`` | ``softmax``), q_loss_weight: the ACT loss head.

    FPRM fields:
        num_layers: pre-norm blocks in the map ``f``.
        residual_scale: ``learned`` (per-channel ``alpha = sigmoid(theta)``, trained) or ``fixed`` (kept at init).
        alpha_1_init, alpha_2_init: initial ``alpha_1`` (sublayer residual) and ``alpha_2`` (state injection), in
            (0, 1). ``beta_2 = 1 - alpha_2 * alpha_1^(2L)``, ``beta_1 = beta_2 (1 - alpha_1) / (1 - alpha_1^(2L))``
            with ``2L`` sublayers.
        conv, conv_kernel: short depthwise convolution of the state's grid part (``none`` | ``1d``: always causal,
            left padded | ``2d``), which replaces the grid part of ``y`` before the injection, as in the research code.
            A 2-D kernel of ``2 * 9 - 1 = 17`` reaches every Sudoku cell's whole row and column (the research code's 3
            only its neighbours; at CPU scale the 3 x 3 model learns the row constraint only, docs/reasoning.md).
        conv_skip: use ``y + conv(y)`` on the grid part instead (the same set of maps, but a different
            initialization and weight decay; not the research code's form).
        spectral_norm: spectral-normalize every linear layer of the blocks.
        output_norm: RMS-normalize the output of ``f``.
        init_mode, init_std, init_noise: start the solve from noise of std ``init_std`` (``noise``, FPRM) or from a
            fixed random vector (``fixed``); ``init_noise`` ``truncated`` (truncated normal at 2 std, the research
            code) or ``normal``; at evaluation the noise comes from a generator seeded with ``seed`` (one draw shared
            by the batch; the research code draws fresh noise).
        bptt_window: solver steps with gradient per supervision step (truncated BPTT window).
        eval_step_decay: the ``fpopt`` step-size decay at evaluation (0.99); training decays by
            ``fp_solver_kwargs["decay"]`` (``fpopt``'s 0.9 if not given). A ``decay`` in a call's ``fp_solver_kwargs``
            applies to that call in either mode. Only with ``fp_solver="fpopt"`` (other solvers have no step size).
        solve_mode: ``official`` (the research code): a training call with a carried state runs ``bptt_window``
            solver steps on every puzzle and decides halting after the window (residual below ``fp_tol``, step size
            below ``fpopt``'s ``min_step`` or ``fp_max_iter`` solver steps in all); an evaluation call with a carry
            takes one solver step and halts the whole batch once every puzzle's residual is below ``fp_tol`` (or
            every step size vanished, or ``fp_eval_max_iter`` steps; a batch with some puzzles converged and the
            others stalled goes on, as in the research code); a call without a state runs one window from a
            fresh state in training and, at evaluation, steps until the batch halts. The output is the damped
            iterate ``y``. ``per_sample``: a puzzle that converges is frozen inside a window, a call without a
            state is a full ``fixed_point`` solve (any solver and backward mode) that stops per puzzle and returns
            ``f(y)``. ``official`` needs ``fp_solver`` ``fpopt`` or ``picard``.
        pad_id: input token of padding; its positions are left out of the ``token_linf`` residual (mixed-length
            grids converge); None counts every position (the research code; Sudoku has no padding).
        fp_*: fixed-point settings; FPRM defaults ``fp_solver="fpopt", fp_norm="token_linf", fp_tol=0.1``,
            ``fp_max_iter`` (cap on solver steps per puzzle in training), ``fp_eval_max_iter`` (cap at evaluation),
            ``fp_stop_fraction`` (a training window stops once at most this fraction of the batch is unconverged).
    """

    model_type = "fprm"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_fprm.FPRMConfig", "AutoModel": "modeling_fprm.FPRMModel",
                       "AutoModelForTokenClassification": "modeling_fprm.FPRMForPuzzles"}

    def __init__(
        self,
        vocab_size: int = 11,
        seq_len: int = 81,
        hidden_size: int = 64,
        num_attention_heads: int = 4,
        expansion: float = 4.0,
        mlp_multiple_of: int = 64,
        num_puzzle_identifiers: int = 1,
        puzzle_emb_len: int = 1,
        puzzle_emb_ndim: int = None,
        pos_encodings: str = "rope",
        causal: bool = False,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        forward_dtype: str = "float32",
        grid_shape: list = None,
        halt_max_steps: int = 16,
        halt_exploration_prob: float = 0.0,
        loss_type: str = "stablemax",
        q_loss_weight: float = 0.5,
        num_layers: int = 2,
        residual_scale: str = "learned",
        alpha_1_init: float = 0.75,
        alpha_2_init: float = 0.25,
        conv: str = "none",
        conv_kernel: int = 3,
        spectral_norm: bool = False,
        output_norm: bool = False,
        init_mode: str = "noise",
        init_std: float = 6.0,
        seed: int = 0,
        bptt_window: int = 6,
        eval_step_decay: float = EVAL_STEP_DECAY,
        conv_skip: bool = False,
        init_noise: str = "truncated",
        solve_mode: str = "official",
        pad_id: int = 0,
        **kwargs,
    ):
        # Configs saved between the option's introduction and its removal carry pos_embedding="none", which is this
        # model exactly; "learned" (positions added to the rotary encoding) no longer exists.
        if kwargs.get("pos_embedding", "none") != "none":
            raise ValueError(
                f"pos_embedding={kwargs['pos_embedding']!r} was removed from FPRMConfig: learned positions are "
                "pos_encodings='learned' (shared by every puzzle family; it replaces the rotary encoding, the old "
                "option added to it). Allowed: pos_embedding='none' (the same model) or no pos_embedding; use "
                "pos_encodings='learned' for learned positions.")
        kwargs.pop("pos_embedding", None)
        fields = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        for key, value in {**fields, **pop_fp_kwargs(kwargs, FPRM_FP_DEFAULTS)}.items():
            setattr(self, key, value)
        check_puzzle_config(self)
        check_number(num_layers, "num_layers", low=1, integer=True)
        check_choice(residual_scale, "residual_scale", RESIDUAL_SCALES)
        for name in ("alpha_1_init", "alpha_2_init"):
            check_number(getattr(self, name), name, low=0.0, high=1.0, low_open=True, high_open=True)
        check_choice(conv, "conv", CONV_KINDS)
        check_number(conv_kernel, "conv_kernel", low=1, integer=True)
        if conv == "2d" and grid_shape is None:
            raise ValueError("conv='2d' needs grid_shape=[rows, cols] (e.g. [9, 9] for Sudoku).")
        if conv == "2d" and grid_shape[0] * grid_shape[1] != seq_len:
            cells = grid_shape[0] * grid_shape[1]
            raise ValueError(f"grid_shape={grid_shape} has {cells} cells but seq_len={seq_len}.")
        check_choice(init_mode, "init_mode", INITS)
        check_number(init_std, "init_std", low=0.0)
        check_number(seed, "seed", integer=True)
        check_number(bptt_window, "bptt_window", low=1, integer=True)
        check_number(eval_step_decay, "eval_step_decay", low=0.0, high=1.0, low_open=True, high_open=True)
        if eval_step_decay != EVAL_STEP_DECAY and self.fp_solver != "fpopt":
            raise ValueError(f"eval_step_decay={eval_step_decay!r} is fpopt's step-size decay at evaluation; "
                             f"fp_solver={self.fp_solver!r} has no step size (use fp_solver='fpopt' or leave "
                             f"eval_step_decay at {EVAL_STEP_DECAY}).")
        for name in ("spectral_norm", "output_norm", "conv_skip"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        check_choice(init_noise, "init_noise", INIT_NOISES)
        check_choice(solve_mode, "solve_mode", SOLVE_MODES)
        if solve_mode == "official" and self.fp_solver not in WINDOW_SOLVERS:
            raise ValueError(f"solve_mode='official' steps the research code's solver; fp_solver must be one of "
                             f"{WINDOW_SOLVERS}, got {self.fp_solver!r} (use solve_mode='per_sample').")
        if pad_id is not None:
            check_number(pad_id, "pad_id", low=0, integer=True)
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        super().__init__(**kwargs)


__all__ = ["FPRMConfig"]
