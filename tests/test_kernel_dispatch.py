"""The decode loop through the Pallas kernels (``attention_impl="pallas"`` / ``"cuda"``): still lossless.

On this CPU machine both kernel packages run in Pallas interpret mode; on a GPU (or TPU) machine the same
tests run the compiled kernel of that backend (the other one stays in interpret mode).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_jit, oracle_drafter, random_prompts, tiny_target
from dflash_jax import generate, random_drafter, speculative_generate
from dflash_jax.costs import CostTable
from dflash_jax.cuda import attention as cuda_attention
from dflash_jax.cuda import cache_write
from dflash_jax.engine import job as jobs
from dflash_jax.engine import programs
from dflash_jax.kernels import attention, common, dispatch, resolve_impl
from dflash_jax.pallas import attention as pallas_attention
from dflash_jax.tuning import Kernels, Tuning

# head_dim 64 and GQA 2: a shape the kernels are built for, small enough for interpret mode.
SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=64, intermediate_size=128, num_layers=2,
             vocab_size=96)
PROMPTS = random_prompts(3, [5, 11, 2], 96, seed=4)
KW = dict(max_new_tokens=10, stop_token_ids=[])
# Step cost by tokens per row at batch 3, dearer with every token: compact keeps its three tiers (3, 6, 12 tokens)
# on any backend (a backend's shipped table may prune tiers of so small a model).
TIERED = CostTable("cpu", "test", "float32", "tiny", 4, 32, {3: {1: 1.0, 2: 1.4, 4: 2.2}})


@pytest.fixture(scope="module", autouse=True)
def exact_float32():
    """On a GPU, XLA's float32 matmuls default to TF32 while the kernels compute in full float32: compare at
    "highest" precision so only summation order differs (a no-op on CPU)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", seed=3, **SHAPE)
    return target, random_drafter(target, block_size=4, num_layers=1, seed=5)


@pytest.fixture(scope="module")
def reference(pair):
    target, drafter = pair
    return {"ar": generate(target, PROMPTS, attention_impl="xla", **KW),
            "spec": speculative_generate(target, drafter, PROMPTS, attention_impl="xla", **KW)}


@pytest.mark.parametrize("impl", ["pallas", "cuda"])
def test_kernels_in_the_decode_loop_are_lossless(pair, reference, impl):
    target, drafter = pair
    # AR through the TPU kernels in interpret mode is slow here and runs no kernel that the speculative runs below
    # miss (the verify op with one query a row): the GPU kernels' AR run only.
    if impl == "cuda":
        ar = generate(target, PROMPTS, attention_impl=impl, **KW)
        assert ar.token_ids == reference["ar"].token_ids
    spec = speculative_generate(target, drafter, PROMPTS, attention_impl=impl, **KW)
    assert spec.token_ids == reference["ar"].token_ids
    # Same drafts as the reference drafter attention ⇒ same acceptance lengths, cycle for cycle.
    assert spec.acceptance_lengths == reference["spec"].acceptance_lengths
    # An oracle drafter exercises every acceptance length, so verify windows start at varied positions.
    oracle = oracle_drafter(target, PROMPTS, reference["ar"].token_ids, block_size=4, corrupt=0.3)
    out = speculative_generate(target, oracle, PROMPTS, attention_impl=impl, **KW)
    assert out.token_ids == reference["ar"].token_ids
    assert len({a for row in out.acceptance_lengths for a in row}) >= 3


