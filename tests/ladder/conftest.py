"""The `ladder run --sbatch` tests run on the session's real single-node SLURM (tests/conftest.py
`slurm_cluster`); they skip where slurm-wlm + munge are absent (the fake-`sbatch` tests in
test_ladder_stage.py cover the scripts and the submission without it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def slurm(slurm_cluster) -> dict[str, str]:
    """The environment (SLURM_CONF, PATH) in which `sbatch`/`squeue` reach the running cluster."""
    return slurm_cluster.env
