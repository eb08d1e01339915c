"""Storage faults: a damaged newest checkpoint (truncated, a file deleted, bytes flipped) is set aside and the
run, `eval` and `export` fall back to the previous one; a disk that fills up while checkpointing stops the run
with the path and the bytes needed, keeps what was there, and the re-run after freeing space resumes; a token
store rewritten under a run is refused at resume; the W&B sink (offline) records what metrics.jsonl does."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

STEPS = 12


def _largest_file(step_dir):
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def damage(step_dir, how: str) -> str:
    target = _largest_file(step_dir / "state")
    if how == "truncate":
        os.truncate(target, target.stat().st_size // 2)
    elif how == "delete":
        target.unlink()
    else:  # one flipped bit in the middle of the largest array chunk: orbax alone restores it silently
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    return target.relative_to(step_dir).as_posix()


@pytest.fixture
def copied_run(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference["run_dir"], run_dir)
    return run_dir


def test_damaged_newest_checkpoint_is_set_aside_and_the_run_finishes(h, trainer, reference, copied_run):
    """The issue's reproduction: the newest checkpoint truncated, the run re-run to a step it must write again."""
    damage(copied_run / "checkpoints" / str(STEPS), "truncate")
    rc, summary, out = trainer.run(copied_run, quiet=False)
    assert rc == 0, out[-3000:]
    assert summary["resumed_from"] == STEPS - 4 and summary["steps"] == STEPS
    line = [ln for ln in out.splitlines() if f"checkpoint {STEPS} is damaged" in ln]
    assert (
        line
        and "SHA-256" in line[0]
        and "set aside as" in line[0]
        and f"resuming from checkpoint {STEPS - 4}" in (line[0])
    ), out[-3000:]
    aside = [p for p in (copied_run / "checkpoints").iterdir() if p.name.startswith(f"{STEPS}.damaged-")]
    assert len(aside) == 1 and (aside[0] / "state").is_dir()  # kept for inspection, not deleted
    assert h.train_losses(copied_run) == reference["losses"]
    h.assert_bitwise_equal(h.final_state(copied_run / "checkpoints", STEPS), reference["state"])


@pytest.mark.parametrize("how", ["truncate", "delete", "flip"])
def test_export_falls_back_past_a_damaged_checkpoint_and_says_why(how, fault_env, copied_run, tmp_path):
    rel = damage(copied_run / "checkpoints" / str(STEPS), how)
    out_dir = tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, "-m", "marinctl.cli", "export", str(copied_run), "--out", str(out_dir), "--json"],
        env=fault_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["step"] == STEPS - 4
    assert (
        len(summary["skipped_checkpoints"]) == 1
        and f"checkpoint {STEPS} is damaged" in summary["skipped_checkpoints"][0]
    )
    assert rel in summary["skipped_checkpoints"][0] or "missing" in summary["skipped_checkpoints"][0]
    assert f"checkpoint {STEPS} is damaged" in proc.stderr and f"using checkpoint {STEPS - 4} instead" in proc.stderr
    assert (copied_run / "checkpoints" / str(STEPS)).is_dir()  # eval/export only read: nothing moved


