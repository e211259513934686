"""The grouped-expert kernels (dflash_jax.cuda.moe: Triton; dflash_jax.pallas.moe: Mosaic) against the jnp
reference moe.experts_gathered.

On the CPU both run in Pallas interpret mode on tiny shapes; the weights (and biases) of every expert that no
token routes to are NaN, so a kernel that read one would return NaN. Each case is one program (both kernels
and the reference, compiled once). Production shapes are only lowered (Triton IR, Mosaic MLIR), not run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import fast_jit
from dflash_jax.cuda import moe as cuda_moe
from dflash_jax.kernels import common, moe
from dflash_jax.models import gpt_oss
from dflash_jax.pallas import moe as tpu_moe
from dflash_jax.quant import Scheme, quantize
from dflash_jax.tuning import Kernels, KernelTuning

CUDA_INTERPRET = jax.default_backend() != "gpu"
TPU_INTERPRET = None if jax.default_backend() == "tpu" else pltpu.InterpretParams()
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}
GPT_OSS_ACT = functools.partial(gpt_oss.clamped_swiglu, alpha=1.702, limit=1.0)


@pytest.fixture(autouse=True)
def exact_float32():
    with jax.default_matmul_precision("highest"):
        yield


def _all(x, w, idx, gate, up, down, *biases, clean, act, cuda_kw):
    """Reference (on finite weights), GPU kernel and TPU kernel (on the poisoned ones): one program."""
    kw = dict(biases=tuple(biases) or None, act=act)
    ref = moe.experts_gathered(x, w, idx, *clean[:3], biases=tuple(clean[3:]) or None, act=act)
    return (ref, cuda_moe.grouped_experts(x, w, idx, gate, up, down, interpret=CUDA_INTERPRET, **kw, **cuda_kw),
            tpu_moe.grouped_experts(x, w, idx, gate, up, down, interpret=TPU_INTERPRET, **kw))


def _inputs(seed, idx, e, d, f, dtype, bias):
    rng = np.random.default_rng(seed)
    n, _ = idx.shape
    shapes = [(e, d, f), (e, d, f), (e, f, d)] + ([(e, f), (e, f), (e, d)] if bias else [])
    clean = [rng.normal(size=s).astype(np.float32) * 0.3 for s in shapes]
    unrouted = np.setdiff1d(np.arange(e), idx)
    assert unrouted.size, "every case leaves some expert unrouted"
    poisoned = [a.copy() for a in clean]
    for a in poisoned:
        a[unrouted] = np.nan
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.random(idx.shape).astype(np.float32)
    cast = lambda arrays: [jnp.asarray(a, dtype) for a in arrays]  # noqa: E731
    return cast([x, w]), jnp.asarray(idx, jnp.int32), cast(poisoned), cast(clean)


# (idx, E, D, F, dtype, bias/act, cuda tuning). D, F not multiples of the blocks: tail masks.
CASES = [
    ([[5, 2]], 8, 40, 24, jnp.float32, False, dict(num_splits=2, block_d=16, block_k=16)),  # N=1, D split
    ([[1, 4], [4, 6], [3, 1]], 8, 40, 24, jnp.float32, False, {}),  # experts shared across tokens
    ([[0, 3, 6], [6, 0, 2], [2, 3, 0], [7, 6, 0], [3, 2, 7]], 9, 32, 16, jnp.bfloat16, False, {}),
    ([[1, 4], [4, 6], [6, 1], [0, 4]], 8, 24, 40, jnp.float32, True, dict(num_splits=3, block_d=16)),  # gpt-oss
    ([[2, 5], [5, 2]], 6, 32, 16, jnp.bfloat16, True, {}),
]


@pytest.mark.parametrize("idx, e, d, f, dtype, bias, cuda_kw", CASES)
def test_kernels_match_reference(idx, e, d, f, dtype, bias, cuda_kw):
    (x, w), idx, poisoned, clean = _inputs(len(idx), np.asarray(idx), e, d, f, dtype, bias)
    run = fast_jit(_all, clean=tuple(clean), act=GPT_OSS_ACT if bias else moe.swiglu, cuda_kw=cuda_kw)
    ref, *outs = run(x, w, idx, *poisoned)
    ref32 = np.asarray(ref, np.float32)
    for name, out in zip(("cuda", "tpu"), outs):
        out32 = np.asarray(out, np.float32)
        assert out.dtype == ref.dtype and out.shape == ref.shape, name
        assert np.isfinite(out32).all(), f"{name}: non-finite output (an unrouted expert was read)"
        tol = TOL[dtype] * max(1.0, np.abs(ref32).max())
        np.testing.assert_allclose(out32, ref32, atol=tol, rtol=TOL[dtype], err_msg=name)


# (idx, E, D, F, dtype, bias/act, pair kernel tuning): D / F not multiples of the blocks, D splits.
PAIR_CASES = [
    ([[5, 2, 7]], 8, 40, 24, jnp.float32, False, dict(block_f=16, block_d=16, num_splits=2, block_k=16)),
    ([[1, 4], [4, 6]], 8, 24, 40, jnp.float32, True, dict(num_splits=3, block_d=16)),  # gpt-oss, shared expert
    ([[3, 0]], 6, 32, 16, jnp.bfloat16, False, {}),
]


@pytest.mark.parametrize("idx, e, d, f, dtype, bias, kw", PAIR_CASES)
def test_pair_kernel_matches_reference(idx, e, d, f, dtype, bias, kw):
    """The per-pair GPU kernels (decode at a token or two) against the reference, unrouted experts NaN."""
    (x, w), idx, poisoned, clean = _inputs(len(idx) + 10, np.asarray(idx), e, d, f, dtype, bias)
    act = GPT_OSS_ACT if bias else moe.swiglu
    run = fast_jit(lambda x, w, idx, *a: (
        moe.experts_gathered(x, w, idx, *clean[:3], biases=tuple(clean[3:]) or None, act=act),
        cuda_moe.pair_experts(x, w, idx, *a[:3], biases=tuple(a[3:]) or None, act=act, interpret=CUDA_INTERPRET,
                              **kw)))
    ref, out = (np.asarray(o, np.float32) for o in run(x, w, idx, *poisoned))
    assert np.isfinite(out).all(), "non-finite output (an unrouted expert was read)"
    tol = TOL[dtype] * max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(out, ref, atol=tol, rtol=TOL[dtype])


def test_cuda_kernel_loops_over_row_tiles():
    """An expert with more pairs than a tile has rows (N > 64): the GPU kernel loops over row tiles."""
    n = 70
    idx = np.stack([np.where(np.arange(n) % 3 == 0, 1, 0), np.full(n, 2)], 1)  # expert 2: all 70 tokens
    (x, w), idx, poisoned, clean = _inputs(0, idx, 4, 16, 16, jnp.float32, False)
    run = fast_jit(lambda *a: (moe.experts_gathered(*a[:3], *clean[:3]),
                               cuda_moe.grouped_experts(*a, interpret=CUDA_INTERPRET)))
    ref, out = run(x, w, idx, *poisoned)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pairwise_max", [0, 1024])  # argsort / pairwise-comparison ranks
def test_group_pairs(pairwise_max):
    idx = np.random.default_rng(3).integers(0, 12, size=(7, 3))
    idx[:, 1] = (idx[:, 0] + 1) % 12  # distinct per token, as top-k gives
    idx[:, 2] = (idx[:, 0] + 5) % 12
    grp = jax.jit(functools.partial(moe.group_pairs, num_experts=12, pairwise_max=pairwise_max))(jnp.asarray(idx))
    flat = idx.ravel()
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(np.asarray(grp.pos)[order], np.arange(flat.size))
    routed = np.unique(flat)
    a = routed.size
    assert int(grp.n_active) == a
    np.testing.assert_array_equal(np.asarray(grp.expert)[:a], routed)
    assert (np.asarray(grp.expert)[a:] == routed[-1]).all()  # idle groups repeat the last routed expert
    np.testing.assert_array_equal(np.asarray(grp.count), np.r_[[np.sum(flat == r) for r in routed], [0] * (12 - a)])
    np.testing.assert_array_equal(np.asarray(grp.start)[:a], np.searchsorted(flat[order], routed))
    np.testing.assert_array_equal(np.asarray(grp.group), np.searchsorted(routed, flat))
    np.testing.assert_array_equal(np.asarray(grp.rank), np.asarray(grp.pos) - np.asarray(grp.start)[grp.group])


def _shapes(n, dtype, bias, e=128, d=2048, f=768, k=8):
    sds = jax.ShapeDtypeStruct
    args = [sds((n, d), dtype), sds((n, k), dtype), sds((n, k), jnp.int32), sds((e, d, f), dtype),
            sds((e, d, f), dtype), sds((e, f, d), dtype)]
    return args + ([sds((e, f), dtype), sds((e, f), dtype), sds((e, d), dtype)] if bias else [])


@pytest.mark.parametrize("n, dtype, bias", [(1, jnp.bfloat16, False), (16, jnp.bfloat16, True),
                                            (4, jnp.float32, False)])
def test_kernels_lower_for_gpu_and_tpu(n, dtype, bias):
    """The decode shape (E=128, D=2048, F=768, top-8) lowers to Triton IR and to Mosaic MLIR: block-shape
    rules and the lowering of every primitive (act included). Interpret mode checks none of this."""
    args = _shapes(n, dtype, bias)
    act = GPT_OSS_ACT if bias else moe.swiglu
    for platform, fn, target in (("cuda", cuda_moe.grouped_experts, "__gpu$xla.gpu.triton"),
                                 ("tpu", tpu_moe.grouped_experts, "tpu_custom_call")):
        call = lambda *a, fn=fn: fn(*a[:6], biases=tuple(a[6:]) or None, act=act)  # noqa: E731
        text = jax.jit(call).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert target in text, platform


def test_auto_dispatch_reasons():
    """experts_auto's choice (the CPU keeps the jnp paths; prefill-sized calls and float32 on GPU too)."""
    limit = KernelTuning().moe_kernel_max_tokens
    small, wide = _shapes(4, jnp.bfloat16, False), _shapes(limit + 1, jnp.bfloat16, False)
    assert "no MoE kernel" in moe.kernel_unsupported_reason(Kernels("xla"), *small)
    if jax.default_backend() == "cpu":
        assert "moe_kernels_on" in moe.kernel_unsupported_reason(Kernels("cuda"), *small)
    interpret = Kernels("cuda", KernelTuning(interpret=True))
    assert "moe_kernel_max_tokens" in moe.kernel_unsupported_reason(interpret, *wide)
    assert moe.kernel_unsupported_reason(interpret, *small) is None
    if jax.default_backend() == "gpu":  # float32 on a GPU: the cuda entry declines, the XLA paths run
        assert cuda_moe.experts_kernel(*_shapes(4, jnp.float32, False), kernels=Kernels("cuda")) is None
    assert cuda_moe.unsupported_reason(*small, interpret=True) is None
    assert tpu_moe.unsupported_reason(*small, biases=tuple(_shapes(4, jnp.bfloat16, True)[6:]), interpret=True) is None
    assert "block_f" in tpu_moe.unsupported_reason(*small, block_f=100, interpret=True)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_runs_the_kernel(monkeypatch, backend):
    """experts_auto on a (pretended) GPU / TPU backend goes through the kernel — interpret mode here; on the
    TPU after the compile probe — gpt-oss's biases and clamped SwiGLU included."""
    idx = np.array([[1, 4], [4, 6], [6, 1]])
    (x, w), idx, poisoned, clean = _inputs(7, idx, 8, 24, 16, jnp.bfloat16, True)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    mod, interp = (cuda_moe, True) if backend == "gpu" else (tpu_moe, pltpu.InterpretParams())
    calls = []
    real = mod.grouped_experts
    monkeypatch.setattr(mod, "grouped_experts",
                        lambda *a, **kw: calls.append(1) or real(*a, **{**kw, "interpret": interp}))
    monkeypatch.setattr(common, "_PROBED", {})
    kernels = Kernels("cuda" if backend == "gpu" else "pallas")
    run = fast_jit(lambda *a: (moe.experts_auto(*a[:6], biases=a[6:], act=GPT_OSS_ACT, kernels=kernels),
                               moe.experts_gathered(*a[:3], *clean[:3], biases=tuple(clean[3:]), act=GPT_OSS_ACT)))
    out, ref = run(x, w, idx, *poisoned)
    assert calls and list(common._PROBED.values()) == ([None] if backend == "tpu" else [])
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------------------------------------
# Quantized experts (int8 / float8 values, per-expert float32 block scales) through the GPU pair kernels
# --------------------------------------------------------------------------------------------------


