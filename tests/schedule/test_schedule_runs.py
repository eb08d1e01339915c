"""The run as a schedule, trained (micro recipe, 8 CPU devices, data 4 x expert 2): the issue's key proofs.

- the uninterrupted scheduled run: every step once with its segment's shape and transport, a change record
  at each transition, ragged drops nothing, eval at both contexts, dashed lines on the plots; bitwise the
  same with its later steps compiled at each transition instead of on the background thread;
- killed right after a transition (a crash after the checkpoint that lands on the extension) and re-run:
  bitwise equal to the uninterrupted run;
- a switch to the same transport is a bitwise no-op;
- preempt (a real SIGTERM) → `switch-ep` → `extend-context --at-step N` → `marinctl train RUN_DIR`: every
  step once, the new transport and shape from the stated steps, bitwise equal to the declared schedule;
- the in-loop eval at the first context equals `marinctl eval --seq-len S0`; `eval-dropless` equals the
  current-context eval; `switch-ep --compare K` writes nothing;
- every bad input of the stages: one line, exit 2, the run directory unchanged.
All runs are in-process and share one XLA cache, so each distinct step program compiles once."""

import dataclasses
import json
import os
import signal

import numpy as np
import orbax.checkpoint as ocp
import pytest

from marinctl.cli import run as cli
from marinctl.recipe import load_recipe
from marinctl.train.loop import RunOptions, run
from marinctl.train.metrics import read_metrics

from .conftest import EXTEND_AT, RAGGED_AT, STEPS


def records(run_dir, kind):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


def final_state(run_dir, step=STEPS):
    restored = ocp.StandardCheckpointer().restore((run_dir / "checkpoints" / str(step) / "state").absolute())
    return {k: np.asarray(v) for k, v in restored.items()}


def assert_bitwise(run_dir, reference_dir):
    assert [r["loss"] for r in records(run_dir, "train")] == [r["loss"] for r in records(reference_dir, "train")]
    ours, theirs = final_state(run_dir), final_state(reference_dir)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def snapshot(run_dir):
    """Every file of the run dir with its bytes (nothing may change after a refused command)."""
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(recipes, tmp_path_factory):
    recipe = load_recipe(recipes["scheduled"])
    run_dir = tmp_path_factory.mktemp("scheduled")
    summary = run(recipe, RunOptions(run_dir=run_dir, quiet=True))
    assert summary.exit_reason == "done", summary.message
    return run_dir


