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
* :func:`packed_verify_attention` — compact mode's packed windows over a cache that is only read (each
  window's own K/V beside it, written after the tier's conditional): draft attention's form, causal;
  :func:`packed_verify` is a decoder layer's call of it.

The first two are written as one joint softmax over key groups so the (large) context cache is never concatenated
with anything. Scores and softmax are float32 whatever the input dtype.

``impl`` picks the implementation: ``"xla"`` (these references), ``"pallas"`` (TPU Mosaic kernels,
:mod:`dflash_jax.pallas`), ``"cuda"`` (Pallas-on-Triton GPU kernels, :mod:`dflash_jax.cuda`); ``"auto"`` is
resolved by :func:`resolve_impl` to the kernel of the backend. A kernel asked for on another backend runs in
Pallas interpret mode (slow; for tests). Shapes a kernel does not support fall back to the reference with a
log line, at trace time. The target's static verify / AR step goes through the ragged kernel (static windows
of T rows), compact mode's packed windows through the draft kernel; prefill (:func:`prefill_attention`) runs
cuDNN's fused attention on GPUs and the reference elsewhere (compute-bound, not what our kernels are for).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

NEG_INF = -1e30
IMPLS = ("auto", "xla", "pallas", "cuda")
KERNEL_FOR_BACKEND = {"tpu": "pallas", "gpu": "cuda"}
log = logging.getLogger("dflash_jax")


