"""Qwen3-MoE targets against transformers' ``Qwen3MoeForCausalLM`` (torch, CPU, float32).

One tiny random checkpoint (3 layers, 8 experts, top-2, layer 1 dense through ``mlp_only_layers``) is built
with transformers, written with ``save_pretrained`` and read back with ``load_target``. Logits must match
HF's to 1e-4 relative for prefill (the all-experts path), cached single-token steps (gathered path) and a
multi-token verify-style chunk; greedy ``generate`` must equal HF's greedy ``generate``, and speculative
decoding with a random drafter must equal autoregressive decoding token for token. The three expert
computations are checked against a float64 numpy reference, the fused expert layout of transformers 5
against the per-expert one, and config parsing against transformers' layer rule.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import save_file

from conftest import hf_greedy_tokens, random_prompts
from dflash_jax import generate, load_target, random_drafter, speculative_generate
from dflash_jax.config import ConfigError, model_config_from_hf
from dflash_jax.models import moe
from dflash_jax.kernels import moe as kmoe
from dflash_jax.models.layers import MLP

VOCAB, LAYERS, EXPERTS, TOP_K = 256, 3, 8, 2
REL_TOL = 1e-4


def hf_config(**kw) -> transformers.Qwen3MoeConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, mlp_only_layers=[1],
                max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return transformers.Qwen3MoeConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(HF model, checkpoint directory, our float32 target)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(), attn_implementation="eager").float().eval()
    with torch.no_grad():  # non-trivial norms: all-ones would hide a missing or misplaced one
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3_moe") / "tiny"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path, load_target(path, dtype="float32")


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


@nnx.jit(static_argnames="prefill")  # one compile per shape: ~3x faster than op-by-op on the CPU
def _forward(model, ids, positions, cache, prefill):
    h, _, cache = model(ids, positions, cache, prefill=prefill)
    return model.logits(h), cache


def our_logits(target, ids: np.ndarray, start, cache=None):
    """Logits of ``ids`` [B, T] at positions start[b] …; ``cache=None`` prefills a fresh one."""
    b, t = ids.shape
    prefill = cache is None
    cache = target.model.new_cache(b, 32) if prefill else cache
    positions = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)
    logits, cache = _forward(target.model, jnp.asarray(ids, jnp.int32), positions, cache, prefill)
    return np.asarray(logits), cache


def test_config_and_layer_layout(ckpt):
    _, path, target = ckpt
    cfg = target.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == \
        ("qwen3_moe", EXPERTS, TOP_K, 32)
    assert cfg.norm_topk_prob and cfg.mlp_only_layers == (1,) and cfg.qk_norm
    # save_pretrained writes num_experts as num_local_experts; public checkpoints write num_experts
    raw = json.loads((path / "config.json").read_text())
    assert "num_local_experts" in raw
    public = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": EXPERTS}
    assert model_config_from_hf(public) == cfg
    assert [type(layer.mlp) for layer in target.model.layers] == [moe.SparseMoE, MLP, moe.SparseMoE]
    e = target.model.layers[0].mlp.experts
    assert (e.gate_proj.shape, e.up_proj.shape, e.down_proj.shape) == ((8, 64, 32), (8, 64, 32), (8, 32, 64))
    # transformers' layer rule, with a sparse step
    stepped = hf_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    ours = model_config_from_hf(stepped.to_dict())
    ref = transformers.Qwen3MoeForCausalLM(hf_config(num_hidden_layers=6, decoder_sparse_step=2,
                                                     mlp_only_layers=[3], hidden_size=8, head_dim=2,
                                                     vocab_size=8, intermediate_size=4, moe_intermediate_size=2))
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in ref.model.layers]
    assert [ours.is_moe_layer(i) for i in range(6)] == hf_sparse == [False, True, False, False, False, True]


@pytest.mark.parametrize("change,field", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"mlp_only_layers": [3]}, "mlp_only_layers"),
    ({"decoder_sparse_step": -1}, "decoder_sparse_step"),
    ({"num_local_experts": None}, "num_experts"),
])
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        model_config_from_hf(hf_config().to_dict() | change)


def numpy_moe(x, router, gate, up, down, k, normalize):
    """Float64 reference, token by token: softmax, top-k (renormalised), the K experts' weighted outputs summed."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        probs = np.exp(row @ router - (row @ router).max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:k]
        for expert, w in zip(top, probs[top] / (probs[top].sum() if normalize else 1.0)):
            g, u = row @ gate[expert], row @ up[expert]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[expert])
    return out


