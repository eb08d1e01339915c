"""bench/ab_step.py's --variant parsing (the benchmark itself prints; it is not timed in tests)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("ab_step", Path(__file__).parents[2] / "bench" / "ab_step.py")
ab_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_step)


def test_variant_options_are_typed_and_repeated_enums_stay_together():
    name, options = ab_step.parse_variant(
        "mix=xla_cpu_experimental_ynn_fusion_type:LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE,"
        "xla_cpu_multi_thread_eigen:false,xla_cpu_parallel_codegen_split_count:4"
    )
    assert name == "mix"
    assert options == {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE",
        "xla_cpu_multi_thread_eigen": False,
        "xla_cpu_parallel_codegen_split_count": 4,
    }
    assert ab_step.parse_variant("off=xla_cpu_experimental_ynn_fusion_type:") == (
        "off",
        {"xla_cpu_experimental_ynn_fusion_type": ""},
    )


@pytest.mark.parametrize("bad", ["no-equals", "=opt:1", "x=novalue"])
def test_a_malformed_variant_exits_with_one_line_naming_it(bad):
    with pytest.raises(SystemExit, match="--variant"):
        ab_step.parse_variant(bad)
