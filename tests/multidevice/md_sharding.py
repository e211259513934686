"""Run by tests/test_sharding.py in a subprocess with 8 simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8), so the rest of the suite keeps one device."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from conftest import ZLAB, fast_jit, oracle_drafter, random_prompts, tiny_config, tiny_target
from dflash_jax import (ShardingError, generate, load_drafter, load_target, make_mesh, quantize, random_drafter,
                        restrict_draft_vocab, shard, speculative_generate)
from dflash_jax.quant import Scheme
from dflash_jax.engine import programs as engine_programs
from dflash_jax.loading import Target
from dflash_jax.tuning import Kernels, KernelTuning, Tuning
from flax import nnx
from jax.extend import core as jax_core
from jax.sharding import NamedSharding, PartitionSpec as P

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SHAPE = dict(num_heads=8, num_kv_heads=4, head_dim=8, hidden_size=64, intermediate_size=128, num_layers=2)
PROMPTS = random_prompts(5, [4, 9, 13, 6, 3], 64, seed=0)  # 5 rows: not a multiple of dp (padding exercised)
ZLAB_NEW = 12  # new tokens of the z-lab fixture pair's runs


def pair(mesh=None, family="qwen3"):
    target = tiny_target(family, seed=1, **SHAPE)
    if mesh is not None:
        shard(target, mesh)
    return target, random_drafter(target, block_size=4, num_layers=2, seed=2)


@pytest.fixture(scope="module")
def reference():
    t, d = pair()
    kw = dict(max_new_tokens=16, stop_token_ids=[])
    return {"spec": speculative_generate(t, d, PROMPTS, **kw).token_ids, "ar": generate(t, PROMPTS, **kw).token_ids,
            "sampled": speculative_generate(t, d, PROMPTS, temperature=1.0, seed=3, **kw).token_ids}


# tp = 8 (KV heads replicated), dp alone; tp with dp: the explicit-axes and checkpoint tests below (2, 2), the
# hybrid MoE test (4, 2).
@pytest.mark.parametrize("tp,dp", [(8, 1), (1, 8)])
def test_token_identical_to_single_device(reference, tp, dp):
    t, d = pair(make_mesh(tp=tp, dp=dp))
    kw = dict(max_new_tokens=16, stop_token_ids=[])
    assert speculative_generate(t, d, PROMPTS, **kw).token_ids == reference["spec"]
    assert generate(t, PROMPTS, **kw).token_ids == reference["ar"]
    if dp == 1:  # per-row PRNG keys are the same rows as on one device only without batch padding
        assert speculative_generate(t, d, PROMPTS, temperature=1.0, seed=3, **kw).token_ids == reference["sampled"]


def test_fallback_switches_under_a_mesh(reference, monkeypatch):
    """Auto's fallback to autoregressive steps (dflash_jax.engine.switching) under tp × dp, switching at random
    segments: the fallback program's feature buffer and context writes sharded with the rows, the tokens a single
    device gives, for static and compact."""
    import math

    from dflash_jax.costs import CostTable
    from dflash_jax.engine import switching

    class RandomSwitches(switching.SwitchPolicy):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.rng = np.random.default_rng(0)

        def drafted(self, *args, **kw):
            pass

        def next_segment(self):
            return switching.DRAFT if self.rng.random() < 0.5 else switching.AUTOREGRESSIVE

    monkeypatch.setattr(switching, "SwitchPolicy", RandomSwitches)
    t, d = pair(make_mesh(tp=2, dp=2))
    table = CostTable("cpu", "test", "float32", "tiny", 4, 64, {6: {1: 1.4, 2: 1.6, 4: 1.8}}, ar_ms={6: 1.0},
                      static_ms={6: 1.8})
    for ratio in (math.inf, 1.0):  # auto resolves to static, then to compact
        tuning = Tuning(ar_fallback=True, drafted_segment_cycles=2, fallback_steps=4, auto_compact_ratio=ratio)
        out = speculative_generate(t, d, PROMPTS, max_new_tokens=16, stop_token_ids=[], cost_table=table,
                                   tuning=tuning)
        assert out.token_ids == reference["spec"]
        assert out.stats["ar_fallback_steps"] > 0 and out.stats["fallback_switches"] >= 2
        assert out.stats["verify_mode"] == ("static" if ratio == math.inf else "compact")


def test_compact_streams_under_a_mesh():
    """A stream feeds each segment's state to the next call of the same program: under tp × dp its per-row
    scheduler fields must come out placed as they went in (they came back over dp and the second segment was
    refused). Static and compact, the whole call's tokens."""
    from dflash_jax import speculative_stream

    t, d = pair(make_mesh(tp=2, dp=2))
    kw = dict(max_new_tokens=16, stop_token_ids=[])
    for mode in ("static", "compact"):
        whole = speculative_generate(t, d, PROMPTS, verify_mode=mode, **kw)
        stream = speculative_stream(t, d, PROMPTS, segment_cycles=2, verify_mode=mode, **kw)
        for _ in stream:
            pass
        assert stream.segments > 2 and stream.output.token_ids == whole.token_ids


