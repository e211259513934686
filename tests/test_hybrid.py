"""Hybrid targets (Qwen3.5 dense and MoE, Qwen3-Next) against transformers (torch, CPU, float32).

Tiny random models of three layers (linear attention, full attention, linear attention) are built in
transformers with a fixed seed and written the way the public checkpoints are: Qwen3.5 dense as the
vision-language wrapper's ``save_pretrained`` (text under ``model.language_model.``, a vision tower) plus an MTP
tensor; Qwen3.5-MoE as a wrapper around transformers' fused expert layout; Qwen3-Next as its own
``save_pretrained`` (fused ``in_proj_qkvz`` / ``in_proj_ba``). ``load_target`` reads them.

* the three forms of the gated delta rule agree (token by token, chunked with masked padding, one block with
  the state after every prefix);
* logits match transformers to 1e-4 relative through a scripted sequence: a right-padded prefill of rows of
  different lengths, a deferred 4-token verify block settled at different accepted lengths per row, and a cached
  single-token step after it (which sees the settled states);
* greedy ``generate`` equals transformers' greedy ``generate`` (MoE);
* speculative decoding with oracle drafters equals autoregressive decoding for block sizes 2 and 16, mixed prompt
  lengths in one batch, and chunked prefill, and so does a (random) DSpark drafter; the chunked prefill's linear
  states equal the one-shot prefill's;
* so does compact mode (packed verify windows; on a GPU through the kernels), which commits what cap-accept
  commits.
"""

from __future__ import annotations

import functools

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from conftest import fast_options, oracle_drafter, random_prompts
from dflash_jax import compile_count, generate, load_target, random_drafter, speculative_generate
from dflash_jax.config import model_config_from_hf
from dflash_jax.costs import CostTable
from dflash_jax.engine import job as jobs
from dflash_jax.tuning import Tuning
from dflash_jax.cuda import delta_rule as dr
from dflash_jax.models import layers, linear_attention as la
from dflash_jax.models.hybrid import HybridCache, HybridTargetModel
from dflash_jax.tuning import Kernels, KernelTuning

VOCAB = 128
REL_TOL = 1e-4
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256,
            initializer_range=0.15, rms_norm_eps=1e-6, layer_types=LAYER_TYPES)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)


def _randomize_norms(hf) -> None:
    """Non-trivial norm weights (zero-centred ones around 0, the DeltaNet's gated norm around 1)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.1 * torch.randn_like(p))


def _build(kind: str, path):
    torch.manual_seed(0)
    if kind == "dense":  # the VL wrapper, as Qwen3.5 ships, plus an MTP head's tensor in a second file
        cfg = transformers.Qwen3_5Config(text_config=dict(TEXT, intermediate_size=64), vision_config=VISION)
        hf = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
        _randomize_norms(hf)
        hf.save_pretrained(path)
        save_numpy({"mtp.fc.weight": np.zeros((4, 4), np.float32)}, str(path / "mtp.safetensors"))
    elif kind == "moe":  # Qwen3.5-MoE as the public checkpoints store it: VL prefix, fused experts
        text = transformers.Qwen3_5MoeTextConfig(**TEXT, **MOE)
        hf = transformers.Qwen3_5MoeForCausalLM(text).float().eval()
        _randomize_norms(hf)
        path.mkdir(parents=True)
        state = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in state
        save_file(state | {"mtp.norm.weight": torch.zeros(4)}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": text.to_dict(), "vision_config": VISION}))
    else:  # Qwen3-Next: fused linear-attention projections, MoE every other layer
        cfg = transformers.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=64, decoder_sparse_step=2)
        hf = transformers.Qwen3NextForCausalLM(cfg).float().eval()
        _randomize_norms(hf)
        hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind → (HF model, checkpoint dir, our float32 target)."""
    out = {}
    for kind in ("dense", "moe", "next"):
        path = tmp_path_factory.mktemp("hybrid") / kind
        hf = _build(kind, path)
        out[kind] = (hf, path, load_target(path, dtype="float32"))
    return out


# Tiny models: compiling is nearly all the time, so compile at XLA's lowest CPU optimisation (as conftest does for
# the decode programs of tiny-model tests); None (XLA's defaults) on other backends, which lack the CPU options.
FAST = fast_options()


