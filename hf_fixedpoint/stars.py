"""STARS (Stabilizing Recurrent Dynamics for Test-Time Scalable Latent Reasoning in Looped LMs): Jacobian
spectral-radius regularization (JSRR) of one loop step, plus random loop counts during training.

The regularizer penalizes the squared power-iteration estimate of the spectral radius of ``J = d step(h) / d h`` at a
loop state ``h`` taken from the forward pass (detached, so the penalty acts on the loop's weights only), and is mixed
with the LM loss as a convex combination::

    loss = (1 - reg_weight) * lm_loss + reg_weight * jsrr,   jsrr = ||P v_{k-1}||^2

where ``v_0`` is a random unit vector (one global norm over the whole ``(B, S, D)`` state, so tokens coupled by
attention share one Jacobian) and ``v_i = P v_{i-1} / ||P v_{i-1}||``. ``P`` is a product with the Jacobian:

* ``product="jvp"``: ``J v`` by forward-mode AD, as the paper describes;
* ``product="vjp"``: ``v^T J`` by reverse mode, as the public code does (``njuyxw/STARS``,
  ``train_addition/train.py``);
* ``product="double_backward"``: ``J v`` as the VJP of a VJP (no forward-mode AD needed).

``n_iter`` (the public code's ``spectral_iters``) sets how close the estimate is to ``rho(J)^2``: with ``n_iter=1`` the
expected value is ``||J||_F^2 / n`` (a Hutchinson estimate: a scaled Frobenius penalty, what the default run of the
public code optimizes); more iterations approach ``rho(J)^2`` when the dominant eigenvalue is real and separated. Only
the last product carries the graph used by the double backward.

Any looped family works whose forward output carries ``loop_hidden_states`` (the state after each loop) and whose model
has ``loop_function(outputs)`` (one loop of that call as a function of the state), e.g. ``OuroForCausalLM``. For other
models call ``jsrr(step, state)`` directly.

Double backward through attention: PyTorch's fused SDPA kernels (CPU flash, CUDA flash / memory-efficient) have no
second derivative, and the CPU flash kernel has no forward-mode AD. The regularizer pass therefore switches the model
to transformers' eager attention (``attn_implementation="eager"``) and back, so the regular forward keeps its fast
kernel.

Loop sampling: ``hf_fixedpoint.get_sampler`` (``fixed``, ``lognormal``, ``poisson``, ``exponential``,
``uniform``) draws the same count on every DDP rank for the same step; ``LOOP_SAMPLER_PRESETS`` holds the
paper's settings.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import torch

from .core.fp_jacobian import PRODUCTS, spectral_radius
from .core.fp_registry import check_choice, check_number
from .core.fp_samplers import get_sampler

STATES = ("last", "random")

# The paper's loop-count distributions (one draw per micro-batch, clipped).
LOOP_SAMPLER_PRESETS = {
    "ouro_finetune": {"name": "lognormal", "mu": 1.7, "sigma": 0.4, "min_loops": 1, "max_loops": 16},
    "addition": {"name": "lognormal", "mu": 2.0, "sigma": 0.7, "min_loops": 1, "max_loops": 100},
}


def jsrr(step: Callable, state: torch.Tensor, *, n_iter: int = 1, product: str = "vjp",
         generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Differentiable estimate of ``rho(d step / d state)^2`` at ``state`` (detached), one global vector norm.

    Returns a scalar whose gradient reaches the parameters used by ``step`` (not ``state``'s history).
    """
    z = state.detach().requires_grad_(product != "jvp")
    rho = spectral_radius(step, z, n_iter=n_iter, product=product, batch_dims=0, create_graph=True,
                          generator=generator)
    return rho.pow(2)


