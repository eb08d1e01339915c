"""2 processes x 4 devices over gloo: SIGKILL of both then a re-run resumes and matches the uninterrupted 1 x 8
run; SIGKILL of one makes the other exit 1 within a bounded time, never hang, its last line saying what to do."""

import signal
import time

import numpy as np
import pytest

HEARTBEAT_S = 10


def launch_pair(h, trainer, run_dir, port):
    return [
        trainer.launch(
            run_dir, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
            env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                              "--xla_cpu_enable_concurrency_optimized_scheduler=false",
                 "MARINCTL_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S)},
        )
        for i in range(2)
    ]  # fmt: skip


def test_sigkill_of_one_process_stops_the_other_within_bounded_time(h, trainer, tmp_path):
    run_dir = tmp_path / "pair"
    procs = launch_pair(h, trainer, run_dir, h.free_port())
    h.wait_until(lambda: len(h.train_losses(run_dir)) >= 1 if (run_dir / "metrics.jsonl").exists() else False,
                 procs[0], 600, "a first step of the pair", poll=0.05)  # fmt: skip
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc, _, out = trainer.finish(procs[0], timeout=HEARTBEAT_S * 6 + 60)  # raises TimeoutExpired if it hangs
    waited = time.monotonic() - t0
    procs[1].communicate()
    assert rc != 0, out[-3000:]
    assert waited < HEARTBEAT_S * 6 + 60
    print(f"survivor exited rc={rc} after {waited:.1f}s; last lines:\n" + "\n".join(out.splitlines()[-5:]))
    assert "stopped sending heartbeats" in out, out[-3000:]  # XLA's fatal line names the dead task
    # ... and the last line is marinctl's, saying what to do (a SIGABRT handler, marinctl/train/distributed.py)
    last = out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("marinctl: process 0 of 2 was aborted by the XLA runtime"), out[-3000:]
    assert "Relaunch all 2 processes with the same command" in last and str(run_dir) in last


@pytest.mark.slow
def test_sigkill_of_both_then_rerun_matches_the_uninterrupted_run(h, trainer, reference, tmp_path):
    run_dir = tmp_path / "pair"
    procs = launch_pair(h, trainer, run_dir, h.free_port())
    h.wait_until(lambda: h.committed_steps(run_dir / "checkpoints"), procs[0], 900, "a checkpoint of the pair")
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.communicate()
    results = [trainer.finish(p, timeout=1200) for p in launch_pair(h, trainer, run_dir, h.free_port())]
    for rc, _, out in results:
        assert rc == 0, out[-3000:]
    (_, first, _), (_, second, _) = results
    assert first["resumed_from"] == second["resumed_from"] >= 4 and first["steps"] == h.STEPS
    np.testing.assert_allclose(h.train_losses(run_dir), reference["losses"], rtol=1e-5)
    ours, theirs = h.final_state(run_dir / "checkpoints", h.STEPS), reference["state"]
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-4, atol=1e-6, err_msg=key)
