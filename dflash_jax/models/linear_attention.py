"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3-Next, and the gated delta rule in pure jnp.

Dimension letters: B batch, T tokens, H value heads (Hv; keys and queries are repeated to it), Dk key width,
Dv value width, C conv channels (q, k and v, grouped by key head: see :class:`GatedDeltaNet`), R = W-1 conv
history (W the kernel), Q chunk length, N chunks.

Per head the layer keeps a state ``S [Dk, Dv]`` that every token updates (the gated delta rule):
``S ← exp(g_t)·S;  S ← S + β_t·k_t (v_t − Sᵀk_t)ᵀ;  o_t = Sᵀ q_t`` (q, k L2-normalised, q scaled by Dk^-½).
The short causal depthwise convolution before it keeps the last R inputs. So a decoding sequence is fully
described by (conv history ``[B, R, C]``, recurrent state ``[B, H, Dk, Dv]``) per layer: these replace the
KV cache of attention layers and must be exactly the states after the committed tokens.

Three ways to run the recurrence (all float32, as transformers does):

* :func:`delta_rule_sequential`: token by token (``lax.scan``), the reference;
* :func:`delta_rule_chunked`: the WY / UT form over chunks of Q tokens (matmuls inside a chunk, a scan over
  chunks), for prompts longer than :data:`CHUNK`; positions past a row's length are masked out (β = 0, g = 0
  makes a token an identity update), so right padding never enters the state;
* :func:`delta_rule_block` + :func:`state_after`: the tokens as one chunk (verify blocks, decode steps, short
  prompts), returning what is needed to form the state after *any* prefix in one einsum: once a verify's
  accepted length is known, rejected drafts leave no trace and the block's recurrence is not run twice.

On GPUs with ``impl="cuda"`` the short blocks (up to :data:`dflash_jax.cuda.delta_rule.MAX_T` tokens) run as one
Pallas kernel instead (:mod:`dflash_jax.cuda.delta_rule`: the recurrence token by token, the l2norm and the key
heads' repeat folded in); :func:`state_after` and :func:`settle` take its record (k per key head) as it is.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.attention import PackedLayout
from dflash_jax.config import HybridConfig, ModelConfig
from dflash_jax.models.layers import Dense

CHUNK = 64  # prefill chunk of the delta rule (transformers' and FLA's default)
# impl="cuda" runs the short-block GPU kernel on GPU backends only; tests set this to run it in Pallas interpret
# mode on any backend (slow).
KERNEL_INTERPRET = False
log = logging.getLogger("dflash_jax")


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


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
                       chunk: int = CHUNK) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H Dk Dv"]]:
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


def kernel_block(impl: str, qkv: Float[Array, "B T Hk C"], g: Float[Array, "B T H"], beta: Float[Array, "B T H"],
                 state: Float[Array, "B H Dk Dv"], lengths: Int[Array, "B"] | None, *, key_dim: int, advance: bool):
    """A short block through the GPU kernel (:func:`dflash_jax.cuda.delta_rule.packed_delta_rule_block`: ``qkv``
    the conv output per key head, q and k not yet normalised), or None when the jnp path must run: ``impl`` is
    not ``"cuda"``, the backend is not a GPU (unless :data:`KERNEL_INTERPRET`), or the kernel does not take these
    shapes (logged once per reason). Returns ``(out, (k, cum, v_new))`` (k per key head), or with ``advance``
    ``(out, state after lengths[b] tokens)``. Under a ``(dp, tp)`` mesh each device runs it on its own rows and
    heads (``shard_map``; rows and value heads are independent, and a device's value heads read its key heads)."""
    if impl != "cuda":
        return None
    interpret = jax.default_backend() != "gpu"
    if interpret and not KERNEL_INTERPRET:
        return None
    from jax.sharding import PartitionSpec as P

    from dflash_jax.cuda import delta_rule as kernel

    args = (qkv, g, beta, state) + (() if lengths is None else (lengths.astype(jnp.int32),))
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty or mesh.size == 1 else dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows = "dp" if "dp" in sizes and qkv.shape[0] % sizes["dp"] == 0 else None
    heads = "tp" if "tp" in sizes and qkv.shape[2] % sizes["tp"] == 0 else None
    specs = (P(rows, None, heads, None), P(rows, None, heads), P(rows, None, heads), P(rows, heads, None, None),
             P(rows))[:len(args)]
    split = lambda d, axis: d // sizes[axis] if axis else d  # noqa: E731
    local = tuple(jax.ShapeDtypeStruct(tuple(split(d, axis) for d, axis in zip(a.shape, tuple(spec) + (None,) * 4)),
                                       a.dtype) for a, spec in zip(args, specs))
    why = (f"mesh axes {tuple(sizes)} (it shards over 'dp' and 'tp' only)" if set(sizes) - {"dp", "tp"} else
           kernel.packed_unsupported_reason(*local, key_dim=key_dim, interpret=interpret))
    if why is not None:
        _log_once(f"Gated DeltaNet: the XLA delta rule instead of the GPU kernel ({why})")
        return None
    fn = functools.partial(kernel.packed_delta_rule_block, key_dim=key_dim, advance=advance, interpret=interpret)
    if not sizes:
        return fn(*args)
    values = P(rows, None, heads, None)
    out_specs = (values, P(rows, heads, None, None)) if advance else (values, (values, P(rows, None, heads), values))
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)


