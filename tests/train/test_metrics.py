"""metrics.jsonl writing and resume truncation, the TensorBoard sink, throughput/MFU arithmetic, the peak."""

import json

import jax
import pytest

from marinctl.train.metrics import MetricsLog, TensorBoardSink, measure_matmul_peak, read_metrics, throughput


def test_resume_drops_records_past_the_checkpoint_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, enabled=True)
    for step in range(6):
        log.write({"kind": "train", "step": step, "loss": 1.0 / (step + 1)})
    log.write({"kind": "eval", "step": 4, "macro_loss": 2.0})
    log.close()
    with path.open("a") as f:
        f.write('{"kind": "train", "step": 6, "lo')  # a writer killed mid-line
    MetricsLog(path, enabled=True).resume(4)
    records = read_metrics(path)
    assert [(r["kind"], r["step"]) for r in records] == [("train", s) for s in range(4)]


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl", enabled=False)
    log.write({"kind": "train", "step": 0})
    log.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_tensorboard_sink_writes_scalar_events(tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto.event_pb2 import Event

    sink = TensorBoardSink(tmp_path)
    sink.write({"kind": "train", "step": 3, "loss": 2.5, "drop_frac_per_layer": [0.1, 0.2], "finite": True})
    sink.close()
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    data, scalars = events.read_bytes(), []
    while data:  # TFRecord framing: u64 length, u32 crc, payload, u32 crc
        n = int.from_bytes(data[:8], "little")
        event = Event.FromString(data[12 : 12 + n])
        scalars += [(v.tag, v.simple_value, event.step) for v in event.summary.value]
        data = data[16 + n :]
    assert scalars == [("train/loss", 2.5, 3)]  # lists and booleans are not scalars


def test_throughput_follows_the_spec7_convention():
    out = throughput(tokens=4096, seconds=2.0, flops_per_token=1e9, n_devices=8, peak=1e12)
    assert out["tokens_per_s"] == 2048
    assert out["tflops_per_device"] == pytest.approx(3 * 1e9 * 2048 / 8 / 1e12)
    assert out["mfu"] == pytest.approx(3 * 1e9 * 2048 / 8 / 1e12)


def test_measured_cpu_peak_is_plausible():
    peak = measure_matmul_peak(jax.devices(), n=256, repeats=2)
    assert 1e8 < peak * len(jax.devices()) < 1e13  # a host does 0.1 GFLOP/s .. 10 TFLOP/s of f32 matmul


def test_the_peak_times_calls_for_at_least_its_time_floor():
    """Best of five ~10 ms calls read 20-25% under the peak on these hosts: each variant is timed for a floor."""
    import time

    from marinctl.train.metrics import CPU_PEAK_VARIANTS

    start = time.perf_counter()
    measure_matmul_peak(jax.devices()[:1], n=64, repeats=1, seconds=0.2)
    assert time.perf_counter() - start >= 0.2 * len(CPU_PEAK_VARIANTS)


def test_the_peak_times_ynnpack_dots_that_the_step_runs_without():
    """The step's flags (conftest mirrors marinctl.runtime) keep dots out of YNNPACK; the peak's second variant
    puts them back, so the MFU denominator is the faster of the two ways (marinctl/runtime.py)."""
    from marinctl.train.metrics import CPU_PEAK_VARIANTS

    lowered = jax.jit(lambda a: a @ a).lower(jax.numpy.ones((64, 64)))
    assert "__ynn_fusion" not in lowered.compile().as_text()
    assert "__ynn_fusion" in lowered.compile(compiler_options=CPU_PEAK_VARIANTS[1]).as_text()


def test_records_are_json_lines_with_arrays_as_lists(tmp_path):
    import numpy as np

    path = tmp_path / "m.jsonl"
    log = MetricsLog(path, enabled=True)
    log.write({"kind": "train", "step": 0, "drop_frac_per_layer": np.array([0.0, 0.5])})
    log.close()
    assert json.loads(path.read_text()) == {"kind": "train", "step": 0, "drop_frac_per_layer": [0.0, 0.5]}


def test_non_finite_numbers_are_written_as_null_so_every_line_is_strict_json(tmp_path):
    import numpy as np

    path = tmp_path / "m.jsonl"
    log = MetricsLog(path, enabled=True)
    log.write({"kind": "train", "step": 3, "loss": float("nan"), "per_layer": np.array([1.0, np.inf])})
    log.close()
    record = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert record == {"kind": "train", "step": 3, "loss": None, "per_layer": [1.0, None]}
