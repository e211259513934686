"""The GPU dequantize-and-multiply kernel (dflash_jax.cuda.quantized) against the jnp reference
(dflash_jax.kernels.quantized.reference), and its dispatch.

One file for both places: on a CPU backend the kernel runs in Pallas interpret mode on small, ragged shapes
(several tiles, steps and D splits each); on a GPU it is compiled through Triton and the Qwen3-8B layer shapes
are added (``python -m pytest -q tests/test_quantized_kernels.py`` on the GPU machine).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_jit
from dflash_jax.cuda import quantized as cuda
from dflash_jax.kernels import quantized as op
from dflash_jax.quant import Scheme, quantize
from dflash_jax.tuning import KernelTuning, Kernels

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


@pytest.fixture(autouse=True)
def exact_float32():
    with jax.default_matmul_precision("highest"):
        yield


def _check(got: jax.Array, want: jax.Array, dtype) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    # Both accumulate exact products (int8 / e4m3 values are bf16 numbers) in float32; they differ in the
    # order of the sums and, in bf16, by the output's rounding.
    tol = (2e-5 if dtype == jnp.float32 else 1.2e-2) * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def _inputs(seed: int, t: int, d: int, e: int, scheme: Scheme, dtype):
    rng = np.random.default_rng(seed)
    q, s = quantize(rng.standard_normal((d, e), np.float32) / np.sqrt(d), scheme)
    x = rng.standard_normal((t, d), np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(q), jnp.asarray(s), scheme.blocks(d, e)


# (T, D, E, scheme, activation dtype, tuning): D and E not multiples of the tiles; small tiles so that every
# case has several programs and loop steps in interpret mode.
CASES = [
    (1, 200, 72, Scheme("int8"), jnp.float32, dict(block_d=32, block_e=16)),  # one token: the GEMV path
    (1, 200, 72, Scheme("int8"), jnp.float32, dict(block_d=32, block_e=16, gemv=False)),  # ... as a 16-row dot
    (3, 200, 72, Scheme("fp8"), jnp.float32, dict(block_d=32, block_e=16, num_splits=3)),  # D splits
    (5, 300, 200, Scheme("fp8", (128, 128)), jnp.float32, dict(block_d=64, block_e=32)),  # HF FP8 blocks
    (1, 300, 200, Scheme("fp8", (128, 128)), jnp.bfloat16, dict(block_d=64, block_e=32)),
    (17, 256, 96, Scheme("int8", (64, 1)), jnp.bfloat16, dict(block_d=32, block_e=32, num_splits=2)),  # groups
    (33, 64, 48, Scheme("int8", (None, 16)), jnp.float32, dict(block_d=32, block_e=32)),  # column blocks
    (70, 64, 40, Scheme("int8"), jnp.float32, dict(block_d=32, block_e=16)),  # two row tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-{c[1]}x{c[2]}-{c[3].kind}-{c[3].block}"
                         if isinstance(c, tuple) else None)
def test_kernel_matches_reference(case):
    t, d, e, scheme, dtype, tuning = case
    x, q, s, block = _inputs(t, t, d, e, scheme, dtype)
    assert cuda.unsupported_reason(x, q, s, block, interpret=INTERPRET, **tuning) is None
    got = fast_jit(cuda.quantized_matmul, block=block, interpret=INTERPRET, **tuning)(x, q, s)
    want = fast_jit(op.reference, block=block, out_dtype=dtype)(x, q, s)
    _check(got, want, dtype)


def test_leading_axes_and_output_dtype():
    """x [B, T, D] as the op's callers pass it, logits-style float32 output from bfloat16 activations."""
    x, q, s, block = _inputs(1, 6, 96, 40, Scheme("int8"), jnp.bfloat16)
    x = x.reshape(2, 3, 96)
    got = fast_jit(cuda.quantized_matmul, block=block, out_dtype=jnp.float32, interpret=INTERPRET, block_d=32,
                   block_e=16)(x, q, s)
    assert got.shape == (2, 3, 40) and got.dtype == jnp.float32
    _check(got, op.reference(x, q, s, block, jnp.float32), jnp.bfloat16)


def _runs_kernel(kernels: Kernels, t: int, kind: str = "int8") -> bool:
    x, q, s, block = _inputs(0, t, 64, 32, Scheme(kind), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, q, s: op.quantized_matmul(x, q, s, block, kernels=kernels))(x, q, s)
    return "pallas_call" in str(jaxpr)


def test_dispatch():
    """impl "cuda" runs the kernel up to ``quant_kernel_max_tokens`` tokens (default 1: the one-token step), for
    int8 (float8 with ``quant_kernel_float8`` on); ``quant_kernel`` off turns it off; "xla" never."""
    assert _runs_kernel(Kernels("cuda"), 1) and not _runs_kernel(Kernels("cuda"), 2)
    wide = Kernels("cuda", KernelTuning(quant_kernel_max_tokens=64))
    assert _runs_kernel(wide, 64) and not _runs_kernel(wide, 65)
    assert not _runs_kernel(Kernels("cuda", KernelTuning(quant_kernel=False)), 1)
    assert not _runs_kernel(Kernels("xla"), 1)
    assert not _runs_kernel(Kernels("cuda"), 1, "fp8")
    float8 = Kernels("cuda", KernelTuning(quant_kernel_float8=True))
    assert _runs_kernel(float8, 1) and _runs_kernel(float8, 1, "fp8")
    x, q, s, block = _inputs(2, 4, 64, 32, Scheme("fp8"), jnp.float32)
    got = jax.jit(lambda x, q, s: op.quantized_matmul(x, q, s, block, kernels=float8))(x, q, s)
    _check(got, op.reference(x, q, s, block, jnp.float32), jnp.float32)