def test_reduced_draft_vocabulary_under_a_mesh(reference):
    """The drafts' head rows (placed replicated) and id map under tp × dp: the target's tokens still."""
    t, d = pair(make_mesh(tp=4, dp=2))
    small = restrict_draft_vocab(d, t, np.arange(0, 64, 2))
    assert small.model.draft_head[...].sharding.spec == P()
    out = speculative_generate(t, small, PROMPTS, max_new_tokens=16, stop_token_ids=[])
    assert out.token_ids == reference["ar"]


def test_continuous_batching_under_a_mesh(reference):
    """A pool of 2 rows over dp=2 (a refill of one prompt rounded up to dp, its padding row dropped), tp=4."""
    t, d = pair(make_mesh(tp=4, dp=2))
    kw = dict(max_new_tokens=16, stop_token_ids=[], batch_size=2)
    out = speculative_generate(t, d, PROMPTS, **kw)
    assert out.token_ids == reference["spec"] and out.stats["refills"] >= 2
    assert generate(t, PROMPTS, **kw).token_ids == reference["ar"]


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_dflash2_under_a_mesh(reference, mode):
    """A DFlash2 drafter (convolutions and selector replicated; the top-K over the LM head's split vocabulary)
    under tp × dp: the target's tokens, verifying whole blocks or the windows its confidences choose."""
    t, _ = pair(make_mesh(tp=4, dp=2))
    d = random_drafter(t, kind="dflash2", block_size=4, num_layers=1, seed=2, selector_top_k=8, selector_rank=16)
    out = speculative_generate(t, d, PROMPTS, max_new_tokens=16, stop_token_ids=[], verify_mode=mode)
    assert out.token_ids == reference["ar"] and out.stats["verify_mode"] == mode


def count_collectives(hlo: str) -> dict[str, int]:
    return {k: len(re.findall(rf"= \S+ {k}(?:-start)?\(", hlo))
            for k in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")}


def test_collectives_per_cycle_are_only_what_tp_needs():
    """tp=2: per cycle, 2 all-reduces per layer (after o_proj and down_proj) for the 2 target and 2 drafter
    layers, one per embedding lookup of the draft and verify blocks (the table is vocab-sharded), and an
    all-gather of (max, index) for each of the two vocab-sharded argmaxes — nothing touches the caches."""
    engine_programs.CACHE.clear()
    t, d = pair(make_mesh(tp=2, dp=1))
    speculative_generate(t, d, PROMPTS[:2], max_new_tokens=8, stop_token_ids=[])
    decode = [p.decode for p in engine_programs.CACHE.values()]
    assert len(decode) == 1
    hlo = decode[0].as_text()
    counts = count_collectives(hlo)
    assert counts == {"all-reduce": 2 * (2 + 2) + 2, "all-gather": 4, "all-to-all": 0, "collective-permute": 0,
                      "reduce-scatter": 0}, counts
    # Every collective moves block-sized activations ([B, L, …]), never a cache ([B, S, …], S = 48 here).
    shapes = re.findall(r"= \w+\[([\d,]+)\][^=]*? (?:all-reduce|all-gather)(?:-start)?\(", hlo)
    assert shapes and all(int(s.split(",")[1]) <= 4 for s in shapes), shapes


def test_two_way_tp_holds_half_the_weights_per_device():
    t, _ = pair(make_mesh(tp=2, dp=1))
    total = per_device = 0
    dev0 = jax.devices()[0]
    for leaf in jax.tree.leaves(jax.tree.map(lambda v: v, __import__("flax").nnx.state(t.model))):
        total += leaf.nbytes
        per_device += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == dev0)
    assert 0.5 <= per_device / total < 0.52, per_device / total  # only the small norms are replicated
    k = t.model.layers[0].self_attn.k_proj.kernel[...]
    assert k.sharding.spec == jax.sharding.PartitionSpec(None, "tp")  # 4 KV heads split 2-way


