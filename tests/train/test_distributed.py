"""Distributed configuration: flags, env vars and SLURM variables resolve to the same runtime settings."""

import pytest

from marinctl.errors import UserError
from marinctl.train.distributed import DistributedConfig, first_slurm_host, resolve_distributed


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node7", "node7"), ("gpu[003-010,012]", "gpu003"), ("gpu[12,14-15],cpu[1-2]", "gpu12"), ("a-b1,c2", "a-b1")],
)
def test_first_slurm_host_expands_ranges_keeping_padding(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_single_process_needs_no_runtime():
    assert resolve_distributed(env={}) is None
    assert resolve_distributed(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}) is None
    assert resolve_distributed(num_processes=1, env={}) is None


def test_slurm_variables_give_coordinator_count_and_id():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NODELIST": "gb200-[017-018]",
        "SLURM_JOB_NODELIST": "other",
        "SLURM_JOB_ID": "4242",
    }
    assert resolve_distributed(env=env) == DistributedConfig("gb200-017:12587", 8, 3, "slurm")
    assert resolve_distributed(env={**env, "MARINCTL_COORDINATOR_PORT": "999"}).coordinator == "gb200-017:999"


def test_flags_override_env_and_env_overrides_slurm():
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    env = {**slurm, "MARINCTL_COORDINATOR": "10.0.0.1:5000", "MARINCTL_NUM_PROCESSES": "4", "MARINCTL_PROCESS_ID": "2"}
    assert resolve_distributed(env=env) == DistributedConfig("10.0.0.1:5000", 4, 2, "env")
    got = resolve_distributed("localhost", 2, 0, env=env)
    assert got == DistributedConfig("localhost:12345", 2, 0, "flags")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("h:1", None, 0), "number of processes"),
        ((None, 2, 0), "coordinator"),
        (("h:1", 2, None), "process id"),
        (("h:1", 2, 5), "outside 0..1"),
        (("h:1", 0, 0), "≥ 1"),
    ],
)
def test_incomplete_or_inconsistent_settings_are_user_errors(args, message):
    with pytest.raises(UserError, match=message):
        resolve_distributed(*args, env={})


def test_non_integer_env_is_a_user_error_naming_the_variable():
    with pytest.raises(UserError, match="MARINCTL_NUM_PROCESSES"):
        resolve_distributed(env={"MARINCTL_NUM_PROCESSES": "two"})
