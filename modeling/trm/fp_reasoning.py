# Source of truth: hf_fixedpoint/core/fp_reasoning.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Building blocks of the puzzle-reasoning families (TRM, Attractor-reasoning, URM, FPRM), written once.

* layers: ``trunc_normal_``, parameter-free ``rms_norm``, ``CastedLinear`` (fp32 master weight, cast to the input
  dtype), ``Attention`` (SDPA with RoPE, bidirectional or causal), ``SwiGLU`` / ``ConvSwiGLU`` (URM),
  ``SequenceMLP`` (TRM's ``mlp_t``), ``ShortConv`` (FPRM's depthwise 1-D or 2-D grid convolution) and
  ``ReasoningBlock`` (post- or pre-norm, optional FPRM residual scaling ``h <- a * h + b * sublayer(norm(h))``);
* inputs: ``SparsePuzzleEmbedding`` (a table kept as a buffer and trained with sign-SGD, as in the research code) and
  ``PuzzleInput`` (token embedding, puzzle prefix of ``puzzle_emb_len`` positions, optional learned positions,
  ``sqrt(D)`` scale);
* outputs: ``PuzzleHeads`` (LM head over the non-prefix positions and the Q-halt head read at position 0, or at the
  last position of a causal model);
* the ACT outer loop with deep-supervision carry: ``new_carry``, ``reset_carry``, ``act_halt``;
* losses: ``stablemax_cross_entropy``, ``softmax_cross_entropy`` and ``puzzle_loss`` (ACT loss head).

The rotary helper is passed in by the modeling files (transformers' ``apply_rotary_pos_emb``), so this file stays
torch-only.
"""

import math
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from .fp_registry import check_choice, check_number, keyword_options
from .fp_settings import FP_DEFAULTS, FixedPointConfigMixin, call_knobs

NORM_PLACEMENTS = ("post", "pre")
MLP_KINDS = ("swiglu", "conv_swiglu")
CONV_KINDS = ("none", "1d", "2d")
LOSS_TYPES = ("stablemax", "softmax")
IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------------------------
# Layers


def trunc_normal_(t: torch.Tensor, std: float = 1.0, lower: float = -2.0, upper: float = 2.0,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Truncated normal on ``[lower, upper]`` standard deviations, rescaled so the *actual* std is ``std``.

    One ``nn.init`` call, so that transformers' ``from_pretrained`` (which guards ``nn.init`` while it fills missing
    weights) leaves a loaded tensor as it is. Returns ``t`` itself: transformers 4.57's guard replaces ``nn.init``
    functions by ones that return ``None``."""
    with torch.no_grad():
        if std == 0:
            nn.init.zeros_(t)
            return t
        scale = _truncated_scale(std, lower, upper)
        nn.init.trunc_normal_(t, mean=0.0, std=scale, a=lower * scale, b=upper * scale, generator=generator)
        return t


def _truncated_scale(std: float, lower: float, upper: float) -> float:
    """The scale of a standard normal truncated to ``[lower, upper]`` whose actual standard deviation is ``std``."""
    a, b = lower / math.sqrt(2), upper / math.sqrt(2)
    z = (math.erf(b) - math.erf(a)) / 2
    pdf_u = math.exp(-(upper**2) / 2) / math.sqrt(2 * math.pi)
    pdf_l = math.exp(-(lower**2) / 2) / math.sqrt(2 * math.pi)
    var = 1 - (upper * pdf_u - lower * pdf_l) / z - ((pdf_u - pdf_l) / z) ** 2
    return std / math.sqrt(var)


def truncated_normal(shape, std: float = 1.0, lower: float = -2.0, upper: float = 2.0, device=None,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``trunc_normal_``'s distribution drawn without a host read, for noise drawn in every training forward: the
    inverse CDF (``torch.special.ndtri``) of uniforms between the bounds' CDF values. ``nn.init.trunc_normal_``
    (torch 2.13) redraws out-of-range values in a loop whose test reads the device each round."""
    def cdf(x):
        return (1 + math.erf(x / math.sqrt(2))) / 2

    u = torch.empty(shape, device=device).uniform_(cdf(lower), cdf(upper), generator=generator)
    return torch.special.ndtri(u).clamp_(lower, upper).mul_(_truncated_scale(std, lower, upper))


def rms_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Parameter-free RMS norm computed in (at least) float32 and cast back (as in TRM/HRM/URM)."""
    return F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), (x.shape[-1],), eps=eps).to(x.dtype)


def _value_range(ids: torch.Tensor) -> tuple:
    """``(min, max)`` of integer ``ids`` in one read to the host; ``(0, 0)`` for an empty tensor and inside a
    ``torch.compile`` graph (where the embedding's own bounds check acts instead)."""
    if not ids.numel() or torch.compiler.is_compiling():
        return 0, 0
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()
    return lo, hi


