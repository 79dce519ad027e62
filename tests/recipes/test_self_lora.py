"""Tests of the SELF LoRA retrofit recipe (``recipes/self_lora.py``) on tiny random LLaMA / Mistral checkpoints.

The recipe runs in-process (``main(argv)``) with the accelerate state reset between runs. The checkpoints are plain
``LlamaForCausalLM`` / ``MistralForCausalLM`` folders (model_type llama / mistral) with a byte-level BPE tokenizer
trained on the generated problems, so everything is offline and takes seconds. One slow test trains the real SmolLM2.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("peft")

from accelerate.state import AcceleratorState  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from hf_fixedpoint.modeling import SelfLlamaForCausalLM, SelfMistralForCausalLM  # noqa: E402
from recipes import self_lora  # noqa: E402
from tests.helpers import train_bpe_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.1)


def run(argv):
    AcceleratorState._reset_state(True)
    return self_lora.main([str(a) for a in argv])


def tokenizer_for_problems():
    train, evaluation = self_lora.make_problems(300, 20)
    texts = [r["question"] + " " + r["answer"] for r in [*train, *evaluation]]
    return train_bpe_tokenizer(texts, vocab_size=320)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_llama")
    tok = tokenizer_for_problems()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 **TINY)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def small(out, model, steps=4, extra=()):
    return ["--output_dir", out, "--model_name_or_path", model, "--max_steps", steps, "--logging_steps", 1,
            "--num_train_problems", 64, "--num_eval_problems", 6, "--per_device_train_batch_size", 4,
            "--per_device_eval_batch_size", 3, "--max_new_tokens", 6, "--fp_max_iter", 3, "--eval_fp_max_iter", 2, 3,
            "--learning_rate", 3e-2, "--warmup_ratio", 0, "--lora_dropout", 0, *extra]


def test_problems_are_deterministic_disjoint_and_answer_checked():
    train, evaluation = self_lora.make_problems(200, 30, seed=7)
    again, _ = self_lora.make_problems(200, 30, seed=7)
    assert list(train) == list(again) and len(train) == 200 and len(evaluation) == 30
    assert not {r["question"] for r in train} & {r["question"] for r in evaluation}
    for row in [*train, *evaluation]:
        *steps, last = row["answer"].split("\n")
        lhs, rhs = steps[-1].split(" = ")
        assert last == f"#### {rhs}" and eval(lhs) == int(rhs) and int(rhs) >= 0  # the worked steps are right
    assert self_lora.final_answer("so 3 + 4 = 7\n#### 7 and then 9") == "7"
    assert self_lora.final_answer("3 + 4 = 7 apples, 1,200.") is None
    assert self_lora.final_answer("3 + 4 = 7 apples, 1,200.", flexible=True) == "1200"


def test_trains_only_lora_resumes_and_exports(tiny_llama, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    metrics = run(small(full, tiny_llama, extra=["--checkpointing_steps", 2, "--eval_before_training"]))
    losses = [r["loss"] for r in metrics["train_log"]]
    assert [r["step"] for r in metrics["train_log"]] == [1, 2, 3, 4]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    first = metrics["train_log"][0]
    assert 1 <= first["fpsa_iter_median"] <= 3 and 0 <= first["fpsa_cap_hit_rate"] <= 1
    # Before training: fp_max_iter=1 (the base model) and the eval caps; after: the caps.
    assert [r["fp_max_iter"] for r in metrics["eval_before_training"]] == [1, 2, 3]
    assert metrics["eval_before_training"][0]["fpsa_iter_max"] == 1
    assert [r["fp_max_iter"] for r in metrics["eval"]] == [2, 3]
    for r in metrics["eval"]:
        assert r["n"] == 6 and 0 <= r["exact_match"] <= r["exact_match_flexible"] <= 1
        assert 1 <= r["fpsa_iter_median"] <= r["fp_max_iter"] and r["latency_s_per_problem"] > 0

    # Training checkpoints hold the LoRA weights only; the base weights did not move (the merge differs only in the
    # attention projections LoRA adapts).
    lora_state = load_file(full / "step_2" / "model.safetensors")
    assert lora_state and all(".lora_" in k for k in lora_state)
    base, merged = load_file(tiny_llama / "model.safetensors"), load_file(full / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in changed)

    # Resume from step 2 into a fresh folder: steps 3-4 reproduce the uninterrupted run (the log of steps 1-2 comes
    # with the checkpoint).
    second = run(small(resumed, tiny_llama, extra=["--resume_from_checkpoint", full / "step_2"]))
    assert [r["step"] for r in second["train_log"]] == [1, 2, 3, 4]
    assert [r["loss"] for r in second["train_log"]] == losses
    again = load_file(resumed / "model.safetensors")
    assert all(torch.equal(merged[k], again[k]) for k in merged)

    # The adapter loads with PEFT on the SELF retrofit and gives the merged export's logits; the export reloads in
    # a fresh process (torch + transformers, remote code) with the same logits.
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    base = SelfLlamaForCausalLM.from_pretrained(tiny_llama, fp_max_iter=3, fpsa_halt_unit="state",
                                                fpsa_update_scale=0.5)  # the recipe's settings
    peft_model = PeftModel.from_pretrained(base, full / "adapter").eval()
    with torch.no_grad():
        want = peft_model(ids).logits
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(full)!r}, trust_remote_code=True).eval()
        assert "hf_fixedpoint" not in sys.modules, "the export needs hf_fixedpoint"
        with torch.no_grad():
            torch.save(m(torch.tensor({ids.tolist()})).logits, {str(tmp_path / "logits.pt")!r})
        print(type(m).__name__, m.config.fp_max_iter)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SelfLlamaForCausalLM", "3"]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, atol=1e-4, rtol=1e-4)


def test_mistral_checkpoint_under_accelerate_launch_with_accumulation_and_bf16(tmp_path):
    folder = tmp_path / "tiny_mistral"
    tok = tokenizer_for_problems()
    MistralForCausalLM(MistralConfig(vocab_size=len(tok), sliding_window=None, **TINY)).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert self_lora.self_model_class(folder) is SelfMistralForCausalLM
    out = tmp_path / "out"
    argv = small(out, folder, steps=2, extra=["--eval_fp_max_iter", 2, "--lora_target_modules", "q_proj,v_proj",
                                              "--gradient_accumulation_steps", 2, "--bf16"])
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                           "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "no",
                           str(ROOT / "recipes" / "self_lora.py"), *map(str, argv)], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                          "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["step"] for r in metrics["train_log"]] == [1, 2]  # 2 optimizer steps of 2 micro-batches each
    assert torch.isfinite(torch.tensor(metrics["train_log"][-1]["loss"]))
    assert json.loads((out / "config.json").read_text())["model_type"] == "self_mistral"
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]


def test_bad_inputs_give_clear_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"no nn.Linear module named \['qkv'\].*available: .*down_proj.*q_proj"):
        run(small(tmp_path / "a", tiny_llama, extra=["--lora_target_modules", "q_proj,qkv"]))
    with pytest.raises(ValueError, match="fp_max_iter=0 is out of range"):
        run(small(tmp_path / "b", tiny_llama, extra=["--fp_max_iter", 0]))
    with pytest.raises(ValueError, match="eval_fp_max_iter=0 is out of range"):
        run(small(tmp_path / "c", tiny_llama, extra=["--eval_fp_max_iter", 0]))
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=16)).save_pretrained(bert)
    with pytest.raises(ValueError, match="model_type='bert'.*LLaMA and Mistral"):
        self_lora.self_model_class(bert)


@pytest.mark.slow
def test_real_smollm2_few_steps(tmp_path):
    pytest.importorskip("gguf")
    from hf_fixedpoint.resources import smollm2_path

    path = smollm2_path()
    metrics = run(["--output_dir", tmp_path, "--model_name_or_path", path, "--max_steps", 2, "--logging_steps", 1,
                   "--num_train_problems", 8, "--num_eval_problems", 2, "--per_device_train_batch_size", 2,
                   "--max_new_tokens", 24, "--fp_max_iter", 2, "--eval_fp_max_iter", 2])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics["train_log"])
    assert metrics["lora_trainable_parameters"] == 921_600  # r=8 on q, k, v, o of SmolLM2-135M


def test_killed_anywhere_and_resumed_ends_with_the_uninterrupted_weights(tiny_llama, tmp_path):
    """Issue 21: kills inside a save, at a step boundary and in the export; resumed with ``latest`` until done, the
    merged export equals the uninterrupted run's bitwise (LoRA dropout on, so the RNG state matters too)."""
    from tests.helpers import kill_at_step, kill_during_save, kill_each, kill_in, same_weights

    def args(out, *extra):
        return small(out, tiny_llama, steps=5, extra=["--checkpointing_steps", 1, "--lora_dropout", 0.1, *extra])

    reference = tmp_path / "reference"
    run(args(reference))
    out = tmp_path / "run"
    kill_each(lambda *flags: run(args(out, *flags)), [
        lambda mp: kill_during_save(mp, 2), lambda mp: kill_at_step(mp, 2),
        lambda mp: kill_in(mp, self_lora, "export")])
    assert not (out / "config.json").exists()  # the killed export left nothing that loads
    run(args(out, "--resume_from_checkpoint", out / "step_5"))  # resumed at the end: restores, then exports
    assert same_weights(reference / "model.safetensors", out / "model.safetensors")
    assert same_weights(reference / "adapter" / "adapter_model.safetensors",
                        out / "adapter" / "adapter_model.safetensors")
