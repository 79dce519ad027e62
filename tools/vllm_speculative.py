"""Ouro's self-speculative decoding through vLLM's own draft-model speculation: the export drafts at ``d`` loops
(a second folder: the export's files, its config with ``total_ut_steps=d``) and verifies at ``K`` loops; the tokens
side by side with vLLM without speculation and with transformers' greedy search, and the time of each.

    python tools/vllm_check.py --venv .venv-vllm                          # once: vLLM's environment with the package
    .venv-vllm/bin/python -m tools.vllm_speculative runs/stars_ouro        # stars/ at 12 loops, drafts at 2 and 4
    .venv-vllm/bin/python -m tools.vllm_speculative runs/stars_ouro --loops 16 --draft_loops 1,3 \\
        --num_speculative_tokens 4 --eval_size 200 --single 50 --json vllm_speculative.json

The problems are the addition recipe's held-out ones (``tools/vllm_addition.problems``; ``--eval_size`` and
``--digits`` default to the run's ``metrics.json``), greedy, at most ``digits + 2`` new tokens. One engine per setting
(float32, eager, ``hf_overrides={"total_ut_steps": K}``; with ``speculative_config={"method": "draft_model", "model":
<draft folder>, "num_speculative_tokens": n}``); each first decodes the problems once (warm-up), then is timed on all
of them in one ``generate`` call (batch) and on the first ``--single`` one at a time (latency), ``--repeat`` times (the
best time counts). ``same`` is the share of problems whose tokens equal the reference's (vLLM without speculation;
transformers' ``generate`` at ``K`` loops); ``accepted`` the share of drafted tokens the target kept (vLLM's
``spec_decode`` counters). vLLM starts worker processes, so this runs as a script; ``VLLM_CPU_KVCACHE_SPACE`` defaults
to 1 (GiB).
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from tools.vllm_addition import parse_problems, problems, until_end


def draft_folder(folder, loops, into) -> str:
    """A folder that serves ``folder``'s export at ``loops`` loops: links to its files, its config with
    ``total_ut_steps=loops`` (vLLM hands a speculative draft no ``hf_overrides`` of its own)."""
    draft = Path(into) / f"draft_{loops}"
    draft.mkdir(parents=True)
    for path in Path(folder).resolve().iterdir():
        if path.name != "config.json":
            (draft / path.name).symlink_to(path)
    config = json.loads((Path(folder) / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "total_ut_steps": loops}, indent=2))
    return str(draft)


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters (drafted and accepted tokens) so far."""
    names = {"vllm:spec_decode_num_draft_tokens": "drafted", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    found = {"drafted": 0, "accepted": 0}
    for metric in llm.get_metrics():
        if metric.name in names:
            found[names[metric.name]] += metric.value
    return found


def served(folder, loops, draft, spec_tokens, prompts, max_tokens, single, repeat):
    """One engine at ``loops`` loops (drafting from the ``draft`` folder, or without speculation if None): its
    tokens, the batch's and the one-at-a-time wall times (the best of ``repeat``), and its counters over the timed
    runs."""
    from vllm import LLM, SamplingParams

    kwargs = {}
    if draft is not None:
        kwargs["speculative_config"] = {"method": "draft_model", "model": draft,
                                        "num_speculative_tokens": spec_tokens}
    llm = LLM(folder, dtype="float32", enforce_eager=True, trust_remote_code=True, skip_tokenizer_init=True,
              max_model_len=len(prompts[0]) + max_tokens + spec_tokens + 8, seed=0, disable_log_stats=False,
              hf_overrides={"total_ut_steps": loops}, **kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    before = counters(llm)
    batch_s, single_s = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
        batch_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for request in requests[:single]:
            llm.generate([request], params, use_tqdm=False)
        single_s.append(time.perf_counter() - start)
    after = counters(llm)
    del llm  # shuts the engine down before the next one starts
    gc.collect()
    return {"tokens": outputs, "batch_s": min(batch_s), "single_s": min(single_s),
            **{key: after[key] - before[key] for key in after}}


def transformers_tokens(folder, loops, prompts, max_tokens):
    """transformers' greedy tokens (to the end token) at ``loops`` loops."""
    from hf_fixedpoint.modeling import OuroForCausalLM

    model = OuroForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                             total_ut_steps=loops)[:, x.shape[1]:]
    return [until_end(row, model.config.eos_token_id) for row in out.tolist()]


def compare(folder, loops, draft_loops, spec_tokens, eval_size, digits, single, repeat):
    """Per setting (``"none"``, then each draft depth): the share of problems matching each reference, tokens/s of
    the batch and of the one-at-a-time runs, and the accepted share of the drafted tokens."""
    prompts, answers, _ = problems(eval_size, digits)
    max_tokens, single = digits + 2, min(single, len(prompts))
    reference = transformers_tokens(folder, loops, prompts, max_tokens)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for d in [None, *draft_loops]:
            draft = None if d is None else draft_folder(folder, d, tmp)
            results["none" if d is None else str(d)] = served(folder, loops, draft, spec_tokens, prompts,
                                                              max_tokens, single, repeat)
    plain = results["none"]["tokens"]
    n = len(prompts)
    rows = {}
    for name, run in results.items():
        generated = sum(len(t) for t in run["tokens"])
        one_by_one = sum(len(t) for t in run["tokens"][:single])
        rows[name] = {"same_as_vllm": sum(a == b for a, b in zip(run["tokens"], plain)) / n,
                      "same_as_transformers": sum(a == b for a, b in zip(run["tokens"], reference)) / n,
                      "exact": sum(a == b for a, b in zip(run["tokens"], answers)) / n,
                      "batch_tokens_per_s": generated / run["batch_s"],
                      "single_tokens_per_s": one_by_one / run["single_s"] if single else None,
                      "accepted": run["accepted"] / run["drafted"] if run["drafted"] else None,
                      "drafted": run["drafted"]}
    return rows


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="the addition recipe's --output_dir (holds the run folder, metrics.json)")
    parser.add_argument("--run", default="stars", help="the model folder in output_dir")
    parser.add_argument("--loops", type=int, default=12, help="the target's loop count K")
    parser.add_argument("--draft_loops", default="2,4", help="comma-separated draft loop counts d")
    parser.add_argument("--num_speculative_tokens", type=int, default=4, help="drafted tokens per step")
    parser.add_argument("--single", type=int, default=100, help="problems also timed one request at a time")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per engine (the best counts)")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parse_problems(parser, argv, ("draft_loops",))


def main(argv=None):
    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = compare(os.path.join(args.output_dir, args.run), args.loops, args.draft_loops,
                   args.num_speculative_tokens, args.eval_size, args.digits, args.single, args.repeat)
    print(f"{args.run} at {args.loops} loops, {args.eval_size} {args.digits}-digit additions, greedy, "
          f"{args.num_speculative_tokens} drafted tokens per step")
    print(f"{'draft':>6s}{'same/vLLM':>11s}{'same/HF':>9s}{'exact':>7s}{'accepted':>10s}{'batch tok/s':>13s}"
          f"{'single tok/s':>14s}")
    for name, row in rows.items():
        accepted = "-" if row["accepted"] is None else f"{100 * row['accepted']:.1f}"
        single = "-" if row["single_tokens_per_s"] is None else f"{row['single_tokens_per_s']:.1f}"
        print(f"{name:>6s}{100 * row['same_as_vllm']:11.1f}{100 * row['same_as_transformers']:9.1f}"
              f"{100 * row['exact']:7.1f}{accepted:>10s}{row['batch_tokens_per_s']:13.1f}{single:>14s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
