"""Shared tests of the puzzle-reasoning families (FPRM, TRM/Attractor, URM) on top of the fixed-point tester.

A family's test file subclasses ``PuzzleModelTesterMixin`` and sets ``config_class``, ``model_classes`` (the base
model with ``AutoModel``), ``puzzle_class`` (the ``*ForPuzzles`` model) and a tiny ``config_kwargs`` on a 3x3 grid.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.models.fixed_point_tester import _CHILD, FixedPointModelTesterMixin


class PuzzleModelTesterMixin(FixedPointModelTesterMixin):
    puzzle_class = None
    seq_length = 9  # a 3x3 grid
    vocab_size = 11

    def prepare_inputs(self, config, batch_size=None):
        batch_size = batch_size or self.batch_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (batch_size, self.seq_length), generator=g)
        pids = torch.randint(0, config.num_puzzle_identifiers, (batch_size,), generator=g)
        return {"input_ids": ids, "puzzle_identifiers": pids}

    def puzzle_batch(self, config, batch_size=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        inputs = self.prepare_inputs(config, batch_size)
        labels = torch.randint(1, config.vocab_size, inputs["input_ids"].shape, generator=g)
        labels[:, 0] = -100  # an unsupervised position
        return {**inputs, "labels": labels}

    def build_puzzle(self, **overrides):
        torch.manual_seed(0)
        return self.puzzle_class(self.get_config(**overrides))

    # ---- puzzle-model tests -------------------------------------------------------------------------------------
    def test_deep_supervision_carry(self):
        model = self.build_puzzle(halt_max_steps=3, halt_exploration_prob=0.0).train()
        batch = self.puzzle_batch(model.config)
        carry = model.initial_carry(4)
        assert carry["halted"].all()
        for step in range(1, 4):
            out = model(**batch, carry=carry)
            carry = out.carry
            assert out.logits.shape == (4, self.seq_length, model.config.vocab_size)
            assert out.q_halt_logits.shape == (4,) and out.iterations.shape == (4,)
            assert torch.isfinite(out.loss)
            out.loss.backward()
            assert (carry["steps"] <= step).all()
            assert not any(t.requires_grad for t in carry["state"].values())
        assert carry["halted"][carry["steps"] >= 3].all()  # everyone halts at halt_max_steps
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [n for n, g in grads.items()
                                                                                        if g is None]
        # A halted slot takes the next batch's puzzle; a running one keeps its own.
        new = self.puzzle_batch(model.config, seed=1)
        out = model(**new, carry=carry)
        kept = ~carry["halted"]
        torch.testing.assert_close(out.carry["data"]["input_ids"][carry["halted"]], new["input_ids"][carry["halted"]])
        torch.testing.assert_close(out.carry["data"]["input_ids"][kept], carry["data"]["input_ids"][kept])

    def test_carry_rejects_a_different_batch_shape(self):
        model = self.build_puzzle().train()
        batch = self.puzzle_batch(model.config)
        carry = model(**batch, carry=model.initial_carry(4)).carry
        small = {k: v[:2] for k, v in batch.items()}
        with pytest.raises(ValueError, match="keep the batch size fixed"):
            model(**small, carry=carry)

    def test_loss_metrics_and_iterations(self):
        model = self.build_puzzle().eval()
        batch = self.puzzle_batch(model.config)
        with torch.no_grad():
            out = model(**batch)
        assert out.loss.ndim == 0 and torch.isfinite(out.loss)
        assert set(out.metrics) >= {"lm_loss", "q_loss", "cell_accuracy", "exact"}
        assert out.iterations.dtype == torch.long and (out.iterations >= 1).all()

    def test_bfloat16_forward(self):
        model = self.build_puzzle(forward_dtype="bfloat16").eval()
        with torch.no_grad():
            out = model(**self.puzzle_batch(model.config))
        assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
        assert torch.isfinite(out.loss)

    @pytest.mark.parametrize("emb_len", [0, 2])
    def test_puzzle_embedding_length(self, emb_len):
        model = self.build_puzzle(puzzle_emb_len=emb_len).eval()
        with torch.no_grad():
            out = model(**self.puzzle_batch(model.config))
        assert out.logits.shape[1] == self.seq_length
        assert (model.model.trunk.input.puzzle_emb is None) == (emb_len == 0)

    # ---- learned positions (pos_encodings="learned", TRM/HRM's option, shared by every family) ---------------------
    POS_TABLE = "model.trunk.input.embed_pos.weight"

    def test_learned_positions_train_in_place_of_rope(self):
        model = self.build_puzzle(pos_encodings="learned").train()
        c, params = model.config, dict(model.named_parameters())
        assert params[self.POS_TABLE].shape == (c.puzzle_emb_len + self.seq_length, c.hidden_size)
        std = float(params[self.POS_TABLE].detach().std()) * c.hidden_size ** 0.5  # initialized like the tokens
        assert 0.7 < std < 1.3, std
        assert model.model.trunk.rope(c.puzzle_emb_len + self.seq_length) is None  # no rotary tables
        out = model(**self.puzzle_batch(c), carry=model.initial_carry(4))
        out.loss.backward()
        assert torch.isfinite(out.loss) and params[self.POS_TABLE].grad.abs().sum() > 0
        for other in ("rope", "none"):  # the table exists exactly with "learned"
            assert self.POS_TABLE not in dict(self.build_puzzle(pos_encodings=other).named_parameters())
        with pytest.raises(ValueError, match="pos_encodings='alibi' is not allowed. Allowed values: 'rope', "
                                             "'learned', 'none'"):
            self.get_config(pos_encodings="alibi")

    def test_learned_positions_injection_float64(self):
        # The research code: x = sqrt(D) * 0.707106781 * (cat(zero-padded puzzle embedding, tokens) + embed_pos),
        # the table covering the puzzle prefix too; written out here from the raw tables.
        model = self.build_puzzle(pos_encodings="learned", puzzle_emb_len=2, forward_dtype="float64").double().eval()
        inp, D = model.model.trunk.input, model.config.hidden_size
        with torch.no_grad():
            inp.puzzle_emb.weights.normal_()
        batch = self.puzzle_batch(model.config)
        ids, pids = batch["input_ids"], batch["puzzle_identifiers"]
        prefix = torch.nn.functional.pad(inp.puzzle_emb.weights[pids], (0, D)).view(4, 2, D)
        tokens = torch.cat([prefix, inp.embed_tokens.weight[ids]], dim=1)
        expected = D ** 0.5 * 0.707106781 * (tokens + inp.embed_pos.weight)
        with torch.no_grad():
            torch.testing.assert_close(model.model.trunk.embed(ids, pids), expected, rtol=0, atol=1e-14)
            x, _ = model(**batch, output_hidden_states=True).hidden_states
        torch.testing.assert_close(x, expected[:, 2:], rtol=0, atol=1e-14)
        for length in (self.seq_length - 1, 2 * self.seq_length):
            with pytest.raises(ValueError, match=rf"pos_encodings='learned' has one learned embedding per position: "
                                                 rf"{self.seq_length + 2} = puzzle_emb_len 2 \+ seq_len "
                                                 rf"{self.seq_length}; got input_ids of length {length}"):
                model(torch.randint(0, self.vocab_size, (2, length)))

    def test_learned_positions_save_and_load(self, tmp_path):
        model = self.build_puzzle(pos_encodings="learned").eval()
        with torch.no_grad():
            model.model.trunk.input.embed_pos.weight.normal_()
        model.save_pretrained(tmp_path)
        loaded = self.puzzle_class.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(loaded.get_parameter(self.POS_TABLE), model.get_parameter(self.POS_TABLE),
                                   rtol=0, atol=0)
        batch = self.puzzle_batch(model.config)
        with torch.no_grad():
            torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)
        # A checkpoint without the table (trained with rope) gets a freshly initialized one, not torch.empty memory.
        rope = self.build_puzzle()
        filled = self.puzzle_class.from_pretrained(None, config=model.config, state_dict=rope.state_dict())
        std = float(filled.get_parameter(self.POS_TABLE).detach().std()) * model.config.hidden_size ** 0.5
        assert 0.7 < std < 1.3, std

    def test_sign_sgd_updates_only_touched_rows(self):
        model = self.build_puzzle(num_puzzle_identifiers=5).train()
        table = model.model.trunk.input.puzzle_emb
        with torch.no_grad():
            table.weights.normal_()
        before = table.weights.clone()
        batch = self.puzzle_batch(model.config)
        batch["puzzle_identifiers"] = torch.tensor([1, 3, 3, 1])
        model(**batch).loss.backward()
        grad = table.local_weights.grad.clone()
        table.sign_sgd_step(lr=0.1, weight_decay=0.5)
        expected = before.clone()
        for row in (1, 3):
            summed = grad[batch["puzzle_identifiers"] == row].sum(0)
            expected[row] = before[row] * (1 - 0.1 * 0.5) - 0.1 * summed.sign()
        torch.testing.assert_close(table.weights, expected, rtol=0, atol=1e-6)
        # The step used the rows: the next training forward refills the same leaf (a compiled step's input) ...
        leaf = table.local_weights
        assert table.local_ids is None and leaf.grad is None
        model(**batch)
        assert table.local_weights is leaf and torch.equal(leaf.detach(), table.weights[batch["puzzle_identifiers"]])
        # ... and a forward whose rows no step used gets a new one (the last forward's rows are the step's).
        model(**batch).loss.backward()
        assert table.local_weights is not leaf and leaf.grad is None

    # Overrides that make the recurrence run a fixed number of plain iterations, so that with causal attention a
    # prefix's outputs cannot depend on later tokens through a stopping rule or a solver's whole-sample mixing.
    causal_overrides = {}

    def test_causal_prefix_ignores_later_tokens_float64(self):
        model = self.build_puzzle(causal=True, forward_dtype="float64", **self.causal_overrides).double().eval()
        with torch.no_grad():
            model.heads.q_head.weight.normal_()
        ids = self.prepare_inputs(model.config)["input_ids"]
        changed = ids.clone()
        changed[:, 5:] = (ids[:, 5:] + 1) % model.config.vocab_size
        with torch.no_grad():
            a, b = model(ids), model(changed)
        torch.testing.assert_close(a.logits[:, :5], b.logits[:, :5], rtol=0, atol=0)
        assert (a.logits[:, 5:] - b.logits[:, 5:]).abs().amax() > 1e-6
        # The Q-halt head reads the last position, the only one that sees the whole puzzle.
        assert (a.q_halt_logits - b.q_halt_logits).abs().amin() > 0
        with pytest.raises(ValueError, match="causal must be True or False"):
            self.get_config(causal="yes")

    def test_bad_inputs(self):
        model = self.build_puzzle(num_puzzle_identifiers=2).eval()
        batch = self.puzzle_batch(model.config)
        with pytest.raises(ValueError, match="puzzle_identifiers must lie in"):
            model(**{**batch, "puzzle_identifiers": torch.tensor([0, 1, 2, 0])})
        with pytest.raises(ValueError, match="input_ids must lie in"):
            model(**{**batch, "input_ids": batch["input_ids"] + model.config.vocab_size})
        with pytest.raises(ValueError, match="hidden_size=30 must be divisible"):
            self.get_config(hidden_size=30, num_attention_heads=4)
        with pytest.raises(ValueError, match="loss_type='l2' is not allowed"):
            self.get_config(loss_type="l2")
        with pytest.raises(ValueError, match="grid_shape must be"):
            self.get_config(grid_shape=[3])

    def test_fields_are_checked_at_load_and_by_assignment(self, tmp_path):
        # from_pretrained(dir, field=value) and config.field = value go through the same checks as the constructor,
        # cross-field ones included (transformers would set them after __init__, unchecked).
        self.build_puzzle().save_pretrained(tmp_path)
        loaded = self.puzzle_class.from_pretrained(tmp_path, halt_max_steps=7, fp_max_iter=3)
        assert (loaded.config.halt_max_steps, loaded.config.fp_max_iter) == (7, 3)
        with pytest.raises(ValueError, match=r"halt_max_steps=0 is out of range; allowed values lie in \[1, inf\)"):
            self.puzzle_class.from_pretrained(tmp_path, halt_max_steps=0)
        with pytest.raises(ValueError, match="loss_type='l2' is not allowed"):
            self.puzzle_class.from_pretrained(tmp_path, loss_type="l2")
        config = loaded.config
        config.q_loss_weight = 0.25
        assert config.q_loss_weight == 0.25
        with pytest.raises(ValueError, match="causal must be True or False, got 1"):
            config.causal = 1
        odd = config.num_attention_heads * 8 + 1
        with pytest.raises(ValueError, match=f"hidden_size={odd} must be divisible by num_attention_heads"):
            config.hidden_size = odd
        assert config.causal is False and config.hidden_size != odd  # a refused value is not set

    def test_puzzle_id_count_must_match_the_checkpoint(self, tmp_path):
        self.build_puzzle(num_puzzle_identifiers=3).save_pretrained(tmp_path)
        with pytest.raises(ValueError, match="num_puzzle_identifiers=5 differs from the checkpoint's 3"):
            self.puzzle_class.from_pretrained(tmp_path, num_puzzle_identifiers=5)
        with pytest.raises(ValueError, match="differs from the checkpoint"):
            self.model_classes[0][0].from_pretrained(tmp_path, config=self.get_config(num_puzzle_identifiers=4))
        assert self.puzzle_class.from_pretrained(tmp_path, num_puzzle_identifiers=3).config.num_puzzle_identifiers == 3

    def test_puzzle_model_remote_code_round_trip(self, tmp_path):
        # The *ForPuzzles checkpoint loads through AutoModelForTokenClassification without hf_fixedpoint installed.
        model = self.build_puzzle().eval()
        ckpt, io = tmp_path / "ckpt", tmp_path / "io"
        io.mkdir()
        model.save_pretrained(ckpt)
        inputs = self.prepare_inputs(model.config)
        torch.save(inputs, io / "inputs.pt")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": ""}
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), "AutoModelForTokenClassification", str(io)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["module"].startswith("transformers_modules.") and not report["hf_fixedpoint_loaded"]
        # The child backpropagates the logits only: every parameter but the Q-halt head's weight and bias gets a grad.
        assert report["n_grads"] == report["n_params"] - 2
        with torch.no_grad():
            expected = model(**inputs).logits
        torch.testing.assert_close(torch.load(io / "child_out.pt"), expected, rtol=1e-5, atol=1e-6)

    # ---- transformers conventions (issue 17) ---------------------------------------------------------------------
    def test_from_pretrained_fills_missing_heads_and_latent_buffers(self, tmp_path):
        # A base checkpoint loaded into *ForPuzzles lacks the heads; a checkpoint without the latents' reset vectors
        # lacks those buffers. from_pretrained must fill both through _init_weights, not leave torch.empty memory.
        base = self.build(self.model_classes[0][0]).eval()
        base.save_pretrained(tmp_path / "base")
        model = self.puzzle_class.from_pretrained(tmp_path / "base")
        assert (model.heads.q_head.weight == 0).all() and (model.heads.q_head.bias == -5).all()
        std = float(model.heads.lm_head.weight.detach().std()) * model.config.hidden_size ** 0.5  # LeCun: 1 / sqrt(D)
        assert 0.7 < std < 1.3, std
        for name, buffer in base.named_buffers():
            torch.testing.assert_close(model.model.get_buffer(name), buffer, rtol=0, atol=0)  # loaded, not redrawn
        latents = [name for name, _ in model.named_buffers() if name.endswith("_init")]
        assert latents
        state = {k: v for k, v in model.state_dict().items() if k not in latents}
        reloaded = self.puzzle_class.from_pretrained(None, config=model.config, state_dict=state)
        for name in latents:
            buffer = reloaded.get_buffer(name)
            assert torch.isfinite(buffer).all() and 0.7 < float(buffer.std()) < 1.3, (name, buffer)

    def test_from_pretrained_without_a_path(self):
        # from_pretrained(None, config=..., state_dict=...) is how transformers (and its tests) build from memory.
        model = self.build_puzzle().eval()
        loaded = self.puzzle_class.from_pretrained(None, config=model.config, state_dict=model.state_dict()).eval()
        batch = self.puzzle_batch(model.config)
        with torch.no_grad():
            torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)

    def test_standard_output_switches_and_input_embeddings(self):
        model = self.build_puzzle().eval()
        batch = self.puzzle_batch(model.config)
        assert model.get_input_embeddings() is model.model.trunk.input.embed_tokens
        assert model.model.get_input_embeddings() is model.get_input_embeddings()
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True)
            as_tuple = model(**batch, return_dict=False)
            base = model.model(batch["input_ids"], batch["puzzle_identifiers"], output_hidden_states=True)
        assert isinstance(as_tuple, tuple)
        torch.testing.assert_close(as_tuple[1], out.logits, rtol=0, atol=0)  # (loss, logits, ...)
        x, h = base.hidden_states
        assert x.shape == h.shape == (4, self.seq_length, model.config.hidden_size)
        torch.testing.assert_close(h, base.last_hidden_state, rtol=0, atol=0)
        assert len(out.hidden_states) == 2
        model.config.output_hidden_states = True
        with torch.no_grad():
            assert model(**batch).hidden_states is not None
        with pytest.raises(ValueError, match="no attention weights"):
            model(**batch, output_attentions=True)
