"""The top-K op (:mod:`dflash_jax.kernels.top_k`): the chunked two-stage form (:mod:`dflash_jax.cuda.top_k`) gives
exactly what ``lax.top_k`` gives — values and indices, ties to the lowest index — on logits full of exact ties,
over ragged vocabularies, and the dispatch runs it only where ``KernelTuning.top_k_chunked`` asks. The LM head and
top-K in one GPU kernel (:mod:`dflash_jax.cuda.head_top_k`, interpret mode) gives the reference's values and ids
on integer-valued rows and heads (exact float32 sums, thousands of ties), both head layouts, ragged tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.cuda.head_top_k import head_top_k
from dflash_jax.cuda.top_k import chunk_width, chunked_top_k
from dflash_jax.kernels import top_k as top_k_op
from dflash_jax.tuning import KernelTuning, Kernels

CHUNKED = Kernels("cuda", KernelTuning(top_k_chunked=True, top_k_chunk=4096, top_k_chunked_max_rows=0))


def tied_logits(shape, dtype, seed: int = 0) -> jax.Array:
    """Integers in [-8, 8) (every value ties with thousands of others), some rows' best value placed only in
    the last (ragged) chunk, one row of a single repeated value, -0.0 beside +0.0 and a few -inf."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-8, 8, shape).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    rows[0, -3:] = 9.0  # the best only at the very end
    if len(rows) > 1:
        rows[1] = 0.0  # all equal: indices 0 … k-1
        rows[1, ::7] = -0.0  # +0 > -0 in lax.top_k's order
    if len(rows) > 2:
        rows[2, rng.integers(0, shape[-1], 50)] = -np.inf
    return jnp.asarray(x).astype(dtype)


def assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    # Bitwise, so -0.0 and +0.0 differ.
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))


@pytest.mark.parametrize("v, lead", [(49152 - 3, (3,)), (49152, (2, 2)), (49152 + 5, (4,)), (151936, (2, 3))])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_matches_lax_top_k(v, lead, dtype):
    x = tied_logits((*lead, v), dtype, seed=v)
    for k in (1, 16):
        want = jax.lax.top_k(x, k)
        for chunk in (4096, chunk_width(v, 4096), 16):  # padded (unless it divides), a divisor, chunks of k
            got = chunked_top_k(x, k, chunk)
            assert got[0].shape == (*lead, k) and got[1].dtype == jnp.int32
            assert_same(got, want)
        assert_same(top_k_op.top_k(x, k, kernels=CHUNKED), want)


def test_padding_never_wins_over_real_minus_inf():
    """A row of -inf (equal to the padding) and a row whose only finite values sit in the padded chunk."""
    x = np.full((2, 4096 + 10), -np.inf, np.float32)
    x[1, -4:] = [1.0, 3.0, 2.0, 3.0]
    for k in (1, 16):
        assert_same(chunked_top_k(jnp.asarray(x), k, 4096), jax.lax.top_k(jnp.asarray(x), k))


def test_chunk_width_prefers_a_divisor():
    assert chunk_width(151936, 4096) == 2374  # 151,936 = 2^7 · 1187
    assert chunk_width(49152, 4096) == 4096
    assert chunk_width(49157, 4096) == 4096  # a prime: the last chunk is padded


def test_the_dispatch_runs_chunked_only_when_asked():
    """Two TopKs in the program with ``top_k_chunked`` under "cuda"; one (lax.top_k) by default, under "xla",
    and where the row is one chunk."""
    def count(kernels, v=8192):
        jaxpr = jax.make_jaxpr(lambda x: top_k_op.top_k(x, 16, kernels=kernels))(jnp.zeros((16, v)))
        return str(jaxpr).count("top_k[")

    assert count(CHUNKED) == 2
    assert count(Kernels("cuda")) == count(Kernels("xla", CHUNKED.tuning)) == count(CHUNKED, v=4096) == 1
    # with a row limit: chunked up to that many rows (here 16), lax.top_k past it
    limited = Kernels("cuda", KernelTuning(top_k_chunked=True, top_k_chunk=4096, top_k_chunked_max_rows=16))
    many = jax.make_jaxpr(lambda x: top_k_op.top_k(x, 16, kernels=limited))(jnp.zeros((17, 8192)))
    assert count(limited) == 2 and str(many).count("top_k[") == 1
    with pytest.raises(ValueError, match="k = 17"):
        top_k_op.top_k(jnp.zeros((2, 16)), 17)


