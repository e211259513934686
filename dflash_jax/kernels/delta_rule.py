"""The gated delta rule of linear attention (Gated DeltaNet): its jnp forms and the dispatch to the GPU kernel.

Dimension letters: B batch, T tokens, H value heads (keys and queries repeated to it), Dk key width, Dv value
width, Q chunk length, N chunks. Per head a state ``S [Dk, Dv]`` that every token updates:
``S ← exp(g_t)·S;  S ← S + β_t·k_t (v_t − Sᵀk_t)ᵀ;  o_t = Sᵀ q_t`` (q, k L2-normalised, q scaled by Dk^-½).

Three ways to run the recurrence (all float32, as transformers does):

* :func:`delta_rule_sequential`: token by token (``lax.scan``), the reference;
* :func:`delta_rule_chunked`: the WY / UT form over chunks of Q tokens (matmuls inside a chunk, a scan over
  chunks), for prompts longer than a chunk (``kernels.tuning.delta_rule_chunk``);
* :func:`delta_rule_block` + :func:`state_after`: the tokens as one chunk (verify blocks, decode steps, short
  prompts), returning what is needed to form the state after *any* prefix in one einsum.

:func:`kernel_block` hands a short block to the kernel of op ``"delta_rule"`` (:mod:`dflash_jax.kernels.dispatch`:
the GPU's, :mod:`dflash_jax.cuda.delta_rule`, under ``impl="cuda"``: the recurrence token by token, the l2norm
and the key heads' repeat folded in); :func:`state_after` takes its record (k per key head) as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dflash_jax.kernels.common import native
from dflash_jax.kernels.dispatch import kernel
from dflash_jax.tuning import Kernels, KernelTuning


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(Σx² + eps)`` over the last axis (FLA's form, which transformers matches)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule_sequential(q: Float[Array, "B T H Dk"], k: Float[Array, "B T H Dk"], v: Float[Array, "B T H Dv"],
                          g: Float[Array, "B T H"], beta: Float[Array, "B T H"], state: Float[Array, "B H Dk Dv"]
                          ) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H Dk Dv"]]:
    """Token-by-token gated delta rule (the reference). Inputs prepared (normalised, scaled, float32)."""
    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def _chunk_terms(q, k, v, g, beta):
    """The intra-chunk half of the UT form, for every chunk at once. Inputs ``[B, H, N, Q, …]``.

    With ``Γ_ij = exp(cum_i − cum_j)`` (i ≥ j, cum the in-chunk cumulative g) and ``A = strict_lower(βk·kᵀ ⊙ Γ)``,
    ``U = (I + A)⁻¹ βv`` and ``W = (I + A)⁻¹ (βk ⊙ exp(cum))``; a chunk starting from state S then has
    ``v_new = U − W·S``, outputs ``(q ⊙ exp(cum))·S + (q·kᵀ ⊙ Γ)·v_new`` and final state
    ``exp(cum_last)·S + (k ⊙ exp(cum_last − cum))ᵀ·v_new``.
    """
    n = q.shape[-2]
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, Q]
    lower = jnp.tril(jnp.ones((n, n), bool))
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # Γ, zero above the diagonal
    kb, vb = k * beta[..., None], v * beta[..., None]
    a = jnp.where(jnp.tril(lower, -1), jnp.einsum("...ik,...jk->...ij", kb, k) * decay, 0.0)
    if n == 1:  # a decode step: I + A is [[1]], and the solve would still be a cuBLAS trsm call per use on GPUs
        solve = lambda rhs: rhs  # noqa: E731
    else:
        unit_lower = jnp.eye(n, dtype=a.dtype) + a
        solve = lambda rhs: jax.scipy.linalg.solve_triangular(  # noqa: E731
            unit_lower, rhs, lower=True, unit_diagonal=True)
    u, w = solve(vb), solve(kb * jnp.exp(cum)[..., None])
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    return cum, u, w, intra


def delta_rule_chunked(q: Float[Array, "B T H Dk"], k: Float[Array, "B T H Dk"], v: Float[Array, "B T H Dv"],
                       g: Float[Array, "B T H"], beta: Float[Array, "B T H"], state: Float[Array, "B H Dk Dv"],
                       chunk: int = KernelTuning().delta_rule_chunk) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H Dk Dv"]]:
    """The gated delta rule over chunks of ``chunk`` tokens (T is zero-padded to a multiple: zero β and g are
    identity updates, so padding changes neither the outputs before it nor the final state)."""
    b, t, h, dk = q.shape
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [B, T, H, …] → [B, H, N, Q, …]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, h, *x.shape[3:]), 3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum, u, w, intra = _chunk_terms(q, k, v, g, beta)
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    last = jnp.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    def step(s, xs):
        u_i, w_i, q_i, k_i, intra_i, last_i = xs
        v_new = u_i - w_i @ s
        out = q_i @ s + intra_i @ v_new
        return s * last_i + jnp.swapaxes(k_i, -1, -2) @ v_new, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_dec, k_dec, intra, last))  # chunks first
    state, out = jax.lax.scan(step, state, xs)  # out [N, B, H, Q, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, -1)[:, :, :t]
    return jnp.swapaxes(out, 1, 2), state


def delta_rule_block(q: Float[Array, "B T H Dk"], k: Float[Array, "B T H Dk"], v: Float[Array, "B T H Dv"],
                     g: Float[Array, "B T H"], beta: Float[Array, "B T H"], state: Float[Array, "B H Dk Dv"]):
    """The block as one chunk: its outputs and ``(k, cum, v_new)``, from which :func:`state_after` forms the
    state after any prefix of it. Returns ``(out [B, T, H, Dv], (k, cum [B, T, H], v_new [B, T, H, Dv]))``."""
    tr = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 — [B, T, H, …] ↔ [B, H, T, …]
    qh, kh, vh, gh, bh = (tr(x) for x in (q, k, v, g, beta))
    cum, u, w, intra = _chunk_terms(qh, kh, vh, gh, bh)
    v_new = u - w @ state
    out = (qh * jnp.exp(cum)[..., None]) @ state + intra @ v_new
    return tr(out), (k, tr(cum), tr(v_new))


def state_after(state: Float[Array, "B H Dk Dv"], k: Float[Array, "B T H Dk"], cum: Float[Array, "B T H"],
                v_new: Float[Array, "B T H Dv"], n: Int[Array, "B"]) -> Float[Array, "B H Dk Dv"]:
    """The state after the first ``n[b]`` tokens of a :func:`delta_rule_block` block (0 ≤ n ≤ T):
    ``exp(cum_{n−1})·S + Σ_{i<n} exp(cum_{n−1} − cum_i)·k_i v_newᵢᵀ`` (``v_new_i`` depends only on tokens ≤ i).

    ``k``: per value head ``[B, T, H, Dk]`` (:func:`delta_rule_block`'s), or per key head ``[B, T, Hk, Dk]`` (the
    GPU kernel's, :mod:`dflash_jax.cuda.delta_rule`: value head i reads key head i // (H / Hk))."""
    b, t, h = cum.shape
    cum0 = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum], axis=1)  # [B, T+1, H]: cum before token 0 is 0
    c_n = jnp.take_along_axis(cum0, n[:, None, None], axis=1)  # [B, 1, H]
    keep = (jnp.arange(t)[None, :] < n[:, None])[..., None]
    weights = jnp.exp(jnp.where(keep, c_n - cum, -jnp.inf))  # exponents ≤ 0 where kept (g ≤ 0)
    decayed = state * jnp.exp(c_n[:, 0])[..., None, None]
    hk = k.shape[2]
    if hk == h:
        return decayed + jnp.einsum("bthk,bth,bthv->bhkv", k, weights, v_new)
    r, dv = h // hk, v_new.shape[-1]  # value head g·r + i reads key head g
    upd = jnp.einsum("btgk,btgr,btgrv->bgrkv", k, weights.reshape(b, t, hk, r), v_new.reshape(b, t, hk, r, dv))
    return decayed + upd.reshape(state.shape)


def kernel_block(qkv: Float[Array, "B T Hk C"], g: Float[Array, "B T H"], beta: Float[Array, "B T H"],
                 state: Float[Array, "B H Dk Dv"], lengths: Int[Array, "B"] | None, *, key_dim: int, advance: bool,
                 kernels: Kernels = Kernels()):
    """A short block through the kernel of op ``"delta_rule"`` under ``kernels.impl`` (the GPU's,
    :func:`dflash_jax.cuda.delta_rule.kernel_block`: ``qkv`` the conv output per key head, q and k not yet
    normalised), or None when the jnp path must run: no kernel for ``kernels.impl``, a backend the kernel does
    not compile for (unless ``kernels.tuning.interpret``: Pallas interpret mode, for tests), or shapes the
    kernel does not take (logged once per reason). Returns ``(out, (k, cum, v_new))`` (k per key head), or with
    ``advance`` ``(out, state after lengths[b] tokens)``. Under a ``(dp, tp)`` mesh each device runs it on its
    own rows and heads."""
    run = kernel("delta_rule", kernels)
    if run is None or not (native(kernels.impl) or kernels.tuning.interpret):
        return None
    return run(qkv, g, beta, state, lengths, key_dim=key_dim, advance=advance, kernels=kernels)