@contextmanager
def attention_implementation(model, implementation: Optional[str]):
    """Temporarily switch a transformers model's attention implementation (``None`` or unchanged: no-op)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if implementation is None or config is None or current == implementation:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


class STARSRegularizer:
    """JSRR mixed with the LM loss after a warm-up.

    Args:
        reg_weight: lambda in ``(1 - lambda) * lm_loss + lambda * jsrr``, in ``[0, 1)`` (paper: 0.1).
        warmup_steps: optimizer steps without the regularizer (0-based steps ``< warmup_steps`` are plain).
        n_iter: power iterations (1: Frobenius-type estimate, see the module docstring).
        product: ``"vjp"`` (public code), ``"jvp"`` (paper) or ``"double_backward"``.
        state: which loop state to linearize at: ``"last"`` (the state after the sampled loop count, as STARS) or
            ``"random"`` (a loop drawn uniformly, the same on every rank for a step).
        attn_implementation: attention used for the regularizer pass (``"eager"``: twice differentiable; ``None``:
            keep the model's).
        max_batch: linearize at the first ``max_batch`` sequences only (``None``: the whole batch, as STARS). The
            ``n_iter=1`` estimate has the same expectation (the mean of ``||J_b||_F^2 / n_b`` over sequences) at a
            fraction of the cost; the step must accept a batch prefix (``OuroForCausalLM``'s does).
        seed: seeds the random start vector and the ``"random"`` state choice together with the step.
    """

    def __init__(self, reg_weight: float = 0.1, warmup_steps: int = 0, n_iter: int = 1, product: str = "vjp",
                 state: str = "last", attn_implementation: Optional[str] = "eager", max_batch: Optional[int] = None,
                 seed: int = 0):
        check_number(reg_weight, "reg_weight", low=0.0, high=1.0, high_open=True)
        check_number(warmup_steps, "warmup_steps", low=0, integer=True)
        check_number(n_iter, "n_iter", low=1, integer=True)
        check_choice(product, "product", PRODUCTS)
        check_choice(state, "state", STATES)
        check_number(seed, "seed", low=0, integer=True)
        if max_batch is not None:
            check_number(max_batch, "max_batch", low=1, integer=True)
        self.max_batch = max_batch
        self.reg_weight, self.warmup_steps = float(reg_weight), warmup_steps
        self.n_iter, self.product = n_iter, product
        self.state, self.attn_implementation, self.seed = state, attn_implementation, seed

    def active(self, step: int) -> bool:
        return self.reg_weight > 0 and step >= self.warmup_steps

    def regularizer(self, model, outputs, step: int) -> torch.Tensor:
        """JSRR at the chosen loop state of ``outputs`` (which must carry ``loop_hidden_states``; ``model`` must have
        ``loop_function``)."""
        states = getattr(outputs, "loop_hidden_states", None)
        if not states or not hasattr(model, "loop_function"):
            raise ValueError(f"{type(outputs).__name__} has no loop_hidden_states or {type(model).__name__} no "
                             "loop_function: STARS needs a looped model that provides them (e.g. OuroForCausalLM), or "
                             "call jsrr(step, state).")
        step_fn = model.loop_function(outputs)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        index = -1 if self.state == "last" else int(torch.randint(len(states), (), generator=g))
        state = states[index] if self.max_batch is None else states[index][: self.max_batch]
        gen = torch.Generator(device=state.device).manual_seed(self.seed * 1_000_003 + step)
        with attention_implementation(model, self.attn_implementation):
            return jsrr(step_fn, state, n_iter=self.n_iter, product=self.product, generator=gen)

    def __call__(self, model, outputs, step: int):
        """``(total_loss, jsrr or None)`` for an output with ``loss`` (before warm-up ends: the LM loss alone)."""
        if outputs.loss is None:
            raise ValueError("STARSRegularizer needs outputs.loss: call the model with labels.")
        if not self.active(step):
            return outputs.loss, None
        reg = self.regularizer(model, outputs, step)
        return (1.0 - self.reg_weight) * outputs.loss + self.reg_weight * reg, reg

    def __repr__(self):
        return f"STARSRegularizer({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def loop_sampler(name: str, **kwargs):
    """A loop-count sampler by name or preset (``ouro_finetune``, ``addition``); same draw on every rank per step."""
    if name in LOOP_SAMPLER_PRESETS:
        preset = dict(LOOP_SAMPLER_PRESETS[name])
        return get_sampler(preset.pop("name"), **{**preset, **kwargs})
    return get_sampler(name, **kwargs)


__all__ = ["LOOP_SAMPLER_PRESETS", "STATES", "STARSRegularizer", "attention_implementation", "jsrr", "loop_sampler"]
