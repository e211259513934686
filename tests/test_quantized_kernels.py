"""The dequantize-and-multiply kernels — GPU (dflash_jax.cuda.quantized) and TPU (dflash_jax.pallas.quantized) —
against the jnp reference (dflash_jax.kernels.quantized.reference), and their dispatch.

One file for both places: on a CPU backend the GPU kernel runs in Pallas interpret mode on small, ragged shapes
(several tiles, steps and D splits each); on a GPU it is compiled through Triton and the Qwen3-8B layer shapes
are added (``python -m pytest -q tests/test_quantized_kernels.py`` on the GPU machine). The TPU kernel runs in
TPU interpret mode on small shapes (several column tiles, D steps and row blocks a step) and is lowered to Mosaic
for platform "tpu" at the Qwen3-8B shapes; on a TPU it is also compiled and run at those shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_jit
from dflash_jax.cuda import quantized as cuda
from dflash_jax.kernels import quantized as op
from dflash_jax.pallas import quantized as tpu
from dflash_jax.quant import Scheme, quantize
from dflash_jax.tuning import KernelTuning, Kernels

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
# The GPU kernel asked for: by default GPUs run XLA's fused conversion and GEMM (KernelTuning.quant_kernel_impls).
GPU_ON = KernelTuning(quant_kernel_impls=("cuda", "pallas"))


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
    _matches_reference(cuda, case, INTERPRET)


def _matches_reference(kernel_module, case, interpret) -> None:
    """``kernel_module.quantized_matmul`` (a GPU or TPU kernel) takes ``case`` and gives the reference's product."""
    t, d, e, scheme, dtype, tuning = case
    x, q, s, block = _inputs(t, t, d, e, scheme, dtype)
    assert kernel_module.unsupported_reason(x, q, s, block, interpret=interpret, **tuning) is None
    got = fast_jit(kernel_module.quantized_matmul, block=block, interpret=interpret, **tuning)(x, q, s)
    want = fast_jit(op.reference, block=block, out_dtype=dtype)(x, q, s)
    _check(got, want, dtype)


@pytest.mark.parametrize("rows,e,dtype,path", [
    (1, 200, jnp.float32, "partials"), (99, 200, jnp.float32, "partials"), (128, 200, jnp.float32, "kernel"),
    (64, 200, jnp.bfloat16, "kernel"), (2, 256, jnp.bfloat16, "partials"), (16, 256, jnp.float32, "activations"),
    (100, 256, jnp.bfloat16, "activations"), (128, 256, jnp.bfloat16, "kernel")])
