"""The small pieces docs/recipe.md §2 composes: RMSNorm, GatedNorm and the short causal conv (SConv).

Precision contract (shared by every module in `marinctl.model`): parameters are fp32 master weights and
are cast to the compute dtype at the matmul that uses them; norms run in fp32 and hand back fp32.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from marinctl.params import MESH_AXES

F32 = jnp.float32


def compute_dtype(name: str) -> jnp.dtype:
    """`model.compute_dtype`: "auto" is bf16 on GPU/TPU (tensor cores) and f32 on CPU (no fast bf16)."""
    if name == "auto":
        return jnp.dtype(jnp.bfloat16) if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else jnp.dtype(F32)
    return jnp.dtype(name)


def shard_batch(x: Array) -> Array:
    """Pin an activation's leading (batch or token) dim to every mesh axis, the layout the batch arrives in.

    FSDP keeps activations batch-sharded and gathers weights; left alone, the partitioner may follow a
    weight's sharding instead (heads over devices) and reshard around the scan. A no-op without a mesh,
    on a 1-device mesh, or when the dim does not divide (e.g. a small eval batch).
    """
    axes = _batch_axes(x.shape[0])
    if not axes:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes, *([None] * (x.ndim - 1))))


def _batch_axes(n: int) -> tuple[str, ...]:
    """The mesh axes `shard_batch` splits a leading dim of size n over (none without a mesh or if n does not
    divide)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = tuple(a for a in MESH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or n % math.prod(mesh.shape[a] for a in axes):
        return ()
    return axes


def batch_shards(n: int) -> int:
    """How many ways `shard_batch` splits a leading dim of size n: n / this is the per-device share."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in _batch_axes(n))


@jax.custom_vjp
def linear(x: Float[Array, "... k"], w: Float[Array, "k n"]) -> Float[Array, "... n"]:
    """`x @ w` for an activation times a weight, with a backward that keeps XLA:CPU off a slow path.

    Autodiff's weight gradient `dw = xᵀ·g` contracts over the tokens; XLA:CPU's dot wants that axis
    minor, so it transposes `g`, and fuses the transpose into the elementwise backward that produces `g`
    (a norm's or gate's derivative over several inputs, written column by column: 10-40 ms per [2048,
    256] array on the tiny recipe, ~15% of its step). An optimization barrier on `g` has it written row by
    row first and transposed on its own. Same products, same sums: only where XLA fuses changes.
    """
    return x @ w


def _linear_fwd(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
    return x @ w, (x, w)


def _linear_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    x, w = residuals
    g = jax.lax.optimization_barrier(g)
    dw = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
    return g @ w.T, dw


linear.defvjp(_linear_fwd, _linear_bwd)


def rms_norm(x: Float[Array, "... d"], eps: float) -> Float[Array, "... d"]:
    """Non-parametric RMSNorm `x / sqrt(mean(x²) + eps)`, always in fp32 (docs/recipe.md §2)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(eqx.Module):
    """RMSNorm with a learnable gain (init 1); the output stays fp32."""

    gain: Float[Array, " d"]
    eps: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        return rms_norm(x, self.eps) * self.gain


class GatedNorm(eqx.Module):
    """`y = x̂ ⊙ sigmoid(W_up · silu(W_down · x̂))`, rank r, no biases (docs/recipe.md §2).

    Applied to an RMSNorm output x̂. The two rank-r matmuls run in the compute dtype; the gate and the
    product stay fp32 so the norm's output scale is exact. At init the gate is ≈ 0.5 (small matrices).
    """

    w_down: Float[Array, "d r"]
    w_up: Float[Array, "r d"]

    def __call__(self, x_hat: Float[Array, "... d"], dtype: jnp.dtype) -> Float[Array, "... d"]:
        h = jax.nn.silu(linear(x_hat.astype(dtype), self.w_down.astype(dtype)))
        gate = jax.nn.sigmoid(linear(h, self.w_up.astype(dtype)).astype(F32))
        return x_hat.astype(F32) * gate


def normalize(norm: RMSNorm, gated_norm: GatedNorm | None, x: Array, dtype: jnp.dtype) -> Array:
    """RMSNorm then (if enabled) GatedNorm — the pre-norm every sub-layer reads — cast to the compute dtype."""
    y = norm(x)
    if gated_norm is not None:
        y = gated_norm(y, dtype)
    return y.astype(dtype)


class ShortConv(eqx.Module):
    """SConv: depthwise causal conv over the sequence, `weight[lag, c]`, lag 0 = the current token (docs/recipe.md §2).

    `out[t,c] = Σ_lag w[lag,c] · x[t−lag,c] · 1[seg(t−lag) = seg(t)]`; positions before the sequence start
    read as 0. No bias, no activation, no internal residual; identity init makes it a no-op at step 0.
    The taps are a Python loop over the (static, small) kernel: k shifted multiply-adds beat a conv op
    on CPU and fuse into one kernel on GPU.
    """

    weight: Float[Array, "k c"]

    def __call__(self, x: Float[Array, "b s c"], segment_ids: Int[Array, "b s"]) -> Float[Array, "b s c"]:
        w = self.weight.astype(x.dtype)
        out = x * w[0]
        for lag in range(1, w.shape[0]):
            shifted = jnp.pad(x, ((0, 0), (lag, 0), (0, 0)))[:, : x.shape[1]]
            # A sentinel segment id for the zero padding so the start of the sequence never matches.
            seg_shifted = jnp.pad(segment_ids, ((0, 0), (lag, 0)), constant_values=-1)[:, : x.shape[1]]
            same_doc = (seg_shifted == segment_ids)[..., None]
            out = out + jnp.where(same_doc, shifted, 0) * w[lag]
        return out
