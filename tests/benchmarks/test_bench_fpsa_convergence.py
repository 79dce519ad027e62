"""FPSA convergence benchmark: a smoke run of every task, and its profile counted the way FPSAStats counts."""

import json

import pytest
import torch

from benchmarks.bench_fpsa_convergence import main, meets_target, parse_set, profile
from hf_fixedpoint.modeling import FPSABertConfig, FPSABertForSequenceClassification
from tests.helpers import train_bpe_tokenizer


def test_rid_and_vit_smoke_with_knobs(tmp_path, capsys):
    out_file = tmp_path / "r.json"
    results = main(["--tasks", "rid", "vit", "--rid_steps", "3", "--rid_max_distractors", "4", "--vit_epochs", "0.1",
                    "--set", "fpsa_jac_weight=2.5", "--set", "fp_max_iter=5", "--json", str(out_file)])
    rid, vit = results["rid/seed0"], results["vit/seed0"]
    assert set(rid) == {"TF-1L", "FPSA-1L"}
    assert set(vit) == {"ViT", "FPSA-ViT", "ViT (matched time)", "ViT (matched FLOPs)"}
    # the iterations, their backward and the Jacobian penalty cost FLOPs that one plain step does not have
    assert 1.2 < vit["FPSA-ViT"]["step_flops_ratio"] < 20
    assert vit["ViT (matched FLOPs)"]["steps"] == int(2 * vit["FPSA-ViT"]["step_flops_ratio"])  # 0.1 epoch: 2 steps
    for row, unit in ((rid["FPSA-1L"], "state"), (vit["FPSA-ViT"], "head")):  # RID's default: the state rule
        assert 1 <= row["median"] <= row["p90"] <= row["p99"] <= 100 and 0 <= row["cap_hit"] <= 1
        assert row["unit"] == unit and set(row["by_unit"]) == {"head", "token", "state"}
        assert row["by_unit"][unit]["median"] == row["median"]
    assert set(rid["FPSA-1L"]["by_K"]) == {0, 1, 2, 4}
    saved = json.loads(out_file.read_text())
    assert saved["knobs"] == {"fpsa_jac_weight": 2.5, "fp_max_iter": 5}
    assert "| rid/seed0 | FPSA-1L |" in capsys.readouterr().out


def test_train_step_flops_counts_the_attention_and_the_iterations():
    import warnings

    from benchmarks.bench_fpsa_convergence import train_step_flops
    from hf_fixedpoint.modeling.fpsa_vit import FPSAViTConfig, FPSAViTForImageClassification

    def model(**kw):
        torch.manual_seed(0)
        return FPSAViTForImageClassification(FPSAViTConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=3,
            image_size=4, patch_size=2, num_channels=1, **kw))

    batch = {"pixel_values": torch.randn(2, 1, 4, 4), "labels": torch.tensor([0, 2])}
    # Batch 2, T = 5 tokens (4 patches and CLS), width 16, 2 heads of 8. Forward: patch convolution 2*2*16*4*4,
    # Q/K/V and W_O 4 * 2*2*5*16*16, scores and values 2 * 2*2*2*5*5*8, MLP 2 * 2*2*5*16*32, classifier 2*2*16*3.
    # Backward: twice the forward, but only the convolution's weight gradient is taken (pixels need none).
    conv, proj, attn, mlp, head = 1024, 2 * 2 * 5 * 16 * 16, 2 * 2 * 2 * 2 * 5 * 5 * 8, 20480, 192
    forward = conv + 4 * proj + attn + mlp + head
    assert train_step_flops(model(fp_max_iter=1), batch) == 2 * conv + 3 * (forward - conv) == 135104
    # Three more iterations: each recomputes W_O, Q, K and the attention, forward alone.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the adjoint stops at its cap before 1e-12
        iterated = train_step_flops(model(fp_max_iter=4, fp_tol=1e-12, fpsa_jac_weight=0.0), batch)
    assert iterated > 135104 + 3 * (3 * proj + attn)


def test_glue_profile_of_an_export(tmp_path):
    sentences = ["a fine film .", "a dull , long film that goes on .", "great !", "bad acting and a bad plot ."]
    tok = train_bpe_tokenizer(sentences * 4, vocab_size=60)
    torch.manual_seed(0)
    model = FPSABertForSequenceClassification(FPSABertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        num_labels=2, pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path / "export")
    tok.save_pretrained(tmp_path / "export")
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"sentence": s, "label": i % 2}) + "\n" for i, s in enumerate(sentences)))
    results = main(["--tasks", "glue", "--seeds", "0", "1", "--checkpoint", str(tmp_path / "export"),
                    "--glue_file", str(data)])
    assert list(results) == ["glue/seed0"]
    row = results["glue/seed0"]["FPSA-BERT (MiniLM, SST-2)"]
    lengths = sorted(row["by_length"])
    assert len(lengths) >= 2 and all(v >= 1 for v in row["by_length"].values())