class CastedLinear(nn.Linear):
    """``nn.Linear`` with LeCun truncated-normal init whose weight is cast to the input's dtype at call time.

    Master weights stay in float32 while activations run in bfloat16 (``forward_dtype``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self):
        trunc_normal_(self.weight, std=1.0 / math.sqrt(self.in_features))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def swiglu_width(hidden_size: int, expansion: float, multiple_of: int) -> int:
    """TRM's intermediate width: ``round(expansion * hidden * 2 / 3)`` rounded up to ``multiple_of``."""
    inter = round(expansion * hidden_size * 2 / 3)
    return -(-inter // multiple_of) * multiple_of


class SwiGLU(nn.Module):
    """``down(silu(gate) * up)`` with a fused gate/up projection and no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = CastedLinear(hidden_size, 2 * intermediate_size)
        self.down_proj = CastedLinear(intermediate_size, hidden_size)

    def hidden(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x):
        return self.down_proj(self.hidden(x))


class ConvSwiGLU(SwiGLU):
    """URM's MLP: SwiGLU hidden, then a depthwise causal 2-tap convolution over tokens and another SiLU."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernel_size: int = 2):
        super().__init__(hidden_size, intermediate_size)
        self.conv = nn.Conv1d(intermediate_size, intermediate_size, kernel_size, padding=kernel_size - 1,
                              groups=intermediate_size, bias=True)

    def forward(self, x):
        h = self.hidden(x)
        T = h.shape[1]
        h = self.conv(h.transpose(1, 2).to(self.conv.weight.dtype))[..., :T].transpose(1, 2).to(x.dtype)
        return self.down_proj(F.silu(h))


class SequenceMLP(nn.Module):
    """TRM's ``mlp_t``: a SwiGLU over the *sequence* axis, used in place of attention.

    As in the research code the block around it works on the transposed state, so its RMS norm is taken over the
    sequence axis too (``norm_dim = 1``; see ``ReasoningBlock``)."""

    norm_dim = 1

    def __init__(self, seq_len: int, expansion: float, multiple_of: int):
        super().__init__()
        self.mlp = SwiGLU(seq_len, swiglu_width(seq_len, expansion, multiple_of))

    def forward(self, x, rope=None):
        return self.mlp(x.transpose(1, 2)).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head attention (fused QKV, no biases) through ``F.scaled_dot_product_attention``; bidirectional, or
    ``causal`` (position ``t`` attends to ``<= t``: the state-tracking set-up, where the answer at ``t`` depends on the
    first ``t`` inputs only).

    ``rope`` is ``(cos, sin, apply_rotary)`` with ``apply_rotary(q, k, cos, sin)`` (transformers' helper) or None.
    """

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.causal = num_heads, hidden_size // num_heads, causal
        self.qkv_proj = CastedLinear(hidden_size, 3 * hidden_size)
        self.o_proj = CastedLinear(hidden_size, hidden_size)

    def forward(self, x, rope=None):
        B, T, D = x.shape
        q, k, v = self.qkv_proj(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if rope is not None:  # rotated in (at least) float32 and cast back, as in the research code's bf16 runs
            cos, sin, apply_rotary = rope
            wide = torch.promote_types(q.dtype, torch.float32)
            qr, kr = apply_rotary(q.to(wide), k.to(wide), cos.to(wide), sin.to(wide), unsqueeze_dim=0)
            q, k = qr.to(q.dtype), kr.to(k.dtype)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, D))


def rotary_tables(head_dim: int, max_positions: int, base: float = 10000.0):
    """``(cos, sin)`` of shape ``(max_positions, head_dim)`` in the ``rotate_half`` convention."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class ShortConv(nn.Module):
    """FPRM's short depthwise convolution over the grid part of the state (the puzzle prefix bypasses it).

    ``kind="1d"``: kernel ``kernel_size`` over the flattened row-major sequence, always causal (left padded: position
    ``t`` reads ``t - kernel_size + 1 .. t``), as in the research code. ``kind="2d"``: ``kernel_size x kernel_size``
    ("same" padding) over the ``grid_shape`` grid. No bias. Returns the state with its grid part replaced by the
    convolution (the prefix unchanged), as the research code does; with ``skip`` the grid part becomes
    ``grid + conv(grid)`` instead (same maps, other initialization and weight decay).
    """

    def __init__(self, hidden_size: int, kind: str, kernel_size: int, prefix_len: int, grid_shape=None,
                 skip: bool = False):
        super().__init__()
        check_choice(kind, "conv", CONV_KINDS[1:])  # causal with "2d" is rejected by check_puzzle_config
        self.kind, self.prefix_len, self.skip = kind, prefix_len, skip
        self.grid_shape = tuple(grid_shape) if grid_shape is not None else None
        conv = nn.Conv1d if kind == "1d" else nn.Conv2d
        self.conv = conv(hidden_size, hidden_size, kernel_size, padding="same", groups=hidden_size, bias=False)

    def forward(self, h):
        grid = h[:, self.prefix_len:]
        B, T, D = grid.shape
        w = self.conv.weight.to(h.dtype)
        if self.kind == "1d":
            out = F.conv1d(F.pad(grid.transpose(1, 2), (w.shape[-1] - 1, 0)), w, groups=D).transpose(1, 2)
        else:
            rows, cols = self.grid_shape
            if rows * cols != T:
                raise ValueError(f"grid_shape={self.grid_shape} does not cover the {T} non-prefix positions.")
            img = grid.transpose(1, 2).reshape(B, D, rows, cols)
            out = F.conv2d(img, w, padding="same", groups=D).reshape(B, D, T).transpose(1, 2)
        return torch.cat([h[:, : self.prefix_len], grid + out if self.skip else out], dim=1)


class ReasoningBlock(nn.Module):
    """A transformer block with a token mixer (attention or ``SequenceMLP``) and an MLP.

    ``post``-norm (TRM/HRM/URM): ``h = norm(h + mixer(h)); h = norm(h + mlp(h))``.
    ``pre``-norm (FPRM): ``h = a * h + b * mixer(norm(h)); h = a * h + b * mlp(norm(h))`` with the residual scales
    ``(a, b)`` passed in (``None``: 1 and 1, a plain pre-norm residual).
    The mixer's norm is over its ``norm_dim`` (the hidden axis; the sequence axis for ``SequenceMLP``).
    """

    def __init__(self, mixer: nn.Module, mlp: nn.Module, norm: str = "post", eps: float = 1e-5):
        super().__init__()
        check_choice(norm, "norm", NORM_PLACEMENTS)
        self.mixer, self.mlp, self.norm, self.eps = mixer, mlp, norm, eps

    def _mixer_norm(self, h):
        if getattr(self.mixer, "norm_dim", -1) == 1:
            return rms_norm(h.transpose(1, 2), self.eps).transpose(1, 2)
        return rms_norm(h, self.eps)

    def forward(self, h, rope=None, scale=None):
        if self.norm == "post":
            h = self._mixer_norm(h + self.mixer(h, rope))
            return rms_norm(h + self.mlp(h), self.eps)
        for sub, norm in ((lambda t: self.mixer(t, rope), self._mixer_norm), (self.mlp, self._norm)):
            out = sub(norm(h))
            h = h + out if scale is None else scale[0] * h + scale[1] * out
        return h

    def _norm(self, h):
        return rms_norm(h, self.eps)


# ---------------------------------------------------------------------------------------------------------------
# Inputs and outputs


class SparsePuzzleEmbedding(nn.Module):
    """Per-puzzle embedding table trained with sign-SGD on the rows a batch touches.

    The table ``weights`` is a persistent buffer (not a parameter: the main optimizer never sees it). In a training
    forward the batch's rows are copied into ``local_weights``, a leaf tensor that receives their gradient;
    ``sign_sgd_step`` then applies ``w <- w * (1 - lr * wd) - lr * sign(sum of the grads of that row)`` to the touched
    rows ("Adam is about sign-SGD for a very sparse gradient"), with the last training forward's rows and gradient.
    Zero initialized, as in TRM.

    After a step the leaf is kept and the next training forward refills it in place (as TRM's
    ``CastedSparseEmbedding`` does), so that a compiled training step takes it as an input: a graph cannot create a
    tensor that requires grad. A new leaf is made where the batch size, device or dtype changed, or where no step has
    used the last one's rows (a forward replaces them, as every forward did before); under ``torch.compile`` that
    allocation is a graph break, so a ``fullgraph=True`` training step runs after one eager step.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.register_buffer("weights", torch.zeros(num_embeddings, embedding_dim), persistent=True)
        self.local_weights: Optional[torch.Tensor] = None  # the last training forward's rows, a leaf
        self.local_ids: Optional[torch.Tensor] = None  # their ids; None once a step has used them

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lo, hi = _value_range(ids)
        if lo < 0 or hi >= self.weights.shape[0]:
            raise ValueError(f"puzzle_identifiers must lie in [0, {self.weights.shape[0]}); got values in "
                             f"[{lo}, {hi}]. Build the model with num_puzzle_identifiers from the dataset's "
                             "PuzzleMetadata.")
        if not (self.training and torch.is_grad_enabled()):
            return self.weights[ids]
        leaf, w = self.local_weights, self.weights
        if (self.local_ids is not None or leaf is None or leaf.shape[0] != ids.shape[0] or leaf.device != w.device
                or leaf.dtype != w.dtype):
            leaf = self._new_leaf(ids.shape[0])
        with torch.no_grad():
            leaf.copy_(w[ids])
        self.local_weights, self.local_ids = leaf, ids
        return leaf

    @torch.compiler.disable
    def _new_leaf(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.weights.shape[1], dtype=self.weights.dtype, device=self.weights.device,
                           requires_grad=True)

    @torch.no_grad()
    def sign_sgd_step(self, lr: float, weight_decay: float = 0.0, ids=None, grad=None) -> None:
        """Apply one sign-SGD step with the gradient of the last training forward (or given ``ids``/``grad``,
        e.g. gathered from every process), then drop it; the leaf is kept for the next forward to refill."""
        if ids is None:
            if self.local_ids is None or self.local_weights.grad is None:
                return
            ids, grad = self.local_ids, self.local_weights.grad
        uniq, inv = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(uniq.numel(), grad.shape[1], dtype=grad.dtype, device=grad.device)
        summed.index_add_(0, inv, grad)
        rows = self.weights[uniq]
        self.weights[uniq] = rows * (1.0 - lr * weight_decay) - lr * summed.sign().to(rows.dtype)
        if self.local_weights is not None:
            self.local_weights.grad = None
        self.local_ids = None


# The research code's 1/sqrt(2) for learned positions, as it writes it (a rounded literal): float64 parity with its
# forward needs the same constant.
LEARNED_POS_SCALE = 0.707106781


class PuzzleInput(nn.Module):
    """``sqrt(D) * cat(puzzle prefix, embed(tokens))``: the input injection ``x`` of shape ``(B, P + L, D)``.

    The puzzle embedding (``puzzle_emb_ndim`` wide, at most ``P * D``) is zero-padded to ``P`` prefix positions.
    ``P = 0`` disables it. With ``num_positions`` (TRM/HRM's ``pos_encodings="learned"``) a learned embedding per
    position ``embed_pos`` (``(P + L, D)``, puzzle prefix included, initialized like the token embedding) is added
    before the scale: ``sqrt(D) * 0.707106781 * (cat(prefix, embed(tokens)) + embed_pos)``; inputs must then have
    exactly ``num_positions - P`` tokens.
    """

    def __init__(self, vocab_size: int, hidden_size: int, num_puzzle_identifiers: int, puzzle_emb_len: int,
                 puzzle_emb_ndim: int, num_positions: int = 0):
        super().__init__()
        self.hidden_size, self.prefix_len = hidden_size, puzzle_emb_len
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        init_puzzle_weights(self.embed_tokens)
        self.puzzle_emb = SparsePuzzleEmbedding(num_puzzle_identifiers, puzzle_emb_ndim) if puzzle_emb_len else None
        self.embed_pos = nn.Embedding(num_positions, hidden_size) if num_positions else None
        if self.embed_pos is not None:
            init_puzzle_weights(self.embed_pos)

    def forward(self, input_ids, puzzle_identifiers=None, dtype=torch.float32):
        emb = self.embed_tokens.weight.to(dtype)[input_ids]
        if self.puzzle_emb is not None:
            B = input_ids.shape[0]
            if puzzle_identifiers is None:
                puzzle_identifiers = torch.zeros(B, dtype=torch.long, device=input_ids.device)
            pe = self.puzzle_emb(puzzle_identifiers.long()).to(dtype)
            pe = F.pad(pe, (0, self.prefix_len * self.hidden_size - pe.shape[1]))
            emb = torch.cat([pe.view(B, self.prefix_len, self.hidden_size), emb], dim=1)
        if self.embed_pos is not None:
            rows = self.embed_pos.num_embeddings
            if emb.shape[1] != rows:
                raise ValueError(
                    f"pos_encodings='learned' has one learned embedding per position: {rows} = puzzle_emb_len "
                    f"{self.prefix_len} + seq_len {rows - self.prefix_len}; got input_ids of length "
                    f"{input_ids.shape[1]}. Pass inputs of length seq_len (pos_encodings='rope' takes any length).")
            emb = LEARNED_POS_SCALE * (emb + self.embed_pos.weight.to(dtype))
        return math.sqrt(self.hidden_size) * emb


class QHaltLinear(CastedLinear):
    """The Q-halt head's linear map, initialized to weight 0 and bias -5 (as in TRM: halting starts unlikely)."""

    def reset_parameters(self):
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.constant_(self.bias, -5.0)


class PuzzleHeads(nn.Module):
    """LM head over the non-prefix positions and the Q-halt head (weight 0, bias -5, as in TRM) at position 0, or at
    the last position in a ``causal`` model (the only one that sees the whole puzzle)."""

    def __init__(self, hidden_size: int, vocab_size: int, prefix_len: int, causal: bool = False):
        super().__init__()
        self.prefix_len, self.q_position = prefix_len, -1 if causal else 0
        self.lm_head = CastedLinear(hidden_size, vocab_size)
        self.q_head = QHaltLinear(hidden_size, 1, bias=True)

    def forward(self, h):
        return self.lm_head(h[:, self.prefix_len:]), self.q_head(h[:, self.q_position]).float()[:, 0]


POS_ENCODINGS = ("rope", "learned", "none")
FORWARD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class PuzzleTrunk(nn.Module):
    """What every puzzle family shares around its recurrence: the input injection and the positions.

    Reads ``vocab_size, hidden_size, num_attention_heads, num_puzzle_identifiers, puzzle_emb_len, puzzle_emb_ndim,
    pos_encodings, rope_theta, seq_len, forward_dtype`` from ``config``; ``apply_rotary`` is the rotary helper
    (transformers' ``apply_rotary_pos_emb``). ``pos_encodings``: ``rope`` (rotary tables for attention, any input
    length), ``learned`` (an embedding per position in the input injection, ``PuzzleInput.embed_pos``, in place of
    rotary tables, as in TRM/HRM; inputs of length ``seq_len`` only) or ``none``.
    """

    def __init__(self, config, apply_rotary: Callable):
        super().__init__()
        c = config
        self.config, self.apply_rotary = c, apply_rotary
        self.prefix_len = c.puzzle_emb_len
        positions = c.puzzle_emb_len + c.seq_len if c.pos_encodings == "learned" else 0
        self.input = PuzzleInput(c.vocab_size, c.hidden_size, c.num_puzzle_identifiers, c.puzzle_emb_len,
                                 c.puzzle_emb_ndim or c.hidden_size, positions)
        self.head_dim = c.hidden_size // c.num_attention_heads
        # A plain cache, not buffers: non-persistent buffers are not restored by from_pretrained's meta-device load.
        self._rope_cache = {}

    @property
    def dtype(self):
        """``forward_dtype``, or float64 once the model itself was cast with ``.double()``."""
        if self.input.embed_tokens.weight.dtype == torch.float64:
            return torch.float64
        return FORWARD_DTYPES[self.config.forward_dtype]

    def embed(self, input_ids, puzzle_identifiers=None):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len); got shape {tuple(input_ids.shape)}.")
        vocab = self.config.vocab_size
        lo, hi = _value_range(input_ids)
        if lo < 0 or hi >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab}) (vocab_size); got values in [{lo}, {hi}].")
        return self.input(input_ids, puzzle_identifiers, self.dtype)

    def rope(self, length: int):
        """``(cos, sin, apply_rotary)`` for ``length`` positions (any length), or None without rotary encodings."""
        if self.config.pos_encodings != "rope":
            return None
        device = self.input.embed_tokens.weight.device
        key = (length, str(device))
        if key not in self._rope_cache:
            cos, sin = rotary_tables(self.head_dim, length, self.config.rope_theta)
            self._rope_cache = {key: (cos.to(device), sin.to(device))}
        return (*self._rope_cache[key], self.apply_rotary)