def test_fewer_kv_heads_than_tp_are_replicated():
    t, _ = pair(make_mesh(tp=8, dp=1))
    k = t.model.layers[0].self_attn.k_proj.kernel[...]
    assert k.sharding.spec == jax.sharding.PartitionSpec(None, None)


@pytest.fixture(scope="module")
def zlab_reference():
    """The z-lab fixture pair's tokens on one device (its target's stop tokens)."""
    target = load_target(ZLAB / "target")
    drafter = load_drafter(ZLAB / "drafter_fitted", target)
    return speculative_generate(target, drafter, PROMPTS, max_new_tokens=ZLAB_NEW).token_ids


def test_checkpoint_loaded_onto_shards_and_smollm2_head_layout(zlab_reference):
    """Weights loaded straight from a checkpoint onto their shards (tp and dp together) decode like one device
    (placing a loaded model afterwards and dp alone are covered above); SmolLM2's head layout (9 query / 3 KV
    heads, MLP 1536, vocab 49152) splits over tp=3, and tp=2, 4 or 8 cannot split it."""
    t = load_target(ZLAB / "target", mesh=make_mesh(tp=2, dp=2))
    d = load_drafter(ZLAB / "drafter_fitted", t)  # inherits the target's mesh
    assert d.mesh is t.mesh
    assert speculative_generate(t, d, PROMPTS, max_new_tokens=ZLAB_NEW).token_ids == zlab_reference

    kw = dict(max_new_tokens=10, stop_token_ids=[])

    smol = dict(num_heads=9, num_kv_heads=3, head_dim=8, hidden_size=72, intermediate_size=96, vocab_size=96,
                num_layers=2)
    ref_t = tiny_target("llama", seed=1, **smol)
    want = speculative_generate(ref_t, random_drafter(ref_t, block_size=4, num_layers=1, seed=2), PROMPTS,
                                **kw).token_ids
    t = shard(tiny_target("llama", seed=1, **smol), make_mesh(tp=3, dp=2))
    assert speculative_generate(t, random_drafter(t, block_size=4, num_layers=1, seed=2), PROMPTS,
                                **kw).token_ids == want
    for tp in (2, 4, 8):
        with pytest.raises(ShardingError, match=rf"tp={tp} cannot split .*9 attention heads"):
            shard(Target(nnx.clone(ref_t.model), None, "smollm2-shaped"), make_mesh(tp=tp))


def test_quantized_targets_under_a_mesh():
    """A quantized layer's scales shard with its kernel (a dimension whose block count the axis does not divide
    replicated) and the target decodes like one device: int8 per output channel under tp × dp with a drafter,
    FP8 blocks over tp = 4, and an int8 target loaded from a checkpoint straight onto its shards."""
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    specs = {"int8": {"q_proj": P(None, "tp"), "o_proj": P(None, None), "down_proj": P(None, None)},
             Scheme("fp8", (16, 16)): {"q_proj": P(None, "tp"), "o_proj": P("tp", None), "down_proj": P("tp", None)}}
    for (scheme, want_specs), mesh in zip(specs.items(), (make_mesh(tp=2, dp=2), make_mesh(tp=4))):
        one = quantize(tiny_target("qwen3", seed=1, **SHAPE), scheme)
        want = speculative_generate(one, random_drafter(one, block_size=4, num_layers=1, seed=2), PROMPTS,
                                    **kw).token_ids
        t = quantize(shard(tiny_target("qwen3", seed=1, **SHAPE), mesh), scheme)
        got = speculative_generate(t, random_drafter(t, block_size=4, num_layers=1, seed=2), PROMPTS, **kw)
        assert got.token_ids == want, scheme
        layer = t.model.layers[0]
        for name, dense in (("q_proj", layer.self_attn.q_proj), ("o_proj", layer.self_attn.o_proj),
                            ("down_proj", layer.mlp.down_proj)):
            assert dense.scale[...].sharding.spec == want_specs[name], (scheme, name)
        assert t.model.layers[0].self_attn.q_proj.kernel[...].sharding.spec == P(None, "tp")
    one = load_target(ZLAB / "target", quantization="int8")
    placed = load_target(ZLAB / "target", quantization="int8", mesh=make_mesh(tp=2, dp=2))
    assert placed.model.layers[0].mlp.up_proj.scale[...].sharding.spec == P(None, "tp")
    assert generate(placed, PROMPTS, **kw).token_ids == generate(one, PROMPTS, **kw).token_ids