def _quant_inputs(seed, idx, e, d, f, dtype, gate_up: Scheme, down: Scheme, bias=False):
    """Quantized experts (each expert's matrices by ``quantize``: fp8 values within e4m3's ±448) and their
    scales (arrays: ExpertScales' blocks are static, made inside the programs by ``quant``), clean and with every
    unrouted expert's scales NaN (a kernel that read one would return NaN)."""
    rng = np.random.default_rng(seed)
    n, _ = idx.shape
    values, scales = [], []
    for shape, scheme in (((d, f), gate_up), ((d, f), gate_up), ((f, d), down)):
        qs = [quantize(rng.normal(size=shape).astype(np.float32) * 0.3, scheme) for _ in range(e)]
        values.append(jnp.asarray(np.stack([q for q, _ in qs])))
        scales.append(np.stack([s for _, s in qs]))
    unrouted = np.setdiff1d(np.arange(e), idx)
    assert unrouted.size, "every case leaves some expert unrouted"
    poisoned = [s.copy() for s in scales]
    for s in poisoned:
        s[unrouted] = np.nan
    blocks = gate_up.blocks(d, f), down.blocks(f, d)
    quant = lambda ss: tuple(jnp.asarray(s) for s in ss)  # noqa: E731
    x = jnp.asarray(rng.normal(size=(n, d)), dtype)
    w = jnp.asarray(rng.random(idx.shape), dtype)
    biases = tuple(jnp.asarray(rng.normal(size=s) * 0.3, dtype) for s in ((e, f), (e, f), (e, d))) if bias else None
    return x, w, jnp.asarray(idx, jnp.int32), tuple(values), quant(scales), quant(poisoned), biases, blocks


