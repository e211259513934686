"""dflash_jax.cuda kernels against the jnp references in dflash_jax.kernels.

One file for both places: on a CPU backend the kernels run in Pallas interpret mode on small shapes; on a GPU
backend they are compiled through Triton and a few larger (Qwen3-8B-like, S = 4096) cases are added.

Every case fills the cache slots past each row's length with NaN for the kernel (they must never leak) and
with finite random values for the reference (which multiplies masked probabilities by V, so NaN would leak
there). Kernels and references run at matmul precision "highest" (IEEE float32 dots in both, not TF32), so
float32 tolerances are tight; bfloat16 ones are about 2e-2.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_jit
from dflash_jax.cuda import attention as cuda
from dflash_jax.kernels import attention as ref
from dflash_jax.kernels import packed
from dflash_jax.tuning import Kernels

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {jnp.float32: 2e-4, jnp.bfloat16: 2.5e-2}


@pytest.fixture(autouse=True)
def exact_float32():
    with jax.default_matmul_precision("highest"):
        yield


# Inputs are made with numpy (jax.random compiles a program per shape: seconds each on the CPU); kernels and
# references run as whole programs (conftest.fast_jit: compiled for speed on the CPU), not op by op.


def normal_init(rng: np.random.Generator, shape, dtype, scale=1.0) -> jax.Array:
    return jnp.asarray((rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(dtype))


def _poison(x: jax.Array, lens: jax.Array) -> jax.Array:
    """NaN in slots >= lens[b] of a [B, S, K, H] cache."""
    slot = np.arange(x.shape[1])[None, :, None, None]
    poisoned = np.where(slot < np.asarray(lens)[:, None, None, None], np.asarray(x, np.float32), np.nan)
    return jnp.asarray(poisoned.astype(x.dtype))


def _check(out: jax.Array, want: jax.Array, dtype) -> None:
    out32, want32 = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert out.dtype == want.dtype and out.shape == want.shape
    assert np.isfinite(out32).all(), "non-finite output (garbage leaked or rows left unwritten)"
    tol = TOL[dtype]
    np.testing.assert_allclose(out32, want32, atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------- draft

# (B, L, N, K, H, S, dtype, causal, window, tuning)
DRAFT_CASES = [
    (2, 4, 4, 4, 64, 96, jnp.float32, False, None, dict(num_splits=1, block_k=32)),  # G=1, L=4: 16-row tile
    (3, 8, 4, 2, 128, 200, jnp.bfloat16, False, None, dict(num_splits=3, block_k=32)),  # S % block_k != 0
    (2, 16, 8, 2, 64, 256, jnp.bfloat16, True, 40, dict(num_splits=2, block_k=32)),  # G=4, causal + window
    (2, 16, 4, 1, 64, 64, jnp.float32, False, 8, dict(num_splits=1, block_k=16)),  # window, non-causal
    (2, 8, 8, 4, 64, 128, jnp.float32, True, None, dict(num_splits=4, block_k=16)),  # causal, many splits
]
if ON_GPU:
    DRAFT_CASES += [
        (2, 16, 32, 8, 128, 4096, jnp.bfloat16, False, None, {}),  # Qwen3-8B heads, default tuning
        (1, 16, 32, 8, 128, 4096, jnp.bfloat16, True, 1024, {}),
        (3, 16, 16, 8, 64, 4096, jnp.float32, False, None, dict(num_splits=1)),
        (8, 8, 32, 8, 128, 1000, jnp.bfloat16, False, None, dict(block_k=128, num_warps=8, num_stages=2)),
    ]


def _draft_inputs(seed, b, l, n, k, h, s, dtype):
    rng = np.random.default_rng(seed)
    q = normal_init(rng, (b, l, n, h), dtype, 1.5)
    ctx_k, ctx_v = normal_init(rng, (b, s, k, h), dtype), normal_init(rng, (b, s, k, h), dtype)
    blk_k, blk_v = normal_init(rng, (b, l, k, h), dtype), normal_init(rng, (b, l, k, h), dtype)
    # Lengths: 0, full cache, and random in between.
    lens = rng.integers(0, s + 1, b)
    lens[0] = 0
    if b > 1:
        lens[1] = s
    ctx_len = jnp.asarray(lens, jnp.int32)
    q_positions = jnp.asarray(lens[:, None] + np.arange(l)[None], jnp.int32)
    return q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len


@pytest.mark.parametrize("case", DRAFT_CASES, ids=lambda c: "B{}-L{}-N{}-K{}-H{}-S{}-{}-causal{}-win{}".format(
    *c[:6], jnp.dtype(c[6]).name, c[7], c[8]))
def test_draft_attention_matches_reference(case):
    b, l, n, k, h, s, dtype, causal, window, tuning = case
    q, ctx_k, ctx_v, blk_k, blk_v, pos, ctx_len = _draft_inputs(len(DRAFT_CASES) + b + s, b, l, n, k, h, s, dtype)
    assert cuda.draft_attention_unsupported_reason(q, ctx_k, ctx_v, blk_k, blk_v, causal=causal, window=window,
                                                   interpret=INTERPRET) is None
    with jax.default_matmul_precision("highest"):
        want = fast_jit(ref.draft_attention, causal=causal, window=window)(q, ctx_k, ctx_v, blk_k, blk_v, pos,
                                                                             ctx_len)
    out = fast_jit(cuda.draft_attention, causal=causal, window=window, interpret=INTERPRET, **tuning)(
        q, _poison(ctx_k, ctx_len), _poison(ctx_v, ctx_len), blk_k, blk_v, pos, ctx_len)
    _check(out, want, dtype)


# ------------------------------------------------------------------------------------ ragged verify

# (B, Lmax, N, K, H, S, dtype, tuning)
VERIFY_CASES = [
    (3, 8, 8, 2, 64, 160, jnp.float32, dict(num_splits=1, block_k=32)),
    (4, 16, 8, 2, 128, 256, jnp.bfloat16, dict(num_splits=3, block_k=32)),
    (2, 4, 4, 4, 64, 64, jnp.float32, dict(num_splits=2, block_k=16)),  # G=1, 4-row windows: 16-row tile
    (3, 16, 16, 4, 64, 100, jnp.float32, dict(num_splits=2, block_k=16)),  # G=4
]
if ON_GPU:
    VERIFY_CASES += [
        (4, 16, 32, 8, 128, 4096, jnp.bfloat16, {}),
        (1, 16, 32, 8, 128, 4096, jnp.bfloat16, {}),
        (3, 16, 16, 8, 64, 4096, jnp.float32, dict(num_splits=1)),
        (8, 8, 32, 8, 128, 1000, jnp.bfloat16, dict(block_k=128, num_warps=8, num_stages=2)),
    ]


def _verify_inputs(seed, b, lmax, n, k, h, s, dtype, pad_rows=3):
    rng = np.random.default_rng(seed)
    wins = rng.integers(0, lmax + 1, b)
    wins[0] = 0  # an empty window
    if b > 1:
        wins[1] = lmax  # a full window
    kv = np.array([rng.integers(w, s + 1) for w in wins])
    if b > 1:
        kv[1] = s  # a full cache
    if b > 2:
        kv[2] = wins[2]  # the window is the whole context
    cu = np.concatenate([[0], np.cumsum(wins)]).astype(np.int32)
    t = int(cu[-1]) + pad_rows
    q = normal_init(rng, (t, n, h), dtype, 1.5)
    kc, vc = normal_init(rng, (b, s, k, h), dtype), normal_init(rng, (b, s, k, h), dtype)
    return q, kc, vc, jnp.asarray(cu), jnp.asarray(kv, jnp.int32)


@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: "B{}-L{}-N{}-K{}-H{}-S{}-{}".format(
    *c[:6], jnp.dtype(c[6]).name))
def test_ragged_verify_matches_reference(case):
    b, lmax, n, k, h, s, dtype, tuning = case
    q, kc, vc, cu, kv = _verify_inputs(b * 7 + s, b, lmax, n, k, h, s, dtype)
    assert cuda.ragged_verify_unsupported_reason(q, kc, vc, max_q_len=lmax, interpret=INTERPRET) is None
    with jax.default_matmul_precision("highest"):
        want = fast_jit(ref.ragged_verify_attention)(q, kc, vc, cu, kv)
    # Padding rows of the output must be written as zeros: poisoning the input q there must not matter.
    out = fast_jit(cuda.ragged_verify_attention, max_q_len=lmax, interpret=INTERPRET, **tuning)(
        q, _poison(kc, kv), _poison(vc, kv), cu, kv)
    _check(out, want, dtype)
    assert not np.asarray(out[int(cu[-1]):], np.float32).any()


def _poison_outside_windows(x: jax.Array, cu, kv, window: int | None, block: int) -> jax.Array:
    """NaN also in the KV blocks (of ``block`` rows) wholly before every query's sliding window of their request,
    and in the whole row of an empty window: the kernel must never read them."""
    wins, kv = np.diff(np.asarray(cu)), np.asarray(kv)
    lo = 0 if window is None else np.maximum(kv - wins - window + 1, 0) // block * block
    lo = np.where(wins == 0, x.shape[1], lo)
    slot = np.arange(x.shape[1])[None, :, None, None]
    return jnp.asarray(np.where(slot >= lo[:, None, None, None], np.asarray(x, np.float32), np.nan).astype(x.dtype))


# (B, Lmax, N, K, H, S, dtype, tuning, sliding window, sinks)
SINK_WINDOW_CASES = [
    (3, 8, 8, 2, 64, 160, jnp.float32, dict(num_splits=1, block_k=32), None, True),  # sinks, single pass
    (4, 16, 8, 2, 128, 256, jnp.bfloat16, dict(num_splits=3, block_k=32), 40, False),  # window, 3 splits
    (3, 16, 16, 4, 64, 100, jnp.float32, dict(num_splits=2, block_k=16), 20, True),  # both, G=4, 2 splits
    (2, 4, 4, 4, 64, 64, jnp.float32, dict(num_splits=1, block_k=16), 1, True),  # both, window 1 (itself)
]


@pytest.mark.parametrize("case", SINK_WINDOW_CASES, ids=lambda c: "B{}-L{}-N{}-K{}-S{}-{}-splits{}-win{}-sinks{}"
                         .format(*c[:4], c[5], jnp.dtype(c[6]).name, c[7]["num_splits"], *c[8:]))
def test_ragged_verify_sinks_and_window(case):
    """gpt-oss attention: a sink logit per query head in the denominator (counted once across splits) and
    sliding windows; blocks wholly before the windows, and empty windows' rows, are NaN: never read."""
    b, lmax, n, k, h, s, dtype, tuning, window, with_sinks = case
    q, kc, vc, cu, kv = _verify_inputs(b * 11 + s, b, lmax, n, k, h, s, dtype)
    sinks = normal_init(np.random.default_rng(s), (n,), jnp.float32, 2.0) if with_sinks else None
    assert cuda.ragged_verify_unsupported_reason(q, kc, vc, cu, kv, sinks, max_q_len=lmax, window=window,
                                                 interpret=INTERPRET) is None
    with jax.default_matmul_precision("highest"):
        want = fast_jit(ref.ragged_verify_attention, window=window)(q, kc, vc, cu, kv, sinks)
    kc, vc = (_poison_outside_windows(_poison(x, kv), cu, kv, window, tuning["block_k"]) for x in (kc, vc))
    out = fast_jit(cuda.ragged_verify_attention, max_q_len=lmax, window=window, interpret=INTERPRET, **tuning)(
        q, kc, vc, cu, kv, sinks)
    _check(out, want, dtype)
    assert not np.asarray(out[int(cu[-1]):], np.float32).any()