def check_puzzle_config(c) -> None:
    """Validate the fields every puzzle family's config shares (errors name the field and the allowed values)."""
    for name in ("vocab_size", "seq_len", "hidden_size", "num_attention_heads", "num_puzzle_identifiers",
                 "halt_max_steps", "mlp_multiple_of"):
        check_number(getattr(c, name), name, low=1, integer=True)
    check_number(c.puzzle_emb_len, "puzzle_emb_len", low=0, integer=True)
    if c.hidden_size % c.num_attention_heads:
        raise ValueError(f"hidden_size={c.hidden_size} must be divisible by num_attention_heads="
                         f"{c.num_attention_heads}.")
    if c.puzzle_emb_ndim is not None:
        check_number(c.puzzle_emb_ndim, "puzzle_emb_ndim", low=1, high=c.puzzle_emb_len * c.hidden_size,
                     integer=True)
    check_number(c.expansion, "expansion", low=0.0, low_open=True)
    check_number(c.rope_theta, "rope_theta", low=0.0, low_open=True)
    check_number(c.rms_norm_eps, "rms_norm_eps", low=0.0, low_open=True)
    check_number(c.halt_exploration_prob, "halt_exploration_prob", low=0.0, high=1.0)
    check_number(c.q_loss_weight, "q_loss_weight", low=0.0)
    check_choice(c.pos_encodings, "pos_encodings", POS_ENCODINGS)
    check_choice(c.forward_dtype, "forward_dtype", tuple(FORWARD_DTYPES))
    check_choice(c.loss_type, "loss_type", LOSS_TYPES)
    if not isinstance(c.causal, bool):
        raise ValueError(f"causal must be True or False, got {c.causal!r}.")
    if c.causal and getattr(c, "mlp_t", False):
        raise ValueError("causal=True needs attention: mlp_t=True mixes every position through its sequence MLP.")
    if c.causal and getattr(c, "conv", "none") == "2d":
        raise ValueError("causal=True cannot use conv='2d' (a grid has no left-to-right order); use conv='1d'.")
    if c.grid_shape is not None:
        if (not isinstance(c.grid_shape, (list, tuple)) or len(c.grid_shape) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in c.grid_shape)):
            raise ValueError(f"grid_shape must be [rows, cols] of positive integers, got {c.grid_shape!r}.")