def test_quantized_moe_experts_under_a_mesh():
    """Quantized routed experts (int8, per expert and output channel): values and scales split like the experts'
    hidden F over tp (the down projection's [E, 1, D] scales replicated), tokens as on one device."""
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    kw = dict(max_new_tokens=10, stop_token_ids=[])
    one = quantize(tiny_target("qwen3_moe", seed=3, **SHAPE, **experts), "int8")
    t = quantize(shard(tiny_target("qwen3_moe", seed=3, **SHAPE, **experts), make_mesh(tp=2, dp=2)), "int8")
    e = t.model.layers[0].mlp.experts
    assert e.quant == Scheme("int8") and e.gate_proj[...].dtype == np.int8
    assert e.gate_proj_scale[...].sharding.spec == P(None, None, "tp")
    assert e.down_proj[...].sharding.spec == P(None, "tp", None) and e.down_proj_scale[...].sharding.spec == P(
        None, None, None)
    assert generate(t, PROMPTS, **kw).token_ids == generate(one, PROMPTS, **kw).token_ids


def test_mistral_under_a_mesh():
    """The worked example of docs/port-a-model.md: a family with no partition rules of its own (the shared ones
    split it) and a sliding window on every layer, token-identical under tp × dp."""
    window = dict(SHAPE, sliding_layers=(0, 1), sliding_window=5)
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    want = generate(tiny_target("mistral", seed=1, **window), PROMPTS, **kw).token_ids
    t = shard(tiny_target("mistral", seed=1, **window), make_mesh(tp=2, dp=2))
    assert t.model.layers[0].self_attn.q_proj.kernel[...].sharding.spec == P(None, "tp")
    d = random_drafter(t, block_size=4, num_layers=1, seed=2)
    assert speculative_generate(t, d, PROMPTS, **kw).token_ids == want


def test_mesh_errors():
    with pytest.raises(ShardingError, match="needs 16 devices, 8 available"):
        make_mesh(tp=4, dp=4)
    t, d = pair(make_mesh(tp=2))
    other = random_drafter(tiny_target("qwen3", seed=1, **SHAPE), block_size=4, num_layers=1)
    with pytest.raises(ShardingError, match="same mesh"):
        speculative_generate(t, other, PROMPTS, max_new_tokens=4)


def test_explicit_axes_mesh(reference):
    """A mesh with JAX's explicit axes is accepted, inside and outside a `jax.set_mesh` context."""
    mesh = make_mesh(tp=2, dp=2, explicit=True)
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    t, d = pair(mesh)
    kw = dict(max_new_tokens=16, stop_token_ids=[])
    assert speculative_generate(t, d, PROMPTS, **kw).token_ids == reference["spec"]
    with jax.set_mesh(mesh):
        assert speculative_generate(t, d, PROMPTS, **kw).token_ids == reference["spec"]
        assert generate(t, PROMPTS, **kw).token_ids == reference["ar"]