def test_ragged_verify_static_windows_equal_cache_attention():
    """ℓ_r = L for every r is the decode loop's static verify: same as cache_attention at those positions."""
    b, l, n, k, h, s = 2, 8, 4, 2, 64, 96
    rng = np.random.default_rng(3)
    q = normal_init(rng, (b, l, n, h), jnp.float32)
    kc, vc = normal_init(rng, (b, s, k, h), jnp.float32), normal_init(rng, (b, s, k, h), jnp.float32)
    kv = np.array([l + 5, s], np.int32)
    pos = jnp.asarray(kv[:, None] - l + np.arange(l)[None], jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = fast_jit(ref.cache_attention)(q, kc, vc, pos)
    cu = jnp.arange(b + 1, dtype=jnp.int32) * l
    out = fast_jit(cuda.ragged_verify_attention, max_q_len=l, interpret=INTERPRET, num_splits=2, block_k=16)(
        q.reshape(b * l, n, h), _poison(kc, kv), _poison(vc, kv), cu, jnp.asarray(kv))
    _check(out.reshape(b, l, n, h), want, jnp.float32)


# ---------------------------------------------------------------------- packed windows, own K/V apart

# (B, Lmax, N, K, H, S, dtype, window, tuning)
PACKED_CASES = [
    (3, 8, 8, 2, 64, 96, jnp.float32, None, dict(num_splits=1, block_k=32)),
    (4, 16, 8, 2, 64, 160, jnp.bfloat16, 40, dict(num_splits=3, block_k=32)),  # splits + sliding window
    (6, 16, 8, 2, 64, 96, jnp.float32, None, dict(num_splits=2, block_k=32, short_q_len=4)),  # both tiles
]
if ON_GPU:
    PACKED_CASES += [(64, 16, 9, 3, 64, 512, jnp.bfloat16, None, {}),  # SmolLM2's heads, default tuning
                     (64, 16, 9, 3, 64, 512, jnp.bfloat16, None, dict(short_q_len=4)),
                     (8, 16, 32, 8, 128, 4096, jnp.bfloat16, None, {})]


@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: "B{}-L{}-N{}-K{}-H{}-S{}-{}-win{}".format(
    *c[:6], jnp.dtype(c[6]).name, c[7]))
