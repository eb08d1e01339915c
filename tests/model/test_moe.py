"""The router and LatentMoE against naive per-token loops in numpy (docs/recipe.md §2.10, docs/recipe.md §3.1)."""

import dataclasses

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

from marinctl.model.layers import RMSNorm
from marinctl.model.moe import Experts, LatentMoE, SharedExperts, route
from marinctl.recipe import MoEConfig

T, D, E, K, L_W, I, N_SH, I_SH = 24, 16, 8, 2, 8, 12, 2, 10
BASE = MoEConfig(num_experts=E, top_k=K, expert_width=I, latent_width=L_W, shared_experts=N_SH, shared_width=I_SH,
                 transport="dense", qb_bins=64)  # fmt: skip


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_swiglu(x, wg, wu, wd):
    g = x @ wg
    return (g * np_sigmoid(g) * (x @ wu)) @ wd


def test_router_selects_on_biased_logits_and_weights_on_unbiased_ones_summing_to_2_5():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(T, E)).astype(np.float32)
    bias = np.zeros(E, np.float32)
    bias[[5, 6]] = 10.0  # steers every token to experts 5 and 6, whatever its logits
    r = route(jnp.asarray(logits), jnp.asarray(bias), BASE)
    assert sorted(map(tuple, np.sort(np.asarray(r.expert_idx), axis=1).tolist())) == [(5, 6)] * T
    w = np_sigmoid(np.take_along_axis(logits, np.asarray(r.expert_idx), axis=1))
    np.testing.assert_allclose(np.asarray(r.combine), w * 2.5 / (w.sum(1, keepdims=True) + 1e-9), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.combine).sum(1), 2.5, rtol=1e-6)
    # margins: unbiased logits minus the (K+1)-th biased value
    alpha = -np.sort(-(logits + bias), axis=1)[:, K]
    np.testing.assert_allclose(np.asarray(r.margins), logits - alpha[:, None], rtol=1e-6, atol=1e-6)


def test_post_sigmoid_variant_adds_the_bias_after_the_sigmoid():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(T, E)).astype(np.float32) * 3
    bias = rng.normal(size=E).astype(np.float32) * 0.3
    cfg = dataclasses.replace(BASE, qb_variant="post_sigmoid", router_weight_sum=1.0)
    r = route(jnp.asarray(logits), jnp.asarray(bias), cfg)
    biased = np_sigmoid(logits) + bias
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_idx), 1), np.sort(np.argsort(-biased, 1)[:, :K], 1))
    alpha = -np.sort(-biased, axis=1)[:, K]
    np.testing.assert_allclose(np.asarray(r.margins), np_sigmoid(logits) - alpha[:, None], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(r.combine).sum(1), 1.0, rtol=1e-6)


def make_moe(cfg, seed=0):
    rng = np.random.default_rng(seed)
    width = L_W if cfg.latent else D

    def w(*shape):
        return (rng.normal(size=shape) * 0.4).astype(np.float32)

    p = {"router": w(D, E), "wg": w(E, width, I), "wu": w(E, width, I), "wd": w(E, I, width)}
    if cfg.latent:
        p |= {"down": w(D, L_W), "up": w(L_W, D)}
        if cfg.latent_norm:
            p["gain"] = 1 + w(L_W)
    if cfg.shared_experts:
        n = cfg.shared_experts
        p |= {"sg": w(n, D, I_SH), "su": w(n, D, I_SH), "sd": w(n, I_SH, D)}
    j = {k: jnp.asarray(v) for k, v in p.items()}
    module = LatentMoE(
        router=j["router"],
        latent_down=j.get("down"),
        latent_norm=RMSNorm(j["gain"], 1e-5) if "gain" in j else None,
        experts=Experts(j["wg"], j["wu"], j["wd"]),
        latent_up=j.get("up"),
        shared=SharedExperts(j["sg"], j["su"], j["sd"]) if "sg" in j else None,
        config=cfg,
    )
    return module, p


def naive_moe(m, p, cfg, bias, valid):
    """One token at a time: route, project, run the K selected experts, combine, add the shared experts."""
    out = np.zeros_like(m)
    load = np.zeros(E)
    for t in range(m.shape[0]):
        s = m[t] @ p["router"]
        order = np.argsort(-(s + bias))
        sel = order[:K]
        w = np_sigmoid(s[sel])
        w = w * cfg.router_weight_sum / (w.sum() + 1e-9)
        u = m[t] @ p["down"] if cfg.latent else m[t]
        if "gain" in p:
            u = u / np.sqrt(np.mean(u * u) + 1e-5) * p["gain"]
        y = np.zeros_like(u)
        if valid[t]:
            for k, e in enumerate(sel):
                y += w[k] * np_swiglu(u, p["wg"][e], p["wu"][e], p["wd"][e])
                load[e] += 1
        out[t] = y @ p["up"] if cfg.latent else y
        for i in range(cfg.shared_experts):
            out[t] += np_swiglu(m[t], p["sg"][i], p["su"][i], p["sd"][i])
    return out, load


CASES = {
    "hero": BASE,
    "no_latent": dataclasses.replace(BASE, latent=False),
    "no_latent_norm_no_shared": dataclasses.replace(BASE, latent_norm=False, shared_experts=0, router_weight_sum=1.0),
    "ragged": dataclasses.replace(BASE, transport="ragged"),  # the CPU's sorted-tile dropless path
}


@pytest.mark.parametrize("case", CASES)
def test_latent_moe_equals_a_naive_per_token_loop_over_the_selected_experts(case):
    cfg = CASES[case]
    module, p = make_moe(cfg)
    rng = np.random.default_rng(2)
    m = rng.normal(size=(T, D)).astype(np.float32)
    bias = (rng.normal(size=E) * 0.5).astype(np.float32)
    valid = np.arange(T) < T - 4  # the last tokens are padding: no routed output, not counted
    out, stats = eqx.filter_jit(module)(jnp.asarray(m), jnp.asarray(bias), jnp.asarray(valid))
    expected, load = naive_moe(m.astype(np.float64), p, cfg, bias, valid)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(stats["expert_load"]), load)
    assert float(stats["assignments"]) == K * valid.sum()
    lse = np.log(np.exp(m @ p["router"]).sum(1))
    np.testing.assert_allclose(float(stats["router_z"]), np.mean(lse[valid] ** 2), rtol=1e-4)


def test_beta_is_the_fair_share_quantile_of_the_valid_margins():
    cfg = dataclasses.replace(BASE, qb_estimator="exact")
    module, p = make_moe(cfg, seed=3)
    rng = np.random.default_rng(4)
    m = rng.normal(size=(T, D)).astype(np.float32)
    bias = (rng.normal(size=E) * 0.5).astype(np.float32)
    valid = np.arange(T) >= 5
    _, stats = eqx.filter_jit(module)(jnp.asarray(m), jnp.asarray(bias), jnp.asarray(valid))
    s = (m @ p["router"])[valid]
    margins = s - (-np.sort(-(s + bias), axis=1)[:, K])[:, None]
    share = int(np.ceil(valid.sum() * K / E))
    expected = -np.sort(-margins, axis=0)[share - 1]  # the share-th largest margin of each expert
    np.testing.assert_allclose(np.asarray(stats["beta"]), expected, rtol=1e-5, atol=1e-5)


def test_every_expert_selected_when_top_k_equals_num_experts_without_balancing():
    cfg = dataclasses.replace(BASE, top_k=E, balancing="none")
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(T, E)).astype(np.float32))
    r = route(logits, jnp.zeros(E), cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_idx), 1), np.tile(np.arange(E), (T, 1)))
    assert r.margins is None
