"""transformers' ``ModelTesterMixin`` on the puzzle families FPRM, TRM (and Attractor-reasoning, ``deq=True``) and
URM: base models and ``*ForPuzzles``. Each skip names why the generic check cannot apply to a puzzle model."""

import unittest
from unittest import mock

import torch

from hf_fixedpoint.modeling import (
    FPRMConfig,
    FPRMForPuzzles,
    FPRMModel,
    TRMConfig,
    TRMForPuzzles,
    TRMModel,
    URMConfig,
    URMForPuzzles,
    URMModel,
)
from hf_fixedpoint.modeling.fprm.modeling_fprm import FPRMModelOutput
from tests.hf_common.common import LossClassesMixin, ModelTesterMixin, TinyTester, ids_tensor

# A 3x3 grid, one puzzle-embedding position, two puzzle ids (vocab_size 99 as in transformers' testers: the resize
# test shrinks the vocabulary by 15).
GRID = {"vocab_size": 99, "seq_len": 9, "hidden_size": 16, "num_attention_heads": 2, "mlp_multiple_of": 8,
        "num_puzzle_identifiers": 2}
FPRM = {**GRID, "num_layers": 2, "fp_max_iter": 6, "bptt_window": 2}
TRM = {**GRID, "num_layers": 1, "H_cycles": 2, "L_cycles": 2}
TRM_DEQ = {**TRM, "deq": True, "fp_max_iter": 6}
URM = {**GRID, "num_layers": 2, "L_cycles": 2, "fp_max_iter": 3}


def _puzzles(tester, config):
    return {"input_ids": ids_tensor([tester.batch_size, tester.seq_length], config.vocab_size),
            "puzzle_identifiers": ids_tensor([tester.batch_size], config.num_puzzle_identifiers)}


def _assert_same(test, a, b):
    test.assertEqual(type(a), type(b))
    if isinstance(a, (list, tuple)):
        test.assertEqual(len(a), len(b))
        for u, v in zip(a, b):
            _assert_same(test, u, v)
    elif isinstance(a, dict):
        test.assertEqual(a.keys(), b.keys())
        for key in a:
            _assert_same(test, a[key], b[key])
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


class PuzzleTester(TinyTester):
    """``hidden_states`` of a puzzle model is ``(input injection, final state)``: one reported layer."""

    def __init__(self, parent, config_class, config_kwargs):
        super().__init__(parent, config_class, config_kwargs, inputs=_puzzles, seq_length=9, reported_layers=1)


class _PuzzleCommon(LossClassesMixin, ModelTesterMixin):
    test_can_init_all_missing_weights_before_2023 = True
    # Attention runs through fused scaled_dot_product_attention: no weights to report (output_attentions=True is
    # refused with a clear error, tested in tests/models/).
    has_attentions = False
    config_class = config_kwargs = None

    @property
    def loss_classes(self):
        return tuple(c for c in self.all_model_classes if c.__name__.endswith("ForPuzzles"))

    @unittest.skip("the random reset vectors of the latents (y_init / z_init / h_init buffers) are drawn like "
                   "weights, so two initialisations differ; the test assumes deterministic buffers. from_pretrained "
                   "filling them is tested in tests/models/ (issue 17, item 2).")
    def test_init_weights_can_init_buffers(self):
        pass

    @unittest.skip("hidden_states report the puzzle positions (the puzzle-embedding prefix cut off), views of the "
                   "full state the solve reads, so they lie off the gradient path; the gradient through the "
                   "injection and the solve is tested in tests/models/.")
    def test_retain_grad_hidden_states_attentions(self):
        pass

    def test_model_outputs_equivalence(self):
        # transformers' version formats its failure message eagerly with tensor subtraction, which torch refuses on
        # the per-sample bool metrics["exact"]; the same check (return_dict=False == return_dict=True), bools exact.
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            for labels in (False, True):
                kwargs = self._prepare_for_class(inputs, model_class, return_labels=labels)
                with torch.no_grad():
                    as_tuple = model(**kwargs, return_dict=False, output_hidden_states=True)
                    as_dict = model(**kwargs, return_dict=True, output_hidden_states=True).to_tuple()
                _assert_same(self, as_tuple, as_dict)

    def setUp(self):
        self.model_tester = PuzzleTester(self, self.config_class, self.config_kwargs)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class.__name__.endswith("ForPuzzles"):
            inputs_dict["labels"] = inputs_dict["input_ids"].clone()
        return inputs_dict


class FPRMHFTest(_PuzzleCommon, unittest.TestCase):
    all_model_classes = (FPRMModel, FPRMForPuzzles)
    config_class, config_kwargs = FPRMConfig, FPRM

    def test_batching_equivalence(self):
        # The carried state holds the windowed solver's own state, whose best residual so far starts at +inf (before
        # any window step); the test refuses any inf in an output, so it compares the outputs without the carry.
        # solve_mode="official" (the research code's evaluation) halts the whole batch once every puzzle of it is
        # below the threshold, so a puzzle's output depends on the batch it is in, by design; per_sample does not.
        self.model_tester = PuzzleTester(self, self.config_class, {**self.config_kwargs, "solve_mode": "per_sample"})
        forward = FPRMModel.forward

        def without_state(model, *args, **kwargs):
            return FPRMModelOutput(**{k: v for k, v in forward(model, *args, **kwargs).items() if k != "state"})

        with mock.patch.object(FPRMModel, "forward", without_state):
            super().test_batching_equivalence()


class TRMHFTest(_PuzzleCommon, unittest.TestCase):
    all_model_classes = (TRMModel, TRMForPuzzles)
    config_class, config_kwargs = TRMConfig, TRM


class AttractorReasoningHFTest(_PuzzleCommon, unittest.TestCase):
    all_model_classes = (TRMModel, TRMForPuzzles)
    config_class, config_kwargs = TRMConfig, TRM_DEQ


class URMHFTest(_PuzzleCommon, unittest.TestCase):
    all_model_classes = (URMModel, URMForPuzzles)
    config_class, config_kwargs = URMConfig, URM