def test_profile_counts_and_target():
    torch.manual_seed(0)
    model = FPSABertForSequenceClassification(FPSABertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                             num_attention_heads=2, intermediate_size=16))
    batch = {"input_ids": torch.randint(0, 20, (3, 6)), "labels": torch.tensor([0, 1, 0])}
    row = profile(model, [batch], lambda out, y: (int((out.logits.argmax(-1) == y).sum()), y.numel()))
    with torch.no_grad():
        stats = model.eval()(input_ids=batch["input_ids"],
                             fp_overrides={"fp_tol": 1e-4, "fp_max_iter": 100, "fp_eval_max_iter": None}).fp_stats
    assert row["median"] == stats.median and row["cap_hit"] == stats.cap_hit_rate
    assert meets_target({"median": 6, "p90": 10, "cap_hit": 0.01})
    assert not meets_target({"median": 6, "p90": 11, "cap_hit": 0.0})
    assert parse_set(["a=1", "b=x", 'c={"d": 0.5}']) == {"a": 1, "b": "x", "c": {"d": 0.5}}


def _fake_cifar_task(path, n=30):
    """A task.json laid out like BIG-bench's cifar10_classification/base64 (base64 PNG + target_scores)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    rng = np.random.default_rng(0)
    examples = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
        scores = {name: int(j == i % 10) for j, name in enumerate(names)}
        examples.append({"input": base64.b64encode(buf.getvalue()).decode() + "\n", "target_scores": scores})
    path.write_text(json.dumps({"examples": examples}))
    return names


def test_cifar_loader_and_smoke(tmp_path):
    import pytest

    from benchmarks.bench_fpsa_convergence import load_cifar10_test_images

    task = tmp_path / "task.json"
    names = _fake_cifar_task(task)
    (x_train, y_train), (x_test, y_test) = load_cifar10_test_images(task, 10, 0)
    assert x_train.shape == (20, 3, 32, 32) and x_test.shape == (10, 3, 32, 32)
    assert sorted(torch.cat([y_train, y_test]).tolist()) == sorted(i % 10 for i in range(30))  # labels by class name
    assert names == sorted(names)
    x = torch.cat([x_train, x_test])
    torch.testing.assert_close(x.mean((0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)  # normalised per channel
    results = main(["--tasks", "cifar", "--cifar_json", str(task), "--cifar_test", "10", "--cifar_epochs", "1",
                    "--set", "fp_max_iter=3"])
    rows = results["cifar/seed0"]
    assert set(rows) == {"ViT", "FPSA-ViT", "ViT (matched time)", "ViT (matched FLOPs)"}
    assert 1 <= rows["FPSA-ViT"]["median"] <= 100
    with pytest.raises(ValueError, match="--cifar_json"):
        main(["--tasks", "cifar"])


def test_vit_profile_of_a_recipe_export_fed_with_its_channels(tmp_path):
    from hf_fixedpoint.modeling import FPSAViTConfig, FPSAViTForImageClassification

    torch.manual_seed(0)
    FPSAViTForImageClassification(FPSAViTConfig(image_size=8, patch_size=2, num_channels=3, hidden_size=16,
                                                num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                                num_labels=10)).save_pretrained(tmp_path / "vit")
    row = main(["--tasks", "vit", "--checkpoint", str(tmp_path / "vit")])["vit/seed0"]["FPSA-ViT (recipe export)"]
    assert 1 <= row["median"] <= row["p90"] <= 100 and 0.0 <= row["accuracy"] <= 1.0


def test_device_flag_is_checked_before_any_work():
    with pytest.raises(ValueError, match="--device 'tpu' is not a torch device"):
        main(["--tasks", "vit", "--device", "tpu"])
    with pytest.raises(ValueError, match="--device 'meta': this benchmark runs on cpu or cuda"):
        main(["--tasks", "vit", "--device", "meta"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device here"):
            main(["--tasks", "vit", "--device", "cuda"])


def test_inference_settings_table(capsys):
    rows = main(["--tasks", "vit", "--vit_epochs", "0.1", "--inference"])["vit/seed0"]
    inf = rows["FPSA-ViT"]["inference"]
    assert list(inf) == ["trained", "fp_stop_fraction=0.1", "fp_stop_fraction=0.2", "fp_max_iter=4", "fp_max_iter=1"]
    assert inf["trained"]["time_ratio"] == 1.0 and inf["fp_max_iter=1"]["mean"] == 1.0
    assert inf["trained"]["accuracy"] == rows["FPSA-ViT"]["accuracy_trained_cap"]
    assert inf["fp_max_iter=1"]["accuracy"] == rows["FPSA-ViT"]["accuracy_one_step"]
    assert all(1.0 <= v["mean"] <= 16 and 0.0 <= v["converged"] <= 1.0 and v["time_ratio"] > 0 for v in inf.values())
    assert "| vit/seed0 | FPSA-ViT | fp_stop_fraction=0.1 |" in capsys.readouterr().out
