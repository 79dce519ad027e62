"""Ouro served by vLLM (the package's plugin): generated tokens per second against transformers' ``generate`` and
against a vLLM Llama of the same width with ``layers x loops`` layers (the same decoder-layer applications per token).

    python tools/vllm_check.py --venv .venv-vllm   # once: vLLM's environment with the package
    .venv-vllm/bin/python -m benchmarks.bench_vllm  # ~10 min on 2 shared cores
    .venv-vllm/bin/python -m benchmarks.bench_vllm --prompts 16 --new_tokens 16 --repeats 1   # quicker

Tiny random models (float32, head dim 64: vLLM's CPU attention takes 32, 64, 80, ...): Ouro with ``--layers`` layers
and ``--loops`` loops, Llama with ``layers * loops`` layers, same width and MLP. Both engines live in this process side
by side with transformers' model; the three are timed in turns, ``--repeats`` rounds, fastest round each, on the same
``--prompts`` prompts of ``--prompt_len`` random tokens, greedy, ``--new_tokens`` new tokens each (no end token).
vLLM runs with ``enforce_eager=True`` (on a CPU its compiled mode adds start-up time, not speed at this size). Ouro
keeps its default exit rule (threshold 1.0, evaluated after every loop as transformers does); ``--no_exit_rule``
decodes the last loop without it.
"""

import argparse
import os
import tempfile
import time

import torch


def build(folder, args):
    """Save the Ouro and the Llama of the comparison; return their paths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM

    shape = dict(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                 max_position_embeddings=1024, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    threshold = None if args.no_exit_rule else 1.0  # 1.0: Ouro's default Q-exit rule, evaluated after every loop
    ouro = OuroForCausalLM(OuroConfig(num_hidden_layers=args.layers, total_ut_steps=args.loops,
                                      early_exit_threshold=threshold, **shape))
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=args.layers * args.loops, **shape))
    paths = {}
    for name, model in (("ouro", ouro), ("llama", llama)):
        paths[name] = os.path.join(folder, name)
        model.save_pretrained(paths[name])
    return paths


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--loops", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no_exit_rule", action="store_true", help="early_exit_threshold=None: the last loop")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    folder = tempfile.mkdtemp(prefix="bench_vllm_")
    paths = build(folder, args)
    engines = {name: LLM(path, dtype="float32", enforce_eager=True, trust_remote_code=True, skip_tokenizer_init=True,
                         max_model_len=args.prompt_len + args.new_tokens + 8, seed=0)
               for name, path in paths.items()}
    hf = AutoModelForCausalLM.from_pretrained(paths["ouro"], trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(1))
    prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    runs = {name: (lambda e=engine: e.generate(prompts, params, use_tqdm=False)) for name, engine in engines.items()}
    runs["transformers"] = lambda: hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False,
                                               attention_mask=torch.ones_like(ids))
    for run in runs.values():  # warm-up
        run()
    best = {name: min(timed(run) for _ in range(1)) for name, run in runs.items()}
    for _ in range(args.repeats - 1):
        for name, run in runs.items():
            best[name] = min(best[name], timed(run))
    tokens = args.prompts * args.new_tokens
    rate = {name: tokens / seconds for name, seconds in best.items()}
    print(f"{args.prompts} prompts x {args.new_tokens} new tokens, hidden {args.hidden}, Ouro {args.layers} layers x "
          f"{args.loops} loops, Llama {args.layers * args.loops} layers; fastest of {args.repeats} rounds")
    for name in ("ouro", "llama", "transformers"):
        label = {"ouro": "Ouro, vLLM (plugin)", "llama": "Llama, vLLM", "transformers": "Ouro, transformers generate"}
        print(f"  {label[name]:<30} {rate[name]:9.1f} tokens/s  ({best[name]:.2f} s)")
    print(f"  Ouro / Llama (vLLM): {rate['ouro'] / rate['llama']:.2f}x;  "
          f"Ouro vLLM / transformers: {rate['ouro'] / rate['transformers']:.2f}x")


if __name__ == "__main__":
    main()