@pytest.fixture(scope="module")
def base_run(recipes, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base")
    summary = run(load_recipe(recipes["base"]), RunOptions(run_dir=run_dir, quiet=True))
    assert summary.exit_reason == "done", summary.message
    return run_dir


def test_the_scheduled_run_trains_every_step_with_its_segments_shape(reference):
    train = records(reference, "train")
    assert [r["step"] for r in train] == list(range(STEPS))
    for r in train:
        ragged, long = r["step"] >= RAGGED_AT, r["step"] >= EXTEND_AT
        assert (r["transport"], r["seq_len"], r["batch_size"]) == (
            "ragged" if ragged else "fixed", 64 if long else 32, 8 if long else 16)  # fmt: skip
        assert r["qk_mult"] == pytest.approx(1.3 * (1 + 0.1 * np.log(2)) if long else 1.3)
        assert r["capacity_factor"] == 1.0 and np.isfinite(r["loss"])
    assert max(r["drop_frac"] for r in train if r["step"] < RAGGED_AT) > 0  # fixed at cf 1 drops …
    assert all(r["drop_frac"] == 0 for r in train if r["step"] >= RAGGED_AT)  # … ragged drops nothing
    changes = records(reference, "change")
    assert [(c["step"], c["name"]) for c in changes] == [
        (RAGGED_AT, "fixed → ragged EP"),
        (EXTEND_AT, "32 → 64 context"),
    ]
    assert changes[1]["before"]["seq_len"] == 32 and changes[1]["seq_len"] == 64 and changes[1]["batch_size"] == 8
    evals = records(reference, "eval")
    assert [(e["step"], e["seq_len"]) for e in evals] == [(0, 32), (STEPS, 64)]
    last = evals[-1]
    assert {"macro_loss", "macro_loss@32", "loss@32/docs_val", "bpb@32/code_val"} <= set(last)
    assert last["macro_loss@32"] < evals[0]["macro_loss"] - 0.1  # the first-context curve goes on falling
    assert {p.name for p in reference.glob("*.png")} >= {"loss.png", "routing.png"}


def test_compiling_at_each_transition_instead_of_in_the_background_is_bitwise_equal(recipes, reference, tmp_path):
    """The reference compiles its later segments' steps on the precompile thread; `runtime.precompile =
    false` compiles each at its transition, in the loop: the same programs, the same run."""
    recipe = load_recipe(recipes["scheduled"])
    recipe = dataclasses.replace(recipe, runtime=dataclasses.replace(recipe.runtime, precompile=False))
    summary = run(recipe, RunOptions(run_dir=tmp_path, quiet=True))
    assert summary.exit_reason == "done", summary.message
    assert_bitwise(tmp_path, reference)
    assert [r["macro_loss"] for r in records(tmp_path, "eval")] == [r["macro_loss"] for r in records(reference, "eval")]


def test_killed_right_after_a_transition_and_rerun_is_bitwise_equal(recipes, reference, tmp_path):
    """Checkpoint 10 lands on the extension; the run dies at step 12 and resumes at the transition."""
    recipe = load_recipe(recipes["scheduled"])

    def die(step, batch):
        if step == EXTEND_AT + 2:
            raise KeyboardInterrupt("killed")
        return batch

    with pytest.raises(KeyboardInterrupt):
        run(recipe, RunOptions(run_dir=tmp_path, quiet=True, batch_hook=die))
    assert max(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == EXTEND_AT
    summary = run(recipe, RunOptions(run_dir=tmp_path, quiet=True))
    assert summary.exit_reason == "done" and summary.resumed_from == EXTEND_AT
    assert_bitwise(tmp_path, reference)
    assert [c["step"] for c in records(tmp_path, "change")] == [RAGGED_AT, EXTEND_AT]  # each logged once


def test_a_switch_to_the_same_transport_is_a_bitwise_noop(recipes, base_run, tmp_path):
    recipe = load_recipe(recipes["base"], ['schedule.changes=[{at_step=7, moe={transport="fixed"}}]'])
    summary = run(recipe, RunOptions(run_dir=tmp_path, quiet=True))
    assert summary.exit_reason == "done"
    assert [c["step"] for c in records(tmp_path, "change")] == [7]
    assert_bitwise(tmp_path, base_run)


def test_preempt_switch_extend_then_train_run_dir(recipes, reference, tmp_path, capsys):
    run_dir = tmp_path / "run"

    def preempt(step, batch):  # a real SIGTERM through the trainer's handler, as SLURM sends it
        if step == RAGGED_AT - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    summary = run(load_recipe(recipes["base"]), RunOptions(run_dir=run_dir, quiet=True, batch_hook=preempt))
    assert summary.exit_reason == "preempted" and summary.checkpoint_step == RAGGED_AT
    recipe_toml = (run_dir / "recipe.toml").read_bytes()

    assert cli(["switch-ep", str(run_dir), "--transport", "ragged", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["change"]["at_step"] == RAGGED_AT and out["change"]["name"] == "fixed → ragged EP"
    assert cli(["extend-context", str(run_dir), "--seq-len", "64", "--at-step", str(EXTEND_AT), "--json"]) == 0
    capsys.readouterr()
    assert (run_dir / "recipe.toml").read_bytes() == recipe_toml  # recorded apart, in schedule.toml

    assert cli(["train", str(run_dir), "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["exit_reason"] == "done" and result["resumed_from"] == RAGGED_AT
    train = records(run_dir, "train")
    assert [r["step"] for r in train] == list(range(STEPS))  # every step once
    assert [r["transport"] for r in train] == ["fixed"] * RAGGED_AT + ["ragged"] * (STEPS - RAGGED_AT)
    assert [r["seq_len"] for r in train] == [32] * EXTEND_AT + [64] * (STEPS - EXTEND_AT)
    assert all(r["drop_frac"] == 0 for r in train[RAGGED_AT:])
    assert [c["step"] for c in records(run_dir, "change")] == [RAGGED_AT, EXTEND_AT]
    # the recorded schedule is the declared one: the same run, bit for bit
    assert_bitwise(run_dir, reference)


def test_eval_at_the_first_context_equals_marinctl_eval_with_that_length(reference, capsys):
    last = records(reference, "eval")[-1]
    assert cli(["eval", str(reference), "--seq-len", "32", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["seq_len"] == 32 and first["step"] == STEPS
    for key in ("macro_loss", "loss/docs_val", "loss/code_val", "bpb/docs_val"):
        at = key.replace("macro_loss", "macro_loss@32").replace("/", "@32/", 1) if "/" in key else "macro_loss@32"
        assert first[key] == pytest.approx(last[at], rel=1e-6, abs=0), key
    assert cli(["eval-dropless", str(reference), "--json"]) == 0  # the current context, as the run logged it
    current = json.loads(capsys.readouterr().out)
    assert current["seq_len"] == 64 and current["dropless"] is True
    assert current["macro_loss"] == pytest.approx(last["macro_loss"], rel=1e-6, abs=0)


def test_compare_runs_both_transports_from_the_newest_checkpoint_and_writes_nothing(preempted, capsys):
    """From checkpoint 10 of a fixed-transport run at capacity factor 1: fixed drops, ragged does not."""
    before = snapshot(preempted)
    assert cli(["switch-ep", str(preempted), "--transport", "ragged", "--compare", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert snapshot(preempted) == before
    cur, new = result["current"], result["proposed"]
    assert result["step"] == EXTEND_AT and result["steps"] == 2
    assert (cur["transport"], new["transport"]) == ("fixed", "ragged")
    assert cur["sender_drop_frac"] + cur["receiver_drop_frac"] > 0 and new["drop_frac"] == 0
    assert cur["tokens_per_s"] > 0 and new["tokens_per_s"] > 0 and cur["peak_bytes_per_device"] > 0
    assert abs(cur["loss_mean"] - new["loss_mean"]) < 0.1  # the same batches, weights and bias


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["switch-ep", "{run}", "--transport", "teleport"], "--transport 'teleport': choose one of"),
        (["extend-context", "{run}", "--seq-len", "48"], "--seq-len: 48 does not divide the run's 512 tokens per step"),
        (["extend-context", "{run}", "--seq-len", "256"], "--seq-len 256: train.batch_size: 2 / grad_accum 1 = 2 rows"),
        (["extend-context", "{run}", "--seq-len", "64", "--at-step", "3"], "--at-step 3: already passed"),
        (["extend-context", "{run}", "--seq-len", "64", "--at-step", "99"], "--at-step 99: past the run's last step"),
        (["extend-context", "{run}", "--seq-len", "64", "--qk-mult", "big"], "--qk-mult 'big': expected 'auto'"),
        (["switch-ep", "{tmp}", "--transport", "ragged"], "not a run directory"),
        (["switch-ep", "{tmp}/nope", "--transport", "ragged"], "no such run directory"),
        (["train", "{tmp}"], "not a run directory"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(preempted, tmp_path, capsys, args, message):
    before = snapshot(preempted)
    rc = cli([a.format(run=preempted, tmp=tmp_path) for a in args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and "\n" not in err and "Traceback" not in err, err
    assert snapshot(preempted) == before


def test_conflicting_changes_at_one_step_are_refused(preempted, capsys):
    at = str(EXTEND_AT + 2)
    assert cli(["switch-ep", str(preempted), "--transport", "ragged", "--at-step", at, "-q"]) == 0
    before = snapshot(preempted)
    assert cli(["switch-ep", str(preempted), "--transport", "pooled", "--at-step", at]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--transport: conflicts with schedule.changes[0] at step {at} ('ragged' vs 'pooled')" in err
    assert "\n" not in err
    assert snapshot(preempted) == before


@pytest.fixture(scope="module")
def preempted(recipes, base_run, tmp_path_factory):
    """A copy of the base run cut back to its checkpoint at step 10 (as a preempted run leaves it)."""
    import shutil

    run_dir = tmp_path_factory.mktemp("preempted") / "run"
    shutil.copytree(base_run, run_dir)
    for p in (run_dir / "checkpoints").iterdir():
        if p.name.isdigit() and int(p.name) > EXTEND_AT:
            shutil.rmtree(p)
    return run_dir
