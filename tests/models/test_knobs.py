"""One knob convention for every family (issue 19 §1): a value is checked wherever it enters -- config
construction, a later ``config.<knob> = value``, ``from_pretrained(dir, <knob>=value)`` (with the package and
through the saved remote code in a process that cannot import hf_fixedpoint), per call on ``forward`` and through
``generate`` -- and a per-call ``fp_max_iter=1`` changes the computation. Ouro has no ``fp_*`` settings: its knob is
``total_ut_steps`` and any ``fp*`` keyword is a typo."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_fixedpoint.modeling import FAMILIES
from tests.helpers import family_tester

NAMES = [config_class.model_type for config_class, _ in FAMILIES]
CAUSAL_LMS = ("attractor_lm", "deq_lm", "ouro", "self_llama", "self_mistral")
BAD_RANGE = r"=0 is out of range; allowed values lie in \[1, inf\)"


def knob(name: str) -> str:
    """The iteration knob of a family."""
    return "total_ut_steps" if name == "ouro" else "fp_max_iter"


def family(name: str):
    """``(tester, model class, Auto class name)``: the family's head (puzzle families: ``*ForPuzzles``)."""
    config_class, models = next((c, m) for c, m in FAMILIES if c.model_type == name)
    tester = family_tester(config_class)
    model_class = getattr(tester, "puzzle_class", None) or tester.model_classes[-1][0]
    auto = next(a.__name__ for a, m in models if m is model_class)
    return tester, model_class, auto


def build(name: str):
    tester, model_class, _ = family(name)
    torch.manual_seed(0)
    model = model_class(tester.get_config()).eval()
    return model, tester.prepare_inputs(model.config)


