# Source of truth: hf_fixedpoint/core/fp_speculative.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Self-speculative decoding: ``generate(..., draft_depth=d)`` drafts tokens with the model itself at a smaller depth
(fewer loops, fewer solver iterations) and verifies them at the full depth, with one cache.

transformers' assisted decoding (``assistant_model``, ``assistant_early_exit``: LayerSkip) is not used as such: it
serves batch 1 only, refuses static caches, keeps a second cache for the draft and verifies with a full forward. The
loop here plugs into ``generate`` as a ``custom_generate`` callable instead (transformers prepares the inputs, cache,
logits processors and stopping criteria; ``speculative_decoding``), uses transformers' acceptance rule for sampling
(``_speculative_sampling``, one row at a time, through ``fp_compat.speculative_sampling``) and its draft-length
settings (``num_assistant_tokens``, ``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``).

A family says how it drafts and verifies by returning a ``Speculation`` from ``model._speculation(generation_config,
draft_depth, model_kwargs)``:

* its own subclass (Ouro: every (loop, layer) has its own cache slots, so a draft of ``d`` loops computes loops
  ``1..d`` of the full model, and the verification runs only the remaining loops on the drafted tokens);
* ``ForwardSpeculation``, for models whose depth is a ``forward`` keyword (``SpeculativeGenerationMixin``): the draft
  is the model's forward with that keyword set to ``d``; its cache entries are rolled back before one forward at the
  full depth over the last kept token and the drafts. SELF-LLaMA / SELF-Mistral (``fp_max_iter=d``; ``d = 1`` is
  the base model's attention) and the Attractor LM (``readout_iters=d``) decode this way: there every layer's input
  depends on the depth, so no entry of the draft is the full model's.

Greedy search keeps the drafts up to the first one the full model disagrees with, plus the full model's token there:
the full model's tokens. Sampling keeps the full model's output distribution (the speculative acceptance rule). A
batch advances by the fewest tokens any of its unfinished rows keeps; rejected positions are rolled back from every
cache layer (dynamic, sliding-window dynamic or static).
"""

import torch
from torch.nn import functional as F

from .fp_compat import (
    decoder_only_output,
    generate_with,
    is_dynamic_layer,
    is_static_layer,
    pop_cache,
    sliding_window_rollback,
    speculative_sampling,
)
from .fp_registry import check_choice, check_number

SCHEDULES = ("constant", "heuristic", "heuristic_transient")  # num_assistant_tokens_schedule, as transformers
DEFAULT_DRAFT_TOKENS = 20  # transformers' num_assistant_tokens default


def generate_speculative(model, *args, **kwargs):
    """``generate(..., draft_depth=d)``: transformers' ``generate`` with ``speculative_decoding`` as its decoding
    method. Another draft source in the same call is refused."""
    for name in ("assistant_model", "custom_generate", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if kwargs.get(name) is not None:
            raise ValueError(f"draft_depth (self-speculative decoding: the model drafts at a smaller depth) cannot be "
                             f"combined with {name}; pass one of them.")
    return generate_with(model, speculative_decoding, *args, **kwargs)


def rollback(cache, tokens: int, layers=None) -> None:
    """Drop the last ``tokens`` positions from every cache layer (or from ``layers``, some of ``cache.layers``):
    dynamic layers are cropped; a sliding-window layer (recording its past, see ``Speculation``) is cropped and cut
    back to its window, also for ``tokens = 0``; a static layer's length goes back (its stale entries lie past every
    later query's position, masked, then overwritten)."""
    for layer in cache.layers if layers is None else layers:
        if torch.is_tensor(getattr(layer, "cumulative_length", None)):  # static
            if tokens > 0:
                layer.cumulative_length.sub_(tokens)
        elif tokens > 0 or getattr(layer, "is_sliding", False):  # a window is cut back to its size at 0 too
            layer.crop(-tokens)


def check_cache(cache) -> None:
    """A cache the loop can roll back: dynamic layers (sliding windows included) or full static layers whose length
    is a device counter."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"draft_depth needs a DynamicCache or StaticCache; got {type(cache).__name__}.")
    for layer in layers:
        sliding = getattr(layer, "is_sliding", False)
        if is_dynamic_layer(layer) and sliding and not sliding_window_rollback():
            raise ValueError("draft_depth with a sliding-window cache needs a transformers release whose "
                             "sliding-window layers can roll back rejected drafts; this one records their past but "
                             "hands all of it to attention (transformers 5.16). Upgrade transformers, or decode "
                             "without draft_depth.")
        if is_static_layer(layer) or is_dynamic_layer(layer):
            continue
        raise ValueError(f"draft_depth needs a DynamicCache or StaticCache (without sliding-window static layers); "
                         f"got {type(cache).__name__} with a {type(layer).__name__}, from which rejected drafts "
                         "cannot be rolled back. Use the dynamic cache.")


class SpeculativeState:
    """The running sequences: ``ids`` ``(B, n)``, the 2-d ``mask`` (None: no padding), the next position ``pos``
    ``(B,)`` and token ``last`` ``(B,)`` (not yet in the cache at full depth: the prompt's last token until a token is
    appended), ``unfinished`` ``(B,)``, and the kept tokens' processed ``scores``."""

    def __init__(self, ids, mask, position_ids, generation_config, stopping_criteria):
        self.ids, self.mask, self.stopping = ids, mask, stopping_criteria
        self.pos = (position_ids[:, -1] if position_ids is not None  # the position of `last` once appended
                    else torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long, device=ids.device))
        self.unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        self.pad = generation_config._pad_token_tensor
        self.scores, self.last = [], ids[:, -1]

    def padded(self, token):
        """``token`` ``(B,)`` with finished rows' replaced by padding, as greedy search feeds them."""
        return token if self.pad is None else torch.where(self.unfinished, token, self.pad.to(token.dtype))

    def append(self, tokens, scores=None) -> int:
        """Append ``tokens`` ``(B, m)`` one column at a time, as greedy search does: padding for finished rows, the
        stopping criteria after each. Stops after a column in which a row finishes (greedy search would feed that
        row padding from there on, the cache's next entries included). Returns the count of columns appended."""
        appended = 0
        for i in range(tokens.shape[1]):
            self.last = self.padded(tokens[:, i])
            self.ids = torch.cat([self.ids, self.last[:, None]], dim=-1)
            if scores is not None:
                self.scores.append(scores[:, i])
            appended += 1
            before = self.unfinished
            self.unfinished = before & ~self.stopping(self.ids, None)
            if not torch.equal(before, self.unfinished):
                break
        if self.mask is not None:
            self.mask = F.pad(self.mask, (0, appended), value=1)
        self.pos = self.pos + appended
        return appended

    def mask_with(self, new: int):
        """The 2-d mask with ``new`` more positions (None without padding)."""
        return None if self.mask is None else F.pad(self.mask, (0, new), value=1)

    def positions(self, new: int):
        """The positions ``(B, new)`` of ``last`` and the ``new - 1`` tokens after it."""
        return self.pos[:, None] + torch.arange(new, device=self.pos.device)