def test_packed_block_attention_matches_reference(case):
    """Compact mode's packed verify: each window attends to its row's cache before its first position and
    causally to its own K/V, read and written packed; as the reference (which unpacks to [B, L]). The cache
    from each window's start on, and q/K/V in the padding rows, are NaN: never read; padding rows come out 0."""
    b, lmax, n, k, h, s, dtype, window, tuning = case
    rng = np.random.default_rng(b * 11 + s)
    wins = rng.integers(0, lmax + 1, b)
    wins[0], wins[-1] = 0, lmax  # an empty and a full window
    if tuning.get("short_q_len"):  # windows at, under and over the short tile's length
        wins[1:4] = [1, tuning["short_q_len"], tuning["short_q_len"] + 1]
    starts = rng.integers(0, s - lmax + 1, b)
    starts[-1] = 0  # a window with no cache before it
    layout = packed.PackedLayout.build(jnp.asarray(wins, jnp.int32), jnp.asarray(starts, jnp.int32),
                                    int(wins.sum()) + 3, lmax)
    valid = np.asarray(layout.valid)[:, None, None]
    q = normal_init(rng, (layout.valid.shape[0], n, h), dtype, 1.5)
    kv = normal_init(rng, (layout.valid.shape[0], 2, k, h), dtype, 1.5)
    kc, vc = normal_init(rng, (b, s, k, h), dtype), normal_init(rng, (b, s, k, h), dtype)
    qkv = jnp.concatenate([q, kv.reshape(-1, 2 * k, h)], axis=1)  # heads: queries, keys, values
    with jax.default_matmul_precision("highest"):
        want = fast_jit(packed.packed_verify_attention, window=window)(qkv, kc, vc, layout)
    nan_pad = jnp.asarray(np.where(valid, np.asarray(qkv, np.float32), np.nan).astype(qkv.dtype))
    out = fast_jit(cuda.packed_block_attention, max_q_len=lmax, window=window, interpret=INTERPRET, **tuning)(
        nan_pad, _poison(kc, starts), _poison(vc, starts), layout.cu_q_lens, jnp.asarray(starts, jnp.int32))
    live = int(wins.sum())
    _check(out[:live], want[:live], dtype)
    assert not np.asarray(out[live:], np.float32).any()


