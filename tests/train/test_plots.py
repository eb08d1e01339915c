"""Plots from metrics.jsonl: every PNG is written (and is a PNG); a non-run directory is a user error."""

import json

import pytest

from marinctl.cli import run
from marinctl.errors import UserError
from marinctl.train.plots import write_plots

PNG = b"\x89PNG\r\n\x1a\n"


def _fake_run(run_dir):
    lines = []
    for step in range(20):
        rec = {
            "kind": "train",
            "step": step,
            "loss": 5 - 0.1 * step,
            "ce": 5 - 0.1 * step,
            "drop_frac": 0.1,
            "routing_entropy": 2.7,
        }
        if step % 5 == 0:
            rec["param_norm/lm_head.weight"] = 12.0
            rec["param_norm/blocks.attention.w_q"] = [3.0, 3.1]
        lines.append(rec)
    lines += [
        {"kind": "eval", "step": s, "macro_loss": 5 - 0.1 * s, "loss/docs_val": 5.0, "loss/code_val": 4.0}
        for s in (0, 10, 20)
    ]
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plots_are_written_as_png_files(tmp_path):
    _fake_run(tmp_path)
    written = write_plots(tmp_path)
    assert sorted(p.name for p in written) == ["loss.png", "norms.png", "routing.png"]
    for path in written:
        assert path.read_bytes()[:8] == PNG
    assert not list(tmp_path.glob("*.tmp.png"))


def test_plot_of_a_directory_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"no metrics\.jsonl"):
        write_plots(tmp_path)
    assert run(["plot", str(tmp_path)]) == 2


def test_plot_stage_reports_the_files_as_json(tmp_path, capsys):
    _fake_run(tmp_path)
    assert run(["plot", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {p.rsplit("/", 1)[1] for p in out["plots"]} == {"loss.png", "routing.png", "norms.png"}