def solver_steps(out) -> float:
    """Iterations reported in the output: mean solver steps (FPSA: mean iterations per token and head); Ouro: the
    number of loops run."""
    if getattr(out, "loop_hidden_states", None) is not None:
        return float(len(out.loop_hidden_states))
    summary = out.fp_stats.summary()
    return float(summary.get("fpsa_iter_mean", summary.get("fp_nstep_mean")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every family's head saved once: ``{name: folder}``."""
    root = tmp_path_factory.mktemp("knobs")
    folders = {}
    for name in NAMES:
        model, _ = build(name)
        model.save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


@pytest.mark.parametrize("name", NAMES)
def test_config_construction_and_assignment_are_checked(name):
    tester, _, _ = family(name)
    with pytest.raises(ValueError, match=knob(name) + BAD_RANGE):
        tester.get_config(**{knob(name): 0})
    config = tester.get_config()
    with pytest.raises(ValueError, match=knob(name) + BAD_RANGE):
        setattr(config, knob(name), 0)
    setattr(config, knob(name), 2)
    assert getattr(config, knob(name)) == 2


@pytest.mark.parametrize("name", NAMES)
def test_from_pretrained_checks_the_knob(name, saved):
    _, model_class, auto = family(name)
    import transformers

    for loader in (model_class, getattr(transformers, auto)):
        with pytest.raises(ValueError, match=knob(name) + BAD_RANGE):
            loader.from_pretrained(saved[name], **{knob(name): 0})
    if name != "ouro":  # a typo of an fp_* setting names the valid keys
        with pytest.raises(ValueError, match=r"Unknown fixed-point setting\(s\) \['fp_max_itr'\].*fp_max_iter"):
            model_class.from_pretrained(saved[name], fp_max_itr=3)
    loaded = model_class.from_pretrained(saved[name], **{knob(name): 2})
    assert getattr(loaded.config, knob(name)) == 2


@pytest.mark.parametrize("name", ["fpsa_bert", "fpsa_vit", "self_llama", "self_mistral"])
def test_fpsa_settings_are_checked_at_load_and_on_assignment(name, saved):
    """The FPSA families' ``fpsa_*`` settings enter the same ways: a bad ``from_pretrained(dir, fpsa_x=...)`` value or
    a typo fails at load, a bad assignment fails, and an accepted one takes effect."""
    _, model_class, _ = family(name)
    with pytest.raises(ValueError, match=r"fpsa_halt_unit='layer' is not allowed.*'head', 'token', 'state'"):
        model_class.from_pretrained(saved[name], fpsa_halt_unit="layer")
    with pytest.raises(ValueError, match=r"Unknown FPSA setting.*fpsa_halt_units"):
        model_class.from_pretrained(saved[name], fpsa_halt_units="state")
    loaded = model_class.from_pretrained(saved[name], fpsa_halt_unit="state")
    assert loaded.config.fpsa_halt_unit == "state"
    with pytest.raises(ValueError, match=r"fpsa_halt_unit='layer' is not allowed"):
        loaded.config.fpsa_halt_unit = "layer"
    with pytest.raises(ValueError, match=r"fpsa_jac_target=1.5 is out of range"):
        loaded.config.fpsa_jac_target = 1.5
    assert loaded.config.fpsa_halt_unit == "state" and loaded.config.fpsa_jac_target == 0.2


@pytest.mark.parametrize("name", NAMES)
def test_forward_rejects_a_typo(name):
    model, inputs = build(name)
    with torch.no_grad(), pytest.raises(ValueError, match=r"unknown (fixed-point )?keyword\(s\) \['fp_max_itr'\]"):
        model(**inputs, fp_max_itr=3)


@pytest.mark.parametrize("name", NAMES)
def test_forward_rejects_an_out_of_range_value(name):
    model, inputs = build(name)
    with torch.no_grad(), pytest.raises(ValueError, match=knob(name) + BAD_RANGE):
        model(**inputs, **{knob(name): 0})


@pytest.mark.parametrize("name", NAMES)
def test_one_iteration_per_call_changes_the_computation(name):
    model, inputs = build(name)
    with torch.no_grad():
        default = model(**inputs)
        one = model(**inputs, **{knob(name): 1})
        assert solver_steps(one) == 1 < solver_steps(default)
        assert not torch.equal(one.logits, default.logits)
        if name != "ouro":  # the dict form is the same knob
            alt = model(**inputs, fp_overrides={"fp_max_iter": 1})
            torch.testing.assert_close(alt.logits, one.logits, rtol=0, atol=0)
    assert getattr(model.config, knob(name)) != 1  # the config itself is unchanged


@pytest.mark.parametrize("name", [n for n in NAMES if n != "ouro"])
def test_any_fp_setting_is_a_keyword(name):
    # Settings other than fp_max_iter / fp_tol are keywords of forward too; their values are checked.
    model, inputs = build(name)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs, fp_solver="picard", fp_max_iter=2).logits,
                                   model(**inputs, fp_overrides={"fp_solver": "picard", "fp_max_iter": 2}).logits,
                                   rtol=0, atol=0)
        with pytest.raises(ValueError, match="fp_solver='newton' is not a known solver. Allowed values: 'anderson'"):
            model(**inputs, fp_solver="newton")


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_generate_takes_and_checks_the_knob(name):
    model, _ = build(name)
    ids = torch.randint(1, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))  # no pad id
    greedy = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "output_scores": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        with pytest.raises(ValueError, match=knob(name) + BAD_RANGE):
            model.generate(ids, **{knob(name): 0}, **greedy)
        with pytest.raises(ValueError, match="fp_max_itr"):
            model.generate(ids, fp_max_itr=3, **greedy)
        one = model.generate(ids, **{knob(name): 1}, **greedy)
        default = model.generate(ids, **greedy)
        # the first generated token's scores are those of a one-iteration forward over the prompt
        torch.testing.assert_close(one.scores[0], model(ids, **{knob(name): 1}).logits[:, -1], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(one.scores[0], default.scores[0])


@pytest.mark.parametrize("name", [n for n in CAUSAL_LMS if n != "ouro"])
def test_generate_takes_every_fp_keyword(name):
    """Any ``fp_*`` setting is a keyword of ``generate`` too (transformers' ``generate`` passes a forward only its
    named parameters: the models fold the others into ``fp_overrides``), with the same tokens as through
    ``fp_overrides``, and a bad value gets the setting's own error, not transformers' "not used by the model"."""
    model, _ = build(name)
    ids = torch.randint(1, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    greedy = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        picard = model.generate(ids, fp_solver="picard", fp_max_iter=2, **greedy)
        folded = model.generate(ids, fp_max_iter=2, fp_overrides={"fp_solver": "picard"}, **greedy)
        assert torch.equal(picard, folded)
        both = model.generate(ids, fp_solver="picard", fp_overrides={"fp_solver": "anderson", "fp_max_iter": 2},
                              **greedy)  # the keyword wins, as in forward
        assert torch.equal(both, picard)
        with pytest.raises(ValueError, match="fp_solver='newton' is not a known solver"):
            model.generate(ids, fp_solver="newton", **greedy)


_CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):  # the saved remote code only
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("hf_fixedpoint", "modeling", "tests"):
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, Block())
    import torch, transformers

    def error(fn):
        try:
            fn()
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        return None

    report = {}
    for name, (folder, auto, knob, inputs) in json.load(open(sys.argv[1])).items():
        cls = getattr(transformers, auto)
        model = cls.from_pretrained(folder, trust_remote_code=True).eval()
        inputs = torch.load(inputs)
        with torch.no_grad():
            out = model(**inputs, **{knob: 1})
        report[name] = {
            "load": error(lambda: cls.from_pretrained(folder, trust_remote_code=True, **{knob: 0})),
            "typo": error(lambda: model(**inputs, fp_max_itr=3)),
            "call": error(lambda: model(**inputs, **{knob: 0})),
            "logits_one": out.logits.tolist(),
        }
    report["_library_loaded"] = sorted(m for m in sys.modules if m.partition(".")[0] == "hf_fixedpoint")
    print(json.dumps(report))
    """
)


def test_remote_code_checks_the_knobs(saved, tmp_path):
    # One child process for all families (a process start costs more than the checks).
    jobs, expected = {}, {}
    for name in NAMES:
        _, model_class, auto = family(name)
        model, inputs = build(name)
        torch.save(inputs, tmp_path / f"{name}.pt")
        jobs[name] = (saved[name], auto, knob(name), str(tmp_path / f"{name}.pt"))
        with torch.no_grad():
            expected[name] = model(**inputs, **{knob(name): 1}).logits
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "jobs.json")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report.pop("_library_loaded") == []
    for name, got in report.items():
        k = knob(name)
        assert got["load"] is not None and got["load"].startswith("ValueError") and f"{k}=0 is out of range" in \
            got["load"], (name, got["load"])
        assert got["typo"] is not None and "ValueError" in got["typo"] and "fp_max_itr" in got["typo"], name
        assert got["call"] is not None and "ValueError" in got["call"] and f"{k}=0 is out of range" in got["call"]
        torch.testing.assert_close(torch.tensor(got["logits_one"]), expected[name].float(), rtol=1e-5, atol=1e-5)
