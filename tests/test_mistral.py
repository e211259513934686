"""Mistral targets against transformers' ``MistralForCausalLM`` (torch, CPU, float32): the worked example of
``docs/port-a-model.md`` (the family is :mod:`dflash_jax.families.mistral`).

One tiny random checkpoint (2 layers, sliding window 5) is built with transformers, written with
``save_pretrained`` and read with ``load_target``. Norms are made non-trivial and attention peaked, so that a
missing norm or a wrong window shows in the logits. The config must parse (and a null window give full
attention); logits must match HF's to 1e-4 relative for a prefill and a cached verify-style chunk past the
window; greedy ``generate`` must equal HF's, and speculative decoding with a random drafter must equal it too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from conftest import fast_options, hf_greedy_tokens, random_prompts
from dflash_jax import families, generate, load_target, random_drafter, speculative_generate
from dflash_jax.config import model_config_from_hf
from dflash_jax.models.target import TargetModel

VOCAB, WINDOW, NEW = 128, 5, 10
REL_TOL = 1e-4


def hf_config(**kw) -> transformers.MistralConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, sliding_window=WINDOW, max_position_embeddings=128,
                initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return transformers.MistralConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(HF model, our float32 target)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(), attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF initialises norms to one: that would hide a missing one
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("mistral") / "tiny"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_target(path, dtype="float32")


def test_config_round_trip(ckpt):
    hf, target = ckpt
    cfg = target.config
    assert families.get("mistral") is families.of(cfg) and type(target.model) is TargetModel
    assert (cfg.family, cfg.sliding_layers, cfg.sliding_window) == ("mistral", (0, 1), WINDOW)
    assert not cfg.qk_norm and not cfg.attention_sinks and not cfg.moe
    assert [layer.self_attn.window for layer in target.model.layers] == [WINDOW, WINDOW]
    assert model_config_from_hf(hf.config.to_dict()) == cfg
    full = model_config_from_hf(hf_config(sliding_window=None).to_dict())
    assert (full.sliding_layers, full.sliding_window) == ((), None)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_prefill_and_cached_chunk_match_transformers(ckpt):
    """Prefill of 7 (> window), then a 4-token chunk at offsets 7 and 6 in the two rows (row 1 rewrites 6)."""
    hf, target = ckpt
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 11))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    graphdef, state = nnx.split(target.model)

    def run(state, prompt, chunk, starts):
        model = nnx.merge(graphdef, state)
        h, _, cache = model(prompt, jnp.broadcast_to(jnp.arange(7), (2, 7)), model.new_cache(2, 16), prefill=True)
        first = model.logits(h)
        h, _, _ = model(chunk, starts[:, None] + jnp.arange(4), cache)
        return first, model.logits(h)

    args = (state, jnp.asarray(ids[:, :7], jnp.int32), jnp.asarray(np.stack([ids[0, 7:11], ids[1, 6:10]]), jnp.int32),
            jnp.asarray([7, 6], jnp.int32))
    first, chunk = jax.jit(run).lower(*args).compile(fast_options())(*args)
    assert rel_err(first, ref[:, :7]) <= REL_TOL
    assert rel_err(chunk[0], ref[0, 7:11]) <= REL_TOL and rel_err(chunk[1], ref[1, 6:10]) <= REL_TOL


PROMPTS = random_prompts(2, [4, 9], VOCAB, seed=3)  # one shorter, one longer than the window


@pytest.fixture(scope="module")
def greedy(ckpt):
    return generate(ckpt[1], PROMPTS, max_new_tokens=NEW, stop_token_ids=[]).token_ids


def test_greedy_generate_matches_transformers(ckpt, greedy):
    assert greedy == hf_greedy_tokens(ckpt[0], PROMPTS, NEW)


def test_speculative_decoding_is_lossless(ckpt, greedy):
    """A random DFlash drafter on the Mistral target, block 4: verify windows crossing the sliding window."""
    drafter = random_drafter(ckpt[1], block_size=4, num_layers=1, seed=6)
    out = speculative_generate(ckpt[1], drafter, PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert out.token_ids == greedy
