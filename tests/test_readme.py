"""The README's and the guides' (``docs/*.md``) Python examples run as written.

The blocks show what a user writes and prints; what their results must satisfy is checked here (``CHECKS``), on the
variables each block leaves behind. A block that loads the model ``make demo`` saves runs on that model when it
exists, and otherwise on a tiny untrained model of the same kind saved in its place.
"""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (doc.relative_to(ROOT).as_posix(), i, code)
    for doc in DOCS
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL))
]
DEMO_MODEL = "runs/stars_ouro/stars"  # what `make demo` saves


def _tiny_demo_model(folder: Path) -> str:
    """A tiny untrained Ouro with the demo's character tokenizer, saved as the demo saves its model."""
    from hf_fixedpoint.modeling import OuroConfig, OuroForCausalLM
    from recipes.stars_ouro import char_tokenizer

    tokenizer = char_tokenizer()
    config = OuroConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, total_ut_steps=4, trained_loops=[1, 16],
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    OuroForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _check_quick_start(ns):
    prompt_len = ns["prompt"].input_ids.shape[1]
    assert prompt_len == len("321+654=")  # one token a character, no special tokens added
    assert 1 <= ns["out"].shape[1] - prompt_len <= 4
    if (ROOT / DEMO_MODEL).is_dir():  # the trained demo model: the README's printed answer, at 4 and at 16 loops
        for loops in (4, 16):
            out = ns["model"].generate(**ns["prompt"], max_new_tokens=4, do_sample=False, total_ut_steps=loops)
            assert ns["tokenizer"].decode(out[0, prompt_len:]) == "9750"


def _check_deq_knobs(ns):
    assert ns["model"](ns["ids"], fp_max_iter=1).fp_stats.nfe == 1
    assert ns["more_compute"].config.fp_eval_max_iter == 60
    assert ns["text"].shape[0] == 2 and 3 < ns["text"].shape[1] <= 8


def _check_lm_eval_models(ns):
    assert ns["stock"].model.config.total_ut_steps == 2  # written into the config at load time
    assert ns["ours"].forward_kwargs == {"total_ut_steps": 2}  # passed to every forward / generate call
    assert ns["ours"].model.config.total_ut_steps == 4


# doc -> [(a string that identifies the block, a check: a function of the variables the block leaves, or an
# expression evaluated among them)]
CHECKS = {
    "README.md": [("total_ut_steps=loops", _check_quick_start)],
    "docs/index.md": [("fp_eval_max_iter=60", _check_deq_knobs),
                      ('get_model("hf-fixedpoint")', _check_lm_eval_models),
                      ("hub.export(model, d, model_card=card)", "'deq_lm' in card.data.tags"),
                      ("hub.export(model, d, model_card=card)", "card.data.datasets == ['wikitext']")],
    "docs/attractor_lm.md": [
        ('print(t0.fp_stats, capped.fp_stats.nfe)',
         't0.fp_stats is None and capped.fp_stats.nfe <= 2'),
        ('print(model.config.fp_max_iter)',
         'model.config.fp_max_iter == 12'),
    ],
    "docs/fpsa.md": [
        ('print(more.fp_stats.nfe, model.config.fp_max_iter)',
         'more.fp_stats.nfe <= 32 and model.config.fp_max_iter == 8'),
        ('print(torch.equal(fpsa(ids).logits, bert(ids).logits))',
         'torch.equal(fpsa(ids).logits, bert(ids).logits)'),
    ],
    "docs/fpsa_recipes.md": [
        ('print(result["exact"], result["HasAns_total"], result["NoAns',
         'result["exact"] == 100.0 and result["HasAns_total"] == 1 and result["NoAns_total"] == 1'),
        ('print(ids[0, where + 1] == value, ids.shape)',
         'ids[0, where + 1] == value and ids.shape == (2, 5 + 3)'),
    ],
    "docs/ouro_stars.md": [
        ('print(out.exit_pdf.sum(-1))',
         'torch.allclose(out.exit_pdf.sum(-1), torch.ones(2, 6))'),
        ('print(len(model(ids, total_ut_steps=5).loop_hidden_states))',
         'len(model(ids, total_ut_steps=5).loop_hidden_states) == 5'),
        ('print(torch.equal(cached, model.generate(ids, use_cache=Fals',
         'torch.equal(cached, model.generate(ids, use_cache=False, **kw))'),
        ('print(est.sqrt().item())',
         'abs(est.sqrt().item() - 0.9) < 1e-6'),
        ('compute_sweep(model, settings',
         'rows[0]["mean_loops"] == 3.0 and 1.0 <= rows[1]["mean_loops"] <= 3.0'),
    ],
    "docs/puzzles.md": [
        ('print(easy.count(0))',
         'easy.count(0) == 20'),
        ('print(count, solved == solution, backtracks == difficulty)',
         'count == 1 and solved == solution and backtracks == difficulty'),
        ('print((t.inverse().apply(t.apply(puzzle)) == np.array(puzzle',
         '(t.inverse().apply(t.apply(puzzle)) == np.array(puzzle)).all()'),
        ('print(back["inputs"] == ds["inputs"] and back["labels"] == d',
         'back["inputs"] == ds["inputs"] and back["labels"] == ds["labels"]'),
    ],
    "docs/recipes.md": [
        ('print(args.seed, args.to_dict()["hub_token"])',
         'isinstance(args, RecipeArgs) and args.seed == 0 and args.to_dict()["hub_token"] == "<HUB_TOKEN>"'),
    ],
    "docs/self_llama.md": [
        ('print(torch.equal(model(ids, attention_mask=mask).logits, ll',
         'torch.equal(model(ids, attention_mask=mask).logits, llama(ids, attention_mask=mask).logits)'),
        ('print([s.iterations.shape[2] for s in log])',
         'all(s.iterations.shape[2] == 1 for s in log[1:])'),
        ('print(torch.equal(spec.sequences, plain), spec.draft_tok',
         'torch.equal(spec.sequences, plain) and int(spec.accepted_draft_tokens.sum()) > 0'),
    ],
    "docs/self_lora.md": [
        ('print(final_answer(example["answer"]))',
         'final_answer(example["answer"]) == "4"'),
        ('print(final_answer("26 - 22 = 4, so 4 dollars.", flexible=Tr',
         'final_answer("26 - 22 = 4, so 4 dollars.", flexible=True) == "4"'),
        ('print({r["question"] for r in train} & {r["question"] for r ',
         'not {r["question"] for r in train} & {r["question"] for r in evaluation}'),
    ],
}


def test_readme_has_examples():
    assert sum(name == "README.md" for name, _, _ in BLOCKS) >= 1


def test_every_check_finds_its_block():
    for doc, checks in CHECKS.items():
        for marker, _ in checks:
            assert sum(marker in code for name, _, code in BLOCKS if name == doc) == 1, (doc, marker)


@pytest.mark.parametrize("name,index,code", BLOCKS, ids=[f"{n}[{i}]" for n, i, _ in BLOCKS])
def test_doc_example(name, index, code, tmp_path):
    if DEMO_MODEL in code:
        demo = ROOT / DEMO_MODEL
        code = code.replace(DEMO_MODEL, str(demo) if demo.is_dir() else _tiny_demo_model(tmp_path / "stars"))
    namespace = {}
    exec(compile(code, f"{name}[python block {index}]", "exec"), namespace)
    for marker, check in CHECKS.get(name, []):
        if marker in code:
            if callable(check):
                check(namespace)
            else:
                assert eval(check, namespace), check
