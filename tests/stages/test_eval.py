"""stages/eval.py: `marinctl eval RUN_DIR` reproduces the trainer's in-loop dropless eval of a checkpoint."""

import json
import shutil

import pytest

from marinctl.cli import run as cli
from marinctl.train.metrics import read_metrics


def eval_json(capsys, *args):
    rc = cli(["eval", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def trainer_eval(run_dir, step):
    """Oracle: the run's own eval record at `step` (the last one written for it)."""
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval" and r["step"] == step][-1]


def test_eval_json_equals_the_trainers_last_eval_record(trained_run, capsys):
    recipe, run_dir = trained_run
    result = eval_json(capsys, run_dir)
    sources = recipe.eval.sources
    assert sources == ("docs_val", "code_val")
    assert set(result) == {
        "run_dir", "step", "seq_len", "transport", "dropless", "macro_loss", "skipped_checkpoints",
        *(f"{kind}/{s}" for s in sources for kind in ("loss", "bpb", "tokens")),
    }  # fmt: skip
    assert result["skipped_checkpoints"] == []
    assert result["step"] == 2 and result["transport"] == "ragged" and result["dropless"] is True  # top-2 of 8
    record = trainer_eval(run_dir, 2)  # the run's last eval: same checkpoint, same data, same function
    for key in ("macro_loss", *(f"{kind}/{s}" for s in sources for kind in ("loss", "bpb", "tokens"))):
        assert result[key] == pytest.approx(record[key], rel=1e-6, abs=0), key
    assert result["macro_loss"] == pytest.approx(sum(result[f"loss/{s}"] for s in sources) / len(sources))


def test_eval_step_option_evaluates_that_checkpoint(trained_run, capsys):
    _, run_dir = trained_run
    result = eval_json(capsys, run_dir, "--step", 1, "--dropless")
    assert result["step"] == 1
    assert result["macro_loss"] == pytest.approx(trainer_eval(run_dir, 1)["macro_loss"], rel=1e-6, abs=0)
    assert result["macro_loss"] != pytest.approx(trainer_eval(run_dir, 2)["macro_loss"], rel=1e-4)


def test_eval_transport_option_measures_drops_against_the_dropless_loss(trained_run, capsys):
    _, run_dir = trained_run
    dropless = trainer_eval(run_dir, 2)["macro_loss"]
    dense = eval_json(capsys, run_dir, "--transport", "dense")  # named explicitly: the same dropless numbers
    assert dense["transport"] == "dense" and dense["dropless"] is True
    assert dense["macro_loss"] == pytest.approx(dropless, rel=1e-6, abs=0)
    fixed = eval_json(capsys, run_dir, "--transport", "fixed")  # capacity factor 1 on 2 expert shards drops
    assert fixed["transport"] == "fixed" and fixed["dropless"] is False
    assert fixed["macro_loss"] != dropless and abs(fixed["macro_loss"] - dropless) < 0.1


def test_eval_prints_a_table_of_per_source_loss_bits_per_byte_and_macro(trained_run, capsys):
    _, run_dir = trained_run
    assert cli(["eval", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    record = trainer_eval(run_dir, 2)
    assert out == ""  # human output goes to stderr
    assert "step 2" in err and "dropless" in err
    for source in ("docs_val", "code_val"):
        line = next(line for line in err.splitlines() if source in line)
        assert f"{record[f'loss/{source}']:.4f}" in line and f"{record[f'bpb/{source}']:.4f}" in line
    assert f"{record['macro_loss']:.4f}" in next(line for line in err.splitlines() if "macro" in line)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], "no such run directory"),
        (["{empty}"], "no recipe.toml"),
        (["{no_ckpt}"], "no checkpoint in"),
        (["{run}", "--step", "7"], "no checkpoint at step 7 (available: 1, 2)"),
        (["{run}", "--transport", "teleport"], "--transport 'teleport': choose one of"),
        (["{run}", "--dropless", "--transport", "fixed"], "--dropless and --transport fixed: choose one"),
        (["{run}", "--set", "eval.sources=[]"], "eval.sources is empty"),
        (["{run}", "--set", "eval.batch_size=3"], "recipe.toml: eval.batch_size: 3 rows at seq_len 32"),
        (["{run}", "--set", "model.hidden=128"], "checkpoint leaf 'model.embed.weight' is float32[264, 64]"),
    ],
)
def test_eval_mistakes_exit_2_with_one_line(trained_run, tmp_path, capsys, args, message):
    _, run_dir = trained_run
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_ckpt").mkdir()
    shutil.copy(run_dir / "recipe.toml", tmp_path / "no_ckpt" / "recipe.toml")
    paths = {
        "missing": tmp_path / "missing",
        "empty": tmp_path / "empty",
        "no_ckpt": tmp_path / "no_ckpt",
        "run": run_dir,
    }
    rc = cli(["eval", *(a.format(**paths) for a in args)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""