def test_packed_block_attention_lowers_to_triton():
    """Through Pallas' Triton rules for a GPU at the embedded pair's compact tiers (64 rows × 1 / 16 tokens; and
    with the short windows' second tile)."""
    sds = jax.ShapeDtypeStruct
    for b, t, short in ((64, 64, None), (64, 1024, None), (64, 128, 4)):
        args = (sds((t, 9 + 2 * 3, 64), jnp.bfloat16),) + (sds((b, 512, 3, 64), jnp.bfloat16),) * 2 + (
            sds((b + 1,), jnp.int32), sds((b,), jnp.int32))
        text = jax.jit(lambda *a: cuda.packed_block_attention(*a, max_q_len=16, short_q_len=short)).trace(  # noqa: B023
            *args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "dflash_packed_block_attention" in text


# ----------------------------------------------------------------------------------- unsupported


def test_unsupported_reasons():
    sds = jax.ShapeDtypeStruct
    q, kv = sds((2, 16, 32, 128), jnp.bfloat16), sds((2, 512, 8, 128), jnp.bfloat16)
    blk = sds((2, 16, 8, 128), jnp.bfloat16)
    assert cuda.draft_attention_unsupported_reason(q, kv, kv, blk, blk, interpret=True) is None
    assert "head_dim" in cuda.draft_attention_unsupported_reason(
        sds((2, 16, 32, 96), jnp.bfloat16), sds((2, 512, 8, 96), jnp.bfloat16), sds((2, 512, 8, 96), jnp.bfloat16),
        sds((2, 16, 8, 96), jnp.bfloat16), sds((2, 16, 8, 96), jnp.bfloat16), interpret=True)
    assert "multiple" in cuda.draft_attention_unsupported_reason(
        sds((2, 16, 12, 128), jnp.bfloat16), sds((2, 512, 8, 128), jnp.bfloat16), kv, sds((2, 16, 8, 128),
                                                                                          jnp.bfloat16), blk,
        interpret=True)
    assert "tile" in cuda.draft_attention_unsupported_reason(
        sds((2, 128, 32, 128), jnp.bfloat16), kv, kv, sds((2, 128, 8, 128), jnp.bfloat16),
        sds((2, 128, 8, 128), jnp.bfloat16), interpret=True)
    assert "dtype" in cuda.draft_attention_unsupported_reason(
        sds((2, 16, 32, 128), jnp.int8), kv, kv, blk, blk, interpret=True)
    qv = sds((32, 32, 128), jnp.bfloat16)
    assert cuda.ragged_verify_unsupported_reason(qv, kv, kv, max_q_len=16, interpret=True) is None
    assert "max_q_len" in cuda.ragged_verify_unsupported_reason(sds((512, 32, 128), jnp.bfloat16), kv, kv,
                                                                interpret=True)
    assert cuda.ragged_verify_unsupported_reason(qv, kv, kv, sinks=sds((32,), jnp.bfloat16), max_q_len=16,
                                                 window=8, interpret=True) is None
    assert "window" in cuda.ragged_verify_unsupported_reason(qv, kv, kv, max_q_len=16, window=0, interpret=True)
    assert "sinks" in cuda.ragged_verify_unsupported_reason(qv, kv, kv, sinks=sds((8,), jnp.float32), max_q_len=16,
                                                            interpret=True)
    if not ON_GPU:
        assert "GPU" in cuda.ragged_verify_unsupported_reason(qv, kv, kv, max_q_len=16)


def test_float32_dots_follow_the_default_matmul_precision():
    """TF32 (tensor cores) at JAX's default precision, as XLA's float32 dots; IEEE float32 under "highest"."""
    kw = dict(rows=16, n=8, k=2, h=64, s=256, programs=4, block_k=None, num_splits=None, min_chunk=64,
              num_warps=None, num_stages=None)
    assert cuda._make_tiling(dtype=jnp.float32, **kw).ieee_f32  # this module runs under "highest"
    assert not cuda._make_tiling(dtype=jnp.bfloat16, **kw).ieee_f32
    with jax.default_matmul_precision("default"):
        assert not cuda._make_tiling(dtype=jnp.float32, **kw).ieee_f32
    with jax.default_matmul_precision("float32"):
        assert cuda._make_tiling(dtype=jnp.float32, **kw).ieee_f32


def test_splits_only_where_the_programs_leave_sms_idle_or_the_cache_is_long(monkeypatch):
    """Split-KV: ~3 programs an SM below one program an SM; once the grid fills the SMs, only caches long enough
    for chunks of FILLED_MIN_CHUNK rows are split (a split's extra pass and merge cost more on short caches)."""
    monkeypatch.setattr(cuda, "num_sms", lambda: 132)
    kw = dict(rows=16, n=9, k=3, h=64, dtype=jnp.bfloat16, block_k=None, num_splits=None,
              min_chunk=cuda.DEFAULT_MIN_CHUNK, num_warps=None, num_stages=None)
    splits = lambda programs, s: cuda._make_tiling(programs=programs, s=s, **kw).num_splits  # noqa: E731
    assert splits(16 * 3, 768) == 3  # 48 programs: split to fill the SMs, chunks of 256 rows
    assert splits(128 * 3, 768) == 1  # 384 programs fill them: one pass
    assert splits(44 * 3, 640) == 1
    assert splits(43 * 3, 640) == 2  # 129 programs: three SMs idle, the old rule
    assert splits(64 * 3, 4096) == 3  # a long cache is still split, in chunks of ≥ FILLED_MIN_CHUNK rows
    assert splits(64 * 3, 2048) == 2


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's fused attention: GPUs only (on a CPU prefill runs the reference)")
@pytest.mark.parametrize("b,t,n,k,h,window", [(3, 512, 9, 3, 64, None), (1, 1024, 32, 8, 128, None),
                                              (2, 256, 8, 2, 64, 128)])
def test_prefill_attention_matches_reference(b, t, n, k, h, window):
    """cuDNN's causal attention over the prompt (bfloat16) against the float32-softmax reference."""
    rng = np.random.default_rng(t + n)
    q, kk, v = (normal_init(rng, (b, t, heads, h), jnp.bfloat16) for heads in (n, k, k))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    got = jax.jit(lambda *a: ref.prefill_attention(*a, kernels=Kernels("cuda"), window=window))(q, kk, v, positions)
    want = jax.jit(lambda *a: ref.cache_attention(*a, window=window))(q, kk, v, positions)
    assert "cudnn" in jax.jit(lambda *a: ref.prefill_attention(*a, kernels=Kernels("cuda"), window=window)).lower(
        q, kk, v, positions).as_text().lower()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[jnp.bfloat16],
                               rtol=TOL[jnp.bfloat16])