def test_expert_implementations_match_a_numpy_reference():
    """Routing and the three expert computations on 20 tokens over 8 experts (most experts get several)."""
    rng = np.random.default_rng(0)  # (jax.random would compile threefry for every shape: seconds on the CPU)
    n, d, e, f = 20, 16, EXPERTS, 8
    arrays = [rng.normal(size=s) * c for s, c in
              [((n, d), 1), ((d, e), 1), ((e, d, f), 0.25), ((e, d, f), 0.25), ((e, f, d), 0.3)]]
    x, router, gate, up, down = (jnp.asarray(a, jnp.float32) for a in arrays)

    @jax.jit
    def all_impls(x):
        w, idx = moe.route(x, router, TOP_K, normalize=True)
        raw_w, _ = moe.route(x, router, TOP_K, normalize=False)  # norm_topk_prob=False (transformers' default)
        return idx, [impl(x, w, idx, gate, up, down) for impl in
                     (kmoe.experts_dense, kmoe.experts_gathered, kmoe.experts_grouped, kmoe.experts_auto)
                     ] + [kmoe.experts_dense(x, raw_w, idx, gate, up, down)]

    idx, outs = all_impls(x)
    assert np.bincount(np.asarray(idx).ravel()).max() > 1  # the grouped path really groups
    ref, raw_ref = numpy_moe(*arrays, TOP_K, True), numpy_moe(*arrays, TOP_K, False)
    for name, out, expected in zip(("dense", "gathered", "grouped", "auto", "unnormalised"), outs,
                                   [ref] * 4 + [raw_ref]):
        assert rel_err(out, expected) < 1e-5, name


def test_prefill_and_cached_decode_match_transformers(ckpt):
    hf, _, target = ckpt
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 13))
    ref = hf_logits(hf, ids)
    logits, cache = our_logits(target, ids[:, :7], [0, 0])  # prefill: 28 routed pairs > 8 experts, dense
    assert rel_err(logits, ref[:, :7]) <= REL_TOL
    for p in (7, 8):  # single-token steps: 4 pairs, gathered
        step, cache = our_logits(target, ids[:, p:p + 1], [p, p], cache)
        assert rel_err(step[:, 0], ref[:, p]) <= REL_TOL, f"decode step at {p}"
    chunk, cache = our_logits(target, ids[:, 9:13], [9, 9], cache)  # verify-style chunk: 16 pairs, dense
    assert rel_err(chunk, ref[:, 9:13]) <= REL_TOL
    # routing really varies: tokens do not all pick the same experts (softmax keeps the logits' order)
    router = np.asarray(target.model.layers[0].mlp.gate.kernel[...])
    picks = np.argsort(-(np.random.default_rng(2).normal(size=(32, 64)) @ router), 1)[:, :TOP_K]
    assert len(np.unique(picks)) >= EXPERTS - 1


def test_fused_expert_layout_loads_identically(ckpt, tmp_path):
    """transformers 5's own parameter layout (``experts.gate_up_proj`` [E, 2F, D], ``experts.down_proj``)."""
    hf, path, target = ckpt
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(2, 7))  # the prefill shape above: no new compile
    np.testing.assert_array_equal(our_logits(load_target(tmp_path), ids, [0, 0])[0],
                                  our_logits(target, ids, [0, 0])[0])


PROMPTS = random_prompts(2, [5, 9], VOCAB, seed=4)
NEW = 12


@pytest.fixture(scope="module")
def greedy(ckpt):
    """Our autoregressive greedy tokens for PROMPTS (shared: one compiled program)."""
    return generate(ckpt[2], PROMPTS, max_new_tokens=NEW, stop_token_ids=[]).token_ids


def test_greedy_generate_matches_transformers(ckpt, greedy):
    assert greedy == hf_greedy_tokens(ckpt[0], PROMPTS, NEW)


def test_speculative_decoding_is_lossless(ckpt, greedy):
    """A random DFlash drafter: verify blocks of 2 rows × 4 tokens run the all-experts path, AR steps the
    gathered one (multi-token acceptance is MoE-agnostic: tests/test_lossless.py's oracle drafters)."""
    drafter = random_drafter(ckpt[2], block_size=4, num_layers=1, seed=6)
    out = speculative_generate(ckpt[2], drafter, PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert out.token_ids == greedy