def test_compact_verify_through_the_packed_kernel(pair, reference, monkeypatch):
    """Compact mode with the GPU kernels: every tier's packed windows go through
    ``cuda.attention.packed_block_attention``, each tier's new K/V into the largest tier's slots through
    ``place_pending`` (the whole-block tier fills them: none) and into the caches through one ``write_pending``
    kernel — all counted — and the tokens stay the reference's, with an oracle drafter whose acceptance
    lengths (so windows and tiers) vary."""
    target, _ = pair
    calls, writes, placed = [], [], []
    kernel, write, place = cuda_attention.packed_block_attention, cache_write.write_pending, cache_write.place_pending
    monkeypatch.setattr(cuda_attention, "packed_block_attention",
                        lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    monkeypatch.setattr(cache_write, "write_pending", lambda *a, **k: writes.append(a[0].shape) or write(*a, **k))
    monkeypatch.setattr(cache_write, "place_pending", lambda *a, **k: placed.append(a[0].shape) or place(*a, **k))
    oracle = oracle_drafter(target, PROMPTS, reference["ar"].token_ids, block_size=4, corrupt=0.3)
    out = speculative_generate(target, oracle, PROMPTS, attention_impl="cuda", verify_mode="compact",
                               cost_table=TIERED, **KW)
    assert out.token_ids == reference["ar"].token_ids
    assert len({shape[0] for shape in calls}) >= 2  # traced once per layer in each compiled tier
    assert writes and writes[0][1] == target.config.num_layers  # one write, after the tier switch, every layer
    assert len({shape[0] for shape in placed}) >= 2 and all(shape[0] < writes[0][0] for shape in placed)


def test_auto_keeps_float32_on_the_reference_on_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", jnp.bfloat16) == "cuda"
    assert resolve_impl("auto", jnp.float32) == "xla"
    assert resolve_impl("cuda", jnp.float32) == "cuda"  # by name: the kernel, whatever the dtype
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl("auto", jnp.float32) == "pallas"


def test_auto_resolves_to_the_backend_kernel():
    expected = {"gpu": "cuda", "tpu": "pallas"}.get(jax.default_backend(), "xla")
    assert resolve_impl("auto") == expected
    assert resolve_impl("xla") == "xla"
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        resolve_impl("triton")


@pytest.mark.parametrize("impl,dtype,h", [("pallas", jnp.float16, 64),  # TPU kernels: f32 / bf16 only
                                          ("cuda", jnp.float32, 48)])  # GPU kernels: power-of-two head_dim
def test_unsupported_shape_falls_back_with_a_log_line(impl, dtype, h, caplog):
    """A shape the kernel does not take: the reference runs, and a log line says so."""
    b, l, n, k, s = 2, 4, 4, 2, 32
    rng = np.random.default_rng(0)  # (jax.random would compile a program per shape: seconds each on the CPU)
    normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))  # noqa: E731
    q = normal((b, l, n, h))
    ck, cv = normal((b, s, k, h)), normal((b, s, k, h))
    bk, bv = normal((b, l, k, h)), normal((b, l, k, h))
    ctx_len = jnp.array([7, 20], jnp.int32)
    pos = ctx_len[:, None] + jnp.arange(l, dtype=jnp.int32)
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):
        out = fast_jit(attention.draft_attention, kernels=Kernels(impl))(q, ck, cv, bk, bv, pos, ctx_len)
    ref = fast_jit(attention.draft_attention)(q, ck, cv, bk, bv, pos, ctx_len)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert any("uses the XLA reference" in r.getMessage() for r in caplog.records)


def test_a_kernel_that_fails_to_compile_falls_back(pair, reference, monkeypatch, caplog):
    """A TPU kernel whose shape rules pass but whose compile fails (e.g. a Mosaic limit on a real TPU) is
    probed once per shape and replaced by the reference, with the compiler's reason logged."""
    def broken(*args, **kwargs):
        raise NotImplementedError("no lowering for this primitive")

    always = lambda *args, **kwargs: None  # noqa: E731 — shape rules that accept everything
    monkeypatch.setattr(pallas_attention, "native", lambda impl: True)  # as on a TPU: the kernels are probed
    for name, fn in (("unsupported_reason", always), ("draft_attention", broken), ("ragged_verify_attention", broken)):
        monkeypatch.setattr(pallas_attention, name, fn)
    monkeypatch.setattr(common, "_PROBED", {})
    monkeypatch.setattr(programs.CACHE, "programs", {})  # trace afresh: the programs above used real kernels
    target, drafter = pair
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):
        out = speculative_generate(target, drafter, PROMPTS, attention_impl="pallas", **KW)
    assert out.token_ids == reference["ar"].token_ids
    assert out.acceptance_lengths == reference["spec"].acceptance_lengths
    messages = [r.getMessage() for r in caplog.records]
    assert any("draft attention uses the XLA reference" in m and "failed to compile" in m for m in messages)
    assert any("verify attention uses the XLA reference" in m and "NotImplementedError" in m for m in messages)