# ------------------------------------------------------------------------------------ cache write

@pytest.mark.parametrize("dtype,w", [(jnp.float32, 5), (jnp.bfloat16, 16)])
def test_write_pending_matches_the_scatters(dtype, w):
    """Compact's deferred cache write in one kernel: every layer's keys and values land where PendingKV's gather
    and two scatters a layer put them — row b's window, read from its packed slots, at its own start, then
    zeros up to the width; a window that reaches the cache's last slot, an empty one and one whose tile runs
    past the packed slots included — and nothing else of the caches changes (exactly: a copy)."""
    from dflash_jax.cuda.cache_write import write_pending, write_pending_unsupported_reason
    from dflash_jax.models.target import KVCache, PendingKV

    nl, b, k, h, s = 3, 4, 3, 16, 40
    rng = np.random.default_rng(w)
    lens = np.asarray([w, 0, 2, w - 1])
    slots = np.concatenate([[0], np.cumsum(lens)[:-1]])
    t = int(lens.sum()) + 2  # two padding slots: the last window's tile reads past them, masked
    kv = normal_init(rng, (t, nl, 2, k, h), dtype)
    starts = jnp.asarray([s - w, 7, 12, 0], jnp.int32)
    cache = KVCache(*(tuple(normal_init(rng, (b, s, k, h), dtype) for _ in range(nl)) for _ in range(2)))
    assert write_pending_unsupported_reason(kv, cache.k + cache.v, rows=b, interpret=INTERPRET) is None
    pending = PendingKV(starts, jnp.asarray(slots, jnp.int32), jnp.asarray(lens, jnp.int32), kv, width=w)
    want = pending.write(cache)
    got_k, got_v = jax.jit(lambda *a: write_pending(*a, width=w, interpret=INTERPRET))(
        kv, pending.slots, pending.lens, starts, cache.k, cache.v)
    for got, ref_cache in zip(got_k + got_v, want.k + want.v):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref_cache, np.float32))
    # the reference itself: row 2's window, then zeros, at its start; the empty row's width of zeros
    np.testing.assert_array_equal(np.asarray(want.k[1][2, 12:14], np.float32),
                                  np.asarray(kv[slots[2]:slots[2] + 2, 1, 0], np.float32))
    assert not np.asarray(want.v[0][2, 14:12 + w], np.float32).any() and not np.asarray(want.k[2][1, 7:7 + w]).any()


