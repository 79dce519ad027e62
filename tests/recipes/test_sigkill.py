"""Real kills (issue 21), every recipe as a user runs it (``python -m recipes.<name>``, tiny settings, a checkpoint
every step): SIGKILL the moment a checkpoint save starts and at random moments, restart with
``--resume_from_checkpoint latest`` until the run finishes; resume from only the last checkpoint; resume past a torn
newest checkpoint. Each final export is compared with the uninterrupted run's (max |difference| over all tensors).

Slow (several minutes: every restart pays the interpreter and import start-up).
``python -m tests.recipes.test_sigkill [recipe ...]`` prints the three cases per recipe.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def inputs(root: Path) -> dict:
    """Local inputs of the recipes that need them: a text corpus, a tiny 'pretrained' Ouro with chat data, a tiny
    LLaMA with a tokenizer for the SELF problems."""
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text(Path(json.__file__).read_text() * 3)
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
    from recipes import self_lora
    from recipes.stars_ouro import char_tokenizer
    from tests.helpers import train_bpe_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    OuroForCausalLM(OuroConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                               total_ut_steps=2, pad_token_id=tok.pad_token_id)).save_pretrained(root / "ouro")
    tok.save_pretrained(root / "ouro")
    rows = [{"problem": f"What is {a} + {a + 1}?", "solution": f"It is {2 * a + 1}."} for a in range(16)]
    (root / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    train, evaluation = self_lora.make_problems(300, 20)
    tok = train_bpe_tokenizer([r["question"] + " " + r["answer"] for r in [*train, *evaluation]], vocab_size=320)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=256,
                                 initializer_range=0.1)).save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    return {"corpus": corpus, "ouro": root / "ouro", "chat": root / "chat.jsonl", "llama": root / "llama"}


def recipes(data: dict) -> dict:
    """name -> (module, flags, exported weight files relative to output_dir, checkpoint roots relative to it)."""
    reasoning_tiny = ["--task", "a5", "--task_kwargs", '{"num_samples": 16, "length": 4}', "--test_task_kwargs",
                      '[{"num_samples": 8, "length": 4}]', "--batch_size", "4", "--eval_batch_size", "8",
                      "--hidden_size", "16", "--num_attention_heads", "2", "--halt_max_steps", "2",
                      "--warmup_steps", "1", "--model_kwargs", '{"H_cycles": 2, "L_cycles": 1, "mlp_multiple_of": 8}']
    return {
        "stars_ouro fine-tune": ("stars_ouro", ["--model", data["ouro"], "--dataset", data["chat"],
                                                "--micro_batch_size", 2, "--gradient_accumulation_steps", 2,
                                                "--epochs", 2, "--save_every", 1, "--reg_warmup_steps", 0,
                                                "--max_seq_length", 160, "--bf16", "False"],
                                 ["final/model.safetensors"], ["checkpoints"]),
        "stars_ouro addition": ("stars_ouro", ["--max_steps", 6, "--reg_warmup_steps", 1, "--batch_size", 8,
                                               "--hidden_size", 16, "--eval_size", 20, "--eval_loops", "1,2",
                                               "--save_every", 1],
                                ["stars/model.safetensors", "baseline/model.safetensors"],
                                ["checkpoints/stars", "checkpoints/baseline"]),
        "attractor_lm": ("attractor_lm", ["--corpus", data["corpus"], "--max_steps", 6, "--save_every", 1,
                                          "--batch_size", 2, "--seq_length", 32, "--hidden_size", 32, "--vocab_size",
                                          300, "--eval_batches", 1, "--log_every", 1, "--fp_max_iter", 4],
                         ["model.safetensors"], ["checkpoints"]),
        "fpsa_vit": ("fpsa_vit", ["--max_steps", 6, "--checkpointing_steps", 1, "--fp_max_iter", 3,
                                  "--per_device_train_batch_size", 512, "--hidden_size", 16, "--num_attention_heads",
                                  2, "--num_hidden_layers", 1], ["model.safetensors"], ["."]),
        "self_lora": ("self_lora", ["--model_name_or_path", data["llama"], "--max_steps", 6, "--checkpointing_steps",
                                    1, "--num_train_problems", 64, "--num_eval_problems", 6,
                                    "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 3,
                                    "--max_new_tokens", 6, "--fp_max_iter", 3, "--eval_fp_max_iter", 2,
                                    "--learning_rate", 3e-2, "--warmup_ratio", 0, "--lora_dropout", 0.1],
                      ["model.safetensors"], ["."]),
        "reasoning": ("reasoning", ["--model", "trm", *reasoning_tiny, "--num_layers", 1, "--max_steps", 7,
                                    "--eval_every", 3, "--save_every", 1], ["model.safetensors"], ["checkpoints"]),
        "train_deq_lm": ("train_deq_lm", ["--max_steps", 6, "--batch_size", 2, "--seq_length", 16,
                                          "--hidden_size", 16, "--fp_max_iter", 4, "--save_every", 1],
                         ["model.safetensors"], ["checkpoints"]),
    }


def command(module, flags, out, *extra):
    return [sys.executable, "-m", f"recipes.{module}", "--output_dir", str(out), *map(str, flags), *map(str, extra)]


def finish(cmd, timeout=600):
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def temp_checkpoints(out: Path) -> list:
    """The checkpoint folders being written under ``out`` (folders vanish while they are listed: no errors)."""
    return [os.path.join(base, d) for base, dirs, _ in os.walk(out) for d in dirs
            if d.startswith(".step_") and d.endswith(".tmp")]


def killed(cmd, out: Path, when, timeout=600) -> bool:
    """Run ``cmd``; SIGKILL it the moment a checkpoint save starts (``when == "save"``), or ``when`` seconds after
    the first save of this run started (a random moment of training). Whether it was killed (False: it finished
    first)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before, t0, first = set(temp_checkpoints(out)), time.time(), None
    while proc.poll() is None and time.time() - t0 < timeout:
        started = set(temp_checkpoints(out)) - before
        first = first or (time.time() if started else None)
        due = started if when == "save" else first is not None and time.time() - first >= when
        if due:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.005)
    proc.wait()
    return False