def test_cuda_kernels_after_a_chunked_long_prompt():
    """Prompts past the prefill chunk (1024 tokens; 256 here, which keeps the interpreted kernels' run short):
    the decode steps then read caches of several KV blocks and splits, the long-context case the kernels exist
    for. Still token-identical to the reference."""
    target = tiny_target("qwen3", seed=3, **SHAPE)
    drafter = random_drafter(target, block_size=4, num_layers=1, seed=5)
    prompts = random_prompts(2, [300, 420], 96, seed=1)  # the 512-token bucket: two chunks
    kw = dict(max_new_tokens=12, stop_token_ids=[], tuning=Tuning(prefill_chunk=256))
    ref = generate(target, prompts, attention_impl="xla", **kw)
    assert generate(target, prompts, attention_impl="cuda", **kw).token_ids == ref.token_ids
    spec = speculative_generate(target, drafter, prompts, attention_impl="cuda", **kw)
    assert spec.token_ids == ref.token_ids
    job = jobs.make(target, drafter, prompts, 12, block_size=4, attention_impl="cuda", tuning=kw["tuning"])
    assert job.spec.prefill_chunk == 256 and jobs.bucket(420) == 512  # really prefilled in two chunks


# --------------------------------------------------------------------------------------------------
# The (op, implementation) dispatch itself
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", sorted(dispatch.OPS))
@pytest.mark.parametrize("impl", ["xla", "pallas", "cuda"])
def test_every_op_and_impl_resolves_to_its_kernel_or_the_reference(op, impl):
    """Every (op, impl) pair gives the registered kernel entry (a function that loads) or None (the reference):
    "xla" is always the reference. (Every switch on: ``top_k_chunked`` is off by default.)"""
    from dflash_jax.tuning import KernelTuning

    path = dispatch.registered(op, impl)
    run = dispatch.kernel(op, Kernels(impl, KernelTuning(**{knob: True for knob in dispatch.SWITCHES.values()})))
    assert path == dispatch.REGISTRY.get((op, impl))
    if impl == "xla" or path is None:
        assert run is None
    else:
        assert callable(run) and run is dispatch.load(path)


def test_unknown_op_or_impl_raises_one_clear_error():
    with pytest.raises(ValueError, match="unknown kernel op 'flash'.*cache_attention"):
        dispatch.kernel("flash", Kernels("cuda"))
    with pytest.raises(ValueError, match="unknown kernel implementation 'auto'.*resolve"):
        dispatch.kernel("cache_attention", Kernels("auto"))
    with pytest.raises(ValueError, match="unknown kernel implementation 'triton'"):
        dispatch.registered("moe_experts", "triton")


def test_switches_turn_kernels_off():
    from dflash_jax.tuning import KernelTuning

    for op, knob in dispatch.SWITCHES.items():  # (top_k_chunked is off by default)
        assert dispatch.kernel(op, Kernels("cuda", KernelTuning(**{knob: True}))) is not None
        assert dispatch.kernel(op, Kernels("cuda", KernelTuning(**{knob: False}))) is None


