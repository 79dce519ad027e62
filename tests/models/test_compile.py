"""``fp_check_every=0``: every family's no-grad forward compiles as one graph (``torch.compile(fullgraph=True)``)
and equals eager, reads the host at most once per forward besides the model's own input checks and (Ouro, FPSA-BERT)
transformers' mask code, and gives the default path's outputs; a training step compiles as one graph with the
unrolled backward modes."""

import pytest
import torch
from torch.profiler import profile

from tests.models.test_knobs import NAMES, build

# Host reads of one no-grad forward of the tiny two-layer model on a left-padded batch at fp_check_every=0
# (measured; a stock LlamaForCausalLM reads 2 there, in transformers' mask code, which the Attractor LM and SELF-LLaMA
# skip at fp_check_every=0: ``fp_compat.create_causal_mask``'s ``host_reads``): one per forward (the NaN/Inf checks
# of all its solves, read together: ``defer_finite_checks``) plus the model's own input checks and, for Ouro (no
# solve, no fp_check_every), transformers' mask code.
HOST_READS = {"attractor_lm": 1, "deq_lm": 2, "ouro": 2, "fprm": 1, "trm": 1, "urm": 1, "fpsa_bert": 2, "fpsa_vit": 1,
              "self_llama": 1, "self_mistral": 1}


def knobs(name: str) -> dict:
    """A short budget keeps the unrolled graph small; Ouro has no solve (its loops compile as they are)."""
    return {} if name == "ouro" else {"fp_check_every": 0, "fp_max_iter": 3}