def test_write_pending_lowers_to_triton_and_refuses_odd_shapes():
    """At the embedded pair's shapes (30 layers, 64 rows, windows of 16) through Pallas' Triton rules; shapes it
    cannot take are refused with the reason."""
    from dflash_jax.cuda.cache_write import write_pending, write_pending_unsupported_reason

    sds = jax.ShapeDtypeStruct
    kv, caches = sds((1024, 30, 2, 3, 64), jnp.bfloat16), (sds((64, 512, 3, 64), jnp.bfloat16),) * 60
    assert write_pending_unsupported_reason(kv, caches, rows=64, interpret=True) is None
    rows = (sds((64,), jnp.int32),) * 3
    text = jax.jit(lambda kv, slots, lens, starts, *c: write_pending(kv, slots, lens, starts, c[:30], c[30:],
                                                                     width=16)).trace(
        kv, *rows, *caches).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "dflash_write_pending_kv" in text
    assert "caches" in write_pending_unsupported_reason(kv, caches[:59], rows=64, interpret=True)
    assert "not all" in write_pending_unsupported_reason(kv, caches[:59] + (sds((64, 256, 3, 64), jnp.bfloat16),),
                                                         rows=64, interpret=True)
    assert "head_dim" in write_pending_unsupported_reason(sds((1024, 30, 2, 3, 96), jnp.bfloat16),
                                                          (sds((64, 512, 3, 96), jnp.bfloat16),) * 60, rows=64,
                                                          interpret=True)


