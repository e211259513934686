"""The attention operations of the decode loop, as pure-jnp references, and the dispatch to kernels.

* :func:`cache_attention` — target attention over its KV cache (prefill and verify): query at absolute
  position p sees cache entries at positions ``j <= p``. Entries past a row's committed length are stale
  (rejected drafts) or padding; they always sit at positions greater than every current query and are
  overwritten before any later query can see them, so the position test alone is the whole mask.
* :func:`draft_attention` — drafter attention: block queries over the injected context cache (entries at
  positions ``< ctx_len``) plus the block's own keys, non-causal (or causal + sliding window for
  ``sliding_attention`` layers, as z-lab's reference does).
* :func:`ragged_verify_attention` — verify windows of different lengths packed end to end; the decode
  loop's static-window verify is its ℓ_r = L case.
* :func:`prefill_attention` — a prompt's causal attention over its own keys.
* :func:`read_after` — a layer's cache operands tied to its input on CPUs.

Compact mode's packed verify windows are :mod:`dflash_jax.kernels.packed`'s.

The first two are written as one joint softmax over key groups so the (large) context cache is never concatenated
with anything. Scores and softmax are float32 whatever the input dtype.

``kernels`` (:class:`dflash_jax.tuning.Kernels`) picks the implementation through
:mod:`dflash_jax.kernels.dispatch`: ``"xla"`` (these references), ``"pallas"`` (TPU Mosaic kernels,
:mod:`dflash_jax.pallas.attention`), ``"cuda"`` (Pallas-on-Triton GPU kernels, :mod:`dflash_jax.cuda.attention`).
A kernel asked for on another backend runs in Pallas interpret mode (slow; for tests). Shapes a kernel does
not support fall back to the reference with a log line, at trace time. The target's static verify / AR step
goes through the ragged kernel (static windows of T rows), compact mode's packed windows
(:mod:`dflash_jax.kernels.packed`) through the draft kernel or the GPU's packed one; prefill
(:func:`prefill_attention`) runs cuDNN's fused attention on GPUs and the reference elsewhere (compute-bound,
not what our kernels are for).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dflash_jax.kernels.common import NEG_INF, find_bucket, warn_once
from dflash_jax.kernels.dispatch import kernel
from dflash_jax.tuning import Kernels


def read_after(x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kernels: Kernels = Kernels()
               ) -> tuple[jax.Array, jax.Array]:
    """A layer's cache operands for the attention reference, made to depend on the layer's input ``x`` (on CPUs;
    elsewhere returned as they are). Used where compact's drafted steps read caches: the packed verify, the drafter.

    XLA:CPU lays each layer's cache out afresh for the attention GEMMs (a transposing copy of the whole cache).
    With nothing tying those copies to their layers its runtime, which runs operations as soon as their operands
    are ready, starts every layer's copy at the start of a drafted step, beside the drafter, where each costs ~3×
    as much (its output out of cache by the time its layer reads it): about a quarter of a step's thread time
    at ``make demo``'s batch, half that when each copy waits for its layer, and that batch decodes ~5 % faster (the
    plain decode step orders them well without it, so it is not tied). An optimization barrier does not order
    them (XLA:CPU drops it first), so each cache gets a zero computed from ``x`` added: exact (``isfinite`` is 0 or
    1, times 0), and the add fuses into the copy. Only the attention's read is tied: a layer's cache stays.
    ``kernels.tuning.tie_cpu_cache_reads`` False: returned as they are (A/B runs)."""
    if not kernels.tuning.tie_cpu_cache_reads or jax.default_backend() != "cpu":
        return k_cache, v_cache
    zero = jnp.isfinite(x[(slice(0, 1),) * x.ndim]).astype(k_cache.dtype).reshape(()) * 0
    return k_cache + zero, v_cache + zero


def _grouped_scores(q: Float[Array, "B T N H"], k: Float[Array, "B S K H"]) -> Float[Array, "B K G T S"]:
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    return jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * (h ** -0.5)


def _joint_softmax_attend(parts: list[tuple[jax.Array, jax.Array, jax.Array]], q_shape, dtype,
                          sinks: Float[Array, "N"] | None = None) -> jax.Array:
    """parts: (scores [B K G T S_i], mask [B T S_i], values [B S_i K H]) → out [B T N H].

    ``sinks``: one extra logit per query head that joins the denominator and carries no value (gpt-oss)."""
    masked = [jnp.where(m[:, None, None], s, NEG_INF) for s, m, _ in parts]
    m_max = masked[0].max(-1)
    for s in masked[1:]:
        m_max = jnp.maximum(m_max, s.max(-1))
    denom = 0.0
    if sinks is not None:
        kh, g = masked[0].shape[1:3]
        sink = sinks.astype(jnp.float32).reshape(1, kh, g, 1)  # query head n = kv head · G + g
        m_max = jnp.maximum(m_max, sink)
        denom = jnp.exp(sink - m_max)
    out = 0.0
    for s, (_, _, v) in zip(masked, parts):
        p = jnp.exp(s - m_max[..., None])
        denom = denom + p.sum(-1)
        out = out + jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.moveaxis(denom, 3, 1)[..., None]  # denom [B K G T] → [B T K G 1]
    b, t, n, h = q_shape
    return out.reshape(b, t, n, h).astype(dtype)


def cache_attention(
    q: Float[Array, "B T N H"],
    k_cache: Float[Array, "B S K H"],
    v_cache: Float[Array, "B S K H"],
    q_positions: Int[Array, "B T"],
    *,
    kernels: Kernels = Kernels(),
    sinks: Float[Array, "N"] | None = None,
    window: int | None = None,
) -> Float[Array, "B T N H"]:
    """Causal attention of queries at ``q_positions`` over a cache indexed by absolute position.

    With a kernel (``kernels.impl`` "pallas" / "cuda") the rows must be consecutive windows ending at
    ``q_positions[:, -1]`` (the verify block / AR step: their K/V already written), which is the ragged op with
    ℓ_r = T for every row.
    ``sinks`` (a logit per query head in the softmax denominator) and ``window`` (a query at p sees keys at
    ``p - window < j <= p``) are gpt-oss's; both kernels take them.
    """
    run = kernel("cache_attention", kernels)
    if run is not None:
        out = run(q, k_cache, v_cache, q_positions, sinks=sinks, window=window, kernels=kernels)
        if out is not None:
            return out
    s = k_cache.shape[1]
    mask: Bool[Array, "B T S"] = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]
    if window is not None:
        mask &= q_positions[:, :, None] - jnp.arange(s)[None, None, :] < window
    scores = _grouped_scores(q, k_cache)
    return _joint_softmax_attend([(scores, mask, v_cache)], q.shape, q.dtype, sinks)


def prefill_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    positions: Int[Array, "B T"],
    *,
    kernels: Kernels = Kernels(),
    sinks: Float[Array, "N"] | None = None,
    window: int | None = None,
) -> Float[Array, "B T N H"]:
    """A prompt's causal attention over its own keys (an empty cache: positions ``0 … T-1`` in every row; right
    padding sits after every real token, so causality alone keeps it out).

    With the GPU kernels (``kernels.impl == "cuda"``) on a GPU backend, half-precision inputs, no sinks and head
    size ≤ 128: cuDNN's fused flash attention (``jax.nn.dot_product_attention``; prefill is compute-bound, and
    the reference materializes and transposes [B, N, T, T] float32 scores, about half of a 512-token prefill's
    kernel time on a GPU). Elsewhere the reference, :func:`cache_attention`."""
    run = kernel("prefill_attention", kernels)
    if run is not None:
        out = run(q, k, v, positions, sinks=sinks, window=window, kernels=kernels)
        if out is not None:
            return out
    return cache_attention(q, k, v, positions, sinks=sinks, window=window)


def draft_attention(
    q: Float[Array, "B L N H"],
    ctx_k: Float[Array, "B S K H"],
    ctx_v: Float[Array, "B S K H"],
    blk_k: Float[Array, "B L K H"],
    blk_v: Float[Array, "B L K H"],
    q_positions: Int[Array, "B L"],
    ctx_len: Int[Array, "B"],
    *,
    causal: bool = False,
    window: int | None = None,
    kernels: Kernels = Kernels(),
    sinks: Float[Array, "N"] | None = None,
    once: bool = False,
) -> Float[Array, "B L N H"]:
    """Block queries over injected context K/V (positions < ctx_len) and the block's own K/V.

    The kernels need consecutive block positions (``q_positions[b] = q_positions[b, 0] + arange(L)``), which the
    decode loop always passes. ``sinks`` (gpt-oss, as in :func:`cache_attention`): the reference only.
    ``once``: a fallback's line once per process (see :func:`dflash_jax.kernels.common.run_kernel`)."""
    run = kernel("draft_attention", kernels)
    if run is not None and sinks is not None:
        warn_once(f"attention_impl={kernels.impl!r}: block attention with sinks uses the XLA reference (the "
                  f"block kernels take no sinks)")
    elif run is not None:
        out = run(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len, causal=causal, window=window,
                  kernels=kernels, once=once)
        if out is not None:
            return out
    s = ctx_k.shape[1]
    ctx_pos = jnp.arange(s)[None, None, :]
    qp = q_positions[:, :, None]
    ctx_mask = jnp.broadcast_to(ctx_pos < ctx_len[:, None, None], (q.shape[0], q.shape[1], s))
    blk_pos = q_positions[:, None, :]  # block keys sit at the block positions
    blk_mask = jnp.ones((q.shape[0], q.shape[1], q.shape[1]), bool)
    if causal:
        blk_mask &= blk_pos <= qp
    if window is not None:
        ctx_mask &= qp - ctx_pos < window
        blk_mask &= qp - blk_pos < window
        if not causal:
            blk_mask &= blk_pos - qp < window
    parts = [(_grouped_scores(q, ctx_k), ctx_mask, ctx_v), (_grouped_scores(q, blk_k), blk_mask, blk_v)]
    return _joint_softmax_attend(parts, q.shape, q.dtype, sinks)


