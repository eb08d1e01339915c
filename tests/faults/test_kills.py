"""Processes killed, signalled or doubled on one run dir: SIGKILL at seeded random points (during a step, during
an async checkpoint write, during eval) then a re-run ends bitwise equal to the uninterrupted run; a second
trainer is refused naming the holder; a dead holder's lock is taken over; SIGUSR1 alone checkpoints and
exits 3."""

import random
import signal
import socket
import time

import pytest

from marinctl.runlock import LOCK_FILE

STEPS, EVERY = 12, 4  # tests/faults/conftest.py: 12 steps, checkpoint and eval every 4


def _tmp_checkpoint(ckpt_dir):
    """An orbax save in flight: its temporary directory exists until the background write is published."""
    return ckpt_dir.is_dir() and any(".orbax-checkpoint-tmp" in p.name for p in ckpt_dir.iterdir())


def _records(run_dir, kind):
    from marinctl.train.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path) if r["kind"] == kind] if path.exists() else []


def kill_points(seed: int, count: int) -> list[tuple[str, float]]:
    """(where, extra delay in seconds): the seeded random fault plan, every kind about count / 3 times."""
    rng = random.Random(seed)
    plan = [("step", "checkpoint-write", "eval")[i % 3] for i in range(count)]
    rng.shuffle(plan)
    return [(kind, rng.uniform(0.0, 0.3)) for kind in plan]


class _Point:
    """Has the run reached the planned point? Polled every few milliseconds."""

    def __init__(self, kind, run_dir, proc, rng):
        self.kind, self.run_dir, self.proc = kind, run_dir, proc
        self.ckpt = run_dir / "checkpoints"
        done = _records(run_dir, "train")
        # A step a little ahead of where the run resumes, drawn from the same seed.
        self.target = (done[-1] if done else 0) + rng.randrange(1, 4)

    def __call__(self):
        if self.proc.poll() is not None:
            return True
        if self.kind == "checkpoint-write":  # orbax's temporary directory: the async write is under way
            return _tmp_checkpoint(self.ckpt)
        done = _records(self.run_dir, "train")
        if self.kind == "step":  # step `target` logged: the next one is on the devices
            return bool(done) and done[-1] >= self.target
        return _eval_pending(self.run_dir, done)


def _eval_pending(run_dir, done) -> bool:
    """The step before an eval step is logged and its eval record is not yet (the loop saves, then evaluates)."""
    return bool(done) and (done[-1] + 1) % EVERY == 0 and (done[-1] + 1) not in _records(run_dir, "eval")


def kill_chain(h, trainer, run_dir, plan, seed, *extra: str) -> list[dict]:
    """Run, SIGKILL at each planned point, re-run; return what each kill interrupted."""
    rng = random.Random(seed + 1)
    seen = []
    for kind, delay in plan:
        proc = trainer.launch(run_dir, *extra)
        h.wait_until(_Point(kind, run_dir, proc, rng), None, 400, kind)
        if proc.poll() is not None:  # the run finished before the point came
            seen.append({"kind": kind, "interrupted": "nothing: the run had finished", "rc": proc.returncode})
            break
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        ckpt = run_dir / "checkpoints"
        done = _records(run_dir, "train")
        seen.append({
            "kind": kind,
            "rc": proc.returncode,
            "checkpoint_write_in_flight": _tmp_checkpoint(ckpt),
            "last_step_logged": done[-1] if done else None,
            "eval_pending": _eval_pending(run_dir, done),
            "committed": h.committed_steps(ckpt),
        })  # fmt: skip
    return seen


def resume_to_end_and_compare(h, trainer, run_dir, reference, *extra: str, steps: int = STEPS):
    rc, summary, out = trainer.run(run_dir, *extra)
    assert rc == 0, out[-3000:]
    assert summary["exit_reason"] == "done" and summary["steps"] == steps
    assert h.train_losses(run_dir) == reference["losses"]  # record for record, exactly
    h.assert_bitwise_equal(h.final_state(run_dir / "checkpoints", steps), reference["state"])