def resolve_impl(impl: str, dtype=None) -> str:
    """``"auto"`` → the kernel implementation for the default backend (``"xla"`` where there is none).

    ``dtype``: the model's compute dtype. On a GPU, ``"auto"`` keeps float32 models on the XLA reference:
    measured on the H200 (RESULTS.md, 2026-12-01), the kernels' float32 path (TF32 dots, as XLA's) is only
    faster at short contexts and batch 1 (1.5× at 4k) and slower at 16k (0.73–0.83×); it runs when asked for
    by name (``"cuda"``). bfloat16, the serving dtype, is where the kernels win (1.5–2.7× at ≥ 4k).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    chosen = KERNEL_FOR_BACKEND.get(backend, "xla")
    if chosen == "cuda" and dtype is not None and jnp.dtype(dtype) == jnp.float32:
        _log_once("attention_impl='auto': float32 on GPU uses the XLA reference (the cuda kernels are tuned "
                  "for bfloat16; pass attention_impl='cuda' to use them anyway)")
        return "xla"
    return chosen


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


class KernelSet(NamedTuple):
    """One kernel package bound to this backend (interpret mode when the backend is not its own)."""

    native: bool  # compiled for this backend (else Pallas interpret mode)
    draft_reason: Callable
    verify_reason: Callable
    draft_op: Callable
    verify_op: Callable


@functools.cache
def _kernels(impl: str) -> KernelSet:
    native = KERNEL_FOR_BACKEND.get(jax.default_backend()) == impl
    if impl == "pallas":
        from jax.experimental.pallas import tpu as pltpu

        from dflash_jax import pallas as mod
        interp = None if native else pltpu.InterpretParams()
        draft_reason = lambda q, ck, bk, causal, window: mod.unsupported_reason(  # noqa: E731
            "draft", q, ck, interpret=interp, window=window)
        verify_reason = lambda q, kc, max_q_len, window=None, sinks=None: mod.unsupported_reason(  # noqa: E731
            "ragged_verify", q, kc, interpret=interp, max_q_len=max_q_len, window=window, sinks=sinks)
    else:
        from dflash_jax import cuda as mod
        interp = not native
        draft_reason = lambda q, ck, bk, causal, window: mod.draft_attention_unsupported_reason(  # noqa: E731
            q, ck, ck, bk, bk, causal=causal, window=window, interpret=interp)
        verify_reason = lambda q, kc, max_q_len, window=None, sinks=None: (  # noqa: E731
            mod.ragged_verify_unsupported_reason(q, kc, kc, sinks=sinks, max_q_len=max_q_len, window=window,
                                                 interpret=interp))
    if not native:
        log.warning("attention_impl=%r on a %s backend: running its kernels in Pallas interpret mode (slow)",
                    impl, jax.default_backend())
    return KernelSet(native, draft_reason, verify_reason, functools.partial(mod.draft_attention, interpret=interp),
                     functools.partial(mod.ragged_verify_attention, interpret=interp))


_PROBED: dict[tuple, str | None] = {}


def compile_probe(key: tuple, local: Callable, shapes: tuple) -> str | None:
    """Compile ``local`` alone for these (per-device) shapes once; the error's first line if it fails.

    The kernels' shape rules cannot foresee every compiler limit — the TPU kernels have never met a real
    TPU compiler here — and a kernel that fails to compile must not take the whole decode program down
    with it: the op falls back to the reference instead, with the reason logged. The TPU kernels are probed
    (a probe costs a compile per shape bucket); the GPU ones are compiled and tested on an H200.
    """
    key = key + tuple((s.shape, str(s.dtype)) for s in shapes)
    if key not in _PROBED:
        try:
            jax.jit(local).lower(*shapes).compile()
            _PROBED[key] = None
        except Exception as e:  # noqa: BLE001 — any compiler error means "use the reference"
            first = (str(e).strip().splitlines() or [""])[0][:300]
            _PROBED[key] = f"the kernel failed to compile: {type(e).__name__}: {first}"
    return _PROBED[key]


# How a kernel argument is laid out under a (dp, tp) mesh: the mesh axis of each of its dimensions.
_HEADS = ("dp", None, "tp", None)  # [B, ·, heads, H]: rows over dp, heads over tp
_HEAD_VECTOR = ("tp",)  # [N]: per query head (attention sinks)


def _rows(ndim: int) -> tuple:
    """[B, …]: rows over dp."""
    return ("dp",) + (None,) * (ndim - 1)


def _run_kernel(impl: str, op: str, key: tuple, local: Callable, reason_of: Callable,
                args: tuple, layouts: tuple[tuple, ...], warn_once: bool = False) -> jax.Array | None:
    """``local(*args)`` through the kernel, per shard when traced under a mesh; None (after a log line) when
    the kernel cannot take these shapes (its own rules, or a failed compile) and the caller must use the
    reference. ``layouts``: per argument, the mesh axis of each dimension (``_HEADS``, ``_rows(n)`` …); the
    result is laid out like the first argument. ``warn_once``: the fallback's line once per process (an op
    traced in every branch of a ``lax.switch``), not at every trace. The TPU kernels are compiled alone first
    (:func:`compile_probe`).

    Under a ``(dp, tp)`` mesh (see :mod:`dflash_jax.sharding`) attention is independent per row and per KV
    head, so each device runs the kernel on its own rows and heads (``shard_map``): nothing is gathered.
    That needs the KV heads split like the query heads (K divisible by tp); otherwise the reference runs.
    """
    mesh = jax.sharding.get_abstract_mesh()
    sharded = not (mesh.empty or mesh.size == 1)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if sharded else {}
    n_dp, n_tp = sizes.get("dp", 1), sizes.get("tp", 1)
    why = None
    if set(sizes) - {"dp", "tp"}:
        why = f"mesh axes {tuple(sizes)} (kernels shard over 'dp' and 'tp' only)"
    elif any(d % sizes.get(axis, 1) for a, layout in zip(args, layouts) for d, axis in zip(a.shape, layout)
             if axis is not None):
        why = (f"arguments of shapes {[tuple(a.shape) for a in args]} do not split over tp={n_tp}, dp={n_dp} "
               f"(rows over dp, heads over tp)")
    else:
        shapes = tuple(jax.ShapeDtypeStruct(tuple(d // sizes.get(axis, 1) if axis else d
                                                  for d, axis in zip(a.shape, layout)), a.dtype)
                       for a, layout in zip(args, layouts))
        why = reason_of(*shapes)
        if why is None and impl == "pallas" and _kernels(impl).native:
            why = compile_probe((impl, op) + key, local, shapes)
    if why is not None:
        message = f"attention_impl={impl!r}: {op} uses the XLA reference for this shape ({why})"
        if warn_once:
            _warn_once(message)
        else:
            log.warning(message)
        return None
    if not sharded:
        return local(*args)
    from jax.sharding import PartitionSpec as P
    specs = tuple(P(*(axis if axis in sizes else None for axis in layout)) for layout in layouts)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)


# False: the drafted steps' cache reads are not tied to their layers (read_after; A/B runs:
# `bench_cpu_costs.py --parts cache_reads`, `profile_cpu_step.py --tie-cache-reads off`).
TIE_CPU_CACHE_READS = True


def read_after(x: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A layer's cache operands for the attention reference, made to depend on the layer's input ``x`` (on CPUs;
    elsewhere returned as they are). Used where compact's drafted steps read caches: the packed verify, the drafter.

    XLA:CPU lays each layer's cache out afresh for the attention GEMMs (a transposing copy of the whole cache).
    With nothing tying those copies to their layers its runtime, which runs operations as soon as their operands
    are ready, starts every layer's copy at the start of a drafted step, beside the drafter, where each costs ~3×
    as much (its output out of cache by the time its layer reads it): 18 ms of thread time in a 75 ms step at
    ``make demo``'s batch, 10 ms when each copy waits for its layer, and that batch decodes ~5 % faster
    (``benchmarks/RESULTS.md``, session 29; the plain decode step orders them well without it, so it is not
    tied). An optimization barrier does not order them
    (XLA:CPU drops it first), so each cache gets a zero computed from ``x`` added: exact (``isfinite`` is 0 or
    1, times 0), and the add fuses into the copy. Only the attention's read is tied: a layer's cache stays."""
    if not TIE_CPU_CACHE_READS or jax.default_backend() != "cpu":
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
    impl: str = "xla",
    sinks: Float[Array, "N"] | None = None,
    window: int | None = None,
) -> Float[Array, "B T N H"]:
    """Causal attention of queries at ``q_positions`` over a cache indexed by absolute position.

    With a kernel ``impl`` the rows must be consecutive windows ending at ``q_positions[:, -1]`` (the verify
    block / AR step: their K/V already written), which is the ragged op with ℓ_r = T for every row.
    ``sinks`` (a logit per query head in the softmax denominator) and ``window`` (a query at p sees keys at
    ``p - window < j <= p``) are gpt-oss's; both kernels take them.
    """
    if impl in ("pallas", "cuda"):
        kernels = _kernels(impl)

        def local(q, k_cache, v_cache, q_positions, sinks=None):
            b, t, n, h = q.shape
            cu = jnp.asarray(np.arange(b + 1, dtype=np.int32) * t)  # a constant: no kernel per layer each step
            kv_lens = (q_positions[:, -1] + 1).astype(jnp.int32)
            out = kernels.verify_op(q.reshape(b * t, n, h), k_cache, v_cache, cu, kv_lens, sinks, max_q_len=t,
                                    window=window)
            return out.reshape(q.shape)

        def reason(q, k_cache, v_cache, q_positions, sinks=None):
            b, t, n, h = q.shape
            return kernels.verify_reason(jax.ShapeDtypeStruct((b * t, n, h), q.dtype), k_cache, t, window, sinks)

        heads = () if sinks is None else (sinks,)
        out = _run_kernel(impl, "verify attention", (window,), local, reason, (q, k_cache, v_cache, q_positions,
                                                                               *heads),
                          (_HEADS, _HEADS, _HEADS, _rows(2)) + (_HEAD_VECTOR,) * len(heads))
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
    impl: str = "xla",
    sinks: Float[Array, "N"] | None = None,
    window: int | None = None,
) -> Float[Array, "B T N H"]:
    """A prompt's causal attention over its own keys (an empty cache: positions ``0 … T-1`` in every row; right
    padding sits after every real token, so causality alone keeps it out).

    With the GPU kernels (``impl="cuda"`` on a GPU backend), half-precision inputs, no sinks and head size ≤ 128:
    cuDNN's fused flash attention (``jax.nn.dot_product_attention``): prefill is compute-bound, and the reference
    materializes and transposes [B, N, T, T] float32 scores (about half of a 512-token prefill's kernel time on
    an H200, RESULTS 2026-12-04 session 15). Elsewhere the reference, :func:`cache_attention`."""
    h = q.shape[-1]
    if (impl == "cuda" and jax.default_backend() == "gpu" and sinks is None and h % 8 == 0 and h <= 128
            and q.dtype in (jnp.bfloat16, jnp.float16)):
        return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True,
                                            local_window_size=None if window is None else (window - 1, 0),
                                            implementation="cudnn")
    return cache_attention(q, k, v, positions, impl="xla", sinks=sinks, window=window)


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
    impl: str = "xla",
    sinks: Float[Array, "N"] | None = None,
    warn_once: bool = False,
) -> Float[Array, "B L N H"]:
    """Block queries over injected context K/V (positions < ctx_len) and the block's own K/V.

    The kernels need consecutive block positions (``q_positions[b] = q_positions[b, 0] + arange(L)``), which the
    decode loop always passes. ``sinks`` (gpt-oss, as in :func:`cache_attention`): the reference only.
    ``warn_once``: a fallback's line once per process (see :func:`_run_kernel`)."""
    if impl in ("pallas", "cuda") and sinks is not None:
        _warn_once(f"attention_impl={impl!r}: block attention with sinks uses the XLA reference (the block "
                   f"kernels take no sinks)")
    elif impl in ("pallas", "cuda"):
        kernels = _kernels(impl)

        def local(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len):
            return kernels.draft_op(q, ctx_k, ctx_v, blk_k, blk_v, q_positions.astype(jnp.int32),
                                    ctx_len.astype(jnp.int32), causal=causal, window=window)

        def reason(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len):
            return kernels.draft_reason(q, ctx_k, blk_k, causal, window)

        out = _run_kernel(impl, "draft attention", (causal, window), local, reason,
                          (q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len),
                          (_HEADS,) * 5 + (_rows(2), _rows(1)), warn_once=warn_once)
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