def max_diff(a: Path, b: Path, files) -> float:
    from safetensors.torch import load_file

    worst = 0.0
    for f in files:
        x, y = load_file(a / f), load_file(b / f)
        assert x.keys() == y.keys()
        worst = max([worst, *((x[k].double() - y[k].double()).abs().max().item() for k in x)])
    return worst


def copy_checkpoints(src: Path, dst: Path, roots):
    """Only the checkpoints of a finished run (what is left when a kill lands between the last save and the
    export)."""
    for root in roots:
        for step in (src / root).glob("step_*"):
            shutil.copytree(step, dst / root / step.name)


def measure(name, spec, work: Path, seed=0) -> dict:
    """The three cases of the issue for one recipe; max |difference| of the final weights to the uninterrupted run."""
    module, flags, files, roots = spec
    ref, run = work / "reference", work / "killed"
    finish(command(module, flags, ref))
    rng, kills = random.Random(seed), 0
    for when in ["save", rng.uniform(0, 1.5), "save", rng.uniform(0, 1.5)]:
        kills += killed(command(module, flags, run, "--resume_from_checkpoint", "latest"), run, when)
    finish(command(module, flags, run, "--resume_from_checkpoint", "latest"))
    result = {"kills": kills, "killed_and_resumed": max_diff(ref, run, files)}

    last = work / "last_only"
    copy_checkpoints(ref, last, roots)
    finish(command(module, flags, last, "--resume_from_checkpoint", "latest"))
    result["resumed_from_last"] = max_diff(ref, last, files)

    torn = work / "torn"
    copy_checkpoints(ref, torn, roots)
    newest = max((torn / roots[-1]).glob("step_*"), key=lambda p: int(p.name[5:]))
    weights = newest / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    named = subprocess.run(command(module, flags, torn, "--resume_from_checkpoint", newest), cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=600)
    result["torn_named_error"] = named.stderr.strip().splitlines()[-1] if named.returncode else "no error"
    proc = finish(command(module, flags, torn, "--resume_from_checkpoint", "latest"))
    result["torn_latest_warned"] = "skipping checkpoint" in proc.stderr + proc.stdout
    result["torn_resumed"] = max_diff(ref, torn, files)
    return result


@pytest.fixture(scope="module")
def recipe_specs(tmp_path_factory):
    return recipes(inputs(tmp_path_factory.mktemp("inputs")))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stars_ouro fine-tune", "stars_ouro addition", "attractor_lm", "fpsa_vit",
                                  "self_lora", "reasoning", "train_deq_lm"])
def test_real_kills(name, recipe_specs, tmp_path):
    result = measure(name, recipe_specs[name], tmp_path)
    assert result["killed_and_resumed"] == 0.0 and result["resumed_from_last"] == 0.0, result
    assert result["torn_resumed"] == 0.0 and result["torn_latest_warned"], result
    assert "ValueError" in result["torn_named_error"] and "model.safetensors" in result["torn_named_error"], result


@pytest.mark.slow
def test_sigterm_saves_and_says_how_to_resume(tmp_path):
    """A real SIGTERM during the addition demo: the current step finishes, a checkpoint is written, the process
    exits with the resume command, and the resumed run ends with the uninterrupted weights."""
    module, flags, files, _ = recipes(dict.fromkeys(["corpus", "ouro", "chat", "llama"], ""))["stars_ouro addition"]
    flags = [*flags[:1], 40, *flags[2:], "--runs", "stars"]  # 40 steps
    files = ["stars/model.safetensors"]
    ref, run = tmp_path / "reference", tmp_path / "run"
    finish(command(module, flags, ref))
    proc = subprocess.Popen(command(module, flags, run), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while not (run / "checkpoints" / "stars" / "step_2").exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "SIGTERM received" in stdout + stderr
    assert "--resume_from_checkpoint latest" in stdout + stderr
    finish(command(module, flags, run, "--resume_from_checkpoint", "latest"))
    assert max_diff(ref, run, files) == 0.0


if __name__ == "__main__":
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="sigkill_"))
    specs = recipes(inputs(work / "inputs"))
    for name in sys.argv[1:] or specs:
        print(name, json.dumps(measure(name, specs[name], work / name.replace(" ", "_"))), flush=True)
