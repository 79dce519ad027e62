"""Scale-out (issue 17): STARS fine-tuning steps (LM loss + JSRR) on FSDP2-sharded parameters, 2 CPU processes
(gloo), against one process with the same global batch; SELF + LoRA with the FPSA Jacobian penalty on FSDP2 against
DDP; the recipe's refusal of the JSRR products that cannot run under FSDP.

accelerate puts FSDP on accelerators only (on CPU, ``accelerate launch --use_fsdp`` runs as plain multi-CPU DDP), so
the sharded run applies FSDP2's ``fully_shard`` itself, as accelerate's FSDP2 plugin does on GPUs
(``tests/recipes/fsdp_stars_worker.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("fsdp_stars_worker.py"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _run(mode, out, *flags, processes=2):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                 "--standalone"] if mode != "single" else [sys.executable])
    proc = subprocess.run([*launcher, WORKER, mode, str(out), *flags], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_equivalent(a, b):
    assert len(a["steps"]) == len(b["steps"])
    for x, y in zip(a["steps"], b["steps"]):
        assert x["lm_loss"] == pytest.approx(y["lm_loss"], rel=1e-6)
        assert x["jsrr"] == pytest.approx(y["jsrr"], rel=1e-6)
    assert a["weights_abs_sum"] == pytest.approx(b["weights_abs_sum"], rel=1e-9)


def test_stars_steps_on_fsdp_shards_equal_one_process(tmp_path):
    sharded = _run("fsdp", tmp_path / "fsdp.json")
    single = _run("single", tmp_path / "single.json")
    assert sharded["sharded"] and sharded["world"] == 2 and not single["sharded"]
    assert all(s["jsrr"] > 0 for s in sharded["steps"])  # the regularizer ran on the sharded parameters
    _assert_equivalent(sharded, single)


@pytest.mark.slow
def test_fsdp_equals_ddp_and_plain_lm_steps_equal_one_process(tmp_path):
    _assert_equivalent(_run("fsdp", tmp_path / "fsdp.json", "--steps", "5"),
                       _run("ddp", tmp_path / "ddp.json", "--steps", "5"))
    _assert_equivalent(_run("fsdp", tmp_path / "fsdp0.json", "--reg_weight", "0"),
                       _run("single", tmp_path / "single0.json", "--reg_weight", "0"))


@pytest.mark.slow
def test_self_lora_fpsa_penalty_on_fsdp_shards_equals_ddp(tmp_path):
    # FSDP2 rebuilds the dataclasses in a sharded layer's inputs to hook their tensors: before the layers got an
    # FPSAStatsSink instead of the FPSAStats itself, the second layer recorded its penalty into a copy (one penalty of
    # two per rank reached the loss).
    _assert_equivalent(_run("fsdp", tmp_path / "fsdp.json", "--family", "self_lora"),
                       _run("ddp", tmp_path / "ddp.json", "--family", "self_lora"))


@pytest.mark.parametrize("product", ["vjp", "double_backward"])
def test_stars_recipe_refuses_reverse_mode_jsrr_under_fsdp(product):
    from recipes.stars_ouro import Args, check_engine

    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP)
    with pytest.raises(ValueError, match="--reg_product jvp"):
        check_engine(Args(reg_product=product), fsdp)
    check_engine(Args(reg_product="jvp"), fsdp)
    check_engine(Args(reg_product=product, reg_weight=0.0), fsdp)  # no JSRR: nothing to refuse
    check_engine(Args(reg_product=product), SimpleNamespace(distributed_type=DistributedType.MULTI_GPU))


@pytest.mark.parametrize("release, reshard, refused", [("2.11.0+cu130", True, True), ("2.11.0", False, False),
                                                       ("2.13.0+cpu", True, False)])
def test_stars_recipe_refuses_jvp_jsrr_on_resharded_fsdp_before_torch_2_13(monkeypatch, release, reshard, refused):
    # torch 2.11 crashes in the backward of a jvp through parameters FSDP2 resharded after the forward (Makefile,
    # LOWEST_OPEN): the recipe says so at the start instead.
    from recipes.stars_ouro import Args, check_engine

    monkeypatch.setattr(torch, "__version__", release)
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP,
                           state=SimpleNamespace(fsdp_plugin=SimpleNamespace(reshard_after_forward=reshard)))
    if refused:
        with pytest.raises(ValueError, match="fsdp_reshard_after_forward: false"):
            check_engine(Args(reg_product="jvp"), fsdp)
    else:
        check_engine(Args(reg_product="jvp"), fsdp)


@pytest.mark.parametrize("name, engine", [("fsdp", DistributedType.FSDP),
                                          ("deepspeed_zero2", DistributedType.DEEPSPEED),
                                          ("deepspeed_zero3", DistributedType.DEEPSPEED)])
def test_launch_configs_load(name, engine):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "recipes" / "configs" / f"{name}.yaml"))
    assert config.distributed_type == engine and not config.use_cpu
    assert config.fsdp_config.get("fsdp_version") == 2 if engine == DistributedType.FSDP else (
        config.deepspeed_config["zero_stage"] == int(name[-1]))