def test_generate_command_with_a_mesh(tmp_path, zlab_reference):
    """`dflash-jax generate --mesh tp=2,dp=2` writes the tokens of a single-device run (the batch command's
    batches equal direct calls: tests/test_batch.py). One batch of the 5 rows, padded to 6 over dp = 2: the
    programs of the checkpoint test above, which this process has compiled already."""
    import json

    from dflash_jax.cli import main

    rows = [{"id": f"r{i}", "token_ids": p} for i, p in enumerate(PROMPTS)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mesh.jsonl"
    assert main(["generate", "--target", str(ZLAB / "target"), "--drafter", str(ZLAB / "drafter_fitted"), "--input",
                 str(inp), "--max-new-tokens", str(ZLAB_NEW), "--batch-size", "6", "--no-progress", "--output",
                 str(out), "--mesh", "tp=2,dp=2", "--no-speedup-estimate", "--no-compile-cache"]) == 0
    got = {json.loads(x)["id"]: json.loads(x)["token_ids"] for x in out.read_text().splitlines()}
    assert [got[r["id"]] for r in rows] == zlab_reference


def test_kernels_run_per_shard_under_a_mesh(caplog):
    """The GPU kernels (interpret mode here) in the decode loop under tp=2 × dp=2: each device runs them on its
    own rows and KV heads (shard_map), with the reference's tokens on one device and no fallback. The TPU kernels
    share that per-shard dispatch; their ops are checked per shard below (in interpret mode their decode loop
    took 25 s here)."""
    shape = dict(SHAPE, head_dim=16, num_layers=2)

    def kernel_pair(mesh=None):
        target = tiny_target("qwen3", seed=1, **shape)
        if mesh is not None:
            shard(target, mesh)
        return target, random_drafter(target, block_size=4, num_layers=1, seed=2)

    kw = dict(max_new_tokens=8, stop_token_ids=[])
    t1, d1 = kernel_pair()
    ref_ar = generate(t1, PROMPTS, attention_impl="xla", **kw)
    ref_spec = speculative_generate(t1, d1, PROMPTS, attention_impl="xla", **kw)
    t, d = kernel_pair(make_mesh(tp=2, dp=2))
    with caplog.at_level("WARNING", logger="dflash_jax"):
        spec = speculative_generate(t, d, PROMPTS, attention_impl="cuda", **kw)
        ar = generate(t, PROMPTS, attention_impl="cuda", **kw)
    assert ar.token_ids == ref_ar.token_ids
    assert spec.token_ids == ref_ar.token_ids
    assert spec.acceptance_lengths == ref_spec.acceptance_lengths
    assert not any("uses the XLA reference" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("impl", ["cuda", "pallas"])
def test_verify_kernels_take_sinks_per_shard(impl, caplog):
    """gpt-oss's attention sinks are per query head: under tp=2 × dp=2 each device gets its own heads' sinks
    (with a sliding window too), and the kernels run per shard, without falling back."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.kernels import attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(4, 4, 8, 16)), jnp.float32)
    kc, vc = (jnp.asarray(rng.normal(size=(4, 40, 4, 16)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(np.array([10, 20, 30, 35])[:, None] + np.arange(4), jnp.int32)
    sinks = jnp.asarray(2 * rng.normal(size=8), jnp.float32)
    want = jax.jit(lambda *a: attention.cache_attention(*a, sinks=sinks, window=6))(q, kc, vc, pos)
    with caplog.at_level("WARNING", logger="dflash_jax"), jax.set_mesh(make_mesh(tp=2, dp=2)):
        out = jax.jit(lambda *a: attention.cache_attention(*a[:4], kernels=Kernels(impl), sinks=a[4], window=6))(
            q, kc, vc, pos, sinks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=0)
    assert not any("uses the XLA reference" in r.getMessage() for r in caplog.records)


# Hybrid targets (Qwen3.5 dense and MoE): a Gated DeltaNet layer, then a gated full-attention layer. 8 value heads
# of width 8 under 4 (or 2) key heads: tp=2 gives each device 2 key heads and their 4 value heads; 2 key heads
# do not split 4 ways, so at tp=4 the linear layer is replicated (and its states with it).
def hybrid_target(moe: bool, key_heads: int):
    import jax.numpy as jnp

    from dflash_jax.config import HybridConfig
    from dflash_jax.models.hybrid import HybridTargetModel

    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   norm_topk_prob=True) if moe else {}
    linear = HybridConfig(("linear_attention", "full_attention"), conv_kernel=4, key_heads=key_heads, value_heads=8,
                          key_head_dim=8, value_head_dim=8, rotary_dim=4)
    cfg = tiny_config("qwen3_5_moe" if moe else "qwen3_5", vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hybrid=linear, **experts)
    # Weights drawn with numpy (initialising op by op would compile each op: ~10 s of this suite).
    model = nnx.eval_shape(lambda: HybridTargetModel(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, shape = ".".join(map(str, path)), var.value.shape
        if name.endswith("norm.weight"):  # zero-centred norms, the DeltaNet's gated norm around 1
            w = ("linear_attn.norm" in name) + 0.1 * rng.normal(size=shape)
        elif name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, size=shape))
        elif name.endswith("dt_bias"):
            w = rng.uniform(0.5, 1.5, size=shape)
        else:  # projections [in, out] and experts [E, in, out] by 1/√in, the conv [C, 1, W] by 1/√W, embeddings
            fan_in = shape[-1] if "conv1d" in name else 1 if "embed" in name else shape[-2]
            w = rng.normal(size=shape) / np.sqrt(fan_in)
        var.set_value(jnp.asarray(w, jnp.float32))
    return Target(model, None, f"tiny-{cfg.family}", ())


def equations(jaxpr):
    """Every equation of ``jaxpr``, those of the jaxprs in its equations' parameters included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    yield from equations(sub.jaxpr)
                elif isinstance(sub, jax_core.Jaxpr):
                    yield from equations(sub)


HYBRID_PROMPTS = random_prompts(5, [4, 9, 13, 6, 3], 128, seed=0)


def float_collectives(hlo: str) -> tuple[dict[str, int], list[int]]:
    """Collectives of float arrays (those that move activations or states; tuples of them count once), and the
    element count of every collective's result, ints included."""
    ops = re.findall(r"= (\S+|\([^=]*?\)) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                     r"(?:-start)?\(", hlo)
    counts = dict.fromkeys(("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"), 0)
    sizes = []
    for shape, op in ops:
        counts[op] += bool(re.match(r"\(?(f32|bf16)\[", shape))
        sizes += [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", shape)]
    return counts, sizes


@pytest.mark.parametrize("moe,key_heads,tp,dp", [(False, 4, 2, 2), (True, 2, 4, 2)], ids=["dense-tp2-dp2",
                                                                                          "moe-tp4-dp2"])
def test_hybrid_decoding_is_token_identical_to_one_device(moe, key_heads, tp, dp, monkeypatch):
    """Greedy speculative decoding of a hybrid target under tp × dp (an oracle drafter: every acceptance length
    1 … L, so settle runs at each) equals autoregressive decoding on one device. The Gated DeltaNet layer is split
    by key head where tp divides them (dense: weights and states on their shards, per cycle only the
    all-reduces TP needs), replicated otherwise (MoE at tp = 4). The prompts (5 rows: padded to 6 under dp = 2)
    prefill through the chunked delta rule (dense: chunks of 4) or in prefill chunks of 8 (MoE). Dense: compact
    verify too."""
    from dflash_jax.models import layers

    kw = dict(max_new_tokens=16, stop_token_ids=[],
              tuning=Tuning().replace(delta_rule_chunk=64 if moe else 4, **({"prefill_chunk": 8} if moe else {})))
    want = generate(hybrid_target(moe, key_heads), HYBRID_PROMPTS, **kw).token_ids
    t = shard(hybrid_target(moe, key_heads), make_mesh(tp=tp, dp=dp))
    split = key_heads % tp == 0
    assert split == (not moe)
    heads = "tp" if split else None
    # Every weight split tp ways but the norms' (and at tp = 4: the linear layer, the router, the shared expert's
    # gate, the 2 KV heads' projections); in the linear layer that is q/k/v/z/β/g, the conv, the decays, out_proj.
    whole = r"norm\.weight$" + (r"|linear_attn\.|mlp\.gate\.|shared_expert_gate\.|self_attn\.[kv]_proj" if moe else "")
    names = []
    for path, var in nnx.to_flat_state(nnx.state(t.model, nnx.Param)):
        name, w = ".".join(map(str, path)), var[...]
        names.append(name)
        per_device, size = int(np.prod(w.sharding.shard_shape(w.shape))), int(w.size)
        assert per_device == size // (1 if re.search(whole, name) else tp), (name, w.sharding.spec)
    assert sum("linear_attn." in n for n in names) == 9  # the rules above saw the layer's weights
    assert sum("shared_expert." in n for n in names) == 6 * moe  # and both MoE layers' shared experts
    rows = HYBRID_PROMPTS + [[0]] * ((-len(HYBRID_PROMPTS)) % dp)  # the padding row: one token, never used
    # The oracle never reads its weights: zeros (eager jax.random would compile an op per shape).
    monkeypatch.setattr(layers, "normal_init", lambda rngs, shape, scale, dtype: np.zeros(shape, dtype))
    d = shard(oracle_drafter(t, rows, want + [[0] * 16] * (len(rows) - len(want)), block_size=4, corrupt=0.25),
              t.mesh)
    engine_programs.CACHE.clear()
    out = speculative_generate(t, d, HYBRID_PROMPTS, **kw)
    assert out.token_ids == want
    assert {a for row in out.acceptance_lengths for a in row} == {1, 2, 3, 4}
    (programs,) = engine_programs.CACHE.values()
    state = programs.decode.output_shardings[0].target_cache
    placed = lambda s, *spec: s.is_equivalent_to(NamedSharding(t.mesh, P(*spec)), len(spec))  # noqa: E731
    assert placed(state.recurrent[0], "dp", heads, None, None) and placed(state.conv[0], "dp", None, heads)
    assert placed(state.k[0], "dp", None, "tp" if not moe else None, None)  # 2 KV heads: replicated at tp = 4
    if not moe:
        # Per cycle (and in the prefill), of floats: 2 all-reduces per target layer (after out_proj / o_proj and
        # after down_proj; the oracle drafter has no layers to run), one for the embedding lookup and the
        # all-gather of the vocab-sharded argmax's maxima; everything moved (ints too: the argmax's indices, dp's
        # per-row bookkeeping) is at most [B/dp, L, D] (the prefill: [B/dp, P, D]) — no state, no cache.
        for program, tokens in ((programs.decode, 4), (programs.prefill, 16)):
            counts, sizes = float_collectives(program.as_text())
            assert counts == {"all-reduce": 2 * 2 + 1, "all-gather": 1, "all-to-all": 0, "collective-permute": 0,
                              "reduce-scatter": 0}, counts
            assert max(sizes) <= 3 * tokens * 32, sizes
        # Compact verify on the same mesh: each device's rows' windows packed apart (dp), the linear layers'
        # windows back in their blocks and their records settled after the tier's branch.
        from dflash_jax.costs import CostTable

        b = len(rows) // dp
        table = CostTable("cpu", "test", "float32", "tiny", 4, 32, {b: {1: 1.0, 2: 1.5, 4: 2.6}})
        out = speculative_generate(t, d, HYBRID_PROMPTS, verify_mode="compact", cost_table=table, **kw)
        assert out.token_ids == want and out.stats["verify_mode"] == "compact" and len(out.stats["tier_steps"]) >= 2


def test_compact_verify_under_dp(reference, monkeypatch):
    """Compact mode under dp: each device packs, verifies and writes its own rows' windows (PackedLayout groups,
    the scheduler admitting each group alone and running the largest tier one chose) — AR's tokens, drafted and
    autoregressive steps both taken, and nothing but a few per-row integers crossing devices under dp alone."""
    from dflash_jax.costs import CostTable
    from dflash_jax.models import layers

    kw = dict(max_new_tokens=16, stop_token_ids=[])
    want = reference["ar"]
    dp = 2
    t = shard(tiny_target("qwen3", seed=1, **SHAPE), make_mesh(tp=1, dp=dp))
    rows = PROMPTS + [[0]] * ((-len(PROMPTS)) % dp)
    monkeypatch.setattr(layers, "normal_init", lambda rngs, shape, scale, dtype: np.zeros(shape, dtype))
    d = shard(oracle_drafter(t, rows, want + [[0] * 16] * (len(rows) - len(want)), block_size=4, corrupt=0.25),
              t.mesh)
    b = len(rows)  # costs are looked up at a device's rows
    table = CostTable("cpu", "test", "float32", "tiny", 4, 32, {b // dp: {1: 1.0, 2: 1.5, 4: 2.6}},
                      ar_ms={b // dp: 0.8})
    engine_programs.CACHE.clear()
    out = speculative_generate(t, d, PROMPTS, verify_mode="compact", cost_table=table, **kw)
    assert out.token_ids == want and out.stats["verify_mode"] == "compact"
    assert out.stats["tier_steps"] and out.stats["ar_steps"], out.stats
    (programs,) = engine_programs.CACHE.values()
    counts, sizes = float_collectives(programs.decode.as_text())
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0, counts
    assert max(sizes) <= 2 * b, sizes  # per-row bookkeeping, no activations, no cache


@pytest.mark.parametrize("impl", ["cuda", "pallas"])
def test_packed_verify_kernels_run_per_shard(impl, caplog):
    """Compact verify's packed windows (the cache only read, the windows' own K/V beside it) under a mesh: each
    device runs the block kernel (interpret mode here) on its rows and its KV heads with their query heads, as
    the reference on one device computes (a sliding window too)."""
    import jax.numpy as jnp

    from dflash_jax.kernels import common, packed

    rng = np.random.default_rng(0)
    kc, vc = (jnp.asarray(rng.normal(size=(4, 24, 4, 16)), jnp.float32) for _ in range(2))
    layout = packed.PackedLayout.build(jnp.asarray([3, 0, 4, 2], jnp.int32),
                                          jnp.asarray([16, 10, 2, 7], jnp.int32), 12, 4)
    q = jnp.asarray(rng.normal(size=(12, 8, 16)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(12, 2, 4, 16)), jnp.float32)  # the windows' own keys and values

    def attend(impl):
        return lambda *a: packed.packed_verify_attention(*a, kernels=Kernels(impl), window=6)

    args = (jnp.concatenate([q, kv.reshape(12, 8, 16)], axis=1), kc, vc, layout)  # heads: q, then K, then V
    want = np.asarray(fast_jit(attend("xla"))(*args))[:9]  # 9 slots: 3 + 0 + 4 + 2
    common.log_once.cache_clear()
    for mesh in (make_mesh(tp=2), make_mesh(tp=2, dp=2)):
        with caplog.at_level("WARNING", logger="dflash_jax"), jax.set_mesh(mesh):
            program = str(jax.make_jaxpr(attend(impl))(*args))
            out = fast_jit(attend(impl))(*args)
        assert not any("uses the XLA reference" in r.getMessage() for r in caplog.records)
        assert "shard_map" in program and "pallas_call" in program
        np.testing.assert_allclose(np.asarray(out)[:9], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tp,dp,tokens,bias", [(2, 2, 4, True), (4, 2, 2, False)], ids=["tp2-dp2-sorted-gpt-oss",
                                                                                         "tp4-dp2-pairs"])
def test_moe_kernels_run_per_shard_under_a_mesh(tp, dp, tokens, bias):
    """experts_auto under a (tp, dp) mesh with the GPU kernels: the Triton kernels (interpret mode) run on each
    device's token rows and its tp slice of the experts' hidden (2 rows per device: the expert-sorted kernels;
    1: the per-pair ones), the slices' outputs summed over tp, the down bias added once — equal to the jnp
    reference on one device."""
    import functools

    import jax.numpy as jnp

    from dflash_jax.kernels import moe
    from dflash_jax.models import gpt_oss

    e, d, f, k = 8, 16, 32, 2
    rng = np.random.default_rng(tp)
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), jnp.int32)
    shapes = [(tokens, d), (tokens, k), (e, d, f), (e, d, f), (e, f, d)] + ([(e, f), (e, f), (e, d)] if bias else [])
    x, w, *experts = (jnp.asarray(rng.normal(size=s) * 0.3, jnp.bfloat16) for s in shapes)
    act = functools.partial(gpt_oss.clamped_swiglu, alpha=1.702, limit=1.0) if bias else moe.swiglu

    def fn(impl, **kw):
        return lambda x, w, i, *ex: impl(x, w, i, *ex[:3], biases=tuple(ex[3:]) or None, act=act, **kw)

    want = np.asarray(jax.jit(fn(moe.experts_gathered))(x, w, idx, *experts), np.float32)

    mesh = make_mesh(tp=tp, dp=dp)
    args = [x, w, idx, *experts]
    placed = [jax.device_put(a, NamedSharding(mesh, P(*(ax for ax in layout))))
              for a, layout in zip(args, moe.LAYOUTS)]
    auto = fn(moe.experts_auto, kernels=Kernels("cuda", KernelTuning(interpret=True)))
    with jax.set_mesh(mesh):
        program = jax.make_jaxpr(auto)(*placed)
        out = np.asarray(jax.jit(auto)(*placed), np.float32)
    # One shard_map, whose body (a device's token rows and slice of the hidden) runs the Triton kernels.
    (body,) = [eqn.params["jaxpr"] for eqn in equations(program.jaxpr) if eqn.primitive.name == "shard_map"]
    assert [tuple(v.aval.shape) for v in body.invars[:4:3]] == [(tokens // dp, d), (e, d, f // tp)]
    assert any(eqn.primitive.name == "pallas_call" for eqn in equations(body))
    np.testing.assert_allclose(out, want, atol=3e-2 * max(1.0, np.abs(want).max()), rtol=3e-2)


@pytest.mark.parametrize("advance", [False, True], ids=["record", "advance"])
def test_delta_rule_kernel_runs_per_shard(advance):
    """The short-block gated delta rule kernel (interpret mode here) under tp=2 × dp=2: each device runs it on its
    rows and its key heads' value heads (shard_map), with what one device computes."""
    import jax.numpy as jnp

    from dflash_jax.kernels import delta_rule
    b, t, hk, hv, dk, dv = 4, 3, 2, 4, 8, 8
    rng = np.random.default_rng(1)
    qkv = jnp.asarray(rng.normal(size=(b, t, hk, 2 * dk + hv // hk * dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.05, 1.0, size=(b, t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, size=(b, t, hv)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)
    lengths = jnp.asarray([3, 1, 0, 2], jnp.int32) if advance else None
    kernels = Kernels("cuda", KernelTuning(interpret=True))
    run = lambda *a: delta_rule.kernel_block(*a, lengths, key_dim=dk, advance=advance, kernels=kernels)  # noqa: E731
    want = jax.jit(run)(qkv, g, beta, state)
    mesh = make_mesh(tp=2, dp=2)
    with jax.set_mesh(mesh):
        program = str(jax.make_jaxpr(run)(qkv, g, beta, state))
        out = jax.jit(run)(qkv, g, beta, state)
    assert "shard_map" in program and "pallas_call" in program
    for o, w in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(o), np.asarray(w), atol=1e-5, rtol=1e-5)