def test_sigkill_at_seeded_points_then_rerun_is_bitwise_equal(h, trainer, reference, tmp_path):
    """Three kills (one per kind) from seed 14: the default-set version of the soak below."""
    run_dir = tmp_path / "killed"
    seen = kill_chain(h, trainer, run_dir, kill_points(seed=14, count=3), seed=14)
    print("kills:", seen)
    assert [s["rc"] for s in seen] == [-signal.SIGKILL] * 3, seen
    resume_to_end_and_compare(h, trainer, run_dir, reference)
    # Nothing but orbax's own temporary directories was ever left half-written, and those are cleaned up.
    assert not _tmp_checkpoint(run_dir / "checkpoints")


@pytest.mark.slow
def test_soak_sigkill_at_twelve_seeded_points(h, trainer, tmp_path):
    """Twelve kills need a longer run than the default set's 12 steps (each kill lets the run advance 1-3
    steps): 48 steps, with its own uninterrupted reference."""
    steps = 48
    extra = ("--set", f"train.steps={steps}")
    rc, _, out = trainer.run(tmp_path / "reference", *extra)
    assert rc == 0, out[-3000:]
    reference = {
        "losses": h.train_losses(tmp_path / "reference"),
        "state": h.final_state(tmp_path / "reference" / "checkpoints", steps),
    }
    run_dir = tmp_path / "soak"
    seen = kill_chain(h, trainer, run_dir, kill_points(seed=2026, count=12), 2026, *extra)
    print("kills:", seen)
    kills = [s for s in seen if s["rc"] == -signal.SIGKILL]
    assert len(kills) >= 10, seen
    assert any(s["checkpoint_write_in_flight"] for s in kills), seen  # at least one landed mid-write
    assert any(s["eval_pending"] for s in kills), seen  # and one between a save and its eval record
    resume_to_end_and_compare(h, trainer, run_dir, reference, *extra, steps=steps)


def test_second_trainer_is_refused_a_dead_holder_is_taken_over_and_sigusr1_checkpoints(h, trainer, reference, tmp_path):
    run_dir = tmp_path / "locked"
    first = trainer.launch(run_dir)
    h.wait_until(lambda: _records(run_dir, "train"), first, 400, "the first trainer's first step")
    first.send_signal(signal.SIGSTOP)  # a stalled holder (hung I/O, a debugger) still holds the run dir
    # A second trainer on the same run dir: refused at once, exit 2, naming the holder.
    t0 = time.monotonic()
    rc, summary, out = trainer.run(run_dir, timeout=120)
    assert rc == 2, out[-3000:]
    assert time.monotonic() - t0 < 60  # refused before it compiles or touches a device
    line = [ln for ln in out.splitlines() if "in use by" in ln]
    assert line and f"pid {first.pid}" in line[0] and f"host {socket.gethostname()}" in line[0], out[-2000:]
    assert first.poll() is None  # the holder is untouched
    # The holder dies without releasing: the kernel drops the flock, the file still names the dead pid.
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert f'"pid": {first.pid}' in (run_dir / LOCK_FILE).read_text()
    # The next trainer takes the stale lock over (and says so), then SIGUSR1 alone: checkpoint and exit 3.
    third = trainer.launch(run_dir, quiet=False)
    done_before = len(_records(run_dir, "train"))
    h.wait_until(lambda: len(_records(run_dir, "train")) > done_before, third, 400, "a step after taking over")
    third.send_signal(signal.SIGUSR1)
    rc, summary, out = trainer.finish(third)
    assert rc == 3, out[-3000:]
    assert f"taking over the lock of marinctl train pid {first.pid}" in out
    assert summary["exit_reason"] == "preempted" and summary["checkpoint_step"] == summary["steps"] < STEPS
    assert summary["steps"] in h.committed_steps(run_dir / "checkpoints")
    assert "preempted: checkpoint at step" in out
    assert (run_dir / LOCK_FILE).read_text() == ""  # released cleanly on exit
    resume_to_end_and_compare(h, trainer, run_dir, reference)