FUSED = Kernels("cuda", KernelTuning(head_top_k_kernel=True, head_top_k_block_v=128))


@pytest.mark.parametrize("lead, d, v, vocab_major", [((1, 15), 72, 1000, False), ((3, 11), 64, 1024, True),
                                                     ((1,), 40, 300, True), ((10, 15), 40, 300, False)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_top_k_kernel_matches_the_reference(lead, d, v, vocab_major, dtype):
    """Rows (15, 33 → padded to 64, 1, 150 → three tiles of 64) and heads of small integers: every logit is an exact float32 sum in any
    order, with thousands of ties, so values and ids equal ``lax.top_k`` of XLA's product bitwise. D and V ragged
    against the tiles (block_d 64, block_v 128) or not."""
    rng = np.random.default_rng(d + v)
    h = jnp.asarray(rng.integers(-2, 3, (*lead, d)), dtype)
    w = jnp.asarray(rng.integers(-2, 3, (v, d) if vocab_major else (d, v)), dtype)
    h = h.at[(0,) * len(lead)].set(0)  # a row of zeros: every logit +0, ids 0 … k-1
    for k in (1, 16):
        want = top_k_op.head_top_k(h, w, k, vocab_major=vocab_major)  # the reference: XLA's head, lax.top_k
        got = head_top_k(h, w, k, vocab_major=vocab_major, interpret=True)
        assert got[0].shape == (*lead, k) and got[0].dtype == jnp.float32 and got[1].dtype == jnp.int32
        assert_same(got, want)
    assert_same(top_k_op.head_top_k(h, w, 16, vocab_major=vocab_major, kernels=FUSED), want)


def test_the_dispatch_runs_the_fused_head_only_when_asked():
    """One kernel launch and no [N, V] product under "cuda" (``head_top_k_kernel``, on by default); the head and
    lax.top_k with it off, under "xla", past ``head_top_k_max_rows`` rows and for a k above the tile."""
    def program(kernels, rows=16, k=16):
        return str(jax.make_jaxpr(lambda h, w: top_k_op.head_top_k(h, w, k, vocab_major=False, kernels=kernels))(
            jnp.zeros((rows, 64)), jnp.zeros((64, 512))))

    fused = program(FUSED)
    assert fused.count("name=dflash_head_top_k") == 1 and "f32[16,512]" not in fused
    assert program(Kernels("cuda")) == fused
    off = Kernels("cuda", KernelTuning(head_top_k_kernel=False))
    for other in (program(off), program(Kernels("xla", FUSED.tuning)), program(FUSED, rows=1025), program(FUSED, k=129)):
        assert "name=dflash_head_top_k" not in other and other.count("top_k[") == 1
    with pytest.raises(ValueError, match="k = 513"):
        top_k_op.head_top_k(jnp.zeros((2, 64)), jnp.zeros((64, 512)), 513, vocab_major=False)


def test_head_top_k_lowers_to_triton():
    """Through Pallas' Triton rules for a GPU (what interpret mode does not check): Qwen3-8B's untied head (4096 ×
    151,936) at 15 rows, and SmolLM2's tied embedding (49,152 × 576, vocabulary-major) at 1 and 960 rows."""
    sds = jax.ShapeDtypeStruct
    for rows, d, v, vocab_major in ((15, 4096, 151936, False), (1, 576, 49152, True), (960, 576, 49152, True)):
        w = sds((v, d) if vocab_major else (d, v), jnp.bfloat16)
        text = jax.jit(lambda h, w, m=vocab_major: head_top_k(h, w, 16, vocab_major=m)).trace(
            sds((rows, d), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1 and "dflash_head_top_k" in text