@pytest.mark.parametrize("t,size", [(24, 40), (300, 1024)])
def test_place_pending_copies_the_tier_slots_only(t, size):
    """A tier's K/V placed in the largest tier's slots by one kernel: the first T slots exactly the tier's (a
    last tile that runs past them included), and the cache write from the placed buffer the same as from XLA's
    zero padding — what lies past the T slots is never read. Lowered through Pallas' Triton rules."""
    from dflash_jax.cuda.cache_write import place_pending, place_pending_kernel, write_pending
    from dflash_jax.models.target import KVCache, PendingKV

    nl, b, k, h, s, w = 2, 3, 2, 16, 48, 8
    rng = np.random.default_rng(t)
    kv = normal_init(rng, (t, nl, 2, k, h), jnp.float32)
    placed = jax.jit(lambda kv: place_pending(kv, size, interpret=INTERPRET))(kv)
    assert placed.shape == (size, nl, 2, k, h)
    np.testing.assert_array_equal(np.asarray(placed[:t]), np.asarray(kv))
    lens = jnp.asarray([w, 0, 5], jnp.int32)
    pending = PendingKV(jnp.asarray([3, 9, s - 5], jnp.int32), jnp.asarray([0, w, t - 5], jnp.int32), lens, kv,
                        width=w)
    cache = KVCache(*(tuple(normal_init(rng, (b, s, k, h), jnp.float32) for _ in range(nl)) for _ in range(2)))
    padded = pending.widened(w, size)  # XLA's zeros
    on_placed = dataclasses.replace(padded, kv=placed)
    write = jax.jit(lambda p, c: write_pending(p.kv, p.slots, p.lens, p.starts, c.k, c.v, width=w,
                                               interpret=INTERPRET))
    for got, want in zip(sum(write(on_placed, cache), ()), sum(write(padded, cache), ())):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    sds = jax.ShapeDtypeStruct
    text = jax.jit(lambda kv: place_pending(kv, 1024)).trace(sds((64, 30, 2, 3, 64), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "dflash_place_pending_kv" in text
    assert place_pending_kernel(jnp.zeros((8, 1, 2, 1, 96)), 16, kernels=Kernels("cuda")) is None  # head_dim 96: XLA's pad instead