# Searches inside a decode step avoid jnp.searchsorted's default, a binary search compiled as a loop: on a GPU
# each iteration is kernel launches, every step (~60 launches of a compact step at batch 64, which is
# launch-bound). One fused comparison of every value with every edge is cheapest while that is small; a sort
# (a few kernels, no loop) beyond (e.g. sampling tests' batches of thousands of rows).
COMPARE_ALL_MAX = 1 << 22


def find_bucket(edges: Int[Array, "E"], values: Int[Array, "*n"], side: str = "left") -> Int[Array, "*n"]:
    """``jnp.searchsorted(edges, values, side)`` without a loop."""
    method = "compare_all" if edges.shape[-1] * values.size <= COMPARE_ALL_MAX else "sort"
    return jnp.searchsorted(edges, values, side=side, method=method)


def ragged_verify_attention(
    q: Float[Array, "T N H"],
    k_cache: Float[Array, "B S K H"],
    v_cache: Float[Array, "B S K H"],
    cu_q_lens: Int[Array, "B+1"],
    kv_lens: Int[Array, "B"],
    sinks: Float[Array, "N"] | None = None,
    *,
    window: int | None = None,
) -> Float[Array, "T N H"]:
    """Verify windows of different lengths packed end to end (reference).

    Request ``r`` owns query rows ``cu_q_lens[r] : cu_q_lens[r+1]`` (its window of ℓ_r tokens, whose K/V
    are already written into the cache) and attends causally to cache row ``r`` up to ``kv_lens[r]``, which
    includes the window: window token ``i`` sits at position ``kv_lens[r] - ℓ_r + i``. Rows at or past
    ``cu_q_lens[B]`` (padding of T) give zeros. The static-window verify of the decode loop is the case
    ℓ_r = L for every r. ``sinks`` / ``window`` as in :func:`cache_attention`.
    """
    t = q.shape[0]
    b = k_cache.shape[0]
    tok = jnp.arange(t)
    row = jnp.clip(find_bucket(cu_q_lens, tok, side="right") - 1, 0, b - 1)
    win_len = cu_q_lens[row + 1] - cu_q_lens[row]
    pos = kv_lens[row] - win_len + (tok - cu_q_lens[row])
    out = cache_attention(q[:, None], k_cache[row], v_cache[row], pos[:, None], sinks=sinks, window=window)[:, 0]
    return jnp.where((tok < cu_q_lens[b])[:, None, None], out, 0).astype(q.dtype)


