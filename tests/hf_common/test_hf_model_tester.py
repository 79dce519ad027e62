"""transformers' ``ModelTesterMixin`` (its generic model checks, ~120 tests) on SELF-LLaMA and SELF-Mistral: save /
load, ``from_pretrained`` initialisation of missing weights and buffers, output capture, return_dict / tuple
equivalence, eager vs sdpa in fp16 / bf16 / fp32 with padding, resized embeddings, gradient checkpointing, training."""

import unittest

from hf_fixedpoint.modeling import (
    SelfLlamaConfig,
    SelfLlamaForCausalLM,
    SelfLlamaModel,
    SelfMistralConfig,
    SelfMistralForCausalLM,
    SelfMistralModel,
)
from tests.hf_common.common import CausalLMCommon, FixedPointWeightsMixin, TinyTester

# A tiny config with three FPSA iterations per layer.
TINY = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 37, "pad_token_id": 0, "fp_max_iter": 3}


class _SelfCommon(FixedPointWeightsMixin, CausalLMCommon):  # FPSA reads its weights after the solve
    pass


class SelfLlamaHFTest(_SelfCommon, unittest.TestCase):
    all_model_classes = (SelfLlamaModel, SelfLlamaForCausalLM)
    lm_class = SelfLlamaForCausalLM

    def setUp(self):
        self.model_tester = TinyTester(self, SelfLlamaConfig, TINY)


class SelfMistralHFTest(_SelfCommon, unittest.TestCase):
    all_model_classes = (SelfMistralModel, SelfMistralForCausalLM)
    lm_class = SelfMistralForCausalLM

    def setUp(self):
        self.model_tester = TinyTester(self, SelfMistralConfig, {**TINY, "sliding_window": 4})
