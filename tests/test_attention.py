"""The attention references against a naive, explicitly-masked implementation; drafter config variants."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ZLAB
from dflash_jax import load_drafter, load_target
from dflash_jax.kernels.attention import cache_attention, draft_attention, read_after
from dflash_jax.config import default_target_layer_ids, drafter_config_from_hf, read_config_json


def naive(q, k, v, visible):
    """q [B,T,N,H], k/v [B,S,K,H], visible [B,T,S] → softmax(qk/√H masked) v, in float64 numpy."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(visible[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", p, v)


def rand(key, shape):
    """numpy's normal values: jax.random compiles a program per shape (seconds each on the CPU)."""
    return jnp.asarray(np.random.default_rng(key).standard_normal(shape, np.float32))


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 3)])
def test_draft_attention_matches_z_lab_mask(causal, window):
    """z-lab's mask over [context; block] keys (positions 0…s+L-1): causal by position and/or
    ``q_pos - k_pos < window`` (and ``k_pos - q_pos < window`` when not causal); context only below ctx_len."""
    b, l, n, kh, h, s = 3, 4, 4, 2, 8, 16
    q, bk, bv = rand(0, (b, l, n, h)), rand(1, (b, l, kh, h)), rand(2, (b, l, kh, h))
    ck, cv = rand(3, (b, s, kh, h)), rand(4, (b, s, kh, h))
    ctx_len = jnp.array([0, 5, 9])
    qpos = ctx_len[:, None] + jnp.arange(l)
    # Poison the context past ctx_len with huge values: any weight on them would show. (The jnp reference
    # multiplies masked slots by an exact 0, so finite garbage vanishes; NaN-safety is the kernels' job.)
    valid = np.arange(s)[None, :] < np.asarray(ctx_len)[:, None]
    ck = jnp.where(valid[:, :, None, None], ck, 1e6)
    cv = jnp.where(valid[:, :, None, None], cv, 1e6)
    out = draft_attention(q, ck, cv, bk, bv, qpos, ctx_len, causal=causal, window=window)
    keys_pos = np.concatenate([np.broadcast_to(np.arange(s), (b, s)), np.asarray(qpos)], axis=1)  # [B, S+L]
    qp = np.asarray(qpos)[:, :, None]
    kp = keys_pos[:, None, :]
    vis = np.concatenate([np.broadcast_to(valid[:, None, :], (b, l, s)), np.ones((b, l, l), bool)], axis=2)
    if causal:
        vis &= kp <= qp
    if window is not None:
        vis &= qp - kp < window
        if not causal:
            vis &= kp - qp < window
    k_all = np.concatenate([np.asarray(ck), np.asarray(bk)], axis=1)
    v_all = np.concatenate([np.asarray(cv), np.asarray(bv)], axis=1)
    np.testing.assert_allclose(np.asarray(out), naive(q, k_all, v_all, vis), atol=2e-5)


def test_cache_attention_matches_causal_mask():
    b, t, n, kh, h, s = 2, 5, 6, 3, 8, 24
    q, k, v = rand(5, (b, t, n, h)), rand(6, (b, s, kh, h)), rand(7, (b, s, kh, h))
    qpos = jnp.array([[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]])
    out = cache_attention(q, k, v, qpos)
    vis = np.arange(s)[None, None, :] <= np.asarray(qpos)[:, :, None]
    np.testing.assert_allclose(np.asarray(out), naive(q, k, v, vis), atol=2e-5)


def test_read_after_ties_the_caches_to_the_layer_input_exactly():
    """The drafted steps' cache reads wait for their layer on CPUs (a zero computed from the layer's input is
    added): the values are the caches' own whatever the input holds (NaN, ±inf: a poisoned padding slot must not
    reach the cache; a −0 may read as +0, which no dot product tells apart); the jaxpr shows the dependence the
    CPU runtime orders by."""
    k, v = rand(3, (2, 5, 2, 4)), rand(4, (2, 5, 2, 4))
    k = k.at[0, 0, 0, 0].set(-0.0)
    for first in (1.5, np.nan, np.inf, -np.inf):
        x = rand(5, (2, 3, 8)).at[0, 0, 0].set(first)
        tk, tv = jax.jit(read_after)(x, k, v)
        np.testing.assert_array_equal(np.asarray(tk), np.asarray(k))
        np.testing.assert_array_equal(np.asarray(tv), np.asarray(v))
    jaxpr = jax.make_jaxpr(read_after)(x, k, v).jaxpr
    x_var = jaxpr.invars[0]
    assert any(x_var in e.invars for e in jaxpr.eqns), "the caches do not depend on the layer input"
    assert all(o not in jaxpr.invars[1:] for o in jaxpr.outvars)


def test_drafter_config_variants(tmp_path):
    base = read_config_json(ZLAB / "drafter")
    # DFlash keys at top level instead of in dflash_config.
    flat = {k: v for k, v in base.items() if k != "dflash_config"} | base["dflash_config"]
    a, b = drafter_config_from_hf(base), drafter_config_from_hf(flat)
    assert a == b
    # Without target_layer_ids: z-lab's default spread.
    no_ids = dict(flat)
    del no_ids["target_layer_ids"]
    assert drafter_config_from_hf(no_ids).target_layer_ids == default_target_layer_ids(6, 2) == (1, 3)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    # head_dim must be explicit (never derived).
    with pytest.raises(ValueError, match="head_dim explicitly"):
        drafter_config_from_hf({k: v for k, v in base.items() if k != "head_dim"})
    # Sliding-window layers load and run (and differ from full attention once the context exceeds the window).
    d = tmp_path / "sliding"
    shutil.copytree(ZLAB / "drafter", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    (d / "config.json").write_text(json.dumps(cfg))
    target = load_target(ZLAB / "target")
    sliding, full = load_drafter(d, target), load_drafter(ZLAB / "drafter", target)
    assert sliding.config.layer_window(0) == 4 and sliding.config.layer_causal(0)
    assert sliding.config.layer_window(1) is None
    from dflash_jax import speculative_generate

    p = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    x = speculative_generate(target, sliding, p, max_new_tokens=12, stop_token_ids=[])
    y = speculative_generate(target, full, p, max_new_tokens=12, stop_token_ids=[])
    assert x.token_ids == y.token_ids  # lossless either way