# (idx, E, D, F, gate/up scheme, down scheme, dtype, pair tuning). T = 1 and 3, top-2 of 4 experts; D / F not
# multiples of the tiles or of the scale blocks, D splits: several steps, row blocks and tail masks each.
QUANT_CASES = [
    ([[3, 0]], 4, 72, 40, Scheme("int8"), Scheme("int8"), jnp.float32,
     dict(block_f=16, block_d=16, num_splits=2, block_n=16, block_k=16)),  # per output channel
    ([[1, 3], [3, 0], [0, 1]], 4, 256, 96, Scheme("int8", (64, 1)), Scheme("int8", (32, 1)), jnp.bfloat16,
     dict(block_d=32, num_splits=2)),  # group-wise int8: per-step scales over D and F
    ([[2, 1]], 4, 200, 72, Scheme("fp8", (128, 128)), Scheme("fp8", (128, 128)), jnp.bfloat16,
     dict(block_f=16, block_d=64, block_n=32, block_k=32)),  # HF FP8 blocks, ragged edges (no fill value)
    ([[0, 2], [2, 3], [3, 0]], 4, 128, 64, Scheme("fp8", (128, 128)), Scheme("fp8"), jnp.float32, {}),
]


@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"t{len(c[0])}-{c[4]}-{np.dtype(c[6]).name}")
def test_pair_kernel_quantized_matches_reference(case):
    """The pair kernels on quantized experts against experts_gathered's quantized reference (its scaled dots)."""
    idx, e, d, f, gate_up, down, dtype, kw = case
    x, w, idx, values, clean, poisoned, _, blocks = _quant_inputs(len(idx) + 20, np.asarray(idx), e, d, f, dtype,
                                                                  gate_up, down)
    why = cuda_moe.unsupported_reason(x, w, idx, *values, quant=moe.ExpertScales(*poisoned, *blocks),
                                      interpret=CUDA_INTERPRET, **kw)
    if why is not None and "sm_89" in why:
        pytest.skip(why)  # float8 on a GPU older than Ada / Hopper
    assert why is None
    run = fast_jit(lambda x, w, idx, vals, clean, poisoned: (
        moe.experts_gathered(x, w, idx, *vals, quant=moe.ExpertScales(*clean, *blocks)),
        cuda_moe.pair_experts(x, w, idx, *vals, quant=moe.ExpertScales(*poisoned, *blocks), interpret=CUDA_INTERPRET,
                              **kw)))
    ref, out = (np.asarray(o, np.float32) for o in run(x, w, idx, values, clean, poisoned))
    assert np.isfinite(out).all(), "non-finite output (an unrouted expert's scales were read)"
    # Both sum exact products (int8 / e4m3 values are bf16 numbers) in float32; in bf16 the reference also
    # rounds its gate/up products to bf16 before the activation.
    tol = (2e-5 if dtype == jnp.float32 else 3e-2) * max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(out, ref, atol=tol, rtol=0)


