"""Every recipe's tiny settings on two CPU processes (gloo DDP, ``accelerate launch --multi_gpu --num_processes 2``
with ``ACCELERATE_USE_CPU=1``): the run finishes, says it ran on two processes and leaves its export. The STARS
addition demo's two-process run is in the default suite (``tests/recipes/test_stars_ouro.py``); these are slow (a
launch costs 20-60 s of CPU on two cores)."""

import json
from pathlib import Path

import pytest

from tests.helpers import run_two_processes
from tests.recipes.test_fpsa_recipes import tiny_bert  # noqa: F401  (fixture)
from tests.recipes.test_self_lora import small, tiny_llama  # noqa: F401  (fixture)


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(Path(json.__file__).read_text() * 3)
    return path


def _assert_two_process_run(proc, out):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "processes: 2 (DistributedType.MULTI_CPU)" in proc.stdout  # every recipe prints it (start_run)
    assert (out / "config.json").is_file()


@pytest.mark.slow
def test_train_deq_lm(tmp_path):
    out = tmp_path / "run"
    proc = run_two_processes("train_deq_lm", "--output_dir", out, "--max_steps", 2, "--batch_size", 2,
                             "--seq_length", 16, "--hidden_size", 16, "--fp_max_iter", 4, "--log_every", 1,
                             tmp_path=tmp_path)
    _assert_two_process_run(proc, out)
    assert "step    2 loss" in proc.stdout


@pytest.mark.slow
def test_attractor_lm(tmp_path):
    out = tmp_path / "run"
    proc = run_two_processes("attractor_lm", "--output_dir", out, "--corpus", _corpus(tmp_path), "--max_steps", 2,
                             "--batch_size", 2, "--seq_length", 32, "--hidden_size", 32, "--vocab_size", 300,
                             "--eval_batches", 1, "--fp_max_iter", 4, tmp_path=tmp_path)
    _assert_two_process_run(proc, out)


@pytest.mark.slow
def test_reasoning(tmp_path):
    out = tmp_path / "run"
    proc = run_two_processes("reasoning", "--output_dir", out, "--model", "fprm", "--task", "a5", "--task_kwargs",
                             '{"num_samples": 16, "length": 4}', "--test_task_kwargs",
                             '{"num_samples": 8, "length": 4}', "--batch_size", 4, "--eval_batch_size", 8,
                             "--hidden_size", 16, "--num_attention_heads", 2, "--halt_max_steps", 2, "--warmup_steps",
                             1, "--num_layers", 1, "--max_steps", 2, "--eval_every", 2, "--model_kwargs",
                             '{"fp_max_iter": 3, "mlp_multiple_of": 8}', tmp_path=tmp_path)
    _assert_two_process_run(proc, out)


FPSA_COMMON = ["--max_steps", 2, "--logging_steps", 1, "--fp_max_iter", 3, "--per_device_train_batch_size", 4]


@pytest.mark.slow
def test_fpsa_vit(tmp_path):
    out = tmp_path / "run"
    proc = run_two_processes("fpsa_vit", "--output_dir", out, *FPSA_COMMON, "--hidden_size", 16,
                             "--num_attention_heads", 2, "--num_hidden_layers", 1, tmp_path=tmp_path)
    _assert_two_process_run(proc, out)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fpsa_glue", "fpsa_squad"])
def test_fpsa_bert_recipes(recipe, tiny_bert, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    proc = run_two_processes(recipe, "--output_dir", out, "--model_name_or_path", tiny_bert, *FPSA_COMMON,
                             tmp_path=tmp_path)
    _assert_two_process_run(proc, out)


@pytest.mark.slow
def test_self_lora(tiny_llama, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    proc = run_two_processes("self_lora", *small(out, tiny_llama, steps=2), tmp_path=tmp_path)
    _assert_two_process_run(proc, out)
    assert (out / "adapter" / "adapter_config.json").is_file()