class PuzzleConfigMixin(FixedPointConfigMixin):
    """Put before ``PretrainedConfig`` in a puzzle family's config. Its ``__init__`` validates the fields together
    (they constrain one another: ``conv="2d"`` needs ``grid_shape``, ``causal`` excludes ``mlp_t``), so
    ``from_pretrained(dir, field=value)`` keywords join the saved fields before ``__init__`` runs (transformers would
    set them after it, unchecked), and a later ``config.field = value`` is checked by building the config again with
    the new value (the error names the field and its allowed values)."""

    def check_setting(self, key: str, value) -> None:
        super().check_setting(key, value)
        fields = keyword_options(type(self))
        current = vars(self)
        names = fields + tuple(FP_DEFAULTS)
        if key in fields and all(k in current for k in names):  # constructed: check the whole config with the value
            type(self)(**{**{k: current[k] for k in names}, key: value})

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        fields = {k: kwargs.pop(k) for k in [k for k in kwargs if k in keyword_options(cls)]}
        return super().from_dict({**config_dict, **fields}, **kwargs)


def build_blocks(c, num_layers: int, norm: str, mlp: str = "swiglu", mlp_t: bool = False) -> nn.ModuleList:
    """``num_layers`` ``ReasoningBlock``s: attention (causal with ``c.causal``; or TRM's sequence MLP) +
    ``swiglu``/``conv_swiglu``."""
    check_choice(mlp, "mlp", MLP_KINDS)
    inter = swiglu_width(c.hidden_size, c.expansion, c.mlp_multiple_of)
    blocks = []
    for _ in range(num_layers):
        mixer = (SequenceMLP(c.seq_len + c.puzzle_emb_len, c.expansion, c.mlp_multiple_of) if mlp_t
                 else Attention(c.hidden_size, c.num_attention_heads, c.causal))
        ffn = ConvSwiGLU(c.hidden_size, inter) if mlp == "conv_swiglu" else SwiGLU(c.hidden_size, inter)
        blocks.append(ReasoningBlock(mixer, ffn, norm, c.rms_norm_eps))
    return nn.ModuleList(blocks)


