"""Shell completions in completions/ are generated from the live CLI; this fails when they are stale."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from marinctl.cli import discover_stages
from marinctl.completions import SCRIPTS

FOLDER = Path(__file__).resolve().parents[2] / "completions"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_completion_script_matches_the_cli(name):
    committed = (FOLDER / name).read_text()
    assert committed == SCRIPTS[name](), (
        f"completions/{name} is stale: run `python -m marinctl.completions completions`"
    )


def test_every_stage_is_completed():
    bash = (FOLDER / "marinctl.bash").read_text()
    for stage in discover_stages():
        assert f"{stage.name})" in bash


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_bash_script_parses_and_completes_stages():
    script = FOLDER / "marinctl.bash"
    out = subprocess.run(
        ["bash", "-c", f"source {script}; COMP_WORDS=(marinctl pl); COMP_CWORD=1; _marinctl; echo ${{COMPREPLY[@]}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "plan" in out.split()