def test_moe_delta_rule_and_cache_writes_honour_the_impl(monkeypatch):
    """MoE, the delta rule and the cache writes take their kernel from ``kernels.impl`` (not the backend): under
    "xla" none runs, under "cuda" each is called (interpret mode on a CPU)."""
    from dflash_jax.cuda import delta_rule as cuda_delta_rule
    from dflash_jax.cuda import moe as cuda_moe
    from dflash_jax.kernels import cache_write as cw
    from dflash_jax.kernels import delta_rule, moe
    from dflash_jax.tuning import KernelTuning

    calls = []
    for mod, name in ((cuda_moe, "experts_kernel"), (cuda_delta_rule, "kernel_block"),
                      (cache_write, "write_pending_kernel"), (cache_write, "place_pending_kernel")):
        monkeypatch.setattr(mod, name, lambda *a, name=name, **k: calls.append(name))  # None: the reference runs
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 16)), jnp.float32)
    gate = up = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    weights, idx = jnp.full((2, 2), 0.5, jnp.float32), jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    kv = jnp.zeros((8, 1, 2, 1, 16), jnp.float32)
    caches = (jnp.zeros((2, 16, 1, 16), jnp.float32),)
    slots, lens, starts = (jnp.asarray(a, jnp.int32) for a in ([0, 4], [4, 4], [3, 5]))
    qkv = jnp.zeros((2, 3, 1, 3 * 16), jnp.float32)
    g = beta = jnp.zeros((2, 3, 1), jnp.float32)
    state = jnp.zeros((2, 1, 16, 16), jnp.float32)
    interpret = KernelTuning(interpret=True)
    for impl, want in (("xla", []), ("cuda", ["experts_kernel", "kernel_block", "write_pending_kernel",
                                              "place_pending_kernel"])):
        calls.clear()
        kernels = Kernels(impl, interpret)
        moe.experts_auto(x, weights, idx, gate, up, down, kernels=kernels)
        delta_rule.kernel_block(qkv, g, beta, state, None, key_dim=16, advance=True, kernels=kernels)
        cw.write_pending(kv, slots, lens, starts, caches, caches, width=4, kernels=kernels)
        cw.place_pending(kv, 16, kernels=kernels)
        assert calls == want, impl


@pytest.mark.parametrize("family, extra", [
    ("qwen3", {}),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)),
    ("qwen3_5_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24, norm_topk_prob=True)),
])
def test_a_family_declares_the_kernel_ops_its_target_runs(family, extra, monkeypatch):
    """Tracing a family's target (prefill, then one cached step) asks the dispatch for exactly the family's own
    kernel ops (``Family.kernel_ops``) beyond the attention ops every target runs (shapes only: nothing runs)."""
    from flax import nnx

    from conftest import tiny_config
    from dflash_jax import families
    from dflash_jax.config import HybridConfig

    if family == "qwen3_5_moe":
        extra = dict(extra, hybrid=HybridConfig(("linear_attention", "full_attention"), conv_kernel=4, key_heads=2,
                                                value_heads=4, key_head_dim=8, value_head_dim=8, rotary_dim=4))
    cfg = tiny_config(family, num_layers=2, **extra)
    fam = families.of(cfg)
    asked = set()
    registered = dispatch.registered
    monkeypatch.setattr(dispatch, "registered", lambda op, impl: asked.add(op) or registered(op, impl))
    model = nnx.eval_shape(lambda: fam.model(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        cache = m.new_cache(2, 32)
        _, _, cache = m(tokens, jnp.broadcast_to(jnp.arange(8), (2, 8)), cache, prefill=True)
        return m(tokens[:, :1], jnp.full((2, 1), 8), cache)[0]

    jax.eval_shape(run, state, jax.ShapeDtypeStruct((2, 8), jnp.int32))
    assert set(fam.kernel_ops) <= asked <= set(fam.kernels), (sorted(asked), fam.kernels)
    assert ("moe_experts" in asked) == ("moe_experts" in fam.kernel_ops)