def init_puzzle_weights(module: nn.Module) -> None:
    """The shared part of the puzzle families' ``_init_weights``: the values the layers draw when they are built
    (LeCun truncated normal linears, token embeddings with std ``1/sqrt(D)``, the Q-halt head at 0 / -5, a zero
    puzzle-embedding table, torch's default convolutions). ``from_pretrained`` fills the tensors a checkpoint lacks
    through it; every call is an ``nn.init`` function, which transformers guards so that loaded tensors stay."""
    if isinstance(module, (CastedLinear, nn.Conv1d, nn.Conv2d)):
        module.reset_parameters()
    elif isinstance(module, nn.Embedding):
        trunc_normal_(module.weight, std=1.0 / math.sqrt(module.embedding_dim))
    elif isinstance(module, SparsePuzzleEmbedding):
        nn.init.zeros_(module.weights)


def puzzle_hidden_states(config, out: dict, kwargs: dict):
    """The standard output switches of a puzzle model's ``forward``: with ``output_hidden_states`` (call argument,
    else ``config.output_hidden_states``) the input injection and the final state over the puzzle positions,
    ``(x, h)``, else None. The attention is fused (SDPA), so ``output_attentions=True`` is refused."""
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        raise ValueError("the puzzle models compute attention with fused scaled_dot_product_attention and return no "
                         "attention weights; call them with output_attentions=False.")
    if not kwargs.get("output_hidden_states", getattr(config, "output_hidden_states", False)):
        return None
    P = config.puzzle_emb_len
    return out["x"][:, P:], out["h"][:, P:]