def conv_history(window: Float[Array, "B R+T C"], n: Int[Array, "B"] | None, r: int) -> Float[Array, "B R C"]:
    """The last ``r`` conv inputs after ``n[b]`` of the block's tokens (``None``: all of them); ``window`` is the
    previous history followed by the block's inputs."""
    if n is None:
        return window[:, window.shape[1] - r:]
    return jax.vmap(lambda w, s: jax.lax.dynamic_slice_in_dim(w, s, r, axis=0))(window, n)


def group_by_key_head(x: np.ndarray, h: HybridConfig) -> np.ndarray:
    """Conv channels along axis 0 from the checkpoints' order ``[q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]`` to the
    layer's: per key head its q, its k and its r value heads' v (``in_proj_qkv.weight [C, D]``,
    ``conv1d.weight [C, 1, W]``)."""
    kd, rest = h.key_heads * h.key_head_dim, x.shape[1:]
    per_key_head = lambda a: a.reshape(h.key_heads, -1, *rest)  # noqa: E731 — value heads j·r … j·r+r−1 for j
    return np.concatenate([per_key_head(x[:kd]), per_key_head(x[kd:2 * kd]), per_key_head(x[2 * kd:])],
                          axis=1).reshape(x.shape)


class Conv1d(nnx.Module):
    """Depthwise causal conv weights in the checkpoint's ``[C, 1, W]`` layout (PyTorch ``Conv1d``, groups = C)."""

    def __init__(self, channels: int, width: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (channels, 1, width), jnp.float32)
                                 / math.sqrt(width)).astype(dtype))

    def __call__(self, window: Float[Array, "B R+T C"], t: int) -> Float[Array, "B T C"]:
        """``out_t = Σ_j w_j · window_{t+j}``: each of the last T positions over itself and the R before it."""
        w = self.weight[...][:, 0, :].astype(jnp.float32)  # [C, W]
        width = w.shape[1]
        x = window.astype(jnp.float32)
        out = sum(x[:, j:j + t] * w[:, j] for j in range(width))
        return out.astype(window.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm over each value head, then ``· silu(z)`` (transformers' ``RMSNormGated``: the norm in float32,
    cast back and scaled, the gate applied in float32)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * x32.astype(x.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear-attention token mixer (HF names: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``; Qwen3-Next's fused projections are
    split into these when its checkpoint is read).

    The conv channels (``in_proj_qkv``'s columns, ``conv1d``'s rows, the conv history) are grouped by key head:
    per key head its q (Dk), its k (Dk), then its r = Hv/Hk value heads' v (r·Dv) — the checkpoints' order (all q,
    all k, all v) is regrouped on load (:func:`group_by_key_head`). So every per-head array of the layer splits
    into contiguous blocks of whole heads, and tensor parallelism shards the layer by key head
    (:mod:`dflash_jax.sharding`) with nothing to exchange but the all-reduce after ``out_proj``.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hybrid
        d = cfg.hidden_size
        self.hk, self.hv, self.dk, self.dv, self.width = (h.key_heads, h.value_heads, h.key_head_dim,
                                                          h.value_head_dim, h.conv_kernel)
        self.in_proj_qkv = Dense(d, h.conv_dim, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_z = Dense(d, self.hv * self.dv, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_b = Dense(d, self.hv, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_a = Dense(d, self.hv, bias=False, dtype=dtype, rngs=rngs)
        self.conv1d = Conv1d(h.conv_dim, h.conv_kernel, dtype=dtype, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, 1.0, 16.0))
                               .astype(dtype))
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Dense(self.hv * self.dv, d, bias=False, dtype=dtype, rngs=rngs)

    def zero_states(self, batch: int, dtype) -> tuple[jax.Array, jax.Array]:
        """(conv history ``[B, R, C]`` in the model dtype, recurrent state ``[B, H, Dk, Dv]`` in float32)."""
        return (jnp.zeros((batch, self.width - 1, self.in_proj_qkv.kernel.shape[1]), dtype),
                jnp.zeros((batch, self.hv, self.dk, self.dv), jnp.float32))

    def __call__(self, x: Float[Array, "B T D"], conv: jax.Array | None, rec: jax.Array | None, *,
                 lengths: Int[Array, "B"] | None = None, defer: bool = False, impl: str = "xla",
                 packed: PackedLayout | None = None):
        """Mix ``x`` (already input-normed) given the states before it.

        Returns ``(out, conv, rec, record)``: the states after the first ``lengths[b]`` tokens (``None``: all T;
        later tokens are identity updates, so right padding leaves no trace), or with ``defer`` the states
        unchanged plus ``record`` = ``(window, k, cum, v_new)``, from which :func:`settle` forms the states
        after any prefix once the caller knows how many tokens to keep. ``impl="cuda"``: short blocks through the
        GPU kernel where it applies (:func:`kernel_block`; its record holds k per key head).

        ``packed`` (compact mode's verify windows packed end to end; implies ``defer``): ``x`` is ``[1, T, D]``.
        The projections run over the T packed tokens; the conv and the recurrence over each row's window back in
        its ``[B, L', …]`` block (L' = ``packed.block``; zeros past a window: later positions, which no prefix
        that is kept reads); the record is that block's.
        """
        mixed = self.in_proj_qkv(x)  # [B, T, C], channels grouped by key head
        beta = jax.nn.sigmoid(self.in_proj_b(x)).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if packed is not None:
            mixed, beta, g = (packed.unpack(a[0]) for a in (mixed, beta, g))
            defer = True
        out, conv, rec, record = self._mix(mixed, beta, g, conv, rec, lengths=lengths, defer=defer, impl=impl)
        if packed is not None:
            out = packed.pack(out)[None]
        b, t, _ = x.shape
        z = self.in_proj_z(x).reshape(b, t, self.hv, self.dv)
        out = self.norm(out.astype(x.dtype), z).reshape(b, t, self.hv * self.dv)
        return self.out_proj(out), conv, rec, record

    def _mix(self, mixed: Float[Array, "B T C"], beta: Float[Array, "B T H"], g: Float[Array, "B T H"], conv, rec,
             *, lengths, defer: bool, impl: str):
        """The conv and the delta rule over projected rows: ``(out [B, T, H, Dv] float32, conv, rec, record)``."""
        b, t, _ = mixed.shape
        if conv is None:
            conv, rec = self.zero_states(b, mixed.dtype)
        window = jnp.concatenate([conv.astype(mixed.dtype), mixed], axis=1)  # [B, R+T, C]
        qkv = jax.nn.silu(self.conv1d(window, t)).reshape(b, t, self.hk, -1)  # [B, T, Hk, 2Dk + r·Dv]
        short = defer or t <= CHUNK  # one chunk: verify blocks, decode steps, short prompts
        fused = kernel_block(impl, qkv, g, beta, rec, None if defer else lengths, key_dim=self.dk,
                             advance=not defer) if short else None
        if fused is None:
            out, rec, record = self._delta_rule(qkv, g, beta, rec, window, lengths, defer=defer, short=short)
        else:  # the GPU kernel, reading q, k, v from qkv as they lie
            out, res = fused
            record, rec = ((window, *res), rec) if defer else (None, res)
        if not defer:
            conv = conv_history(window, lengths, self.width - 1)
        return out, conv, rec, record

    def _delta_rule(self, qkv, g, beta, rec, window, lengths, *, defer: bool, short: bool):
        """The jnp delta rule: ``(out, rec, record)`` (one chunk when ``short``, else over chunks)."""
        b, t = qkv.shape[:2]
        q = qkv[..., :self.dk]
        k = qkv[..., self.dk:2 * self.dk]
        v = qkv[..., 2 * self.dk:].reshape(b, t, self.hv, self.dv).astype(jnp.float32)
        rep = self.hv // self.hk  # value head i reads key head i // rep (transformers' repeat_interleave)
        q = jnp.repeat(l2norm(q.astype(jnp.float32)), rep, axis=2) * (self.dk ** -0.5)
        k = jnp.repeat(l2norm(k.astype(jnp.float32)), rep, axis=2)
        record = None
        if short:
            out, (k_, cum, v_new) = delta_rule_block(q, k, v, g, beta, rec)
            if defer:
                record = (window, k_, cum, v_new)
            else:
                n = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
                rec = state_after(rec, k_, cum, v_new, n)
        else:
            if lengths is not None:  # tokens past a row's length become identity updates
                live = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
                g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
            out, rec = delta_rule_chunked(q, k, v, g, beta, rec, chunk=CHUNK)  # CHUNK read at trace time
        return out, rec, record


def pad_record(record: tuple, block: int) -> tuple:
    """A deferred block's record of T tokens as one of ``block`` ≥ T (zeros after: tokens no kept prefix reads),
    so that compact mode's tiers, whose windows fit blocks of different widths, return one shape."""
    return tuple(jnp.pad(a, [(0, 0), (0, block - record[1].shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in record)


def settle(conv: jax.Array, rec: jax.Array, record: tuple, n: Int[Array, "B"]) -> tuple[jax.Array, jax.Array]:
    """The (conv history, recurrent state) after the first ``n[b]`` tokens of a deferred block."""
    window, k, cum, v_new = record
    return conv_history(window, n, conv.shape[1]).astype(conv.dtype), state_after(rec, k, cum, v_new, n)
