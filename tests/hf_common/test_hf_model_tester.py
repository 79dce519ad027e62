"""transformers' ``ModelTesterMixin`` (its generic model checks, ~120 tests) on SELF-LLaMA and SELF-Mistral: save /
load, ``from_pretrained`` initialisation of missing weights and buffers, output capture, return_dict / tuple
equivalence, eager vs sdpa in fp16 / bf16 / fp32 with padding, resized embeddings, gradient checkpointing, training."""

import unittest

import torch

from tests.hf_common.hf_suite import ensure

ensure()

from hf_common_tests.generation.test_utils import GenerationTesterMixin  # noqa: E402
from hf_common_tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402

from hf_fixedpoint.modeling import (  # noqa: E402
    SelfLlamaConfig,
    SelfLlamaForCausalLM,
    SelfLlamaModel,
    SelfMistralConfig,
    SelfMistralForCausalLM,
    SelfMistralModel,
)


class _Tester:
    """The attributes ModelTesterMixin reads, for a tiny config with three FPSA iterations per layer."""

    def __init__(self, parent, config_class, **extra):
        self.parent, self.config_class, self.extra = parent, config_class, extra
        self.batch_size, self.seq_length, self.vocab_size = 3, 7, 99
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 32, 2, 4
        self.num_key_value_heads, self.intermediate_size, self.is_training = 2, 37, True

    def get_config(self):
        return self.config_class(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                 num_hidden_layers=self.num_hidden_layers,
                                 num_attention_heads=self.num_attention_heads,
                                 num_key_value_heads=self.num_key_value_heads,
                                 intermediate_size=self.intermediate_size, pad_token_id=0, fp_max_iter=3, **self.extra)

    def prepare_config_and_inputs_for_common(self):
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), {"input_ids": ids, "attention_mask": torch.tril(torch.ones_like(ids))}


class _SelfCommon(ModelTesterMixin, GenerationTesterMixin):
    test_can_init_all_missing_weights_before_2023 = True  # else the check of gotcha "meta-device init" is skipped
    lm_class = None

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is self.lm_class:
            inputs_dict["labels"] = inputs_dict["input_ids"].clone()
        return inputs_dict

    def _lm_only(self, test):
        # The training tests ask every class for a loss; only the LM head has one (transformers' own tests select the
        # classes through the Auto *_MAPPING_NAMES tables, which do not list custom classes).
        classes = self.all_model_classes
        self.all_model_classes = (self.lm_class,)
        try:
            test()
        finally:
            self.all_model_classes = classes

    def test_training(self):
        self._lm_only(super().test_training)

    def test_training_gradient_checkpointing(self):
        self._lm_only(super().test_training_gradient_checkpointing)

    def test_training_gradient_checkpointing_use_reentrant_false(self):
        self._lm_only(super().test_training_gradient_checkpointing_use_reentrant_false)

    def test_training_gradient_checkpointing_use_reentrant_true(self):
        self._lm_only(super().test_training_gradient_checkpointing_use_reentrant_true)

    @unittest.skip("FPSA reports the attention weights at the fixed point through one extra evaluation after the "
                   "solve; the output itself comes from the solver, so those weights get no gradient from it.")
    def test_retain_grad_hidden_states_attentions(self):
        pass


class SelfLlamaHFTest(_SelfCommon, unittest.TestCase):
    all_model_classes = (SelfLlamaModel, SelfLlamaForCausalLM)
    lm_class = SelfLlamaForCausalLM

    def setUp(self):
        self.model_tester = _Tester(self, SelfLlamaConfig)


class SelfMistralHFTest(_SelfCommon, unittest.TestCase):
    all_model_classes = (SelfMistralModel, SelfMistralForCausalLM)
    lm_class = SelfMistralForCausalLM

    def setUp(self):
        self.model_tester = _Tester(self, SelfMistralConfig, sliding_window=4)