def relative_change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per-sample ``max|new - old| / max|new|``: the residual reported by the unrolled (non-solver) loops."""
    dims = tuple(range(1, new.dim()))
    return ((new - old).abs().amax(dims) / (new.abs().amax(dims) + 1e-9)).float()


# ---------------------------------------------------------------------------------------------------------------
# ACT outer loop with deep-supervision carry

BATCH_KEYS = ("input_ids", "labels", "puzzle_identifiers")


def new_carry(state: dict, batch_size: int, device) -> dict:
    """A carry whose slots are all halted, so the first ``reset_carry`` fills every slot with the new batch."""
    return {
        "state": state,
        "steps": torch.zeros(batch_size, dtype=torch.long, device=device),
        "iterations": torch.zeros(batch_size, dtype=torch.long, device=device),
        "halted": torch.ones(batch_size, dtype=torch.bool, device=device),
        "data": None,
    }


def _where_rows(mask, new, old):
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


def reset_carry(carry: dict, batch: dict, fresh_state: dict) -> dict:
    """Halted slots take the new batch's data and the fresh state and restart their counters; the others keep their
    puzzle and their detached state (deep supervision: one puzzle stays in its slot for several steps)."""
    halted = carry["halted"]
    if carry["data"] is None:
        data = {k: v for k, v in batch.items() if k in BATCH_KEYS and v is not None}
    else:
        data = {k: _where_rows(halted, batch[k], v) for k, v in carry["data"].items()}
    state = {k: _where_rows(halted, fresh_state[k], v.detach()) if carry["data"] is not None else fresh_state[k]
             for k, v in (carry["state"] or fresh_state).items()}
    zero = torch.zeros_like(carry["steps"])
    return {"state": state, "steps": torch.where(halted, zero, carry["steps"]),
            "iterations": torch.where(halted, zero, carry["iterations"]), "halted": halted, "data": data}


def act_halt(steps: torch.Tensor, q_halt: torch.Tensor, max_steps: int, training: bool,
             exploration_prob: float = 0.0, done: Optional[torch.Tensor] = None,
             generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Which slots halt after this supervision step.

    Always at ``max_steps``. In training also where the model says so -- ``done`` if the model has its own halting
    signal (FPRM's fixed-point convergence), else ``q_halt > 0`` -- and, with probability ``exploration_prob`` per
    slot, not before a random minimum in ``{2, ..., max_steps}`` (TRM's exploration). At evaluation every slot runs
    ``max_steps`` so batches stay in lockstep.
    """
    halted = steps >= max_steps
    if not training or max_steps <= 1:
        return halted
    want = done if done is not None else q_halt > 0
    if exploration_prob > 0:
        explore = torch.rand(steps.shape, generator=generator, device="cpu").to(steps.device) < exploration_prob
        min_steps = torch.randint(2, max_steps + 1, steps.shape, generator=generator, device="cpu").to(steps.device)
        want = want & ~(explore & (steps < min_steps))
    return halted | want


