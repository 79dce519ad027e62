"""Every family trains with ``transformers.Trainer`` under its default arguments (``remove_unused_columns=True``
included: the columns a model's ``forward`` does not name are dropped, an extra text column must be) for two steps on
a tiny dataset, and ``FixedPointStatsCallback`` puts the fixed-point statistics into the Trainer logs."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from hf_fixedpoint.callbacks import FixedPointStatsCallback
from hf_fixedpoint.modeling import (
    AttractorForCausalLM,
    DEQLMForCausalLM,
    FPRMForPuzzles,
    FPSABertForSequenceClassification,
    FPSABertForTokenClassification,
    FPSAViTForImageClassification,
    OuroForCausalLM,
    SelfLlamaForCausalLM,
    SelfMistralForCausalLM,
    TRMForPuzzles,
    URMForPuzzles,
)

# The families' tiny configs, from their test modules (imported as modules so pytest does not collect their
# test classes a second time here).
from tests.models.attractor_lm import test_modeling_attractor_lm as attractor_tests
from tests.models.deq_lm import test_modeling_deq_lm as deq_tests
from tests.models.fprm import test_modeling_fprm as fprm_tests
from tests.models.fpsa_bert import test_modeling_fpsa_bert as bert_tests
from tests.models.fpsa_vit import test_modeling_fpsa_vit as vit_tests
from tests.models.ouro import test_modeling_ouro as ouro_tests
from tests.models.self_llama import test_modeling_self_llama as llama_tests
from tests.models.self_mistral import test_modeling_self_mistral as mistral_tests
from tests.models.trm import test_modeling_trm as trm_tests
from tests.models.urm import test_modeling_urm as urm_tests

N = 4  # examples; two steps of two


def _tokens(vocab, length=6, seed=0):
    return torch.randint(1, vocab, (N, length), generator=torch.Generator().manual_seed(seed))


def _lm_rows(config):
    ids = _tokens(config.vocab_size)
    return {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.tolist()}


def _sequence_rows(config):
    return {**_lm_rows(config), "labels": [0, 1, 0, 1]}


def _token_rows(config):
    return {**_lm_rows(config), "labels": (_tokens(2, seed=1) - 1).tolist()}


def _image_rows(config):
    pixels = torch.randn(N, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return {"pixel_values": pixels.tolist(), "labels": [0, 1, 2, 0]}


def _puzzle_rows(config):
    ids = _tokens(config.vocab_size, length=9)
    return {"input_ids": ids.tolist(), "puzzle_identifiers": [0, 1, 2, 0], "labels": _tokens(config.vocab_size, 9,
                                                                                            seed=1).tolist()}


BERT, VIT = bert_tests.TINY, vit_tests.TINY
FAMILIES = {  # name: (model class, config kwargs, rows, key the fixed-point statistics log under)
    "deq_lm": (DEQLMForCausalLM, deq_tests.TestDEQLM.config_kwargs, _lm_rows, "fp_nstep_mean"),
    "attractor_lm": (AttractorForCausalLM, attractor_tests.TINY, _lm_rows, "fp_nstep_mean"),
    "ouro": (OuroForCausalLM, ouro_tests.TINY, _lm_rows, None),  # a fixed loop count: no solver statistics
    "self_llama": (SelfLlamaForCausalLM, llama_tests.TestSelfLlama.config_kwargs, _lm_rows, "fpsa_iter_mean"),
    "self_mistral": (SelfMistralForCausalLM, mistral_tests.TestSelfMistral.config_kwargs, _lm_rows,
                     "fpsa_iter_mean"),
    "fpsa_bert_sequence": (FPSABertForSequenceClassification, BERT, _sequence_rows, "fpsa_iter_mean"),
    "fpsa_bert_token": (FPSABertForTokenClassification, {**BERT, "num_labels": 2}, _token_rows, "fpsa_iter_mean"),
    "fpsa_vit": (FPSAViTForImageClassification, VIT, _image_rows, "fpsa_iter_mean"),
    "fprm": (FPRMForPuzzles, fprm_tests.TestFPRM.config_kwargs, _puzzle_rows, "fp_nstep_mean"),
    "trm": (TRMForPuzzles, trm_tests.TestAttractorReasoning.config_kwargs, _puzzle_rows, "fp_nstep_mean"),
    "urm": (URMForPuzzles, urm_tests.TestURM.config_kwargs, _puzzle_rows, "fp_nstep_mean"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trainer_with_default_arguments(family, tmp_path):
    model_class, config_kwargs, rows, stat_key = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(model_class.config_class(**config_kwargs))
    data = Dataset.from_dict({**rows(model.config), "text": ["an unused column"] * N})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                             learning_rate=1e-3, report_to="none", save_strategy="no", disable_tqdm=True,
                             use_cpu=True)
    assert args.remove_unused_columns
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FixedPointStatsCallback()])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    if stat_key is not None:
        assert all(entry[stat_key] >= 1 for entry in logs), logs