def ragged_verify_attention(
    q: Float[Array, "T N H"],
    k_cache: Float[Array, "B S K H"],
    v_cache: Float[Array, "B S K H"],
    cu_q_lens: Int[Array, "B+1"],
    kv_lens: Int[Array, "B"],
    sinks: Float[Array, "N"] | None = None,
    *,
    window: int | None = None,
    kernels: Kernels = Kernels(),
) -> Float[Array, "T N H"]:
    """Verify windows of different lengths packed end to end (reference; ``kernels.tuning``: the bucket search's).

    Request ``r`` owns query rows ``cu_q_lens[r] : cu_q_lens[r+1]`` (its window of ℓ_r tokens, whose K/V
    are already written into the cache) and attends causally to cache row ``r`` up to ``kv_lens[r]``, which
    includes the window: window token ``i`` sits at position ``kv_lens[r] - ℓ_r + i``. Rows at or past
    ``cu_q_lens[B]`` (padding of T) give zeros. The static-window verify of the decode loop is the case
    ℓ_r = L for every r. ``sinks`` / ``window`` as in :func:`cache_attention`.
    """
    t = q.shape[0]
    b = k_cache.shape[0]
    tok = jnp.arange(t)
    row = jnp.clip(find_bucket(cu_q_lens, tok, side="right", tuning=kernels.tuning) - 1, 0, b - 1)
    win_len = cu_q_lens[row + 1] - cu_q_lens[row]
    pos = kv_lens[row] - win_len + (tok - cu_q_lens[row])
    out = cache_attention(q[:, None], k_cache[row], v_cache[row], pos[:, None], sinks=sinks, window=window)[:, 0]
    return jnp.where((tok < cu_q_lens[b])[:, None, None], out, 0).astype(q.dtype)


