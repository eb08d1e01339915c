"""bench/compare_maxtext.py's MaxText invocation: it must train the MoE, not MaxText's default dense block (the
benchmark itself needs a MaxText virtualenv and prints; it is not run in tests)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "compare_maxtext", Path(__file__).parents[2] / "bench" / "compare_maxtext.py"
)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def _venv(tmp_path: Path) -> Path:
    cfg = tmp_path / "lib" / "python3.12" / "site-packages" / "maxtext" / "configs" / "decoupled_base_test.yml"
    cfg.parent.mkdir(parents=True)
    cfg.touch()
    return tmp_path


def _keys(command: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in command if "=" in arg)


def test_maxtext_runs_its_moe_decoder_dropless_at_the_shared_shapes(tmp_path):
    keys = _keys(compare.maxtext_command(_venv(tmp_path), "/out", 14))
    assert keys["decoder_block"] == "mixtral"  # the default, llama2, ignores num_experts: a dense MLP
    assert keys["num_experts"] == "16" and keys["num_experts_per_tok"] == "2"
    assert keys["sparse_matmul"] == "True" and keys["megablox"] == "False" and keys["capacity_factor"] == "-1"
    assert _keys(compare.maxtext_command(_venv(tmp_path / "d"), "/out", 14, "llama2"))["decoder_block"] == "llama2"


def test_a_maxtext_model_without_its_experts_is_refused():
    routed = 16 * 3 * 256 * 128 * 4  # 6,291,456: the compare's routed-expert parameters
    line = "I1207 metric_logger.py:425] number parameters: 0.007 billion"
    assert float(compare.PARAMS_LINE.search(line)[1]) == 0.007
    compare.check_builds_experts(0.007, routed)  # the MoE (7.23 M parameters)
    for logged in (0.001, None):  # MaxText's dense llama2 block at these shapes; no count in the log
        with pytest.raises(SystemExit, match="did not build the MoE"):
            compare.check_builds_experts(logged, routed)
