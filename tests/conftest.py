"""Test set-up: 8 simulated CPU devices for the multi-device tests, set before anything imports JAX."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The CPU default `marinctl` applies (marinctl/runtime.py CPU_DEFAULT_XLA_FLAGS), for in-process runs too.
if "--xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("NO_COLOR", "1")

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


@pytest.fixture(scope="session")
def tiny_recipe():
    from marinctl.recipe import load_recipe

    return load_recipe(RECIPES / "tiny.toml")


@pytest.fixture(scope="session")
def hero_recipe():
    from marinctl.recipe import load_recipe

    return load_recipe(RECIPES / "hero.toml")
