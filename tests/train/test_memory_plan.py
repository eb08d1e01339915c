"""The memory planner (marinctl/counting.py) against XLA's own analysis of the compiled step, and the
hero's plan.

The key check compiles the real sharded train step of a mid-size recipe on the 8 simulated devices
(`train --dry-run --compile --json`) and compares XLA's per-device peak (arguments + outputs − aliased +
temporaries) with the planner's estimate for the same program: within 10%. It compiles with
`model.remat = "offload"`, the hero's policy. XLA:CPU lowers the host placement as a no-op (its device
memory is the host's), so there the program is full remat's and its host temporaries read 0: what the
offload moves to the host on a GPU is checked by lowering for CUDA (tests/model/test_remat.py), not here.
"""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from marinctl.cli import run
from marinctl.counting import ACTIVATION_PARTS, HOST_PARTS, STATE_PARTS, memory_estimate
from marinctl.params import recipe_device_count, resolve_mesh_shape
from marinctl.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
HERO = str(REPO / "recipes" / "hero.toml")
GiB = 2**30

# tests/micro.toml (it compiles fastest) with every block component back on (GatedNorm, SConv, a shared
# expert, the pooled transport) at sizes where the MoE dominates, as it does in the hero: 2,048 tokens
# per device, 16 experts top-4 over data 2 x expert 4, a 4k vocabulary in chunks, window 64 of 128.
MID = """
extends = "{micro}"
name = "memmid"

[model]
vocab_size = 4096
hidden = 512
num_layers = 2
num_heads = 8
head_dim = 64
gated_norm = true
sconv_sites = ["keys", "attn_out", "mlp_out"]
remat = "offload"            # the hero's; on CPU it compiles to "full" (see the module docstring)
ce_chunk_tokens = 512        # 4 chunks of 32 positions x 16 rows, as the hero chunks its 65,536 tokens

[attention]
local_kv_heads = 2
global_kv_heads = 1
window = 64

[moe]
num_experts = 16
top_k = 4
expert_width = 512
latent_width = 256
shared_experts = 1
shared_width = 512
transport = "pooled"
capacity_factor = 1.25

[train]
seq_len = 128
batch_size = 128

[parallel]
replica = 1
data = 2
expert = 4
"""


def _hero_estimate(**model):
    hero = load_recipe(HERO)
    if model:
        hero = replace(hero, model=replace(hero.model, **model))
    return memory_estimate(hero, resolve_mesh_shape(hero.parallel, recipe_device_count(hero.parallel)))


