"""STARS fine-tuning steps (LM loss + JSRR, as ``recipes/stars_ouro.py``'s fine-tuning loop) on a tiny Ouro, run by
``tests/recipes/test_fsdp.py`` under ``torchrun`` with 2 CPU processes (gloo) or in one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/recipes/fsdp_stars_worker.py fsdp OUT.json
    python tests/recipes/fsdp_stars_worker.py single OUT.json

``--family self_lora``: SELF-LLaMA with LoRA adapters (PEFT, as ``recipes/self_lora.py``) whose loss holds the FPSA
Jacobian penalty (``fpsa_jac_weight=0.1``), reported in the ``jsrr`` field.

Modes: ``fsdp`` shards every decoder layer and the root with FSDP2's ``fully_shard`` (what accelerate's FSDP2 plugin
applies), ``ddp`` replicates with ``DistributedDataParallel``, ``single`` is one process on the whole global batch,
accumulating over the ranks' micro-batches (the JSRR is estimated per micro-batch, as each rank does). Every mode
trains on the same global batches (rank r takes rows r::world); rank 0 writes the per-step LM loss, JSRR and the
final weights' checksum to OUT.json. ``--reg_weight 0`` gives the plain LM objective. The JSRR uses the forward-mode
product (``jvp``): the reverse-mode ones run a backward pass inside the forward, which fires FSDP2's backward hooks
early (the process crashes in the later backward).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
from hf_fixedpoint.stars import STARSRegularizer

GLOBAL_BATCH, LENGTH, VOCAB = 4, 12, 50


def build(family="ouro"):
    torch.manual_seed(0)
    if family == "self_lora":  # SELF-LLaMA with the FPSA Jacobian penalty, LoRA adapters as recipes/self_lora.py
        from peft import LoraConfig, get_peft_model

        from hf_fixedpoint.modeling import SelfLlamaConfig, SelfLlamaForCausalLM

        config = SelfLlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, fp_max_iter=4, fpsa_jac_weight=0.1)
        model = SelfLlamaForCausalLM(config).double()
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          task_type="CAUSAL_LM", init_lora_weights="gaussian")
        return get_peft_model(model, lora)
    config = OuroConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, total_ut_steps=2,
                        pad_token_id=0)
    return OuroForCausalLM(config).double()


def shard(model, mode):
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        base = model.get_base_model() if hasattr(model, "peft_config") else model
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), model
    return model, model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("fsdp", "ddp", "single"))
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reg_weight", type=float, default=0.1)
    parser.add_argument("--product", default="jvp", help="JSRR product; vjp / double_backward fail under FSDP2")
    parser.add_argument("--family", choices=("ouro", "self_lora"), default="ouro")
    parser.add_argument("--world", type=int, default=2, help="single mode: the ranks it stands in for")
    args = parser.parse_args()
    if args.mode != "single":
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.mode != "single" else (0, 1)
    wrapped, model = shard(build(args.family), args.mode)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    # max_batch=None: the JSRR linearizes at this rank's whole micro-batch.
    stars = STARSRegularizer(reg_weight=args.reg_weight, warmup_steps=0, product=args.product, seed=0)
    g = torch.Generator().manual_seed(1)
    log = []
    # One process stands in for `world` ranks by accumulating over their micro-batches (rank r takes rows r::world);
    # the losses are averaged as DDP / FSDP average the gradients.
    slices = range(rank, rank + 1) if args.mode != "single" else range(args.world)
    world = world if args.mode != "single" else args.world
    for step in range(args.steps):
        ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, LENGTH), generator=g)
        lm = jsrr = 0.0
        for r in slices:
            mine = ids[r::world]
            torch.manual_seed(1000 * step + r)  # the FPSA penalty's probes: the same per micro-batch in every mode
            if args.family == "self_lora":  # the loss holds the FPSA Jacobian penalty; reported as "jsrr"
                out = wrapped(input_ids=mine, labels=mine, use_cache=False)
                loss, reg = out.loss, out.fp_stats.jac_penalty()
            else:
                out = wrapped(input_ids=mine, labels=mine, total_ut_steps=2 + step % 2, use_cache=False)
                loss, reg = stars(model, out, step)
            (loss / len(slices)).backward()
            lm = lm + out.loss.detach() / len(slices)
            jsrr = jsrr + (reg.detach() if reg is not None else torch.zeros((), dtype=torch.float64)) / len(slices)
        optimizer.step()
        optimizer.zero_grad()
        if args.mode != "single":  # the means over the ranks (equal tokens per rank)
            for t in (lm, jsrr):
                dist.all_reduce(t)
                t /= world
        log.append({"lm_loss": lm.item(), "jsrr": jsrr.item()})
    state = model.state_dict()
    if args.mode == "fsdp":  # gather the shards (DTensors) for the checksum
        state = {k: v.full_tensor() for k, v in state.items()}
    checksum = sum(float(v.double().abs().sum()) for v in state.values())
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "steps": log, "weights_abs_sum": checksum,
                       "sharded": args.mode == "fsdp"}, f)
    if args.mode != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
