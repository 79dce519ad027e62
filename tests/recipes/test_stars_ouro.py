"""recipes/stars_ouro.py: the addition demo in miniature, fine-tuning with resume and 2-process CPU DDP, bad flags."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_two_processes

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _run(args, tmp_path, launcher=None, timeout=600, **env_extra):
    cmd = launcher or [sys.executable, "-m", "recipes.stars_ouro"]
    env = {**ENV, "HF_HOME": str(tmp_path / "hf_home"), **env_extra}
    return subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_addition_demo_tiny(tmp_path):
    out = tmp_path / "run"
    proc = _run(["--output_dir", str(out), "--max_steps", "3", "--reg_warmup_steps", "1", "--batch_size", "8",
                 "--hidden_size", "16", "--eval_size", "20", "--eval_loops", "1,2", "--log_every", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exact match (%)" in proc.stdout and "stars" in proc.stdout and "baseline" in proc.stdout
    assert "[stars] step 3 lm_loss" in proc.stderr and "jsrr" in proc.stderr  # logged after the warm-up step
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["exact_match"]) == {"stars", "baseline"} and set(metrics["exact_match"]["stars"]) == {"1", "2"}
    assert (out / "accuracy_vs_loops.png").stat().st_size > 0
    config = json.loads((out / "stars" / "config.json").read_text())
    assert config["model_type"] == "ouro" and config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_ouro.")
    # the depth guard's record: STARS samples 1 .. 4 x train_loops loops, the baseline trains with train_loops
    assert config["trained_loops"] == [1, 16]
    assert json.loads((out / "baseline" / "config.json").read_text())["trained_loops"] == [4, 4]
    assert {"modeling_ouro.py", "configuration_ouro.py", "fp_registry.py", "tokenizer.json"} <= set(
        os.listdir(out / "stars"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "stars", trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(out / "stars")
    ids = torch.tensor([tok.convert_tokens_to_ids(list("123+456="))])
    assert model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, total_ut_steps=2).shape == (1, 11)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny 'pretrained' Ouro with a chat tokenizer, and a local jsonl chat dataset."""
    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
    from recipes.stars_ouro import char_tokenizer

    root = tmp_path_factory.mktemp("pretrained")
    tok = char_tokenizer()
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                       max_position_embeddings=512, total_ut_steps=2,
                                       pad_token_id=tok.pad_token_id))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [{"problem": f"What is {a} + {a + 1}?", "solution": f"It is {2 * a + 1}."} for a in range(8)]
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return root


def _finetune_args(root, out):
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--output_dir", str(out),
            "--micro_batch_size", "2", "--gradient_accumulation_steps", "2", "--save_every", "1",
            "--reg_warmup_steps", "0", "--max_seq_length", "160"]


