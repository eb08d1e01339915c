"""The run end to end on the micro recipe (8 CPU devices, data 4 x expert 2, fixed capacity):
the metric contract, exact resume after SIGKILL, SIGTERM -> checkpoint + exit 3 -> resume, 2 processes x 4
devices == 1 x 8, dropping vs dropless transports, and non-finite steps skipped and counted."""

import signal
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from marinctl.recipe import load_recipe, recipe_to_dict
from marinctl.train.loop import RunOptions, run
from marinctl.train.metrics import read_metrics

TRAIN_KEYS = {
    "step", "loss", "ce", "z_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "drop_frac",
    "routing_entropy",
}  # fmt: skip


def train_records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def eval_records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]


def final_state(run_dir, step):
    """The checkpoint's arrays as numpy, keyed by dotted path."""
    restored = ocp.StandardCheckpointer().restore((run_dir / "checkpoints" / str(step) / "state").absolute())
    return {k: np.asarray(v) for k, v in restored.items()}


@pytest.fixture(scope="module")
def reference(micro_recipe_path, tmp_path_factory):
    """One uninterrupted in-process run: 1 process x 8 devices."""
    recipe = load_recipe(micro_recipe_path)
    run_dir = tmp_path_factory.mktemp("reference")
    summary = run(recipe, RunOptions(run_dir=run_dir, quiet=True))
    return {
        "recipe": recipe,
        "run_dir": run_dir,
        "summary": summary,
        "losses": [r["loss"] for r in train_records(run_dir)],
    }


def test_uninterrupted_run_keeps_the_metric_contract_and_lowers_the_eval_loss(reference):
    recipe, run_dir, summary = reference["recipe"], reference["run_dir"], reference["summary"]
    steps = recipe.train.steps
    train = train_records(run_dir)
    assert [r["step"] for r in train] == list(range(steps))
    for record in train:
        assert TRAIN_KEYS <= set(record) and np.isfinite(record["loss"])
        assert record["loss"] == pytest.approx(record["ce"] + record["z_loss"], rel=1e-6)
    evals = eval_records(run_dir)
    assert [r["step"] for r in evals] == [0, steps]
    for record in evals:
        assert {"macro_loss", "loss/docs_val", "loss/code_val", "bpb/docs_val", "bpb/code_val"} <= set(record)
        assert record["macro_loss"] == pytest.approx((record["loss/docs_val"] + record["loss/code_val"]) / 2)
    assert evals[-1]["macro_loss"] < evals[0]["macro_loss"] - 0.1
    assert summary.exit_reason == "done" and summary.steps == steps
    assert summary.eval_macro_loss == evals[-1]["macro_loss"] and summary.final_loss == train[-1]["loss"]
    # The summary's MFU is against the better of the start and end peak readings (each record: the start's).
    start_peak = train[-1]["tflops_per_device"] / train[-1]["mfu"]
    assert summary.peak_tflops >= start_peak * (1 - 1e-9)
    steady = train[len(train) // 5 :]
    assert summary.mfu == pytest.approx(np.median([r["mfu"] for r in steady]) * start_peak / summary.peak_tflops)
    # The fixed transport at capacity factor 1 drops tokens, and the run still trains.
    assert max(r["drop_frac"] for r in train) > 0
    assert np.mean(reference["losses"][-5:]) < np.mean(reference["losses"][:3])
    # Per-matrix norms at the configured cadence; every 5th step checkpointed plus the last.
    assert [r["step"] for r in train if "param_norm/lm_head.weight" in r] == [0, 10, 20, steps - 1]
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [5, 10, 15, 20, 24]
    assert recipe_to_dict(load_recipe(run_dir / "recipe.toml")) == recipe_to_dict(recipe)
    assert {p.name for p in run_dir.glob("*.png")} == {"loss.png", "routing.png", "norms.png"}


def test_sigkill_after_a_checkpoint_then_rerun_ends_bitwise_equal(reference, runner, micro_recipe_path, tmp_path):
    run_dir = tmp_path / "killed"
    args = ["train", str(micro_recipe_path), "--run-dir", str(run_dir), "--json", "--quiet"]
    proc = runner.launch(args)
    first = runner.wait_for_checkpoint(proc, run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    rc, summary, err = runner.finish(runner.launch(args))
    assert rc == 0, err[-3000:]
    steps = reference["recipe"].train.steps
    assert summary["exit_reason"] == "done" and first <= summary["resumed_from"] < steps
    assert [r["loss"] for r in train_records(run_dir)] == reference["losses"]  # exactly, record for record
    ours, theirs = final_state(run_dir, steps), final_state(reference["run_dir"], steps)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_sigterm_checkpoints_exits_3_and_the_rerun_continues(reference, runner, micro_recipe_path, tmp_path):
    run_dir = tmp_path / "preempted"
    args = ["train", str(micro_recipe_path), "--run-dir", str(run_dir), "--json", "--quiet"]
    proc = runner.launch(args)
    runner.wait_for_checkpoint(proc, run_dir)
    proc.send_signal(signal.SIGTERM)
    rc, summary, err = runner.finish(proc)
    steps = reference["recipe"].train.steps
    assert rc == 3, err[-3000:]
    assert summary["exit_reason"] == "preempted" and summary["checkpoint_step"] == summary["steps"] < steps
    assert summary["steps"] in runner.committed_steps(run_dir)
    rc, resumed, err = runner.finish(runner.launch(args))
    assert rc == 0, err[-3000:]
    assert resumed["resumed_from"] == summary["steps"] and resumed["steps"] == steps
    assert [r["loss"] for r in train_records(run_dir)] == reference["losses"]


def test_two_processes_of_four_devices_match_one_process_of_eight(reference, runner, micro_recipe_path, tmp_path):
    """Loopback jax.distributed with gloo. Gloo makes each step slow on CPU, so the pair is stopped early by
    SIGTERM to the non-coordinator host: both hosts must agree to checkpoint the same step and exit 3."""
    run_dir = tmp_path / "multihost"
    port = runner.free_port()
    procs = [
        runner.launch(
            ["train", str(micro_recipe_path), "--run-dir", str(run_dir), "--json", "--quiet",
             "--set", "eval.sources=[]", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)],
            env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        )
        for i in range(2)
    ]  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.exists() and len(train_records(run_dir)) >= 3):
        assert all(p.poll() is None for p in procs), [runner.finish(p)[2][-2000:] for p in procs]
        assert time.monotonic() < deadline, "no training steps within the timeout"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    results = [runner.finish(p) for p in procs]
    for rc, _, err in results:
        assert rc == 3, err[-3000:]
    (_, first, _), (_, second, _) = results
    assert first["exit_reason"] == second["exit_reason"] == "preempted"
    assert first["checkpoint_step"] == second["checkpoint_step"] == first["steps"] >= 3
    assert first["steps"] in runner.committed_steps(run_dir)
    losses = [r["loss"] for r in train_records(run_dir)]  # written by process 0 only
    assert len(losses) == first["steps"]
    np.testing.assert_allclose(losses, reference["losses"][: len(losses)], rtol=1e-5)
    assert first["final_loss"] == second["final_loss"]  # both hosts saw the same global loss


