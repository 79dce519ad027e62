"""Configuration of Ouro (ByteDance Seed's looped language model, "Scaling Latent Reasoning via Looped Language
Models", 2025): a Qwen2-style decoder stack applied ``total_ut_steps`` times with weight tying across loops, an
early-exit gate after every loop and one KV-cache slot per (loop, layer).

The keys and their meaning are those of the released ``config.json`` files (``ByteDance/Ouro-1.4B``, ``-2.6B``), so
those files load unchanged; the defaults below are the constructor defaults of the upstream class, not checkpoint
values (Ouro-1.4B: hidden 2048, 24 layers, 16 heads, intermediate 5632, vocab 49152, rope_theta 1e6).
"""

from transformers import PretrainedConfig

from .fp_registry import CheckedConfigMixin, check_choice, check_number, complete_auto_map

EXIT_LOSSES = ("expected_logits", "expected_loss", "last")
EXIT_MODES = ("select", "skip")


def check_trained_loops(value):
    """``trained_loops`` as ``[lo, hi]`` (``1 <= lo <= hi``), or None; one int ``k`` means ``[k, k]``."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        raise ValueError(f"trained_loops={value!r} is not allowed. Allowed values: None, a loop count k >= 1, or "
                         "[lo, hi] with 1 <= lo <= hi.")
    lo, hi = value
    check_number(lo, "trained_loops[0]", low=1, integer=True)
    check_number(hi, "trained_loops[1]", low=lo, integer=True)
    return [int(lo), int(hi)]


class OuroConfig(CheckedConfigMixin, PretrainedConfig):
    r"""
    Args:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        hidden_act, max_position_embeddings, initializer_range, rms_norm_eps, attention_dropout: as in Qwen2 / Llama
            (no biases in the projections).
        rope_theta, rope_scaling: upstream's RoPE keys; stored as transformers-5 ``rope_parameters`` (which
            ``save_pretrained`` writes in their place; both forms load).
        use_sliding_window, sliding_window, max_window_layers, layer_types: kept for key compatibility; Ouro uses
            full attention in every layer.
        total_ut_steps: loops of the layer stack (the "universal transformer" steps); overridable per call with
            ``forward(..., total_ut_steps=k)`` / ``generate(..., total_ut_steps=k)``.
        early_exit_threshold: Q-exit threshold at inference: each token is decoded from the first loop whose
            cumulative exit probability reaches it (1.0: in practice the last loop); ``None`` decodes the last loop.
        early_exit_step: if set (0-based), inference decodes that loop's state instead.
        early_exit_tol: second exit rule at inference (not an upstream key): a token also exits at the first loop
            (from the second on) whose relative state change ``||h_t - h_{t-1}|| / ||h_{t-1}||`` is below it.
            ``None`` disables it.
        early_exit_mode: ``"select"`` (upstream) computes every loop for every token and decodes the exit loop;
            ``"skip"`` (not an upstream key) stops each token at its exit loop at inference: the remaining loops run
            on the tokens still running only, and an exited token's deeper cache slots hold copies of the keys and
            values of its exit loop (see ``docs/ouro_stars.md``). Overridable per call (``exit_mode=``).
        exit_loss: training loss with ``labels`` (not an upstream key): ``"expected_logits"`` (upstream HF code:
            cross-entropy of the exit-probability-weighted mixture of per-loop logits), ``"expected_loss"`` (paper
            stage I: ``sum_t p_t * CE_t - entropy_weight * H(p)``) or ``"last"`` (cross-entropy of the last loop).
        entropy_weight: beta of the entropy bonus in ``"expected_loss"``.
        trained_loops: ``[lo, hi]`` (or one int ``k`` for ``[k, k]``), the loop counts the model was trained with
            (not an upstream key; the recipes write it). ``None``: ``total_ut_steps`` is taken as the largest.
        loop_guard_tol: depth guard (not an upstream key). When a call runs more loops than ``trained_loops`` allows
            and the state is not settling past the trained depth (the mean relative change of the state from one loop
            to the next grows, or stays above this tolerance), a ``LoopDepthWarning`` is emitted once per model: looped
            models trained without a stability regulariser break when run deeper than trained (STARS). ``None``
            disables the guard.
        pad_token_id, bos_token_id, eos_token_id: special tokens (the released configs set all three to 0; the
            ChatML tokenizer uses bos 1, eos 2 -- check the checkpoint's tokenizer).

    Example:
        >>> config = OuroConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...                     num_attention_heads=4, num_key_value_heads=4, total_ut_steps=3)
    """

    model_type = "ouro"
    # Every Auto class of the family: config.json gets them all whichever class saves (see complete_auto_map).
    family_auto_map = {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModel": "modeling_ouro.OuroModel",
                       "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"}
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # "cache": the output field from transformers 5.24
    # Read by transformers' Llama attention / MLP, which Ouro reuses: Ouro has no projection biases. Class
    # attributes, so they are not written to config.json (the released files do not have them).
    attention_bias = False
    mlp_bias = False
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 22016,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 32,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict = None,
        rope_parameters: dict = None,
        use_sliding_window: bool = False,
        sliding_window: int = 4096,
        max_window_layers: int = 28,
        layer_types: list = None,
        attention_dropout: float = 0.0,
        total_ut_steps: int = 4,
        early_exit_threshold: float = 1.0,
        early_exit_step: int = None,
        early_exit_tol: float = None,
        early_exit_mode: str = "select",
        exit_loss: str = "expected_logits",
        entropy_weight: float = 0.0,
        trained_loops: list = None,
        loop_guard_tol: float = 0.1,
        pad_token_id: int = None,
        bos_token_id: int = None,
        eos_token_id: int = None,
        **kwargs,
    ):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            check_number(locals()[name], name, low=1, integer=True)
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size={hidden_size} must be divisible by num_attention_heads={num_attention_heads}."
            )
        if num_attention_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads={num_attention_heads} must be divisible by "
                             f"num_key_value_heads={num_key_value_heads}.")
        check_choice(exit_loss, "exit_loss", EXIT_LOSSES)
        check_number(entropy_weight, "entropy_weight", low=0.0)
        trained_loops = check_trained_loops(trained_loops)
        if loop_guard_tol is not None:
            check_number(loop_guard_tol, "loop_guard_tol", low=0.0)
        if use_sliding_window:
            raise ValueError("use_sliding_window=True is not supported: Ouro uses full attention in every layer.")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_parameters = rope_parameters
        self.use_sliding_window = use_sliding_window
        self.sliding_window = None  # as upstream: forced to None unless use_sliding_window
        self.max_window_layers = max_window_layers
        self.layer_types = layer_types or ["full_attention"] * num_hidden_layers
        self.attention_dropout = attention_dropout
        self.total_ut_steps = total_ut_steps  # this and the early-exit knobs: checked by check_setting
        self.early_exit_threshold = early_exit_threshold
        self.early_exit_step = early_exit_step
        self.early_exit_tol = early_exit_tol
        self.early_exit_mode = early_exit_mode
        self.exit_loss = exit_loss
        self.entropy_weight = entropy_weight
        self.trained_loops = trained_loops
        self.loop_guard_tol = loop_guard_tol
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        kwargs["auto_map"] = complete_auto_map(kwargs.get("auto_map"), self.family_auto_map)
        # Upstream's rope_theta / rope_scaling become transformers-5's rope_parameters (the base class converts them).
        super().__init__(tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta, rope_scaling=rope_scaling,
                         **kwargs)

    def check_setting(self, key: str, value) -> None:
        # The run-time knobs: from_pretrained(dir, total_ut_steps=k) sets them after __init__.
        if key == "total_ut_steps":
            check_number(value, key, low=1, integer=True)
        elif key == "early_exit_threshold" and value is not None:
            check_number(value, key, low=0.0, high=1.0)
        elif key == "early_exit_step" and value is not None:
            check_number(value, key, low=0, integer=True)
        elif key == "early_exit_tol" and value is not None:
            check_number(value, key, low=0.0)
        elif key == "early_exit_mode":
            check_choice(value, key, EXIT_MODES)
        super().check_setting(key, value)


__all__ = ["EXIT_LOSSES", "EXIT_MODES", "OuroConfig", "check_trained_loops"]