def test_unsupported_reasons():
    sds = jax.ShapeDtypeStruct
    x, s = sds((4, 256), jnp.bfloat16), sds((1, 96), jnp.float32)
    assert cuda.unsupported_reason(x, sds((256, 96), jnp.int8), s, (256, 1), interpret=True) is None
    assert "int8 or float8" in cuda.unsupported_reason(x, sds((256, 96), jnp.bfloat16), s, (256, 1), interpret=True)
    assert "columns" in cuda.unsupported_reason(x, sds((256, 96), jnp.int8), sds((1, 4), jnp.float32), (256, 24),
                                                interpret=True)
    assert "rows" in cuda.unsupported_reason(x, sds((256, 96), jnp.int8), sds((32, 96), jnp.float32), (8, 1),
                                             interpret=True)
    assert "activations" in cuda.unsupported_reason(sds((4, 256), jnp.int8), sds((256, 96), jnp.int8), s, (256, 1),
                                                    interpret=True)
    if not ON_GPU:
        assert "GPU" in cuda.unsupported_reason(x, sds((256, 96), jnp.int8), s, (256, 1))


def test_float8_needs_sm89(monkeypatch):
    """Compiled, float8 tiles are declined on GPUs older than Ada / Hopper (Triton converts e4m3 from sm_89 on)."""
    sds = jax.ShapeDtypeStruct
    x, s = sds((4, 256), jnp.bfloat16), sds((1, 96), jnp.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for cc, float8_ok in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(cuda, "compute_capability", lambda cc=cc: cc)
        assert cuda.unsupported_reason(x, sds((256, 96), jnp.int8), s, (256, 1)) is None
        why = cuda.unsupported_reason(x, sds((256, 96), jnp.float8_e4m3fn), s, (256, 1))
        assert (why is None) if float8_ok else "sm_89" in why


@pytest.mark.parametrize("t", [1, 16])
def test_lowers_to_triton(t):
    """Through Pallas' Triton rules for a GPU at a Qwen3-8B gate projection (int8 per channel, FP8 blocks), and
    on ragged shapes (masked weight loads: a float8 tile's fill value has no integer → float8 cast in those rules,
    hence the kernel's uint8 bytes)."""
    sds = jax.ShapeDtypeStruct
    for dtype, (d, e), block, scales, tiles in (
            (jnp.int8, (4096, 12288), (4096, 1), (1, 12288), {}),
            (jnp.float8_e4m3fn, (4096, 12288), (128, 128), (32, 96), {}),
            (jnp.float8_e4m3fn, (200, 72), (200, 1), (1, 72), dict(block_d=32, block_e=16)),
            (jnp.float8_e4m3fn, (300, 200), (128, 128), (3, 2), dict(block_d=64, block_e=32))):
        args = (sds((t, d), jnp.bfloat16), sds((d, e), dtype), sds(scales, jnp.float32))
        text = jax.jit(lambda x, q, s: cuda.quantized_matmul(x, q, s, block, **tiles)).trace(  # noqa: B023
            *args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "dflash_quantized_matmul" in text


# ----------------------------------------------------------------------------------- GPU: real shapes

# Qwen3-8B's linear layers [D, E]: q/o projections, k/v projections, gate/up, down, the LM head.
QWEN3_8B = [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096), (4096, 151936)]


def _random_quantized(key, d: int, e: int, scheme: Scheme):
    """Random values of the scheme's dtype and positive scales, made on the device (no host quantization)."""
    k1, k2 = jax.random.split(key)
    if scheme.kind == "int8":
        q = jax.random.randint(k1, (d, e), -127, 128, jnp.int32).astype(jnp.int8)
    else:
        # within e4m3's range (±448): a value past it converts to NaN, and the reference's output with it
        q = jnp.clip(jax.random.normal(k1, (d, e), jnp.float32) * 100, -448, 448).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(k2, scheme.scale_shape(d, e), jnp.float32, 0.5, 1.5) / (scheme.qmax * np.sqrt(d))
    return q, s


@pytest.mark.skipif(not ON_GPU, reason="compiled through Triton on a GPU only (interpret-mode cases above)")
@pytest.mark.parametrize("scheme", [Scheme("int8"), Scheme("fp8"), Scheme("fp8", (128, 128))], ids=str)
@pytest.mark.parametrize("shape", QWEN3_8B, ids=lambda s: f"{s[0]}x{s[1]}")
def test_qwen3_8b_shapes_on_gpu(shape, scheme):
    d, e = shape
    q, s = _random_quantized(jax.random.key(d + e), d, e, scheme)
    block = scheme.blocks(d, e)
    out_dtype = jnp.float32 if e > 100_000 else jnp.bfloat16  # the LM head's logits
    for t in (1, 2, 16, 64):
        x = jax.random.normal(jax.random.key(t), (t, d), jnp.float32).astype(jnp.bfloat16)
        got = jax.jit(lambda x, q, s: cuda.quantized_matmul(x, q, s, block, out_dtype=out_dtype))(x, q, s)  # noqa
        want = jax.jit(lambda x, q, s: op.reference(x, q, s, block, out_dtype))(x, q, s)  # noqa: B023
        _check(got, want, jnp.bfloat16)
