"""Pallas TPU kernels (dflash_jax.pallas) against the jnp references, in TPU interpret mode on CPU.

Caches are NaN-poisoned past each row's length: the kernels must keep the output finite and equal to the
reference run on the same cache with the poison replaced by zeros (the reference itself is not NaN-safe).
KV blocks are small so that every case spans several blocks, including a ragged last one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import fast_jit
from dflash_jax.kernels import attention as ref
from dflash_jax.pallas.attention import draft_attention, ragged_verify_attention, unsupported_reason

IP = pltpu.InterpretParams()
ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


# Inputs are made with numpy (jax.random compiles a program per shape: seconds each on the CPU), and kernels
# and references run as whole programs compiled for speed (conftest.fast_jit), not op by op.


def rand(seed: int, shape: tuple[int, ...], dtype) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype))


def poison(x: jax.Array, lens) -> jax.Array:
    """NaN in cache slots >= lens[b] of x [B,S,K,H]."""
    valid = np.arange(x.shape[1])[None, :] < np.asarray(lens)[:, None]
    return jnp.asarray(np.where(valid[:, :, None, None], np.asarray(x, np.float32), np.nan).astype(x.dtype))


def clean(x: jax.Array) -> jax.Array:
    """The poisoned cache with zeros for the reference (which is not NaN-safe)."""
    return jnp.asarray(np.nan_to_num(np.asarray(x, np.float32)).astype(x.dtype))


def check(out: jax.Array, want: jax.Array, dtype) -> None:
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert out.shape == want.shape
    assert np.isfinite(out).all(), "NaN/inf leaked into the output"
    np.testing.assert_allclose(out, want, atol=ATOL[dtype], rtol=0)


# ------------------------------------------------------------------------------------------------ draft


DRAFT_CASES = [
    # dtype, B, L, K, G, H, S, block_kv, ctx_len, causal, window, pos offset
    (jnp.float32, 3, 4, 2, 2, 64, 200, 64, [0, 37, 200], False, None, 0),
    (jnp.float32, 3, 4, 2, 2, 64, 200, 64, [0, 37, 200], True, None, 0),
    (jnp.float32, 3, 4, 2, 2, 64, 200, 64, [0, 137, 200], True, 70, 0),  # window skips leading blocks
    (jnp.float32, 3, 4, 2, 2, 64, 200, 64, [0, 37, 200], False, 3, 2),  # q_positions not starting at ctx_len
    (jnp.bfloat16, 2, 16, 1, 4, 128, 256, 128, [5, 256], False, None, 0),
    (jnp.bfloat16, 2, 16, 1, 4, 128, 256, 128, [5, 250], True, 100, 0),
    (jnp.float32, 2, 8, 4, 1, 128, 64, None, [64, 0], False, None, 0),  # one block = whole S
]


@pytest.mark.parametrize("dtype,b,l,k,g,h,s,bkv,ctx_len,causal,window,off", DRAFT_CASES)
def test_draft_attention_matches_reference(dtype, b, l, k, g, h, s, bkv, ctx_len, causal, window, off):
    n = k * g
    q, bk, bv = rand(0, (b, l, n, h), dtype), rand(1, (b, l, k, h), dtype), rand(2, (b, l, k, h), dtype)
    ck, cv = poison(rand(3, (b, s, k, h), dtype), ctx_len), poison(rand(4, (b, s, k, h), dtype), ctx_len)
    lens = jnp.asarray(ctx_len, jnp.int32)
    qpos = lens[:, None] + off + jnp.arange(l, dtype=jnp.int32)
    out = fast_jit(draft_attention, causal=causal, window=window, interpret=IP, block_kv=bkv)(
        q, ck, cv, bk, bv, qpos, lens)
    want = fast_jit(ref.draft_attention, causal=causal, window=window)(q, clean(ck), clean(cv), bk, bv, qpos, lens)
    check(out, want, dtype)


def test_draft_attention_head_groups():
    """kv_heads_per_block < K: a parallel head-group grid axis (K=16, groups of 8 KV heads)."""
    b, l, k, g, h, s = 1, 8, 16, 2, 64, 96
    f32 = jnp.float32
    q, bk, bv = rand(5, (b, l, k * g, h), f32), rand(6, (b, l, k, h), f32), rand(7, (b, l, k, h), f32)
    lens = jnp.array([70], jnp.int32)
    ck, cv = poison(rand(8, (b, s, k, h), f32), lens), poison(rand(9, (b, s, k, h), f32), lens)
    qpos = lens[:, None] + jnp.arange(l, dtype=jnp.int32)
    out = fast_jit(draft_attention, interpret=IP, block_kv=32, kv_heads_per_block=8)(q, ck, cv, bk, bv, qpos, lens)
    check(out, fast_jit(ref.draft_attention)(q, clean(ck), clean(cv), bk, bv, qpos, lens), f32)


# ------------------------------------------------------------------------------------------------ verify


def verify_inputs(dtype, win_lens, kv_lens, k, g, h, s, t_pad, seed=10):
    cu = np.concatenate([[0], np.cumsum(win_lens)]).astype(np.int32)
    t = int(cu[-1]) + t_pad
    q = rand(seed, (t, k * g, h), dtype)
    kc = poison(rand(seed + 1, (len(win_lens), s, k, h), dtype), kv_lens)
    vc = poison(rand(seed + 2, (len(win_lens), s, k, h), dtype), kv_lens)
    return q, kc, vc, jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32)


VERIFY_CASES = [
    # dtype, window lengths, kv_lens, K, G, H, S, block_kv, max_q_len, padding rows of T
    (jnp.float32, [3, 0, 8, 5], [10, 7, 256, 5], 2, 2, 128, 256, 64, 8, 3),  # empty window, full cache
    (jnp.float32, [3, 0, 8, 5], [10, 7, 256, 5], 2, 2, 128, 256, 64, None, 0),  # default max_q_len = T
    (jnp.bfloat16, [16, 1, 9], [16, 130, 192], 2, 4, 64, 192, 64, 16, 5),  # window = whole context
    (jnp.float32, [4, 4], [100, 37], 4, 1, 64, 160, 64, 4, 0),  # ragged last KV block (160 = 2.5 blocks)
]


@pytest.mark.parametrize("dtype,win,kv_lens,k,g,h,s,bkv,max_q_len,t_pad", VERIFY_CASES)
def test_ragged_verify_matches_reference(dtype, win, kv_lens, k, g, h, s, bkv, max_q_len, t_pad):
    q, kc, vc, cu, kvl = verify_inputs(dtype, win, kv_lens, k, g, h, s, t_pad)
    out = fast_jit(ragged_verify_attention, max_q_len=max_q_len, interpret=IP, block_kv=bkv)(q, kc, vc, cu, kvl)
    want = fast_jit(ref.ragged_verify_attention)(q, clean(kc), clean(vc), cu, kvl)
    check(out, want, dtype)
    if t_pad:
        assert not np.asarray(out[int(cu[-1]):]).any(), "rows past cu_q_lens[B] must be zeros"


def poison_outside_windows(x: jax.Array, win_lens, kv_lens, window: int | None, block: int) -> jax.Array:
    """NaN also in the KV blocks (of ``block`` slots) that lie wholly before every query's sliding window of
    their request, and in the whole row of an empty window: a kernel must never read them."""
    lo = [x.shape[1] if w == 0 else 0 if window is None else max(kv - w - window + 1, 0) // block * block
          for w, kv in zip(win_lens, kv_lens)]
    slot = np.arange(x.shape[1])[None, :, None, None]
    poisoned = np.where(slot >= np.asarray(lo)[:, None, None, None], np.asarray(x, np.float32), np.nan)
    return jnp.asarray(poisoned.astype(x.dtype))


SINK_WINDOW_CASES = [
    # dtype, window lengths, kv_lens, K, G, H, S, block_kv, max_q_len, padding rows, sliding window, sinks
    (jnp.float32, [3, 0, 8, 5], [10, 7, 256, 5], 2, 2, 64, 256, 64, 8, 3, None, True),  # sinks only
    (jnp.float32, [3, 0, 8, 5], [10, 7, 256, 150], 2, 2, 64, 256, 64, 8, 3, 70, False),  # window skips blocks
    (jnp.bfloat16, [16, 1, 9], [16, 130, 192], 2, 4, 64, 192, 64, 16, 5, 20, True),  # both; window < ℓ
    (jnp.float32, [4, 4], [100, 37], 4, 1, 64, 160, 64, 4, 0, 1, True),  # window 1: each query sees itself
]


@pytest.mark.parametrize("dtype,win,kv_lens,k,g,h,s,bkv,max_q_len,t_pad,window,with_sinks", SINK_WINDOW_CASES)
def test_ragged_verify_sinks_and_window(dtype, win, kv_lens, k, g, h, s, bkv, max_q_len, t_pad, window,
                                        with_sinks):
    """gpt-oss attention: sinks (one logit per query head in the denominator) and sliding windows. KV blocks
    wholly before a request's windows, and the rows of empty windows, are NaN as well: never read."""
    q, kc, vc, cu, kvl = verify_inputs(dtype, win, kv_lens, k, g, h, s, t_pad, seed=20)
    kc, vc = (poison_outside_windows(x, win, kv_lens, window, bkv) for x in (kc, vc))
    sinks = 2 * rand(21, (k * g,), jnp.float32) if with_sinks else None
    out = fast_jit(ragged_verify_attention, max_q_len=max_q_len, window=window, interpret=IP, block_kv=bkv)(
        q, kc, vc, cu, kvl, sinks)
    want = fast_jit(ref.ragged_verify_attention, window=window)(q, clean(kc), clean(vc), cu, kvl, sinks)
    check(out, want, dtype)
    assert not np.asarray(out[int(cu[-1]):]).any(), "rows past cu_q_lens[B] must be zeros"