def test_finetune_with_accumulation_and_resume(pretrained, tmp_path):
    out = tmp_path / "ft"
    proc = _run(_finetune_args(pretrained, out), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2 lm_loss" in proc.stderr and "jsrr" in proc.stderr and "loops" in proc.stderr
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2"]  # 8 rows / (2 x 2) per step
    assert json.loads((out / "final" / "config.json").read_text())["trained_loops"] == [1, 16]
    # resume from the first checkpoint: continues at step 2 and finishes the same schedule
    proc = _run(_finetune_args(pretrained, out) + ["--resume_from_checkpoint", str(out / "checkpoints" / "step_1")],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 1" in proc.stdout
    assert "step 2 lm_loss" in proc.stderr and "step 1 lm_loss" not in proc.stderr


def test_addition_demo_two_process_cpu_ddp(tmp_path):
    """Issue 19: the demo stopped at its second step under DDP: the exit gate, unused by the 'last' loss, got no
    gradient. Frozen now, it stays at its initial value in both runs."""
    out = tmp_path / "ddp"
    proc = run_two_processes("stars_ouro", "--output_dir", out, "--max_steps", 3, "--reg_warmup_steps", 1,
                             "--batch_size", 8, "--hidden_size", 16, "--eval_size", 16, "--eval_loops", "1,2",
                             "--log_every", 1, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "processes: 2 (DistributedType.MULTI_CPU)" in proc.stdout
    assert "[stars] step 3 lm_loss" in proc.stderr and "[baseline] step 3 lm_loss" in proc.stderr
    from transformers import AutoModelForCausalLM

    from recipes.stars_ouro import freeze_unused_exit_gate

    for run in ("stars", "baseline"):
        model = AutoModelForCausalLM.from_pretrained(out / run, trust_remote_code=True)
        torch.manual_seed(0)  # train_addition's set_seed(args.seed): the same initial gate
        fresh = freeze_unused_exit_gate(type(model)(model.config))
        assert torch.equal(model.model.early_exit_gate.weight, fresh.model.early_exit_gate.weight)
        assert not torch.equal(model.model.embed_tokens.weight, fresh.model.embed_tokens.weight)


def test_exit_gate_is_frozen_only_when_the_loss_ignores_it():
    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
    from recipes.stars_ouro import freeze_unused_exit_gate

    for exit_loss, trainable in (("last", False), ("expected_logits", True), ("expected_loss", True)):
        config = OuroConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2, exit_loss=exit_loss)
        gate = freeze_unused_exit_gate(OuroForCausalLM(config)).model.early_exit_gate
        assert all(p.requires_grad == trainable for p in gate.parameters())


@pytest.mark.slow
def test_finetune_two_process_cpu_ddp(pretrained, tmp_path):
    out = tmp_path / "ddp"
    proc = run_two_processes("stars_ouro", *_finetune_args(pretrained, out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "processes: 2 (DistributedType.MULTI_CPU)" in proc.stdout
    assert "step 1 lm_loss" in proc.stderr and (out / "final" / "config.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--reg_weight", "1.0"], r"reg_weight=1.0 is out of range"),
    (["--sampler", "gaussian"], "gaussian"),
    (["--runs", "stars,other"], "--runs="),
    (["--model", "x"], "--model and --dataset go together"),
    (["--eval_loops", "0,2"], "--eval_loops"),
    (["--max_steps", "0"], "--max_steps must be >= 1"),
    (["--exit_loss", "mean"], "--exit_loss='mean': allowed values are expected_logits, expected_loss, last"),
    (["--entropy_weight", "-1"], "--entropy_weight must be >= 0"),
    (["--gate_stage", "3"], "--gate_stage=3: allowed values are 1"),
    (["--gate_from", "x"], "--gate_from needs --gate_stage 2"),
    (["--gate_stage", "2", "--model", "x", "--dataset", "y"], "--gate_stage 2 runs in the addition demo"),
    (["--gate_stage", "2", "--gate_from", "x"], "--gate_from takes one --runs name"),
    (["--gate_stage", "2", "--gate_steps", "0"], "--gate_steps must be >= 1"),
    (["--gate_stage", "2", "--gate_loops", "1"], "--gate_loops must be >= 2"),
    (["--gate_stage", "2", "--gate_k", "0"], "--gate_k must be > 0"),
    (["--gate_stage", "2", "--gate_lr", "-1"], "--gate_lr must be > 0"),
    (["--gate_stage", "2", "--gate_gamma", "-0.1"], "--gate_gamma must be >= 0"),
])
def test_bad_flags(flags, message):
    from recipes.stars_ouro import main

    with pytest.raises(ValueError, match=message.replace("+", r"\+").replace(".", r"\.")):
        main(flags)


def test_unknown_flag_is_an_error(tmp_path):
    proc = _run(["--max_stpes", "2"], tmp_path, timeout=300)
    assert proc.returncode != 0 and "max_stpes" in proc.stderr


def test_finetune_killed_in_a_later_epoch_and_resumed_ends_with_the_uninterrupted_weights(pretrained, tmp_path):
    """Issue 21: fp32, two epochs of two steps; killed saving step 4 (the last) and then in the export, the run resumes
    inside the second epoch (its shuffle is a function of (seed, epoch)) and ends bitwise where the uninterrupted one
    did."""
    from accelerate.state import AcceleratorState

    from recipes import stars_ouro
    from tests.helpers import assert_survives_kills, kill_during_save, kill_in

    def run(out, *extra):
        AcceleratorState._reset_state(True)
        stars_ouro.main([str(a) for a in [*_finetune_args(pretrained, out), "--epochs", 2, "--bf16", "False",
                                          "--finetune_lr", 1e-2, *extra]])

    assert_survives_kills(run, tmp_path, [lambda mp: kill_during_save(mp, 4),
                                          lambda mp: kill_in(mp, stars_ouro, "staged_folder")],
                          torn="checkpoints/step_4", weights="final/model.safetensors")


def test_stage_two_trains_the_gate_alone_on_a_saved_model(tmp_path):
    """--gate_stage 2 --gate_from DIR: the LM weights are those of DIR, the gate moved, and its BCE fell."""
    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
    from recipes.stars_ouro import char_tokenizer, main

    tok = char_tokenizer()
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                       total_ut_steps=2, initializer_range=0.2, pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path / "lm")
    out = tmp_path / "out"
    logs = []
    import logging

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    handler = Keep()
    logging.getLogger("recipes.stars_ouro").addHandler(handler)
    logging.getLogger("recipes.stars_ouro").setLevel(logging.INFO)
    try:
        main(["--gate_stage", "2", "--gate_from", str(tmp_path / "lm"), "--runs", "stars", "--output_dir", str(out),
              "--gate_steps", "40", "--gate_lr", "0.05", "--gate_loops", "4", "--batch_size", "16", "--eval_size",
              "8", "--eval_loops", "2", "--log_every", "1"])
    finally:
        logging.getLogger("recipes.stars_ouro").removeHandler(handler)
    bce = [float(m.split("gate_bce ")[1].split()[0]) for m in logs if "stage II] step" in m]
    assert len(bce) == 40 and sum(bce[-5:]) < sum(bce[:5])
    trained = OuroForCausalLM.from_pretrained(out / "stars")
    before, after = model.state_dict(), trained.state_dict()
    for name, value in before.items():
        same = torch.equal(value, after[name])
        assert same != name.startswith("model.early_exit_gate."), name
