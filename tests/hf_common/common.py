"""What the ``tests/hf_common`` suites share: a tiny-config tester for ``ModelTesterMixin`` and the causal-LM
overrides (transformers selects the classes a generic test applies to through its Auto ``*_MAPPING_NAMES`` tables,
which do not list custom classes)."""

import unittest

import torch

from tests.hf_common.hf_suite import ensure

ensure()

from hf_common_tests.generation.test_utils import GenerationTesterMixin  # noqa: E402
from hf_common_tests.test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor  # noqa: E402

__all__ = ["CausalLMCommon", "FixedPointWeightsMixin", "GenerationTesterMixin", "LossClassesMixin",
           "ModelTesterMixin", "TinyTester", "floats_tensor", "ids_tensor"]


class TinyTester:
    """The attributes ModelTesterMixin reads: a config built from ``config_kwargs``, ``inputs(tester, config)``
    (default: ``input_ids`` and a lower-triangular ``attention_mask``, i.e. rows of every length) and
    ``reported_layers``, the layer outputs the model reports."""

    def __init__(self, parent, config_class, config_kwargs, inputs=None, batch_size=3, seq_length=7,
                 reported_layers=None):
        self.parent, self.config_class, self.config_kwargs = parent, config_class, config_kwargs
        self.inputs = inputs or (lambda tester, config: {
            "input_ids": (ids := ids_tensor([tester.batch_size, tester.seq_length], config.vocab_size)),
            "attention_mask": torch.tril(torch.ones_like(ids))})
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, True
        config = self.get_config()
        self.vocab_size = getattr(config, "vocab_size", None)
        self.hidden_size = config.hidden_size
        # What output_hidden_states / output_attentions report (len(attentions), len(hidden_states) - 1): a looped
        # model reports every application of its layers.
        self.num_hidden_layers = reported_layers or config.num_hidden_layers
        self.num_attention_heads = config.num_attention_heads

    def get_config(self):
        return self.config_class(**self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        return config, self.inputs(self, config)


class FixedPointWeightsMixin:
    """For models that read attention weights at the fixed point by one extra evaluation after the solve."""

    @unittest.skip("the attention weights are read at the fixed point by one extra evaluation after the solve; the "
                   "output comes from the solver, so those weights get no gradient from it.")
    def test_retain_grad_hidden_states_attentions(self):
        pass


class LossClassesMixin:
    """The training tests run on ``loss_classes`` only: they ask every class for a loss, and transformers' own tests
    select the classes through the Auto ``*_MAPPING_NAMES`` tables, which do not list custom classes."""

    loss_classes = ()

    def _with_loss_only(self, test):
        classes = self.all_model_classes
        self.all_model_classes = tuple(self.loss_classes)
        try:
            test()
        finally:
            self.all_model_classes = classes

    def test_training(self):
        self._with_loss_only(super().test_training)

    def test_training_gradient_checkpointing(self):
        self._with_loss_only(super().test_training_gradient_checkpointing)

    def test_training_gradient_checkpointing_use_reentrant_false(self):
        self._with_loss_only(super().test_training_gradient_checkpointing_use_reentrant_false)

    def test_training_gradient_checkpointing_use_reentrant_true(self):
        self._with_loss_only(super().test_training_gradient_checkpointing_use_reentrant_true)


class CausalLMCommon(LossClassesMixin, ModelTesterMixin, GenerationTesterMixin):
    """``ModelTesterMixin`` for a base model + causal-LM pair (``lm_class``): labels for the LM, and the training
    tests on the LM."""

    test_can_init_all_missing_weights_before_2023 = True  # else the check of gotcha "meta-device init" is skipped
    lm_class = None

    @property
    def loss_classes(self):
        return (self.lm_class,)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is self.lm_class:
            inputs_dict["labels"] = inputs_dict["input_ids"].clone()
        return inputs_dict