class Speculation:
    """One ``speculative_decoding`` call: the generation settings, validated, the cache, and the accept / roll-back
    round; a family implements ``prefill``, ``draft`` and ``verify``."""

    UNSUPPORTED_FLAGS = ("output_hidden_states", "output_attentions")

    def __init__(self, model, generation_config, model_kwargs):
        self.model, self.config = model, generation_config
        self._check_generation(generation_config, model_kwargs)
        self.cache = pop_cache(model_kwargs.pop("past_key_values", None), model_kwargs)
        check_cache(self.cache)
        held = int(self.cache.get_seq_length())
        if held:  # the prefill runs the whole prompt (transformers' generate would feed only its uncached tokens)
            raise ValueError(f"draft_depth starts from an empty cache; this one already holds {held} positions. Pass "
                             "a new cache (or none), or decode without draft_depth.")
        for layer in self.cache.layers:  # sliding windows keep their past until a round's roll-back cuts them
            if getattr(layer, "is_sliding", False):
                layer.activate_past_recording()
        self.num_tokens = generation_config.num_assistant_tokens
        self.num_tokens = DEFAULT_DRAFT_TOKENS if self.num_tokens is None else self.num_tokens
        check_number(self.num_tokens, "num_assistant_tokens", low=1, integer=True)
        self.schedule = generation_config.num_assistant_tokens_schedule or "constant"
        check_choice(self.schedule, "num_assistant_tokens_schedule", SCHEDULES)
        self.confidence = generation_config.assistant_confidence_threshold
        self.sample = bool(generation_config.do_sample)

    @staticmethod
    def check_depth(draft_depth, full_depth: int, full_name: str, unit: str) -> int:
        """``draft_depth``, an integer in ``[1, full_depth - 1]``; the errors name the range."""
        if full_depth < 2:
            raise ValueError(f"draft_depth needs a full depth of at least 2 {unit} to draft below; {full_name}="
                             f"{full_depth}.")
        check_number(draft_depth, "draft_depth", low=1, high=full_depth - 1, integer=True)
        return draft_depth

    def _check_generation(self, generation_config, model_kwargs) -> None:
        """Refuse what the speculative loop does not serve."""
        if generation_config.num_beams > 1:
            raise ValueError("draft_depth decodes by greedy search or sampling; num_beams="
                             f"{generation_config.num_beams} is not supported.")
        if not model_kwargs.get("use_cache", True):
            raise ValueError("draft_depth needs the cache (use_cache=True): drafts and verifications extend one "
                             "cache, and rejected drafts are rolled back from it.")
        for name in self.UNSUPPORTED_FLAGS:
            if getattr(generation_config, name, False) or model_kwargs.get(name):
                raise ValueError(f"{name}=True is not supported with draft_depth.")
        if self.model.training:
            raise ValueError("draft_depth decodes at inference: call model.eval() first.")

    def choose(self, scores):
        """The next token ``(B,)`` from processed scores ``(B, V)``: argmax, or a sample."""
        if self.sample:
            return torch.multinomial(scores.softmax(-1), num_samples=1)[:, 0]
        return scores.argmax(-1)

    def prefill(self, state, input_ids, model_kwargs, logits_processor) -> None:
        """The prompt at the full depth and its first token (``state.append``); or, where the draft's cache entries
        are the full model's (Ouro), the prompt at the draft's depth only, appending nothing: the first round then
        drafts the first token and its verification completes the prompt's depth (``state.last`` is the prompt's
        last token)."""
        raise NotImplementedError

    def draft(self, state, k: int, logits_processor):
        """Up to ``k`` draft tokens ``(B, j)``, their processed scores ``(B, j, V)`` (None for ``j = 0``) and what
        ``verify`` needs of the draft."""
        raise NotImplementedError

    def verify(self, state, drafts, carry, logits_processor):
        """The full depth's processed scores ``(B, k + 1, V)`` at the positions of ``state.last`` and the drafts;
        the cache then holds the full depth's entries of those ``k + 1`` positions."""
        raise NotImplementedError

    def draft_tokens(self, state, k: int, logits_processor, step, deepen=None):
        """Draft up to ``k`` tokens one position at a time; ``step(token, j)`` runs the draft at position ``j``
        (``token`` ``(B,)``) and returns its last-layer logits ``(B, V)`` and anything ``verify`` needs. Where
        ``deepen(j)`` is given, a position whose draft is unsure (an unfinished row's largest probability below
        ``assistant_confidence_threshold``) is decided from ``deepen(j)``'s logits (the draft one loop deeper) until
        it is sure or ``deepen`` returns None; the decision reads the distribution only, never the sampled token, so
        a sample comes from the distribution of the depth it was drawn at, as the acceptance rule needs. Stops early
        when an unfinished row's draft token has a probability below ``assistant_confidence_threshold``. Returns the
        tokens ``(B, j)``, their processed scores ``(B, j, V)`` (None for ``j = 0``) and the steps' extras."""
        ids, token = state.ids, state.last
        tokens, scores, extras = [], [], []
        for j in range(k):
            logits, extra = step(token, j)
            score = logits_processor(ids, logits.to(torch.float32))
            while deepen is not None and self.unsure(score.softmax(-1).amax(-1), state):
                logits = deepen(j)
                if logits is None:
                    break
                score = logits_processor(ids, logits.to(torch.float32))
            token = state.padded(self.choose(score))  # finished rows go on with padding, as in greedy search
            tokens.append(token)
            scores.append(score)
            extras.append(extra)
            ids = torch.cat([ids, token[:, None]], dim=-1)
            if j + 1 < k and self.confidence:
                if self.unsure(score.softmax(-1).gather(-1, token[:, None])[:, 0], state):
                    break
        if not tokens:
            return state.ids[:, :0], None, extras
        return torch.stack(tokens, 1), torch.stack(scores, 1), extras

    def unsure(self, prob, state) -> bool:
        """Whether an unfinished row's probability ``prob`` ``(B,)`` is below ``assistant_confidence_threshold``."""
        return bool(((prob < self.confidence) & state.unfinished).any())  # no boolean indexing: no nonzero

    def process(self, state, drafts, logits, logits_processor):
        """Processed scores ``(B, k + 1, V)`` from the full depth's logits ``(B, k + 1, V)`` at ``state.last`` and
        the drafts, each position's processors seeing the tokens before it."""
        logits = logits.to(torch.float32)
        ids, n = torch.cat([state.ids, drafts], dim=-1), state.ids.shape[1]
        return torch.stack([logits_processor(ids[:, :n + j], logits[:, j]) for j in range(drafts.shape[1] + 1)], dim=1)

    def accept(self, drafts, draft_scores, target, unfinished):
        """The tokens every row keeps ``(B, m)`` and each row's count of accepted drafts ``(B,)``. Greedy: the full
        model's tokens up to and including its first disagreement with the draft (all ``k + 1`` when there is none);
        sampling: transformers' ``_speculative_sampling`` row by row. The batch keeps the fewest tokens any
        unfinished row keeps (each row's kept tokens are a prefix of what it would keep alone, hence full-depth
        tokens, or full-depth samples)."""
        k = drafts.shape[1]
        if not self.sample:
            chosen = target.argmax(-1)
            matched = (drafts == chosen[:, :k]).long().cumprod(-1).sum(-1)
            return chosen[:, : int(torch.where(unfinished, matched + 1, k + 1).min())], matched
        if k == 0:
            return self.choose(target[:, 0])[:, None], torch.zeros_like(drafts[:, 0:1].sum(-1))
        rows, matched = [], []
        for b in range(drafts.shape[0]):
            valid, n = speculative_sampling(drafts[b : b + 1], draft_scores[b : b + 1], target[b : b + 1])
            rows.append(valid[0])
            matched.append(int(n))
        keep = min(len(r) for r, u in zip(rows, unfinished.tolist()) if u)
        return torch.stack([r[:keep] for r in rows]), torch.tensor(matched, device=drafts.device)

    def step_round(self, state, logits_processor, stats) -> None:
        """Draft, verify, accept, roll the cache back; adapt the draft length."""
        k = min(self.num_tokens, self.config.max_length - state.ids.shape[1] - 1)
        drafts, draft_scores, carry = self.draft(state, max(k, 0), logits_processor)
        k = drafts.shape[1]
        target = self.verify(state, drafts, carry, logits_processor)
        active = state.unfinished.clone()
        kept, matched = self.accept(drafts, draft_scores, target, active)
        rollback(self.cache, k + 1 - state.append(kept, target[:, : kept.shape[1]]))
        stats["draft_tokens"] += k * active.long()
        stats["accepted_draft_tokens"] += matched * active.long()
        stats["verify_rounds"] += 1
        if self.schedule != "constant" and k:  # transformers' heuristic: +2 after a fully accepted draft, else -1
            full = bool(((matched == k) | ~active).all())
            self.num_tokens = self.num_tokens + 2 if full else max(1, self.num_tokens - 1)


