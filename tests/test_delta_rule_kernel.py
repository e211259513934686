"""The short-block gated delta rule kernel (dflash_jax.cuda.delta_rule) against the jnp forms, and a hybrid model
through it (``impl="cuda"``) against the XLA path.

On a CPU backend the kernel runs in Pallas interpret mode on small shapes; on a GPU it is compiled through Triton
and Qwen3.5-9B-shaped cases are added. Inputs are drawn with numpy; the references take q and k normalised and
repeated to the value heads, the kernel raw and per key head. Everything is float32 (the references' dots at
"highest" precision, so a GPU's TF32 does not blur the comparison); the kernel's sequential order against the
block form's triangular solve differs only by rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import fast_jit, tiny_config
from dflash_jax.config import HybridConfig
from dflash_jax.cuda import delta_rule as dr
from dflash_jax.models import linear_attention as la
from dflash_jax.models.hybrid import HybridTargetModel
from dflash_jax.tuning import Kernels, KernelTuning

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(autouse=True)
def exact_float32():
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(seed, b, t, hk, hv, dk, dv):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(b, t, hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(b, t, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.02, 1.0, size=(b, t, hv)).astype(np.float32)  # g ≤ 0, β in (0, 1)
    beta = rng.uniform(0.05, 0.95, size=(b, t, hv)).astype(np.float32)
    state = rng.normal(size=(b, hv, dk, dv)).astype(np.float32)
    lengths = rng.integers(0, t + 1, size=b).astype(np.int32)
    lengths[-1] = t  # a full row; the others anywhere in 0 … T
    return q, k, v, g, beta, state, lengths


def _compare(q, k, v, g, beta, state, lengths, *, dtype, packed, block_v):
    """Everything in one program: the kernel (record, and advance over ``lengths``) and the references."""
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    # q, k, v arrive in ``dtype`` already: a cast to a half type inside the program, then back to float32 for
    # the references, is folded away by XLA on GPUs (excess precision), while the kernel reads the rounded values.
    if packed:  # the layer's conv output: per key head q, k, then its value heads' v
        qkv = jnp.concatenate([q, k, v.reshape(b, t, hk, -1)], axis=-1)
        kern = lambda *a, **kw: dr.packed_delta_rule_block(qkv, *a, key_dim=dk, block_v=block_v,  # noqa: E731
                                                           interpret=INTERPRET, **kw)
    else:
        kern = lambda *a, **kw: dr.delta_rule_block(q, k, v, *a, block_v=block_v, interpret=INTERPRET,  # noqa: E731
                                                    **kw)
    out, (k_rec, cum, v_new) = kern(g, beta, state)
    adv_out, adv_state = kern(g, beta, state, lengths, advance=True)
    rep = hv // hk
    qn = jnp.repeat(la.l2norm(q.astype(jnp.float32)), rep, axis=2) * dk ** -0.5
    kn = jnp.repeat(la.l2norm(k.astype(jnp.float32)), rep, axis=2)
    v = v.astype(jnp.float32)
    ref_out, (ref_k, ref_cum, ref_v_new) = la.delta_rule_block(qn, kn, v, g, beta, state)
    seq_out, seq_state = la.delta_rule_sequential(qn, kn, v, g, beta, state)
    after = lambda kk, c, vn: jax.vmap(lambda n: la.state_after(state, kk, c, vn, jnp.full((b,), n)))(  # noqa: E731
        jnp.arange(t + 1))
    return dict(out=out, cum=cum, v_new=v_new, k_rec=k_rec, after=after(k_rec, cum, v_new), adv_out=adv_out,
                adv_state=adv_state, ref_out=ref_out, ref_cum=ref_cum, ref_v_new=ref_v_new,
                ref_k=la.l2norm(k.astype(jnp.float32)), ref_after=after(ref_k, ref_cum, ref_v_new),
                ref_adv_state=la.state_after(state, ref_k, ref_cum, ref_v_new, lengths), seq_out=seq_out,
                seq_state=seq_state)


# (B, T, Hk, Hv, Dk, Dv, block_v, q/k/v dtype, packed qkv)
CASES = [
    (2, 1, 2, 4, 16, 32, 16, jnp.float32, False),  # a decode step; two value tiles
    (2, 2, 2, 4, 16, 32, 32, jnp.float32, True),
    (2, 5, 2, 4, 16, 32, 16, jnp.bfloat16, True),  # odd T, bfloat16 conv output (upcast in the kernel)
    (2, 8, 2, 4, 16, 32, 16, jnp.float32, False),  # a verify block (16 tokens: the GPU cases)
    (1, 3, 1, 2, 128, 128, 32, jnp.float32, True),  # Dk = Dv = 128, four value tiles
]
if ON_GPU:
    CASES += [(1, 1, 16, 32, 128, 128, None, jnp.bfloat16, True),  # Qwen3.5-9B's linear layers
              (8, 16, 16, 32, 128, 128, None, jnp.bfloat16, True),
              (3, 16, 16, 32, 128, 128, 64, jnp.float32, False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-Hk{}-Hv{}-Dk{}-Dv{}-bv{}-{}-packed{}".format(
    *c[:7], jnp.dtype(c[7]).name, c[8]))
def test_kernel_matches_references(case):
    b, t, hk, hv, dk, dv, block_v, dtype, packed = case
    args = _inputs(t * 7 + dk, b, t, hk, hv, dk, dv)
    assert dr.unsupported_reason(*(jnp.asarray(x) for x in args), block_v=block_v, interpret=INTERPRET) is None
    args = tuple(jnp.asarray(x, dtype) for x in args[:3]) + args[3:]
    r = jax.device_get(fast_jit(_compare, dtype=dtype, packed=packed, block_v=block_v)(*args))
    for name in ("out", "cum", "v_new"):  # the record, as the block form's
        np.testing.assert_allclose(r[name], r["ref_" + name], **TOL, err_msg=name)
    np.testing.assert_allclose(r["out"], r["seq_out"], **TOL)
    np.testing.assert_allclose(r["k_rec"], r["ref_k"], **TOL)  # normalised k per key head
    # The state after every prefix from the kernel's record (k per key head) = from the block form's = the
    # token-by-token state at the end.
    np.testing.assert_allclose(r["after"], r["ref_after"], **TOL)
    np.testing.assert_allclose(r["after"][t], r["seq_state"], **TOL)
    np.testing.assert_allclose(r["after"][0], args[5], **TOL)
    # Advance mode: the state after lengths[b] tokens, and the outputs of the tokens before it.
    np.testing.assert_allclose(r["adv_state"], r["ref_adv_state"], **TOL)
    for row, n in enumerate(args[6]):
        np.testing.assert_allclose(r["adv_out"][row, :n], r["ref_out"][row, :n], **TOL)
    assert np.isfinite(r["adv_out"]).all()


def test_unsupported_reasons():
    sds = jax.ShapeDtypeStruct
    f32 = jnp.float32
    q, v = sds((2, 4, 2, 16), jnp.bfloat16), sds((2, 4, 4, 32), jnp.bfloat16)
    g, st = sds((2, 4, 4), f32), sds((2, 4, 16, 32), f32)
    assert dr.unsupported_reason(q, q, v, g, g, st, interpret=True) is None
    assert dr.packed_unsupported_reason(sds((2, 4, 2, 96), jnp.bfloat16), g, g, st, key_dim=16, interpret=True) is None
    assert "channels" in dr.packed_unsupported_reason(sds((2, 4, 2, 90), f32), g, g, st, key_dim=16, interpret=True)
    long = sds((2, dr.MAX_T + 1, 2, 16), f32)
    assert "tokens" in dr.unsupported_reason(long, long, sds((2, dr.MAX_T + 1, 4, 32), f32),
                                             sds((2, dr.MAX_T + 1, 4), f32), sds((2, dr.MAX_T + 1, 4), f32), st,
                                             interpret=True)
    assert "powers of two" in dr.unsupported_reason(sds((2, 4, 2, 24), f32), sds((2, 4, 2, 24), f32), v, g, g,
                                                    sds((2, 4, 24, 32), f32), interpret=True)
    assert "block_v" in dr.unsupported_reason(q, q, v, g, g, st, block_v=24, interpret=True)
    assert "multiple" in dr.unsupported_reason(q, q, sds((2, 4, 3, 32), f32), sds((2, 4, 3), f32),
                                               sds((2, 4, 3), f32), sds((2, 3, 16, 32), f32), interpret=True)
    assert "float32" in dr.unsupported_reason(q, q, v, sds((2, 4, 4), jnp.bfloat16), g, st, interpret=True)
    assert "MAX_TILE" in dr.unsupported_reason(sds((1, 1, 1, 512), f32), sds((1, 1, 1, 512), f32),
                                               sds((1, 1, 1, 64), f32), sds((1, 1, 1), f32), sds((1, 1, 1), f32),
                                               sds((1, 1, 512, 64), f32), interpret=True)
    if not ON_GPU:
        assert "GPU" in dr.unsupported_reason(q, q, v, g, g, st)


@pytest.mark.parametrize("advance", [False, True])
def test_lowers_to_triton(advance):
    """The kernel lowers through Pallas' Triton rules (reductions over Dk, scalar loads and masked stores,
    broadcasts) for a GPU at Qwen3.5-9B's shape; interpret mode checks none of this. (Triton's own compile to
    PTX needs a GPU.)"""
    sds = jax.ShapeDtypeStruct
    b, t, hk, hv, dk, dv = 1, 16, 16, 32, 128, 128
    args = (sds((b, t, hk, 2 * dk + 2 * dv), jnp.bfloat16), sds((b, t, hv), jnp.float32),
            sds((b, t, hv), jnp.float32), sds((b, hv, dk, dv), jnp.float32)) + ((sds((b,), jnp.int32),) * advance)
    fn = lambda *a: dr.packed_delta_rule_block(*a, key_dim=dk, advance=advance)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "dflash_delta_rule_block" in text


# ------------------------------------------------------------------------------------------ in the model

HYBRID = HybridConfig(layer_types=("linear_attention", "linear_attention"), key_heads=2,
                      value_heads=4, key_head_dim=16, value_head_dim=16, rotary_dim=8)


def _tiny_hybrid(seed: int = 0) -> HybridTargetModel:
    """Random weights drawn with numpy (eager jax.random compiles per shape): kernels by fan-in, norms near
    their identity, the decay parameters as checkpoints have them."""
    cfg = tiny_config("qwen3_5", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, hybrid=HYBRID)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridTargetModel(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = str(path[-1].key if hasattr(path[-1], "key") else path[-1])
        shift, scale = {"A_log": (1.4, 0.5), "dt_bias": (1.0, 0.1)}.get(name, (0.0, 0.2))
        if len(x.shape) >= 2:
            scale = 1.0 / np.sqrt(x.shape[-2])
        elif "linear_attn" in str(path) and "norm" in str(path):
            shift = 1.0
        return jnp.asarray((shift + scale * rng.normal(size=x.shape)).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


def _scripted(model, ids, kernels):
    """Right-padded prefill (7 / 5 tokens: the kernel's lengths), a deferred 4-token verify settled after 4 / 2
    tokens (its record, k per key head), then a single-token step (no lengths). Logits and final states."""
    at = lambda p, t: p[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # noqa: E731
    tok = lambda pos: jnp.take_along_axis(ids, pos, axis=1)  # noqa: E731
    cache = model.new_cache(2, 16)
    p = jnp.asarray([7, 5], jnp.int32)
    h, _, cache = model(ids[:, :7], at(jnp.zeros((2,), jnp.int32), 7), cache, prefill=True, lengths=p, kernels=kernels)
    out = [model.logits(h)]
    h, _, cache = model(tok(at(p, 4)), at(p, 4), cache, defer=True, kernels=kernels)
    out.append(model.logits(h))
    kept = jnp.asarray([4, 2], jnp.int32)
    cache = model.settle(cache, kept)
    p = p + kept
    h, _, cache = model(tok(p[:, None]), p[:, None], cache, kernels=kernels)
    return out + [model.logits(h)], cache.recurrent, cache.conv


def test_hybrid_model_through_the_kernel(monkeypatch):
    """impl="cuda" with the kernel (interpret mode here) gives the XLA path's logits, tokens and linear states
    through prefill with lengths, a deferred verify + settle and a decode step; without the ``interpret`` knob a
    CPU keeps the jnp path for impl="cuda"."""
    model = _tiny_hybrid()
    graphdef, state = nnx.split(model)
    ids = np.random.default_rng(1).integers(0, 64, size=(2, 14)).astype(np.int32)
    calls = []
    real = dr.packed_delta_rule_block
    monkeypatch.setattr(dr, "packed_delta_rule_block", lambda *a, **kw: calls.append(kw["advance"]) or real(*a, **kw))

    def run(state, ids, kernels):
        return _scripted(nnx.merge(graphdef, state), ids, kernels)

    if not ON_GPU:  # impl="cuda" on a CPU without the switch: the jnp path, no kernel
        jax.eval_shape(lambda s, i: run(s, i, Kernels("cuda")), state, ids)
        assert calls == []
    interpret = KernelTuning(interpret=True)
    (want, want_rec, want_conv), (got, got_rec, got_conv) = (
        jax.device_get(fast_jit(run, kernels=Kernels(impl, interpret))(state, ids)) for impl in ("xla", "cuda"))
    assert calls == [True, True, False, False, True, True]  # both linear layers: prefill, verify (record), step
    # The prefill's padding positions (row 1's last two) differ by design: there the kernel's state stops at the
    # row's length (the chunked prefill's meaning), the jnp block form's runs on. Nothing reads them.
    live = np.arange(7)[None, :, None] < np.array([7, 5])[:, None, None]
    want[0], got[0] = np.where(live, want[0], 0.0), np.where(live, got[0], 0.0)
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(o.argmax(-1), w.argmax(-1))
    for w, o in zip(want_rec + want_conv, got_rec + got_conv):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-4)