def test_planner_agrees_with_xla_on_a_mid_size_sharded_step(tmp_path, capsys):
    recipe = tmp_path / "memmid.toml"
    recipe.write_text(MID.format(micro=REPO / "tests" / "micro.toml"))
    assert run(["train", str(recipe), "--dry-run", "--compile", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    compiled = report["compiled"]
    assert compiled["devices"] == 8 and compiled["mesh"] == {"replica": 1, "data": 2, "expert": 4}
    xla, plan = compiled["xla_bytes"], compiled["planner_bytes"]
    # The state is exact on both sides: XLA's arguments are the state shards plus this device's batch rows.
    exact = report["per_device_bytes"]
    batch = 4 * (128 // 8) * 128 * 4  # tokens, targets, segment ids, loss mask: [16 rows, 128] x 4 bytes
    assert xla["argument"] == exact["params"] + exact["optimizer"] + exact["other_state"] + batch
    assert xla["alias"] > 0.99 * (exact["params"] + exact["optimizer"])  # the donated state, in place
    # The whole peak: the planner's model of the activations is what this checks.
    assert plan["platform"] == "cpu" and plan["compute_bytes"] == 4 and plan["attention_impl"] == "xla"
    assert abs(plan["total"] / xla["peak"] - 1) < 0.10, (plan["total"], xla)
    assert compiled["difference"] == pytest.approx(plan["total"] / xla["peak"] - 1)
    # No host memory space on CPU: nothing offloaded on either side.
    assert xla["host_temp"] == plan["host_total"] == 0


def test_without_remat_the_planner_stays_above_xla_and_counts_each_layers_own_scores(capsys):
    """The embedded default (remat "none") against its compiled step on one device: the planner overestimates
    (bench/README.md, stop 39: the transports' exchange buffers and one whole block's working set), but by a
    bounded amount. Each layer keeps the scores of its own kind, not the local band and the global square
    both, as a `lax.cond` under remat would; charging both read +40.8% here."""
    tiny = REPO / "recipes" / "tiny.toml"
    recipe = load_recipe(tiny)
    assert run(["train", str(tiny), "--dry-run", "--compile", "--devices", "1", "--json"]) == 0
    compiled = json.loads(capsys.readouterr().out)["compiled"]
    xla, plan = compiled["xla_bytes"], compiled["planner_bytes"]
    assert plan["platform"] == "cpu" and recipe.model.remat == "none"
    assert 0 < plan["total"] / xla["peak"] - 1 < 0.35, (plan["total"], xla)
    # Saved activations, layer by layer: the pattern ends on its global layer ((T), (F, T), (F, F, T), ...), so
    # one layer alone is a global one, and each layer added in front is a local one.
    one = {"replica": 1, "data": 1, "expert": 1}
    saved = {
        n: memory_estimate(replace(recipe, model=replace(recipe.model, num_layers=n)), one, "cpu").parts["remat saves"]
        for n in (1, 2, 3, 4)
    }
    per_global, per_local = saved[1], saved[3] - saved[2]
    assert saved[2] - saved[1] == per_local and saved[4] == 3 * per_local + per_global
    assert per_global > per_local  # the global square's scores against the local band's
    # Under remat one block is a `lax.cond` of both kinds, so its working set holds both kinds' scores.
    none, full = (
        memory_estimate(replace(recipe, model=replace(recipe.model, remat=p)), one, "cpu") for p in ("none", "full")
    )
    assert full.parts["attention"] > none.parts["attention"]


def test_planner_agrees_with_xla_on_the_heros_own_sharded_step(marinctl_process):
    """The hero's real train step, compiled for one rack's 64 devices (its 11 replicas folded: every device's
    shapes as on the full 704-device mesh) on simulated CPU devices: ~25 s, nothing allocated. On CPU it is the
    XLA attention path's program (bf16, as the recipe says, with the masked-softmax scores), which the planner
    is asked about for the CPU; the GPU plan differs only in attention (cuDNN) and the offloaded remat saves."""
    launch, finish = marinctl_process
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    rc, report, _, err = finish(launch(["train", HERO, "--dry-run", "--compile", "--json"], env), timeout=600)
    assert rc == 0, err
    compiled = report["compiled"]
    assert compiled["devices"] == 64 and compiled["replicas_folded"] == 11
    xla, plan = compiled["xla_bytes"], compiled["planner_bytes"]
    assert plan["platform"] == "cpu" and plan["attention_impl"] == "xla" and plan["compute_bytes"] == 2
    assert xla["argument"] > report["per_device_bytes"]["params"] + report["per_device_bytes"]["optimizer"]
    assert abs(plan["total"] / xla["peak"] - 1) < 0.10, (plan["total"], xla)


def test_dry_run_reports_every_component_and_sums_them(capsys):
    assert run(["train", HERO, "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    per_device, est = report["per_device_bytes"], report["planner_estimate"]
    assert list(est["parts"]) == [*STATE_PARTS, *ACTIVATION_PARTS] and list(est["host"]) == list(HOST_PARTS)
    assert est["host_total"] == sum(report["host_bytes_per_device"].values())  # beside the total, not in it
    assert per_device["total"] == sum(v for k, v in per_device.items() if k != "total")
    assert est["total"] == sum(est["parts"].values())
    assert est["phases"][est["peak_phase"]] == max(est["phases"].values())
    assert est["platform"] == "gpu" and est["compute_bytes"] == 2 and est["attention_impl"] == "cudnn"
    # Exact state and the planner's formula agree (other_state is the router bias and counters).
    assert abs(per_device["total"] - est["total"]) < 2**20
    assert run(["train", HERO, "--dry-run"]) == 0
    out = capsys.readouterr().err  # human output goes to stderr
    assert "remat saves" in out and "moe transport" in out and "peak in the backward phase" in out
    assert "remat saves (pinned host)" in out


def test_the_hero_plan_is_bf16_with_block_inputs_offloaded_to_the_host():
    hero = load_recipe(HERO)
    est, full = _hero_estimate(), _hero_estimate(remat="full")
    tokens = hero.tokens_per_step // 704
    block_input = tokens * hero.model.hidden * 2  # one bf16 [tokens, D]
    assert est.compute_bytes == 2 and hero.model.remat == "offload"
    # Full remat keeps one bf16 [tokens, D] block input per layer, nothing else, across the backward ...
    assert full.parts["remat saves"] == hero.model.num_layers * block_input and full.host["remat saves"] == 0
    # ... which "offload" keeps in pinned host memory, with two layers' inputs on the device in the backward.
    assert est.host["remat saves"] == hero.model.num_layers * block_input
    assert est.parts["remat saves"] == 2 * block_input
    assert full.total - est.total == (hero.model.num_layers - 2) * block_input
    assert est.as_dict()["host_total"] == 36 * GiB and est.total <= 170 * GiB
    assert est.parts["gradients"] == est.parts["params"]  # fp32 like the master weights
    assert _hero_estimate(remat="save_dots").total > 5 * est.total


def test_offload_on_cpu_plans_the_program_xla_cpu_compiles_full_remat():
    hero = load_recipe(HERO)
    sizes = resolve_mesh_shape(hero.parallel, 704)
    full = memory_estimate(replace(hero, model=replace(hero.model, remat="full")), sizes, platform="cpu")
    offload = memory_estimate(hero, sizes, platform="cpu")
    assert offload.parts == full.parts and sum(offload.host.values()) == 0


def test_every_hero_schedule_segment_fits_170_gib_per_gpu(capsys):
    assert run(["train", HERO, "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["host_bytes_per_device"] == {"remat saves": 36 * GiB}
    segments = report["segments"]
    assert [s["transport"] for s in segments] == ["pooled", "ragged", "ragged", "ragged"]
    for seg in segments:
        # the ragged segments need their bounded buffer (moe.ragged_buffer_factor): worst case is ~1.1 TiB
        assert seg["total"] <= 170 * GiB, seg
        assert seg["host"] == 36 * GiB  # tokens per GPU stay at 65,536 however long the sequences


def test_chunked_cross_entropy_holds_one_chunk_of_logits():
    full, chunked = _hero_estimate(ce_chunk_tokens=0), _hero_estimate(ce_chunk_tokens=8192)
    hero = load_recipe(HERO)
    tokens = hero.tokens_per_step // 704
    V = hero.model.vocab_size
    # fp32 logits, their gradient and the softmax: three [tokens, V] buffers, or three [chunk, V] ones.
    assert full.phases["loss"] - chunked.phases["loss"] == (tokens - 8192) * V * 4 * 3
    # Unchunked, the logits and their gradient may also outlive the loss, beside every block's backward.
    assert full.phases["backward"] - chunked.phases["backward"] == 2 * tokens * V * 4
    assert full.total - chunked.total > 60 * GiB
    assert full.parts["logits / CE"] == 2 * tokens * V * 4 and chunked.parts["logits / CE"] == 0


def test_folding_replicas_keeps_every_device_shape():
    from marinctl.train.launch import compile_device_count, compile_plan

    hero = load_recipe(HERO)
    sizes = resolve_mesh_shape(hero.parallel, 704)
    folded, folded_sizes = compile_plan(hero, sizes)
    assert folded_sizes == {"replica": 1, "data": 1, "expert": 64} and compile_device_count(hero) == 64
    assert folded.train.batch_size * 11 == hero.train.batch_size
    assert memory_estimate(folded, folded_sizes).parts == memory_estimate(hero, sizes).parts