@pytest.mark.parametrize("case", QUANT_CASES[1:], ids=lambda c: f"t{len(c[0])}-{c[4]}-{np.dtype(c[6]).name}")
def test_sorted_kernel_quantized_matches_reference(case):
    """The sorted (grouped by expert) kernels on quantized experts — the form of calls past E pairs — against
    experts_gathered's quantized reference: tensor-core dots of converted tiles, per-step and once-per-sum scales,
    D splits, ragged float8 tiles; six tokens (12 pairs over 4 experts: each routed expert read once for several)."""
    idx, e, d, f, gate_up, down, dtype, kw = case
    idx = np.concatenate([np.asarray(idx)] * 2)[:6] if len(idx) > 1 else np.array([[2, 1], [1, 2], [2, 1]] * 2)
    x, w, idx, values, clean, poisoned, _, blocks = _quant_inputs(len(idx) + 40, idx, e, d, f, dtype, gate_up, down)
    why = cuda_moe.unsupported_reason(x, w, idx, *values, quant=moe.ExpertScales(*poisoned, *blocks),
                                      interpret=CUDA_INTERPRET, **kw)
    if why is not None and "sm_89" in why:
        pytest.skip(why)
    assert why is None
    run = fast_jit(lambda x, w, idx, vals, clean, poisoned: (
        moe.experts_gathered(x, w, idx, *vals, quant=moe.ExpertScales(*clean, *blocks)),
        cuda_moe.grouped_experts(x, w, idx, *vals, quant=moe.ExpertScales(*poisoned, *blocks),
                                 interpret=CUDA_INTERPRET, **kw)))
    ref, out = (np.asarray(o, np.float32) for o in run(x, w, idx, values, clean, poisoned))
    assert np.isfinite(out).all(), "non-finite output (an unrouted expert's scales were read)"
    tol = (2e-5 if dtype == jnp.float32 else 3e-2) * max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(out, ref, atol=tol, rtol=0)