def puzzle_step(base, heads, *, input_ids, puzzle_identifiers=None, labels=None, carry=None, fp_overrides=None,
                halt_max_steps=16, exploration_prob=0.0, loss_type="stablemax", q_loss_weight=0.5, training=False):
    """One supervision step of a puzzle model: (carry reset,) recurrence, heads, halting, loss.

    ``base.inner(input_ids, puzzle_identifiers, state, fp_overrides)`` returns a dict: ``h`` the full state
    ``(B, P + L, D)`` the heads read, ``x`` the input injection (same shape), ``state`` the detached state to carry,
    ``stats`` the solve's ``FixedPointStats``, ``done`` an optional per-sample halting signal (training), ``halt`` an
    optional halting decision that replaces ``act_halt``'s (FPRM's research-code evaluation halts the whole batch at
    once), ``iterations`` the inner-map evaluations per sample and ``aux_loss`` an optional regularizer added to the
    loss. Without ``carry``
    it is a single call from the fresh state; with ``carry`` the deep-supervision carry is reset for halted slots,
    advanced and returned. Returns a dict with ``logits, q_halt_logits, loss, metrics, carry, fp_stats,
    iterations`` and ``inner`` (the dict ``base.inner`` returned).
    """
    B = input_ids.shape[0]
    state = None
    if carry is not None:
        if carry["data"] is not None and carry["data"]["input_ids"].shape != input_ids.shape:
            raise ValueError(f"the carry holds puzzles of shape {tuple(carry['data']['input_ids'].shape)} but the "
                             f"batch has shape {tuple(input_ids.shape)}; keep the batch size fixed (drop_last).")
        batch = {"input_ids": input_ids, "labels": labels, "puzzle_identifiers": puzzle_identifiers}
        carry = reset_carry(carry, batch, base.fresh_state(B, input_ids.device, input_ids.shape[1]))
        data = carry["data"]
        input_ids, labels, puzzle_identifiers = data["input_ids"], data.get("labels"), data.get("puzzle_identifiers")
        state = carry["state"]
    out = base.inner(input_ids, puzzle_identifiers, state, fp_overrides)
    logits, q_halt = heads(out["h"])
    iterations = out["iterations"]
    if carry is not None:
        steps = carry["steps"] + 1
        iterations = carry["iterations"] + iterations
        halted = act_halt(steps, q_halt.detach(), halt_max_steps, training, exploration_prob, out.get("done"))
        if out.get("halt") is not None:
            halted = out["halt"]
        carry = {"state": out["state"], "steps": steps, "iterations": iterations, "halted": halted, "data": data}
    loss = metrics = None
    if labels is not None:
        loss, metrics = puzzle_loss(logits, labels, q_halt, loss_type, q_loss_weight)
        if out.get("aux_loss") is not None:
            metrics["aux_loss"] = out["aux_loss"].detach()
            loss = loss + out["aux_loss"]
    return {"logits": logits, "q_halt_logits": q_halt, "loss": loss, "metrics": metrics, "carry": carry,
            "fp_stats": out["stats"], "iterations": iterations, "inner": out}


class PuzzleCheckpointMixin:
    """What the puzzle families' ``PreTrainedModel`` classes share: ``_init_weights`` (``init_puzzle_weights`` plus the
    latents' fixed reset vectors, buffers named ``*_init``), the token embedding through ``get_input_embeddings`` /
    ``set_input_embeddings``, and a ``from_pretrained`` that refuses a ``num_puzzle_identifiers`` differing from the
    checkpoint's with a clear error (the puzzle-embedding table has one row per id, so the saved table cannot serve
    another id set)."""

    def _init_weights(self, module):
        init_puzzle_weights(module)
        for name, buffer in module.named_buffers(recurse=False):
            if name.endswith("_init") and buffer is not None:
                trunc_normal_(buffer, std=1.0)

    def get_input_embeddings(self) -> nn.Module:
        return self.base_model.trunk.input.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.base_model.trunk.input.embed_tokens = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        config = kwargs.get("config")
        requested = getattr(config, "num_puzzle_identifiers", None) if config is not None and not isinstance(
            config, str) else kwargs.get("num_puzzle_identifiers")
        if requested is not None and pretrained_model_name_or_path is not None:
            hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder")
                   if k in kwargs}
            saved = cls.config_class.get_config_dict(pretrained_model_name_or_path, **hub)[0].get(
                "num_puzzle_identifiers")
            if saved is not None and saved != requested:
                raise ValueError(
                    f"num_puzzle_identifiers={requested} differs from the checkpoint's {saved}: its puzzle-embedding "
                    "table has one row per puzzle id. Build the dataset with the checkpoint's ids, or train a new "
                    "model for the new id set.")
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)