def test_ragged_verify_all_empty_gives_zeros():
    q, kc, vc, cu, kvl = verify_inputs(jnp.float32, [0, 0], [0, 5], 2, 2, 64, 64, 4)
    out = fast_jit(ragged_verify_attention, max_q_len=4, interpret=IP, block_kv=32)(q, kc, vc, cu, kvl)
    assert out.shape == q.shape and not np.asarray(out).any()


def test_ragged_verify_window_longer_than_max_q_len_is_nan():
    """A contract violation (ℓ_r > max_q_len) must be loud, and must not disturb the other requests."""
    q, kc, vc, cu, kvl = verify_inputs(jnp.float32, [2, 6], [20, 30], 2, 2, 64, 64, 0)
    out = np.asarray(fast_jit(ragged_verify_attention, max_q_len=4, interpret=IP, block_kv=32)(q, kc, vc, cu, kvl))
    want = np.asarray(fast_jit(ref.ragged_verify_attention)(q, clean(kc), clean(vc), cu, kvl))
    np.testing.assert_allclose(out[:6], want[:6], atol=2e-5, rtol=0)  # request 0, request 1's first 4 rows
    assert np.isnan(out[6:]).all()


# ------------------------------------------------------------------------------------------------ support


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_unsupported_reason():
    q, kv = sds((2, 16, 8, 128)), sds((2, 4096, 2, 128))
    assert unsupported_reason("draft", q, kv, interpret=IP) is None
    assert unsupported_reason("ragged_verify", sds((32, 8, 128)), kv, interpret=IP, max_q_len=16) is None
    assert "multiple of KV heads" in unsupported_reason("draft", sds((2, 16, 6, 128)), sds((2, 64, 4, 128)))
    assert "dtype" in unsupported_reason("draft", q, sds((2, 4096, 2, 128), jnp.float32))
    f16 = jnp.float16
    assert "float16" in unsupported_reason("draft", sds((2, 16, 8, 128), f16), sds((2, 64, 2, 128), f16))
    assert "kv_heads_per_block" in unsupported_reason("draft", q, kv, kv_heads_per_block=1)
    assert "rank" in unsupported_reason("ragged_verify", q, kv)
    assert "window" in unsupported_reason("draft", q, kv, window=0)
    qv = sds((32, 8, 128))
    assert unsupported_reason("ragged_verify", qv, kv, interpret=IP, window=4, sinks=sds((8,))) is None
    assert "window" in unsupported_reason("ragged_verify", qv, kv, interpret=IP, window=0)
    assert "sinks" in unsupported_reason("ragged_verify", qv, kv, interpret=IP, sinks=sds((2,)))
    assert "sinks" in unsupported_reason("draft", q, kv, interpret=IP, sinks=sds((8,)))
    # Compiled (non-interpret) mode adds Mosaic-specific limits; on CPU it needs a TPU.
    assert "head_dim" in unsupported_reason("draft", sds((2, 16, 8, 8)), sds((2, 64, 2, 8)))
    assert "VMEM" in unsupported_reason("draft", sds((2, 16, 128, 256)), sds((2, 4096, 64, 256)), block_kv=4096)
    if jax.default_backend() != "tpu":
        assert "TPU backend" in unsupported_reason("draft", q, kv)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        draft_attention(jnp.zeros((1, 4, 6, 64)), *(jnp.zeros((1, 32, 4, 64)),) * 2, *(jnp.zeros((1, 4, 4, 64)),) * 2,
                        jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32), interpret=IP)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_mosaic(dtype):
    """Production-like shapes lower to Mosaic MLIR for platform 'tpu' (block-shape tiling rules, lowering
    rules of every primitive, dimension semantics). Interpret mode checks none of this; Mosaic's own layout
    passes (in libtpu) are not available here."""
    b, l, k, g, h, s = 2, 16, 16, 2, 128, 8192
    i32 = jnp.int32
    for kw in (dict(), dict(causal=True, window=512, kv_heads_per_block=16 if dtype == jnp.bfloat16 else 8)):
        args = (sds((b, l, k * g, h), dtype), sds((b, s, k, h), dtype), sds((b, s, k, h), dtype),
                sds((b, l, k, h), dtype), sds((b, l, k, h), dtype), sds((b, l), i32), sds((b,), i32))
        text = jax.jit(lambda *a: draft_attention(*a, **kw)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text
    args = (sds((b * l, k * g, h), dtype), sds((b, s, k, h), dtype), sds((b, s, k, h), dtype), sds((b + 1,), i32),
            sds((b,), i32))
    text = jax.jit(lambda *a: ragged_verify_attention(*a, max_q_len=l)).trace(*args).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    # gpt-oss: sinks (a lane-replicated [K, G·Lp, 128] float32 input) and a sliding window
    text = jax.jit(lambda *a: ragged_verify_attention(*a, max_q_len=l, window=128)).trace(
        *args, sds((k * g,), dtype)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