def test_quantized_experts_dispatch(monkeypatch):
    """experts_auto under impl "cuda" (interpret mode) hands quantized experts to the pair kernels at decode
    sizes — float8 only with quant_kernel_float8 on — and keeps the reference past N·K > E; gpt-oss's biases
    and act ride along."""
    calls = []
    real = cuda_moe.pair_experts
    monkeypatch.setattr(cuda_moe, "pair_experts",
                        lambda *a, **kw: calls.append(kw["quant"] is not None) or real(*a, **kw))
    fp8 = Scheme("fp8", (128, 128))
    x, w, idx, values, clean, poisoned, biases, blocks = _quant_inputs(5, np.array([[1, 3]]), 4, 128, 64,
                                                                       jnp.bfloat16, fp8, fp8, bias=True)

    def auto(tuning):
        kernels = Kernels("cuda", KernelTuning(interpret=True, **tuning))
        return lambda x, w, idx, vals, q: moe.experts_auto(x, w, idx, *vals, biases=biases, act=GPT_OSS_ACT,
                                                           quant=moe.ExpertScales(*q, *blocks), kernels=kernels)

    ref = fast_jit(lambda *a: moe.experts_gathered(*a[:3], *a[3], biases=biases, act=GPT_OSS_ACT,
                                                   quant=moe.ExpertScales(*a[4], *blocks)))(x, w, idx, values, clean)
    out = fast_jit(auto(dict(quant_kernel_float8=True)))(x, w, idx, values, poisoned)
    assert calls == [True]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)
    for tuning in (dict(quant_kernel_float8=False), dict(quant_kernel=False, quant_kernel_float8=True)):
        jax.eval_shape(auto(tuning), x, w, idx, values, clean)  # traced only: the choice is made there
    wide = jnp.asarray([[1, 3], [3, 0], [0, 1]], jnp.int32)  # N·K = 6 > E = 4: every expert once, no kernel
    jax.eval_shape(auto(dict(quant_kernel_float8=True)), jnp.concatenate([x] * 3), jnp.concatenate([w] * 3), wide,
                   values, clean)
    assert calls == [True]
    # moe_quantized_sorted: such calls through the sorted kernels, past moe_kernel_max_tokens too
    sorted_calls = []
    real_sorted = cuda_moe.sorted_experts
    monkeypatch.setattr(cuda_moe, "sorted_experts",
                        lambda *a, **kw: sorted_calls.append(kw["quant"] is not None) or real_sorted(*a, **kw))
    on = dict(quant_kernel_float8=True, moe_quantized_sorted=True, moe_kernel_max_tokens=2)
    jax.eval_shape(auto(on), jnp.concatenate([x] * 3), jnp.concatenate([w] * 3), wide, values, clean)
    assert calls == [True] and sorted_calls == [True]