class PuzzleSolverMixin:
    """The ``*ForPuzzles`` side of every family: a base model ``self.model`` (with ``inner`` and
    ``fresh_state(batch_size, device, seq_len)``) under ``PuzzleHeads`` ``self.heads``, one supervision step per
    call. Inputs may be longer than ``config.seq_len`` (length generalization) unless a layer is tied to the length
    (``mlp_t``, ``conv="2d"``, ``pos_encodings="learned"``)."""

    def initial_carry(self, batch_size: int, device=None) -> dict:
        """An all-halted carry: pass it to the first call; every call returns the next one."""
        device = device if device is not None else self.heads.lm_head.weight.device
        return new_carry(None, batch_size, device)

    def puzzle_forward(self, input_ids, puzzle_identifiers=None, labels=None, carry=None, fp_overrides=None,
                       fp_max_iter=None, fp_tol=None, **kwargs) -> dict:
        """``puzzle_step`` with the config's halting and loss settings and the per-call knobs (``fp_max_iter``,
        ``fp_tol``, any other ``fp_*`` setting as a keyword, or ``fp_overrides={...}``); other ``kwargs``: the
        standard output switches (``output_hidden_states``, ``output_attentions``; see ``puzzle_hidden_states``)."""
        c = self.config
        fp_overrides = call_knobs(c, kwargs, type(self).__name__, fp_overrides, fp_max_iter, fp_tol)
        out = puzzle_step(self.model, self.heads, input_ids=input_ids, puzzle_identifiers=puzzle_identifiers,
                           labels=labels, carry=carry, fp_overrides=fp_overrides, halt_max_steps=c.halt_max_steps,
                           exploration_prob=c.halt_exploration_prob, loss_type=c.loss_type,
                           q_loss_weight=c.q_loss_weight, training=self.training)
        out["hidden_states"] = puzzle_hidden_states(c, out.pop("inner"), kwargs)
        return out


# ---------------------------------------------------------------------------------------------------------------
# Losses


def _stablemax_s(x):
    # The 1 / (1 - x) branch sees only x < 0: torch.where backpropagates through both branches, and x = 1 would
    # otherwise put 0 * inf = NaN into the gradient.
    neg = x < 0
    return torch.where(neg, 1 / (1 - torch.where(neg, x, 0.0)), x + 1)


def stablemax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """Per-token cross entropy with stablemax ``s(x) = x + 1 (x >= 0), 1 / (1 - x) (x < 0)`` in place of ``exp``,
    computed in float64 (float32 where the device has no float64); ignored tokens give 0."""
    dtype = torch.float64 if logits.device.type != "mps" else torch.float32
    s = _stablemax_s(logits.to(dtype))
    logprobs = torch.log(s / s.sum(-1, keepdim=True))
    valid = labels != ignore_index
    picked = torch.gather(logprobs, -1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, -picked, 0.0)


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """Per-token softmax cross entropy in float32; ignored tokens give 0."""
    flat = F.cross_entropy(logits.float().flatten(0, -2), labels.long().flatten(), ignore_index=ignore_index,
                           reduction="none")
    return flat.view(labels.shape)


LOSSES = {"stablemax": stablemax_cross_entropy, "softmax": softmax_cross_entropy}


def puzzle_loss(logits, labels, q_halt, loss_type: str = "stablemax", q_loss_weight: float = 0.5,
                ignore_index: int = IGNORE_INDEX, reduce_mask: Optional[torch.Tensor] = None):
    """TRM's ACT loss head, averaged over the batch.

    ``lm = sum_t CE_t / n_valid`` per sample; ``q = BCE(q_halt, sequence exactly right)``; total ``lm + w * q``.
    Returns ``(loss, metrics)``; metrics are per-sample tensors (``correct`` cells fraction, ``exact``).
    """
    check_choice(loss_type, "loss_type", LOSSES)
    valid = labels != ignore_index
    n_valid = valid.sum(-1).clamp_min(1)
    token_loss = LOSSES[loss_type](logits, labels, ignore_index)
    lm = (token_loss.sum(-1) / n_valid).to(torch.float32)
    with torch.no_grad():
        right = (logits.argmax(-1) == labels) & valid
        cell_acc = right.sum(-1).float() / n_valid
        exact = right.sum(-1) == valid.sum(-1)
    q = F.binary_cross_entropy_with_logits(q_halt.float(), exact.float(), reduction="none")
    loss = (lm + q_loss_weight * q).mean()
    return loss, {"lm_loss": lm.detach(), "q_loss": q.detach(), "cell_accuracy": cell_acc, "exact": exact}


__all__ = [
    "BATCH_KEYS",
    "CONV_KINDS",
    "FORWARD_DTYPES",
    "IGNORE_INDEX",
    "LEARNED_POS_SCALE",
    "LOSSES",
    "LOSS_TYPES",
    "MLP_KINDS",
    "NORM_PLACEMENTS",
    "POS_ENCODINGS",
    "Attention",
    "CastedLinear",
    "ConvSwiGLU",
    "PuzzleCheckpointMixin",
    "PuzzleConfigMixin",
    "PuzzleHeads",
    "PuzzleInput",
    "PuzzleSolverMixin",
    "PuzzleTrunk",
    "QHaltLinear",
    "ReasoningBlock",
    "SequenceMLP",
    "ShortConv",
    "SparsePuzzleEmbedding",
    "SwiGLU",
    "act_halt",
    "build_blocks",
    "check_puzzle_config",
    "init_puzzle_weights",
    "new_carry",
    "puzzle_hidden_states",
    "puzzle_loss",
    "puzzle_step",
    "relative_change",
    "reset_carry",
    "rms_norm",
    "rotary_tables",
    "softmax_cross_entropy",
    "stablemax_cross_entropy",
    "swiglu_width",
    "trunc_normal_",
    "truncated_normal",
]