# --------------------------------------------------------------------------------------------------
# Packed verify windows (compact verify mode, :mod:`dflash_jax.decode.schedule`)
# --------------------------------------------------------------------------------------------------

# Tiers with room for every whole block use the dense layout (benchmarks turn it off to compare, at trace time).
DENSE_WHOLE_BLOCKS = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Each row's verify window (its first ℓ_r block tokens) packed end to end into T slots (a compiled tier).
    Slot t holds block token ``offsets[t]`` of row ``rows[t]``; row r's window starts at slot ``starts[r]``.

    ``dense`` (a tier with room for every row's whole block, T ≥ B·L): the windows stay in their rows' blocks,
    slot ``r·L + i`` holding row r's token i, valid while i < ℓ_r — packing and unpacking are reshapes, where
    gathering every token would buy nothing: the static verify's form, in a tier (the GPU kernel takes its
    rows as windows of whole blocks).

    ``groups`` > 1 (compact mode under a dp mesh): rows and slots split into that many equal groups, in order —
    group g's rows ``g·B/G …`` pack into its own slots ``g·T/G …`` (padding at the end of each group's slots), so
    packing, unpacking and the cache writes stay on the device that holds the group's rows."""

    starts: Int[Array, "B"]
    lens: Int[Array, "B"]  # ℓ_r
    kv_lens: Int[Array, "B"]  # anchor position + ℓ_r: the row's cache length once its window is written
    rows: Int[Array, "T"]  # padding: a row of the slot's group (its values are never used)
    offsets: Int[Array, "T"]  # padding: 0
    valid: Bool[Array, "T"]
    block: int = dataclasses.field(metadata=dict(static=True))  # L: the longest possible window
    groups: int = dataclasses.field(default=1, metadata=dict(static=True))
    dense: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @staticmethod
    def build(lens: Int[Array, "B"], anchor_pos: Int[Array, "B"], size: int, block: int, groups: int = 1
              ) -> "PackedLayout":
        """``lens``: ℓ_r ∈ [0, L] per row (0: the row verifies nothing); ``size``: T, with each group's Σ ℓ_r ≤
        T / ``groups``; a size of B·L or more gives the dense layout (of B·L slots)."""
        b = lens.shape[0]
        lens = lens.astype(jnp.int32)
        kv_lens = (anchor_pos + lens).astype(jnp.int32)
        if DENSE_WHOLE_BLOCKS and size >= b * block:
            rows = jnp.asarray(np.repeat(np.arange(b, dtype=np.int32), block))  # constants
            offsets = jnp.asarray(np.tile(np.arange(block, dtype=np.int32), b))
            return PackedLayout(jnp.asarray(np.arange(b, dtype=np.int32) * block), lens, kv_lens, rows, offsets,
                                offsets < lens[rows], block, groups, dense=True)
        bg, tg = b // groups, size // groups
        cu = jnp.concatenate([jnp.zeros((groups, 1), jnp.int32), jnp.cumsum(lens.reshape(groups, bg), axis=1)],
                             axis=1)  # [G, B/G + 1]: each group's window bounds in its own slots
        slot = jnp.arange(tg, dtype=jnp.int32)
        local = jax.vmap(lambda c: jnp.clip(find_bucket(c, slot, side="right") - 1, 0, bg - 1))(cu)
        valid = slot[None, :] < cu[:, bg:]
        offsets = jnp.where(valid, slot[None, :] - jnp.take_along_axis(cu, local, axis=1), 0)
        group = jnp.arange(groups, dtype=jnp.int32)[:, None]
        return PackedLayout((cu[:, :-1] + group * tg).reshape(b), lens, kv_lens,
                            (local + group * bg).reshape(size).astype(jnp.int32), offsets.reshape(size),
                            valid.reshape(size), block, groups)

    @property
    def cu_q_lens(self) -> Int[Array, "B+1"]:
        """The windows' slot bounds for the kernels (one group of windows end to end; a dense layout's rows
        as windows of whole blocks, ``r·L``)."""
        if self.groups != 1:
            raise ValueError("cu_q_lens describes one group of windows packed end to end")
        return jnp.concatenate([self.starts, self.starts[-1:] + (self.block if self.dense else self.lens[-1:])])

    @property
    def anchors(self) -> Int[Array, "B"]:
        """Each row's anchor position (its window's first): the cache holds what lies before it."""
        return self.kv_lens - self.lens

    @property
    def positions(self) -> Int[Array, "T"]:
        """Absolute position of each slot's token (padding: its row's anchor position)."""
        return self.anchors[self.rows] + self.offsets

    def local_rows(self) -> Int[Array, "T"]:
        """Each slot's row within its group."""
        if self.groups == 1:
            return self.rows
        t, bg = self.rows.shape[0], self.starts.shape[0] // self.groups
        return self.rows - (jnp.arange(t, dtype=jnp.int32) // (t // self.groups)) * bg

    def pack(self, x: Float[Array, "B L *f"]) -> Float[Array, "T *f"]:
        """``x``'s rows' windows (L ≥ ``block``: tokens from ``block`` on are never packed)."""
        if self.dense:
            return x[:, :self.block].reshape(-1, *x.shape[2:])
        if self.groups == 1:
            return x[self.rows, self.offsets]
        g = self.groups
        out = jax.vmap(lambda xg, r, o: xg[r, o])(x.reshape(g, -1, *x.shape[1:]), self.local_rows().reshape(g, -1),
                                                  self.offsets.reshape(g, -1))
        return out.reshape(-1, *out.shape[2:])

    def unpack(self, y: Float[Array, "T *f"]) -> Float[Array, "B L *f"]:
        """Back to ``[B, L, …]``; block slots past a row's window hold zeros."""
        if not self.dense:
            return gather_windows(y, self.starts, self.lens, self.block, self.groups)
        out = y.reshape(self.starts.shape[0], self.block, *y.shape[1:])
        inside = jnp.arange(self.block)[None, :] < self.lens[:, None]
        return jnp.where(inside.reshape(inside.shape + (1,) * (y.ndim - 1)), out, jnp.zeros((), y.dtype))


def gather_windows(y: Float[Array, "T *f"], starts: Int[Array, "B"], lens: Int[Array, "B"], width: int,
                   groups: int = 1) -> Float[Array, "B W *f"]:
    """Each row's window out of packed slots: row r's ``lens[r]`` slots from slot ``starts[r]``, then zeros, to
    ``width`` (W) tokens. With ``groups`` > 1 (:class:`PackedLayout`'s) each group gathers from its own T/groups
    slots, so nothing crosses the devices of a dp mesh."""
    t, b = y.shape[0], starts.shape[0]
    j = jnp.arange(width)[None, :]
    if groups == 1:
        out = y[jnp.clip(starts[:, None] + j, 0, t - 1)]
    else:
        tg, bg = t // groups, b // groups
        first = starts - (jnp.arange(b) // bg) * tg  # in the group's own slots
        out = jax.vmap(lambda yg, f: yg[jnp.clip(f[:, None] + j, 0, tg - 1)])(
            y.reshape(groups, tg, *y.shape[1:]), first.reshape(groups, bg))
        out = out.reshape(-1, *out.shape[2:])
    inside = j < lens[:, None]
    return jnp.where(inside.reshape(inside.shape + (1,) * (y.ndim - 1)), out, jnp.zeros((), y.dtype))


# The GPU packed kernel's second tile for short windows (cuda.packed_block_attention's ``short_q_len``; None:
# one tile of the block's length). Windows of ≤ 4 tokens then run the 16-row tile the AR step's kernel uses:
# the packed attention of a tier of 1 or 2 tokens a row at 64 rows 407 → 317-325 µs a step on an H200 (30
# layers; session 27's traces), the whole-block tier's unchanged. Benchmarks set it at trace time
# (``--packed-short-tile N``, 0: off).
PACKED_SHORT_Q_LEN: int | None = 4


def _packed_kernel_call(qkv, k_cache, v_cache, layout: PackedLayout, start, window) -> jax.Array | None:
    """The GPU kernel that reads and writes the packed rows itself (:func:`dflash_jax.cuda.packed_block_attention`),
    or None: under a mesh (compact mode does not run under one yet; the block kernels' path would shard) or
    where the kernel cannot take the shapes (logged once). A dense layout goes in as windows of whole blocks:
    its slots past a window hold the block's later drafts (finite, causal after the window: static's verify
    attends them too), whose outputs are never used."""
    mesh = jax.sharding.get_abstract_mesh()
    if not (mesh.empty or mesh.size == 1):
        return None
    from dflash_jax import cuda

    interpret = jax.default_backend() != "gpu"

    def local(qkv, k_cache, v_cache, cu, start):
        return cuda.packed_block_attention(qkv, k_cache, v_cache, cu, start, max_q_len=layout.block,
                                           short_q_len=PACKED_SHORT_Q_LEN, window=window, interpret=interpret)

    def reason(qkv, k_cache, v_cache, cu, start):
        return cuda.packed_block_unsupported_reason(qkv, k_cache, v_cache, max_q_len=layout.block, window=window,
                                                    interpret=interpret)

    return _run_kernel("cuda", "packed verify attention", (window, layout.block), local, reason,
                       (qkv, k_cache, v_cache, layout.cu_q_lens, start),
                       ((None,) * 3, (None,) * 4, (None,) * 4, (None,), (None,)), warn_once=True)


def split_qkv(qkv: Float[Array, "T N+2K H"], kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(queries [T, N, H], keys [T, K, H], values [T, K, H]) of the packed verify's one operand."""
    n = qkv.shape[1] - 2 * kv_heads
    return qkv[:, :n], qkv[:, n:n + kv_heads], qkv[:, n + kv_heads:]


def packed_kv(qkv: Float[Array, "T N+2K H"], kv_heads: int) -> Float[Array, "T 2 K H"]:
    """The keys and values of the packed verify's operand as one slice, for
    :class:`dflash_jax.models.target.PendingKV` (whose stack over the layers reads it: no kernel of its own)."""
    t, heads, h = qkv.shape
    return qkv[:, heads - 2 * kv_heads:].reshape(t, 2, kv_heads, h)


def packed_verify(q: Float[Array, "1 T N H"], k: Float[Array, "1 T K H"], v: Float[Array, "1 T K H"],
                  k_cache: Float[Array, "B S K H"], v_cache: Float[Array, "B S K H"], layout: PackedLayout, *,
                  impl: str, sinks: Float[Array, "N"] | None = None, window: int | None = None
                  ) -> tuple[Float[Array, "1 T N H"], Float[Array, "T 2 K H"]]:
    """A decoder layer's packed verify (rotary embedding applied): (its attention output, the windows' new K/V
    for :class:`dflash_jax.models.target.PendingKV`). Queries, keys and values go in as one ``[T, N + 2K, H]``
    operand, which one fusion writes; the barrier keeps it one buffer — XLA would otherwise rewrite PendingKV's
    slice of it into a concatenation of K and V of their own, one more kernel a layer in the packed tiers."""
    qkv = jax.lax.optimization_barrier(jnp.concatenate([q[0], k[0], v[0]], axis=1))
    out = packed_verify_attention(qkv, k_cache, v_cache, layout, impl=impl, sinks=sinks, window=window)
    return out[None], packed_kv(qkv, k.shape[2])


def packed_verify_attention(
    qkv: Float[Array, "T N+2K H"],
    k_cache: Float[Array, "B S K H"],
    v_cache: Float[Array, "B S K H"],
    layout: PackedLayout,
    *,
    impl: str = "xla",
    sinks: Float[Array, "N"] | None = None,
    window: int | None = None,
) -> Float[Array, "T N H"]:
    """Verify attention of packed windows whose own keys and values are *not* in the cache: slot t attends to
    its row's cache before the window (positions < the anchor's, written by earlier steps) and causally to its
    window's K/V. ``qkv``: each slot's queries, keys and values as the heads of one operand (rotary embedding
    applied; :func:`split_qkv`), which one fusion of the projection's output writes. The cache is only read,
    so a compiled tier (a branch of a ``lax.switch``) can run this and leave the write to after the
    conditional (:class:`dflash_jax.models.target.PendingKV`): a branch that writes a buffer gets its own copy
    of it from XLA, every cache of every layer each step.

    With ``impl="cuda"`` (no sinks, no mesh) one GPU kernel reads and writes the packed rows itself
    (padding slots get zeros). Otherwise the windows go back into their ``[B, L]`` block (zeros past a window:
    masked, as the block is causal) for :func:`draft_attention` — the block kernels (causal, sliding window)
    under ``impl``, the reference with ``sinks``; padding slots give their row's outputs and are never used."""
    start = layout.anchors
    if impl == "cuda" and sinks is None and layout.groups == 1:
        out = _packed_kernel_call(qkv, k_cache, v_cache, layout, start, window)
        if out is not None:
            return out
    q, k, v = split_qkv(qkv, k_cache.shape[2])
    positions = start[:, None] + jnp.arange(layout.block, dtype=jnp.int32)[None, :]
    out = draft_attention(layout.unpack(q), k_cache, v_cache, layout.unpack(k), layout.unpack(v),
                          positions, start, causal=True, window=window, impl=impl, sinks=sinks,
                          warn_once=True)  # traced in every tier of the switch
    return layout.pack(out)