def main_output(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("name", NAMES)
def test_no_grad_forward_compiles_as_one_graph(name):
    model, inputs = build(name)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        eager = main_output(model(**inputs, **knobs(name)))
        graph = main_output(compiled(**inputs, **knobs(name)))
    assert (eager - graph).abs().max() <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_host_reads_of_a_forward(name):
    model, inputs = build(name)
    with torch.no_grad():
        model(**inputs, **knobs(name))
        with profile() as prof:
            model(**inputs, **knobs(name))
    events = {e.key: e.count for e in prof.key_averages()}
    assert events.get("aten::nonzero", 0) == 0
    assert events.get("aten::_local_scalar_dense", 0) <= HOST_READS[name]


@pytest.mark.parametrize("name", [n for n in NAMES if n != "ouro"])
def test_check_every_gives_the_default_answers(name):
    """With a budget that converges, ``fp_check_every`` 0 and 3 give the default path's outputs on the left-padded
    batch (float64): the finished entries are frozen at the same fixed point, and the Attractor LM's and SELF-LLaMA's
    causal mask at 0 (built without transformers' host-read shortcut) masks the same keys."""
    model, inputs = build(name)
    model = model.double()
    inputs = {k: v.double() if torch.is_floating_point(v) else v for k, v in inputs.items()}
    with torch.no_grad():
        default, never, every_3 = (main_output(model(**inputs, fp_max_iter=80, fp_tol=1e-11, fp_check_every=k))
                                   for k in (1, 0, 3))
    torch.testing.assert_close(never, default, rtol=0, atol=1e-9)
    torch.testing.assert_close(every_3, default, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["fprm", "trm", "urm"])
def test_host_reads_of_a_puzzle_training_forward(name):
    """A training forward of the puzzle families at ``fp_check_every=0`` reads the host once (its NaN/Inf check):
    FPRM's fresh start noise is drawn without ``trunc_normal_``'s redraw loop (``truncated_normal``)."""
    model, inputs = build(name)
    model.train()
    kw = {"fp_check_every": 0, "fp_max_iter": 3, "fp_backward": "phantom"}
    model(**inputs, **kw)
    with profile() as prof:
        model(**inputs, **kw)
    events = {e.key: e.count for e in prof.key_averages()}
    assert events.get("aten::nonzero", 0) == 0
    assert events.get("aten::_local_scalar_dense", 0) <= 1


def test_host_reads_do_not_grow_with_the_layers():
    # SELF-LLaMA: one FPSA solve per layer, their NaN/Inf checks read together at the end of the forward.
    from tests.models.test_knobs import family

    tester, model_class, _ = family("self_llama")
    counts = []
    for layers in (2, 6):
        torch.manual_seed(0)
        model = model_class(tester.get_config(num_hidden_layers=layers)).eval()
        inputs = tester.prepare_inputs(model.config)
        with torch.no_grad():
            model(**inputs, **knobs("self_llama"))
            with profile() as prof:
                model(**inputs, **knobs("self_llama"))
        counts.append(sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense"))
    assert counts[0] == counts[1] == HOST_READS["self_llama"]


# Ouro has no solve (no backward mode): its training step as it is.
TRAINING = [(n, b) for n in NAMES if n != "ouro" for b in ("one_step", "phantom", "bptt")] + [("ouro", None)]
PUZZLE_FAMILIES = ("fprm", "trm", "urm")


@pytest.mark.parametrize("name,backward", TRAINING)
def test_training_step_compiles_as_one_graph(name, backward):
    """Forward and backward of a training step (the mean square of the output as the loss) at ``fp_check_every=0``
    compile as one graph and give eager's gradients. A puzzle family's step also runs sign-SGD on its puzzle
    embedding's touched rows: it compiles as one graph once the eager step has made the embedding's gradient leaf,
    with eager's rows' gradient and table update."""
    model, inputs = build(name)
    table = model.model.trunk.input.puzzle_emb if name in PUZZLE_FAMILIES else None
    if table is not None:
        assert inputs.get("puzzle_identifiers") is not None
        with torch.no_grad():
            table.weights.normal_()
        start = table.weights.clone()
    model.train()
    kw = {} if backward is None else {"fp_check_every": 0, "fp_max_iter": 3, "fp_backward": backward}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    grads, tables = [], []
    for fn in (model, compiled):  # eager first
        model.zero_grad()
        torch.manual_seed(0)  # the same start noise and dropout masks, if any
        main_output(fn(**inputs, **kw)).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        if table is not None:
            grads[-1].append(table.local_weights.grad.clone())
            table.sign_sgd_step(lr=0.1, weight_decay=0.5)
            tables.append(table.weights.clone())
            with torch.no_grad():
                table.weights.copy_(start)
    assert len(grads[0]) == len(grads[1]) > (1 if table is not None else 0)
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) <= 1e-5
    if table is not None:
        assert grads[0][-1].abs().sum() > 0
        torch.testing.assert_close(tables[1], tables[0], rtol=0, atol=0)
        assert not torch.equal(tables[0], start)


@pytest.mark.parametrize("name,cache_kind", [("attractor_lm", "dynamic"), ("attractor_lm", "static"),
                                             ("self_llama", "dynamic"), ("self_llama", "static"),
                                             ("self_mistral", "dynamic")])
def test_cached_decode_step_compiles_as_one_graph(name, cache_kind):
    import copy

    from transformers import DynamicCache, StaticCache

    model, inputs = build(name)
    ids = inputs["input_ids"][:, :5]
    kw = knobs(name)
    cache = StaticCache(config=model.config, max_cache_len=12) if cache_kind == "static" else DynamicCache(
        config=model.config)
    torch._dynamo.reset()
    with torch.no_grad():
        prefill = model(input_ids=ids, past_key_values=cache, use_cache=True, **kw)
        token = prefill.logits[:, -1:].argmax(-1)
        step = dict(input_ids=token, use_cache=True, cache_position=torch.tensor([ids.shape[1]]), **kw)
        graph_cache = copy.deepcopy(prefill.past_key_values)
        eager = model(past_key_values=prefill.past_key_values, **step).logits
        graph = torch.compile(model, fullgraph=True, backend="eager")(past_key_values=graph_cache, **step).logits
    assert (eager - graph).abs().max() <= 1e-5


def test_self_static_cache_gives_the_dynamic_cache_tokens():
    model, inputs = build("self_llama")
    ids = inputs["input_ids"][:, :4]
    kw = dict(max_new_tokens=6, do_sample=False, fp_overrides={"fp_check_every": 0})
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dynamic, static)
    mistral, inputs = build("self_mistral")  # its tiny config has a sliding window: a static layer would roll it
    assert mistral.config.sliding_window is not None
    with pytest.raises(ValueError, match="StaticCache without sliding-window layers"):
        mistral.generate(inputs["input_ids"][:, :4], cache_implementation="static", max_new_tokens=2)