class ForwardSpeculation(Speculation):
    """The draft is the model's ``forward`` with each of ``keywords`` set to ``draft_depth``, one position at a time,
    extending the cache; before the verification its entries are rolled back, and one ``forward`` with the call's own
    settings (the full depth) runs on ``state.last`` and the drafts, so that the cache holds the full depth's entries
    (for SELF: the keys of the verification's converged iterates), never the draft's. ``full_depth`` is the depth of
    that ``forward``, named by ``keywords[0]`` in errors."""

    LOOP_KEYWORDS = ("attention_mask", "position_ids", "use_cache", "cache_position", "past_key_values", "cache",
                     "logits_to_keep")

    def __init__(self, model, generation_config, model_kwargs, draft_depth, full_depth: int, keywords):
        if model_kwargs.get("draft_max_depth") is not None:
            raise ValueError(f"draft_max_depth (more depth for unsure draft tokens) is built for Ouro only; decode "
                             f"{type(model).__name__} with draft_depth alone.")
        super().__init__(model, generation_config, model_kwargs)
        self.depth = self.check_depth(draft_depth, full_depth, keywords[0], "iterations")
        self.draft_kwargs = dict.fromkeys(keywords, draft_depth)
        # the call's own keywords (fp_tol, fp_overrides, ...) reach every forward; the loop sets the others
        self.call_kwargs = {k: v for k, v in model_kwargs.items() if k not in self.LOOP_KEYWORDS}

    def forward(self, tokens, positions, mask, **depth):
        """The model on ``tokens`` ``(B, q)`` at ``positions`` ``(B, q)`` against the cache (extending it); the
        logits ``(B, q, V)``."""
        return self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                          use_cache=True, **{**self.call_kwargs, **depth}).logits

    def prefill(self, state, input_ids, model_kwargs, logits_processor) -> None:
        logits = self.model(input_ids=input_ids, attention_mask=model_kwargs.get("attention_mask"),
                            position_ids=model_kwargs.get("position_ids"), past_key_values=self.cache, use_cache=True,
                            logits_to_keep=1, **self.call_kwargs).logits
        scores = logits_processor(state.ids, logits[:, -1].to(torch.float32))
        state.append(self.choose(scores)[:, None], scores[:, None])

    def draft(self, state, k: int, logits_processor):
        def step(token, j):
            logits = self.forward(token[:, None], state.positions(j + 1)[:, j:], state.mask_with(j),
                                  **self.draft_kwargs)
            return logits[:, -1], None

        drafts, scores, _ = self.draft_tokens(state, k, logits_processor, step)
        return drafts, scores, None

    def verify(self, state, drafts, carry, logits_processor):
        k = drafts.shape[1]
        rollback(self.cache, k)  # the draft's entries
        logits = self.forward(torch.cat([state.last[:, None], drafts], dim=-1), state.positions(k + 1),
                              state.mask_with(k))
        return self.process(state, drafts, logits, logits_processor)