@pytest.fixture(scope="module", autouse=True)
def torch_one_thread():
    """transformers' reference runs ~20x faster on one torch thread here (tiny ops; the pool fights JAX's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def fast_compiles(monkeypatch):
    """The decode programs with FAST too, unless the suite already chose options (the default Tuning's)."""
    if FAST and not os.environ.get("DFLASH_JAX_COMPILER_OPTIONS"):
        monkeypatch.setenv("DFLASH_JAX_COMPILER_OPTIONS", json.dumps(FAST))


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_configs_and_checkpoint_layouts(models, caplog):
    dense, moe, nxt = (models[k][2] for k in ("dense", "moe", "next"))
    assert isinstance(dense.model, HybridTargetModel)
    assert (dense.config.family, moe.config.family, nxt.config.family) == ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    h = dense.config.hybrid
    assert h.layer_types == tuple(LAYER_TYPES) and h.rotary_dim == 4 and h.conv_dim == 2 * 16 + 32
    assert [layer.linear for layer in dense.model.layers] == [True, False, True]
    assert moe.config.norm_topk_prob and moe.config.shared_expert_intermediate_size == 24
    assert [moe.config.is_moe_layer(i) for i in range(3)] == [True] * 3
    assert [nxt.config.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert nxt.config.hybrid.fused_projections
    # Qwen3-Next configs written before layer_types existed: a full-attention layer every full_attention_interval
    legacy = json.loads((models["next"][1] / "config.json").read_text())
    del legacy["layer_types"]
    types = model_config_from_hf(legacy | {"num_hidden_layers": 8, "full_attention_interval": 4}).hybrid.layer_types
    assert types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)
    # The unused parts of VL checkpoints (vision tower, MTP head) are named in one log line, not loaded.
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        load_target(models["dense"][1])
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(lines) == 1 and "vision tower" in lines[0] and "1 tensors of the MTP head" in lines[0]


def numpy_delta_rule(q, k, v, g, beta, s):
    """Float64 token-by-token reference: outputs and the state after every token."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s))
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t, :, None]
        s = s + k[:, t, ..., None] * delta[..., None, :]
        outs.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
        states.append(s)
    return np.stack(outs, 1), states


def test_delta_rule_forms_agree():
    """Sequential, chunked (3 chunks of 4, the last padded; a row's tail masked) and one block with the state
    after each prefix, against a float64 reference."""
    rng = np.random.default_rng(0)  # numpy inputs: eager jnp ops would each compile
    b, t, h, dk, dv = 2, 11, 2, 4, 3
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = (unit(rng.normal(size=(b, t, h, dk))).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(b, t, h, dv)).astype(np.float32)
    g = -rng.uniform(0.05, 1.0, size=(b, t, h)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, size=(b, t, h)).astype(np.float32)
    s0 = rng.normal(size=(b, h, dk, dv)).astype(np.float32)
    ref_out, ref_states = numpy_delta_rule(q, k, v, g, beta, s0)

    def forms(q, k, v, g, beta, s0):
        live = (jnp.arange(t)[None] < jnp.asarray([11, 6])[:, None])[..., None]  # row 1: its last 5 tokens masked
        chunked = la.delta_rule_chunked(q, k, v, jnp.where(live, g, 0), jnp.where(live, beta, 0), s0, chunk=4)
        out, (kk, cum, v_new) = la.delta_rule_block(q, k, v, g, beta, s0)
        after = jax.vmap(lambda n: la.state_after(s0, kk, cum, v_new, jnp.full((b,), n)))(jnp.arange(t + 1))
        return la.delta_rule_sequential(q, k, v, g, beta, s0), chunked, out, after

    args = (q, k, v, g, beta, s0)
    (s_out, s_state), (c_out, c_state), b_out, after = jax.device_get(jax.jit(forms).lower(*args).compile(FAST)(*args))
    assert rel_err(s_out, ref_out) < 1e-5 and rel_err(s_state, ref_states[-1]) < 1e-5
    assert rel_err(c_out[0], ref_out[0]) < 1e-5 and rel_err(c_out[1, :6], ref_out[1, :6]) < 1e-5
    assert rel_err(c_state[0], ref_states[-1][0]) < 1e-5 and rel_err(c_state[1], ref_states[5][1]) < 1e-5
    assert rel_err(b_out, ref_out) < 1e-5
    np.testing.assert_allclose(after[0], s0)
    for n in range(1, t + 1):
        assert rel_err(after[n], ref_states[n - 1]) < 1e-5, n


def _scripted(model, ids, kernels=Kernels()):
    """Row 0 / row 1: prefill 7 / 5 tokens (row 1 right-padded), a deferred block of 4 settled after 4 / 2
    tokens, then a single-token step (which reads the settled states). Returns each call's logits."""
    start = jnp.zeros((2,), jnp.int32)
    at = lambda p, t: p[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # noqa: E731
    tok = lambda pos: jnp.take_along_axis(ids, pos, axis=1)  # noqa: E731
    cache = model.new_cache(2, 16)
    p = jnp.asarray([7, 5], jnp.int32)
    h, _, cache = model(ids[:, :7], at(start, 7), cache, prefill=True, lengths=p, kernels=kernels)
    out = [model.logits(h)]
    h, _, cache = model(tok(at(p, 4)), at(p, 4), cache, defer=True, kernels=kernels)
    out.append(model.logits(h))
    kept = jnp.asarray([4, 2], jnp.int32)
    cache = model.settle(cache, kept)
    p = p + kept
    h, _, cache = model(tok(p[:, None]), p[:, None], cache, kernels=kernels)
    return out + [model.logits(h)]


def _run(model, fn, ids: np.ndarray):
    """``fn(model, ids)`` compiled once (with the fast options) and run; numpy results (indexing device arrays
    would compile an op each)."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, ids: fn(nnx.merge(graphdef, state), ids))
    ids = jnp.asarray(ids, jnp.int32)
    return jax.device_get(run.lower(state, ids).compile(FAST)(state, ids))


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_logits_match_transformers(models, kind, monkeypatch):
    """Qwen3-Next prefills through the chunked delta rule (chunks of 4; the 5-token row's tail masked)."""
    hf, _, target = models[kind]
    chunk4 = Kernels(tuning=KernelTuning(delta_rule_chunk=4 if kind == "next" else 64))
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 14))
    ref = hf_logits(hf, ids)
    prefill, block, step = _run(target.model, functools.partial(_scripted, kernels=chunk4), ids)
    assert rel_err(prefill[0], ref[0, :7]) <= REL_TOL and rel_err(prefill[1, :5], ref[1, :5]) <= REL_TOL
    for r, (p1, p2) in ((0, (7, 11)), (1, (5, 7))):  # positions of: the block's start, the step
        assert rel_err(block[r], ref[r, p1:p1 + 4]) <= REL_TOL
        assert rel_err(step[r, 0], ref[r, p2]) <= REL_TOL, f"row {r}: the step after settling"


PROMPTS = random_prompts(4, [5, 17, 9, 30], VOCAB, seed=2)  # bucket 32: one prompt shape for every run
NEW = 24


@pytest.fixture(scope="module")
def greedy(models):
    """Our autoregressive greedy tokens for PROMPTS on the MoE target (the kind the z-lab drafters target)."""
    return generate(models["moe"][2], PROMPTS, max_new_tokens=NEW, stop_token_ids=[])


def test_greedy_generate_matches_transformers(models, greedy):
    """Through the decode loop: prefill by prompt lengths, steps that defer and settle (the dense model's loop is
    the same code; its logits are checked above)."""
    hf = models["moe"][0]
    for prompt, row in zip(PROMPTS, greedy.token_ids):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert row == out[0, len(prompt):].tolist()


def test_speculative_decoding_is_lossless(models, greedy, monkeypatch):
    """Oracle drafters (right most of the time) give acceptance lengths over 1..L; the output is the AR output.
    Block 16 runs with prefill chunks of 8 (4 chunks; the 5-token row is padding from its 1st chunk on), and its
    prefilled linear states equal the one-shot prefill's. A random DSpark drafter goes through the same loop."""
    target = models["moe"][2]
    # The oracle never reads its weights: draw them with numpy (eager jax.random compiles per shape, ~4 s).
    rng = np.random.default_rng(0)
    monkeypatch.setattr(layers, "normal_init", lambda rngs, shape, scale, dtype: jnp.asarray(
        (scale * rng.normal(size=shape)).astype(jnp.dtype(dtype))))
    runs = {}
    for block, corrupt, chunk in ((2, 0.3, Tuning().prefill_chunk), (16, 0.15, 8)):
        tuning = Tuning(prefill_chunk=chunk)
        drafter = oracle_drafter(target, PROMPTS, greedy.token_ids, block_size=block, corrupt=corrupt)
        out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], tuning=tuning)
        assert out.token_ids == greedy.token_ids, f"block {block}"
        lengths = {a for row in out.acceptance_lengths for a in row}
        assert lengths == {1, 2} if block == 2 else len(lengths) >= 5, lengths
        before = compile_count()
        job = jobs.make(target, drafter, [list(p) for p in PROMPTS], NEW, block_size=block, stop_token_ids=[],
                        tuning=tuning)
        runs[block] = job.programs.prefill(*job.pre_args)[0].target_cache
        assert compile_count() == before  # the programs of the run above
    # γ = 3 drafts, verify width 4; random, so mostly rejected
    dspark = random_drafter(target, kind="dspark", block_size=3, num_layers=1, markov_rank=8)
    out = speculative_generate(target, dspark, PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert out.token_ids == greedy.token_ids and len(out.stats["predicted_survival"]) == 3
    # Continuous batching: refilled rows get the new prompts' conv and recurrent states too.
    pool = speculative_generate(target, dspark, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], batch_size=2)
    assert pool.token_ids == greedy.token_ids and pool.stats["refills"] == 2
    one_shot, chunked = runs[2], runs[16]
    assert isinstance(chunked, HybridCache) and len(chunked.conv) == 2 and not chunked.pending
    for x, y in zip(one_shot.conv + one_shot.recurrent, chunked.conv + chunked.recurrent):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