def test_a_nonfinite_step_is_skipped_counted_and_the_run_continues(reference, tmp_path):
    def poison(step, batch):
        if step == 3:  # a NaN loss mask turns the loss and every gradient into NaN
            batch = {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}
        return batch

    summary = run(reference["recipe"], RunOptions(run_dir=tmp_path, quiet=True, batch_hook=poison))
    assert summary.exit_reason == "done" and summary.nonfinite_skipped == 1
    train = train_records(tmp_path)
    assert [r["step"] for r in train] == list(range(reference["recipe"].train.steps))
    assert [r["finite"] for r in train[2:5]] == [True, False, True]
    assert [r["nonfinite_skipped"] for r in train[2:5]] == [0, 1, 1]
    assert "skipped" in train[3]["warnings"][0]
    assert [r["loss"] for r in train[:3]] == reference["losses"][:3]
    assert np.isfinite(summary.final_loss) and summary.final_loss < train[0]["loss"]


def test_consecutive_nonfinite_steps_abort_with_a_clear_message(reference, tmp_path):
    import dataclasses

    recipe = reference["recipe"]
    recipe = recipe.replace(train=dataclasses.replace(recipe.train, max_nonfinite_steps=3))

    def poison(step, batch):
        return {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)} if step >= 2 else batch

    summary = run(recipe, RunOptions(run_dir=tmp_path, quiet=True, batch_hook=poison))
    assert summary.exit_reason == "diverged" and summary.exit_code == 1
    assert "step 4: 3 consecutive non-finite" in summary.message
    assert [r["step"] for r in train_records(tmp_path)][-1] == 4


def test_ragged_transport_logs_no_drops_and_trains(reference, tmp_path):
    recipe = load_recipe(reference["recipe"].source, ["moe.transport=ragged", "train.steps=6", "eval.sources=[]"])
    summary = run(recipe, RunOptions(run_dir=tmp_path, quiet=True))
    train = train_records(tmp_path)
    assert summary.exit_reason == "done" and len(train) == 6
    assert all(r["drop_frac"] == 0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"] - 0.2