def test_eval_falls_back_past_a_flipped_bit(fault_env, reference, copied_run):
    damage(copied_run / "checkpoints" / str(STEPS), "flip")
    proc = subprocess.run(
        [sys.executable, "-m", "marinctl.cli", "eval", str(copied_run), "--json"],
        env=fault_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == STEPS - 4 and "does not match its SHA-256" in result["skipped_checkpoints"][0]
    from marinctl.train.metrics import read_metrics

    record = [r for r in read_metrics(reference["run_dir"] / "metrics.jsonl") if r["kind"] == "eval"]
    assert result["macro_loss"] == pytest.approx([r for r in record if r["step"] == STEPS - 4][-1]["macro_loss"])


# ---------------------------------------------------------------------------------------------------------
# A full disk


def _mount(kind: str, where, scratch, size: int = 64 << 20) -> None:
    where.mkdir(parents=True, exist_ok=True)
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    else:  # a real block file system: ext4 on a loop device backed by a file on this disk
        image = scratch / "disk.img"
        subprocess.run(["truncate", "-s", str(size), str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
        cmd = ["mount", "-o", "loop", str(image), str(where)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a {kind} ({result.stderr.strip()}): the disk-full test needs mount rights")


def _fill_leaving(where, room: int):
    """A ballast file that leaves `room` bytes free (what an operator deletes to free space)."""
    ballast = where / "ballast"
    free = shutil.disk_usage(where).free
    with open(ballast, "wb") as f:
        f.truncate(0)
        chunk = b"\0" * (1 << 20)
        left = free - room
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return ballast


@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_disk_full_while_checkpointing_stops_cleanly_and_the_rerun_resumes(h, fs, trainer, reference, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small file system (CI runs as root)")
    if fs == "ext4" and not shutil.which("mkfs.ext4"):
        pytest.skip("mkfs.ext4 not installed")
    mnt, run_dir = tmp_path / "mnt", tmp_path / "run"
    _mount(fs, mnt, tmp_path)
    try:
        # What one checkpoint takes on this file system (blocks, inodes): copy one in, measure, remove it.
        before = shutil.disk_usage(mnt).free
        shutil.copytree(reference["run_dir"] / "checkpoints" / "4", mnt / "probe")
        one = before - shutil.disk_usage(mnt).free
        shutil.rmtree(mnt / "probe")
        ballast = _fill_leaving(mnt, int(one * 1.5))  # room for the first checkpoint, not the second
        ckpt = mnt / "checkpoints"
        rc, summary, out = trainer.run(run_dir, "--set", f"checkpoint.dir={ckpt}")
        assert rc == 1, out[-3000:]
        assert summary["exit_reason"] == "disk-full"
        line = [ln for ln in out.splitlines() if "disk full" in ln]
        assert line and str(ckpt) in line[0] and "bytes)" in line[0] and "are free" in line[0], out[-3000:]
        assert "Traceback" not in out, out[max(0, out.find("Traceback") - 600) :][:1500]
        kept = h.committed_steps(ckpt)
        assert kept == [4], out[-3000:]
        from marinctl.train.checkpoint import verify_digest

        assert verify_digest(ckpt / "4") is None
        losses = h.train_losses(run_dir)  # metrics.jsonl intact: parseable, a prefix of the reference
        assert len(losses) >= kept[-1] and losses == reference["losses"][: len(losses)]
        ballast.unlink()  # the operator frees space and re-runs the same command
        rc, summary, out = trainer.run(run_dir, "--set", f"checkpoint.dir={ckpt}")
        assert rc == 0, out[-3000:]
        assert summary["resumed_from"] == kept[-1] and summary["steps"] == STEPS
        assert h.train_losses(run_dir) == reference["losses"]
        h.assert_bitwise_equal(h.final_state(ckpt, STEPS), reference["state"])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ---------------------------------------------------------------------------------------------------------
# Data changed under a run; the W&B sink


def test_token_store_rewritten_under_a_run_is_refused_at_resume(h, trainer, tmp_path):
    data = h.copy_data(trainer.recipe, tmp_path / "data")
    run_dir = tmp_path / "run"
    extra = ("--set", f"data.root={data}", "--set", "data.builtin=")  # user data: no built-in self-repair
    proc = trainer.launch(run_dir, *extra)
    h.wait_until(lambda: h.committed_steps(run_dir / "checkpoints"), proc, 400, "the first checkpoint")
    proc.kill()
    proc.communicate()
    # Rewrite one training store in place: another corpus tokenized into the same directory.
    from marinctl.recipe import load_recipe

    docs = data / load_recipe(trainer.recipe).data.sources[0].path
    code = data / load_recipe(trainer.recipe).data.sources[1].path
    saved = tmp_path / "saved_docs"
    shutil.move(docs, saved)
    shutil.copytree(code, docs)
    rc, _, out = trainer.run(run_dir, *extra)
    assert rc == 2, out[-3000:]
    line = [ln for ln in out.splitlines() if "changed since checkpoint" in ln]
    assert line and str(docs) in line[0] and "manifest sha256" in line[0] and "Traceback" not in out
    # Put the original back: the run resumes.
    shutil.rmtree(docs)
    shutil.move(saved, docs)
    proc = trainer.launch(run_dir, *extra)
    h.wait_until(lambda: len(h.committed_steps(run_dir / "checkpoints")) > 1, proc, 400, "a checkpoint after resume")
    proc.kill()
    proc.communicate()


def _wandb_history(run_dir) -> dict[int, dict[str, float]]:
    """Scalars per step from the offline W&B run file (LevelDB log format of `Record` protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    pos, block, payload, out = 7, 32768, b"", {}  # a 7-byte W&B header, then 32 KiB blocks
    while pos + 7 <= len(data):
        room = block - (pos % block)
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += room
            continue
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: one record
            record = pb.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.HasField("history"):
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                step = int(items.pop("_step", record.history.step.num))
                out.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return out


def test_wandb_offline_records_the_same_metrics_as_metrics_jsonl(h, trainer, tmp_path):
    pytest.importorskip("wandb", reason="the `wandb` extra is not installed: pip install 'marinctl[wandb]'")
    run_dir = tmp_path / "run"
    rc, _, out = trainer.run(run_dir, "--set", "log.wandb=true", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert rc == 0, out[-3000:]
    from marinctl.train.metrics import _scalars, read_metrics

    history = _wandb_history(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    expected: dict[int, dict[str, float]] = {}
    for record in records:
        expected.setdefault(record["step"], {}).update(dict(_scalars(record)))
    assert sorted(history) == sorted(expected)
    for step, scalars in expected.items():
        assert history[step].keys() >= scalars.keys(), step
        for key, value in scalars.items():
            assert history[step][key] == value, (step, key)
    assert [history[s]["train/loss"] for s in range(STEPS)] == h.train_losses(run_dir)