class SpeculativeGenerationMixin:
    """``generate(..., draft_depth=d)`` for a model whose depth is a ``forward`` keyword (``ForwardSpeculation``):
    the draft's forwards set each of ``_draft_keywords`` to ``d``; ``_full_depth(model_kwargs)`` is the depth the
    call's own settings (or the config) give. Put it before the ``PreTrainedModel`` classes."""

    _draft_keywords = ()

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``. ``draft_depth=d`` decodes self-speculatively (``speculative_decoding``):
        drafts at depth ``d``, verified at the call's full depth, with one cache."""
        if kwargs.get("draft_depth") is None:
            kwargs.pop("draft_depth", None)
            return super().generate(*args, **kwargs)
        return generate_speculative(self, *args, **kwargs)

    def _full_depth(self, model_kwargs) -> int:
        raise NotImplementedError

    def _speculation(self, generation_config, draft_depth, model_kwargs) -> ForwardSpeculation:
        return ForwardSpeculation(self, generation_config, model_kwargs, draft_depth, self._full_depth(model_kwargs),
                                  self._draft_keywords)


def speculative_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, draft_depth=None,
                         draft_max_depth=None, **model_kwargs):
    """Self-speculative decoding, a ``custom_generate`` callable: ``generate(..., draft_depth=d)``.

    Each round drafts up to ``num_assistant_tokens`` tokens at depth ``d`` (the family's ``Speculation``), then
    verifies them at the full depth in one pass over the last kept token and the drafts. Greedy search keeps the
    drafts up to the first one the full depth disagrees with, plus the full depth's token there (or after the last
    draft). Sampling uses the speculative acceptance rule (the same output distribution). The rejected positions are
    dropped from every cache layer. A batch advances by the fewest tokens any of its unfinished rows keeps.

    Draft length: ``num_assistant_tokens`` (default 20); ``num_assistant_tokens_schedule="heuristic"`` (or
    ``"heuristic_transient"``) adapts it within the call (+2 after a fully accepted draft, -1 otherwise); a draft
    also stops early when an unfinished row's draft token has a probability below ``assistant_confidence_threshold``
    (transformers' default 0.4; 0 or None turns it off). Ouro's ``draft_max_depth=e`` first decides an unsure draft
    token (its largest probability below that threshold) with more loops, up to ``e``.

    With ``return_dict_in_generate=True`` the output also holds ``draft_tokens`` and ``accepted_draft_tokens``
    ``(B,)`` (drafted tokens and those the full depth agreed with, per row) and ``verify_rounds``.
    """
    if input_ids.shape[1] == 0:  # generate(inputs_embeds=...) alone: the drafts and the state need the tokens
        raise ValueError("draft_depth needs the prompt's tokens (input_ids); inputs_embeds alone is not supported.")
    if draft_max_depth is not None:  # a family's draft setting, read (or refused) by its Speculation
        model_kwargs["draft_max_depth"] = draft_max_depth
    spec = model._speculation(generation_config, draft_depth, model_kwargs)
    state = SpeculativeState(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"),
                             generation_config, stopping_criteria)
    zeros = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    stats = {"draft_tokens": zeros, "accepted_draft_tokens": zeros.clone(), "verify_rounds": 0}
    spec.prefill(state, input_ids, model_kwargs, logits_processor)
    while bool(state.unfinished.any()):
        spec.step_round(state, logits_processor, stats)
    rollback(spec.cache, 0)  # sliding windows back to their size
    if not generation_config.return_dict_in_generate:
        return state.ids
    scores = tuple(state.scores) if generation_config.output_scores else None
    result = decoder_only_output(sequences=state.ids, scores=scores, past_key_values=spec.cache)
    for name, value in stats.items():
        result[name] = value
    return result


__all__ = ["ForwardSpeculation", "Speculation", "SpeculativeGenerationMixin", "SpeculativeState", "check_cache",
           "generate_speculative", "rollback", "speculative_decoding"]