# Step cost per tokens-per-row at batch 4: verifying gets dearer, so windows vary.
TABLE = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 1.0, 2: 1.25, 4: 1.8, 8: 3.2}})


def test_compact_verify_is_lossless(models, greedy, monkeypatch):
    """Compact mode packs each row's window: the linear layers run their windows as blocks (tiers narrower than
    the block too: records padded to it) and settle after the accepted prefix, as whole-block verifies do.
    Compact and cap-accept commit the same; on a GPU, so do the kernels (the packed attention and the delta
    rule's record mode; `tools/remote_gpu/kernel_checks.sh`). Steps without drafting: the 8-device suite's test."""
    target = models["moe"][2]
    kw = dict(max_new_tokens=NEW, stop_token_ids=[])
    oracle = oracle_drafter(target, PROMPTS, greedy.token_ids, block_size=8, corrupt=0.2, seed=1)
    compact, cap = (speculative_generate(target, oracle, PROMPTS, verify_mode=m, cost_table=TABLE, **kw)
                    for m in ("compact", "cap-accept"))
    assert compact.token_ids == cap.token_ids == greedy.token_ids
    assert compact.stats["verify_mode"] == "compact" and len(compact.stats["tier_steps"]) >= 2
    assert compact.acceptance_lengths == cap.acceptance_lengths
    assert compact.stats["tier_steps"] == cap.stats["tier_steps"]
    if jax.default_backend() != "gpu":
        return  # each kernel's interpret-mode tests: test_delta_rule_kernel.py, test_kernel_dispatch.py
    calls = []
    real = dr.packed_delta_rule_block
    monkeypatch.setattr(dr, "packed_delta_rule_block", lambda *a, **k: calls.append(k["advance"]) or real(*a, **k))
    # Two tiers (up to 4 drafts a row, or the whole block), 12 tokens.
    two_tiers = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 1.0, 4: 1.0, 8: 3.2}})
    out = speculative_generate(target, oracle, PROMPTS, max_new_tokens=12, stop_token_ids=[], verify_mode="compact",
                               cost_table=two_tiers, attention_impl="cuda")
    assert out.token_ids == [row[:12] for row in greedy.token_ids]
    assert False in calls  # the verify windows went through the kernel