def test_quantized_unsupported_reasons():
    sds = jax.ShapeDtypeStruct
    e, d, f = 8, 256, 128
    x, w, idx = sds((1, d), jnp.bfloat16), sds((1, 2), jnp.bfloat16), sds((1, 2), jnp.int32)
    vals = lambda dt: (sds((e, d, f), dt), sds((e, d, f), dt), sds((e, f, d), dt))  # noqa: E731

    def scales(gu, dn):
        return moe.ExpertScales(*(sds((e, *Scheme("int8", gu).scale_shape(d, f)), jnp.float32),) * 2,
                                sds((e, *Scheme("int8", dn).scale_shape(f, d)), jnp.float32), gu, dn)

    reason = functools.partial(cuda_moe.unsupported_reason, x, w, idx, interpret=True)
    assert reason(*vals(jnp.int8), quant=scales((d, 1), (f, 1))) is None
    assert "not int8" in reason(*vals(jnp.bfloat16), quant=scales((d, 1), (f, 1)))
    assert "columns" in reason(*vals(jnp.int8), quant=scales((d, 8), (f, 1)))  # no 16-wide tile in 8 columns
    assert "rows" in reason(*vals(jnp.int8), quant=scales((8, 1), (f, 1)))
    assert "do not fit" in reason(*vals(jnp.int8), quant=scales((d, 1), (f, 1))._replace(gate_up_block=(64, 1)))


@pytest.mark.parametrize("n, scheme, shape", [
    (1, Scheme("fp8", (128, 128)), {}), (4, Scheme("int8"), {}), (1, Scheme("int8", (128, 1)), {}),
    (1, Scheme("fp8", (128, 128)), dict(e=8, d=200, f=72)),  # ragged float8 tiles: loads without a fill value
    (32, Scheme("fp8", (128, 128)), {}), (32, Scheme("int8"), {}),  # 256 pairs > 128 experts: the sorted kernels
])
def test_quantized_kernels_lower_for_gpu(n, scheme, shape):
    """Qwen3-30B-A3B's experts (E=128, D=2048, F=768, top-8), quantized, lower to Triton IR through the pair
    kernels (up to E pairs) and the sorted ones (more): float8 and int8 loads (ragged float8 tiles on a small
    shape), scalar and per-column scale loads, converted tiles in tensor-core dots. Interpret mode checks none
    of this."""
    x, w, idx, gate, up, down = _shapes(n, jnp.bfloat16, False, **shape)
    e, d, f = gate.shape
    q = lambda a: jax.ShapeDtypeStruct(a.shape, scheme.dtype)  # noqa: E731
    s = lambda rows, cols: jax.ShapeDtypeStruct((e, *scheme.scale_shape(rows, cols)), jnp.float32)  # noqa: E731
    quant = moe.ExpertScales(s(d, f), s(d, f), s(f, d), scheme.blocks(d, f), scheme.blocks(f, d))
    assert cuda_moe.unsupported_reason(x, w, idx, q(gate), q(up), q(down), quant=quant, interpret=True) is None
    call = lambda *a: cuda_moe.grouped_experts(  # noqa: E731
        *a[:6], quant=quant._replace(gate=a[6], up=a[7], down=a[8]))
    text = jax.jit(call).trace(x, w, idx, q(gate), q(up), q(down), *quant[:3]).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert ("dflash_moe_pair_gate_up" if n * idx.shape[1] <= e else "dflash_moe_gate_up") in text