def test_reference_forms_the_smallest_temporary(rows, e, dtype, path):
    """Row blocks (HF's 128 × 128 FP8; D = 300: 3 row blocks): the reference forms the smallest temporary — the
    per-block partial products ``[nbi, N, E]`` (float32), the activations scaled per column block ``[nbo, N, D]``
    (where column blocks divide E, E = 256: from 3 rows on, until N = bo = 128), or the scaled kernel ``[D, E]``
    (past ``N = D · itemsize / (4 · nbi)`` rows for the partials: 100 in float32, 50 in bfloat16). Each:
    x @ dequantized W."""
    x, q, s, block = _inputs(7, rows, 300, e, Scheme("fp8", (128, 128)), dtype)
    dots = [eq for eq in jax.make_jaxpr(lambda x: op.reference(x, q, s, block, dtype))(x).eqns
            if eq.primitive.name == "dot_general"]
    shapes = [v.aval.shape for v in dots[0].invars]
    ran = ("kernel" if not dots[0].params["dimension_numbers"][1][0]
           else "activations" if (e // 128, rows, 300) in shapes else "partials")
    assert ran == path
    w = np.asarray(q, np.float64) * np.repeat(np.repeat(np.asarray(s, np.float64), 128, 0), 128, 1)[:300, :e]
    want = np.asarray(x, np.float64) @ w
    _check(fast_jit(op.reference, block=block, out_dtype=dtype)(x, q, s), want, dtype)


def test_leading_axes_and_output_dtype():
    """x [B, T, D] as the op's callers pass it, logits-style float32 output from bfloat16 activations."""
    x, q, s, block = _inputs(1, 6, 96, 40, Scheme("int8"), jnp.bfloat16)
    x = x.reshape(2, 3, 96)
    got = fast_jit(cuda.quantized_matmul, block=block, out_dtype=jnp.float32, interpret=INTERPRET, block_d=32,
                   block_e=16)(x, q, s)
    assert got.shape == (2, 3, 40) and got.dtype == jnp.float32
    _check(got, op.reference(x, q, s, block, jnp.float32), jnp.bfloat16)


# (T, D, the kernels' (E, scheme), activation dtype, tuning): one input, several kernels of different widths and
# scale layouts in one launch (the narrowest tile fits all), on the GEMV path, the dot path and with D splits.
GROUPED = [
    (1, 200, ((72, Scheme("int8")), (24, Scheme("int8")), (40, Scheme("int8", (None, 8)))), jnp.float32,
     dict(block_d=32, block_e=32)),
    (5, 256, ((96, Scheme("int8", (64, 1))), (32, Scheme("int8", (128, 16)))), jnp.bfloat16,
     dict(block_d=32, block_e=32, num_splits=3)),
    (1, 300, ((200, Scheme("fp8", (128, 128))), (72, Scheme("fp8", (128, 128)))), jnp.bfloat16,
     dict(block_d=64, block_e=32)),
]


@pytest.mark.parametrize("case", GROUPED, ids=lambda c: f"t{c[0]}-{len(c[2])}-{c[2][0][1].kind}"
                         if isinstance(c, tuple) else None)
def test_grouped_kernels_match_reference(case):
    """``quantized_matmuls``: each kernel's product as the reference gives it alone."""
    t, d, kernels_, dtype, tuning = case
    inputs = [_inputs(i, t, d, e, scheme, dtype) for i, (e, scheme) in enumerate(kernels_)]
    x = inputs[0][0]
    qs, ss, blocks = (tuple(v) for v in zip(*(i[1:] for i in inputs)))
    got = fast_jit(cuda.quantized_matmuls, blocks=blocks, interpret=INTERPRET, **tuning)(x, qs, ss)
    assert len(got) == len(kernels_)
    for y, q, s, block in zip(got, qs, ss, blocks):
        _check(y, op.reference(x, q, s, block, dtype), dtype)


def test_grouped_dispatch():
    """The op "quantized_projections" runs one launch for all its kernels under ``quant_group_kernel`` (within the
    single kernel's token limit), else one per kernel; both give the reference's products, biases included
    through ``project_together``."""
    from dflash_jax.models.layers import Dense, project_together
    from flax import nnx

    x, q1, s1, b1 = _inputs(0, 1, 64, 48, Scheme("int8"), jnp.float32)
    _, q2, s2, b2 = _inputs(1, 1, 64, 16, Scheme("int8"), jnp.float32)
    weights = [(q1, s1, b1), (q2, s2, b2)]

    def launches(kernels, x=x):
        jaxpr = jax.make_jaxpr(lambda x: op.quantized_projections(x, weights, kernels=kernels))(x)
        return str(jaxpr).count("pallas_call")

    grouped = Kernels("cuda", dataclasses.replace(GPU_ON, quant_group_kernel=True))
    assert launches(grouped) == 1 and launches(Kernels("cuda", GPU_ON)) == 2 and launches(Kernels("xla")) == 0
    assert launches(grouped, jnp.zeros((2, 64), jnp.float32)) == 0  # two tokens: the reference (token limit)
    _, q3, s3, b3 = _inputs(2, 1, 64, 16, Scheme("fp8"), jnp.float32)
    mixed = jax.make_jaxpr(lambda x: op.quantized_projections(x, [weights[0], (q3, s3, b3)], kernels=grouped))(x)
    assert str(mixed).count("pallas_call") == 2  # int8 and float8 weights: one launch each
    got = jax.jit(lambda x: op.quantized_projections(x, weights, kernels=grouped))(x)
    for y, (q, s, b) in zip(got, weights):
        _check(y, op.reference(x, q, s, b, jnp.float32), jnp.float32)
    layers = []
    for i, (q, s, b) in enumerate(weights):
        dense = Dense(64, q.shape[1], bias=True, dtype=jnp.float32, rngs=nnx.Rngs(i))
        dense.set_quantized(Scheme("int8"), q, s)
        dense.bias[...] = jnp.arange(q.shape[1], dtype=jnp.float32)
        layers.append(dense)
    together = project_together(tuple(layers), x[None], grouped)
    for y, dense in zip(together, layers):
        _check(y, dense(x[None], Kernels("xla")), jnp.float32)


def test_layers_project_together():
    """A quantized tiny target's first layer — q / k / v and the MLP's gate / up in one launch each — gives what
    its layers give one kernel at a time, for one token."""
    from conftest import tiny_target
    from dflash_jax import quantize

    model = quantize(tiny_target("qwen3", seed=5), "int8").model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    x = jax.random.normal(jax.random.key(0), (1, 1, model.config.hidden_size), jnp.float32)
    grouped, alone = (Kernels("cuda", dataclasses.replace(GPU_ON, quant_group_kernel=g)) for g in (True, False))

    def projections(kernels):
        from dflash_jax.models.layers import project_together
        return (*project_together((attn.q_proj, attn.k_proj, attn.v_proj), x, kernels), mlp(x, kernels))

    assert str(jax.make_jaxpr(lambda: projections(grouped))()).count("pallas_call") == 3  # qkv, gate-up, down
    for got, want in zip(projections(grouped), projections(alone)):
        _check(got, want, jnp.float32)


def test_quantized_lm_head_runs_the_kernel():
    """A quantized target's LM head (the largest matrix a decode step reads) goes through the kernel op under the
    kernels it is given, as its layers do, with the reference's logits (it once always took the reference)."""
    from conftest import tiny_target
    from dflash_jax import quantize

    model = quantize(tiny_target("qwen3", seed=6), "int8").model
    h = jax.random.normal(jax.random.key(1), (1, 1, model.config.hidden_size), jnp.float32)

    def launches(kernels):
        return str(jax.make_jaxpr(lambda h: model.logits(h, kernels))(h)).count("pallas_call")

    assert launches(Kernels("cuda", GPU_ON)) == 1 and launches(Kernels("xla")) == 0
    got = jax.jit(lambda h: model.logits(h, Kernels("cuda", GPU_ON)))(h)
    assert got.dtype == jnp.float32
    _check(got, model.logits(h, Kernels("xla")), jnp.float32)


def _runs_kernel(kernels: Kernels, t: int, kind: str | Scheme = "int8", d: int = 64, e: int = 32) -> bool:
    x, q, s, block = _inputs(0, t, d, e, kind if isinstance(kind, Scheme) else Scheme(kind), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, q, s: op.quantized_matmul(x, q, s, block, kernels=kernels))(x, q, s)
    return "pallas_call" in str(jaxpr)


def test_dispatch():
    """impl "cuda" runs the kernel only where ``quant_kernel_impls`` names it (not by default), then up to
    ``quant_kernel_max_tokens`` tokens (default 1: the one-token step), for int8 and float8
    (``quant_kernel_float8`` off: int8 only); ``quant_kernel`` off turns it off; "xla" never."""
    assert not _runs_kernel(Kernels("cuda"), 1) and not _runs_kernel(Kernels("cuda"), 1, "fp8")
    assert _runs_kernel(Kernels("cuda", GPU_ON), 1) and not _runs_kernel(Kernels("cuda", GPU_ON), 2)
    wide = Kernels("cuda", dataclasses.replace(GPU_ON, quant_kernel_max_tokens=64))
    assert _runs_kernel(wide, 64) and not _runs_kernel(wide, 65)
    assert not _runs_kernel(Kernels("cuda", dataclasses.replace(GPU_ON, quant_kernel=False)), 1)
    assert not _runs_kernel(Kernels("xla"), 1)
    assert not _runs_kernel(Kernels("cuda", dataclasses.replace(GPU_ON, quant_kernel_float8=False)), 1, "fp8")
    float8 = Kernels("cuda", GPU_ON)
    assert _runs_kernel(float8, 1) and _runs_kernel(float8, 1, "fp8")
    # kernels of several row blocks (fp8 in 128 × 128 blocks, as HF's) from quant_kernel_blocked_min_tokens (3:
    # one or two rows keep the reference's partial products) to _max_tokens (64), whatever quant_kernel_impls says;
    # a kernel of one row block (int8 per channel) as before
    blocks = functools.partial(_runs_kernel, kind=Scheme("fp8", (128, 128)), d=256, e=128)
    assert not blocks(Kernels("cuda"), 1) and not blocks(Kernels("cuda"), 2) and not blocks(Kernels("cuda"), 65)
    assert blocks(Kernels("cuda"), 3) and blocks(Kernels("cuda"), 64) and not _runs_kernel(Kernels("cuda"), 8)
    blocked = Kernels("cuda", KernelTuning(quant_kernel_blocked_min_tokens=1, quant_kernel_blocked_max_tokens=16))
    assert blocks(blocked, 1) and blocks(blocked, 16) and not blocks(blocked, 17) and not _runs_kernel(blocked, 8)
    assert not blocks(Kernels("cuda", KernelTuning(quant_kernel_blocked_max_tokens=0)), 8)
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
    # a Qwen3-8B layer's q / k / v in one launch
    qkv = tuple(sds((4096, e), jnp.int8) for e in (4096, 1024, 1024))
    scales = tuple(sds((1, e), jnp.float32) for e in (4096, 1024, 1024))
    text = jax.jit(lambda x, qs, ss: cuda.quantized_matmuls(x, qs, ss, ((4096, 1),) * 3)).trace(
        sds((t, 4096), jnp.bfloat16), qkv, scales).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


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
    _real_shape_matches_reference(cuda, shape, scheme)


@pytest.mark.skipif(not ON_GPU, reason="compiled through Triton on a GPU only (interpret-mode cases above)")
@pytest.mark.parametrize("widths", [(4096, 1024, 1024), (12288, 12288)], ids=["qkv", "gate-up"])
@pytest.mark.parametrize("scheme", [Scheme("int8"), Scheme("fp8", (128, 128))], ids=str)
def test_qwen3_8b_grouped_on_gpu(widths, scheme):
    """A Qwen3-8B layer's q / k / v and gate / up in one launch, 1 and 16 tokens, against the reference."""
    made = [_random_quantized(jax.random.key(i), 4096, e, scheme) for i, e in enumerate(widths)]
    qs, ss = (tuple(v) for v in zip(*made))
    blocks = tuple(scheme.blocks(4096, e) for e in widths)
    for t in (1, 16):
        x = jax.random.normal(jax.random.key(t), (t, 4096), jnp.float32).astype(jnp.bfloat16)
        got = jax.jit(lambda x, qs, ss: cuda.quantized_matmuls(x, qs, ss, blocks))(x, qs, ss)
        for y, q, s, block in zip(got, qs, ss, blocks):
            _check(y, jax.jit(lambda x, q, s, b=block: op.reference(x, q, s, b, jnp.bfloat16))(x, q, s),
                   jnp.bfloat16)


def _real_shape_matches_reference(kernel_module, shape, scheme) -> None:
    """The compiled kernel at a model's shape, 1–64 tokens of bfloat16 activations, against the reference."""
    d, e = shape
    q, s = _random_quantized(jax.random.key(d + e), d, e, scheme)
    block = scheme.blocks(d, e)
    out_dtype = jnp.float32 if e > 100_000 else jnp.bfloat16  # the LM head's logits
    for t in (1, 2, 16, 64):
        x = jax.random.normal(jax.random.key(t), (t, d), jnp.float32).astype(jnp.bfloat16)
        got = jax.jit(lambda x, q, s: kernel_module.quantized_matmul(x, q, s, block, out_dtype=out_dtype))(x, q, s)  # noqa
        want = jax.jit(lambda x, q, s: op.reference(x, q, s, block, out_dtype))(x, q, s)  # noqa: B023
        _check(got, want, jnp.bfloat16)


# ------------------------------------------------------------------------------- TPU (Mosaic) kernel

# (T, D, E, scheme, activation dtype, tiles): D = E = 256 by default tiles of 128 columns (two column tiles) and
# one D step; block_d=128 gives two D steps (the accumulator across steps), block_d=256 with 128-row scale
# blocks two row blocks a step.
TPU_CASES = [
    (1, 256, 256, Scheme("int8"), jnp.float32, {}),  # per output channel: scaled once at the end
    (5, 256, 256, Scheme("int8"), jnp.bfloat16, dict(block_d=128)),
    (5, 256, 256, Scheme("int8", (128, 1)), jnp.bfloat16, dict(block_d=256)),  # group-wise: 2 row blocks a step
    (1, 256, 256, Scheme("int8", (128, 1)), jnp.float32, dict(block_d=128)),  # a row block a step
    (3, 512, 128, Scheme("int8", (256, 1)), jnp.float32, dict(block_d=128)),  # steps inside a row block
    (5, 256, 256, Scheme("fp8", (128, 128)), jnp.float32, {}),  # HF FP8 blocks: one scale per tile
    (1, 256, 256, Scheme("fp8", (128, 128)), jnp.bfloat16, dict(block_e=256, block_d=128)),  # 2 per tile row
    (3, 256, 256, Scheme("int8", (None, 16)), jnp.float32, {}),  # column blocks: 8 scales a tile, at the end
]


@pytest.mark.parametrize("case", TPU_CASES, ids=lambda c: f"t{c[0]}-{c[1]}x{c[2]}-{c[3].kind}-{c[3].block}-"
                         f"{jnp.dtype(c[4]).name}" if isinstance(c, tuple) else None)
def test_tpu_kernel_matches_reference(case):
    _matches_reference(tpu, case, True)


def test_tpu_leading_axes_and_output_dtype():
    """x [B, T, D], float32 output from bfloat16 activations (T = 6 padded to 16 rows inside)."""
    x, q, s, block = _inputs(1, 6, 256, 128, Scheme("int8"), jnp.bfloat16)
    x = x.reshape(2, 3, 256)
    got = fast_jit(tpu.quantized_matmul, block=block, out_dtype=jnp.float32, interpret=True, block_d=128)(x, q, s)
    assert got.shape == (2, 3, 128) and got.dtype == jnp.float32
    _check(got, op.reference(x, q, s, block, jnp.float32), jnp.bfloat16)


def test_tpu_dispatch():
    """impl "pallas" runs the TPU kernel (interpret mode here) under the same knobs as the GPU one, and the
    reference for shapes it does not take (D, E not multiples of 128)."""
    assert not _runs_kernel(Kernels("pallas", KernelTuning(quant_kernel_impls=("cuda",))), 1, d=256, e=256)
    wide = Kernels("pallas", KernelTuning(quant_kernel_max_tokens=64))
    assert _runs_kernel(Kernels("pallas"), 1, d=256, e=256) and not _runs_kernel(Kernels("pallas"), 2, d=256, e=256)
    assert _runs_kernel(wide, 64, d=256, e=256) and not _runs_kernel(wide, 65, d=256, e=256)
    assert not _runs_kernel(Kernels("pallas", KernelTuning(quant_kernel=False)), 1, d=256, e=256)
    assert not _runs_kernel(Kernels("pallas", KernelTuning(quant_kernel_float8=False)), 1, "fp8", d=256, e=256)
    assert _runs_kernel(Kernels("pallas"), 1, "fp8", d=256, e=256)
    assert not _runs_kernel(wide, 4, d=64, e=32)  # ragged: the reference
    float8 = Kernels("pallas", KernelTuning(quant_kernel_float8=True, quant_kernel_max_tokens=64))
    for d, e in ((256, 256), (64, 32)):
        x, q, s, block = _inputs(3, 4, d, e, Scheme("fp8", (128, 128)), jnp.float32)
        got = jax.jit(lambda x, q, s: op.quantized_matmul(x, q, s, block, kernels=float8))(x, q, s)  # noqa: B023
        _check(got, op.reference(x, q, s, block, jnp.float32), jnp.float32)


def test_tpu_unsupported_reasons():
    sds = jax.ShapeDtypeStruct
    x, s = sds((4, 256), jnp.bfloat16), sds((1, 384), jnp.float32)
    int8 = sds((256, 384), jnp.int8)
    assert tpu.unsupported_reason(x, int8, s, (256, 1), interpret=True) is None
    assert "int8 or float8" in tpu.unsupported_reason(x, sds((256, 384), jnp.bfloat16), s, (256, 1), interpret=True)
    assert "activations" in tpu.unsupported_reason(sds((4, 256), jnp.float16), int8, s, (256, 1), interpret=True)
    assert "multiple of 128" in tpu.unsupported_reason(sds((4, 200), jnp.bfloat16), sds((200, 384), jnp.int8),
                                                       s, (200, 1), interpret=True)
    assert "rows" in tpu.unsupported_reason(x, int8, sds((4, 384), jnp.float32), (64, 1), interpret=True)
    assert "column" in tpu.unsupported_reason(x, int8, sds((1, 2), jnp.float32), (256, 256), interpret=True)
    assert "block_d" in tpu.unsupported_reason(x, int8, sds((2, 384), jnp.float32), (128, 1), interpret=True,
                                               block_d=256 + 128)
    assert "VMEM" in tpu.unsupported_reason(sds((64, 8192), jnp.float32), sds((8192, 8192), jnp.int8),
                                            sds((1, 8192), jnp.float32), (8192, 1), block_d=8192, block_e=8192)
    if jax.default_backend() != "tpu":
        assert "TPU backend" in tpu.unsupported_reason(x, int8, s, (256, 1))
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu.quantized_matmul(jnp.zeros((1, 64)), jnp.zeros((64, 32), jnp.int8), jnp.ones((1, 32)), (64, 1))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tpu_lowers_to_mosaic(dtype):
    """Qwen3-8B gate projection and LM head shapes lower to Mosaic MLIR for platform 'tpu' (block-shape tiling
    rules, the lowering of every primitive). Interpret mode checks none of this; Mosaic's own layout passes (in
    libtpu) are not available here."""
    sds = jax.ShapeDtypeStruct
    for t in (1, 16):
        for wdtype, (d, e), block, scales in (
                (jnp.int8, (4096, 12288), (4096, 1), (1, 12288)),
                (jnp.int8, (4096, 12288), (128, 1), (32, 12288)),
                (jnp.float8_e4m3fn, (4096, 12288), (128, 128), (32, 96)),
                (jnp.int8, (4096, 151936), (4096, 1), (1, 151936))):
            args = (sds((t, d), dtype), sds((d, e), wdtype), sds(scales, jnp.float32))
            text = jax.jit(lambda x, q, s: tpu.quantized_matmul(x, q, s, block)).trace(  # noqa: B023
                *args).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text and "dflash_quantized_matmul" in text


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="compiled by Mosaic on a TPU only (interpret-mode cases "
                    "and the lowering above)")
@pytest.mark.parametrize("scheme", [Scheme("int8"), Scheme("int8", (128, 1)), Scheme("fp8", (128, 128))], ids=str)
@pytest.mark.parametrize("shape", QWEN3_8B, ids=lambda s: f"{s[0]}x{s[1]}")
def test_qwen3_8b_shapes_on_tpu(shape, scheme):
    _real_shape_matches_reference(tpu, shape, scheme)
