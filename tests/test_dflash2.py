"""DFlash2 drafters: the public checkpoint layout loads unchanged and its forward, candidates, edge scores and walk
match an independent torch rendering of the equations (docs/drafters.md); export writes the same layout back;
malformed checkpoints are refused; decoding is lossless greedy in every verify mode and sampled (χ²)."""

from __future__ import annotations

import functools

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file

from conftest import fast_nnx_jit, random_prompts, tiny_target
from test_sampling import V, chi2_pvalue, draw, exact_distribution, logits, pair  # noqa: F401 (fixtures)
from dflash_jax import config, drafters, generate, load_drafter, random_drafter, speculative_generate
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.checkpoints.safetensors_io import CheckpointError, read_safetensors
from dflash_jax.config import ConfigError
from dflash_jax.costs import CostTable
from dflash_jax.drafters.dflash2 import selector_walk
from dflash_jax.loading import Drafter, with_confidence_temperatures
from dflash_jax.models.drafter import DFlash2Drafter
from dflash_jax.tuning import KernelTuning, Kernels, Tuning

D, H, NH, NKV, FF, VOCAB = 32, 8, 4, 2, 64, 64  # the tiny target's shape (conftest.tiny_config)
TAPS, GROUP, TOPK, RANK, BLOCK = 3, 8, 8, 16, 8
FEATURE_LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=21)


def public_config(**dflash) -> dict:
    """A config.json in the published layout (z-lab/Qwen3.8-27B-DFlash2's keys), for the tiny target."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "attention_bias": False, "is_causal": False,
        "dflash_config": {"block_size": BLOCK, "conv_group_size": GROUP, "conv_kernel_size": TAPS,
                          "mask_token_id": VOCAB - 1, "selector_rank": RANK, "selector_top_k": TOPK,
                          "target_layer_ids": FEATURE_LAYERS, "input_embedding_scale": 1.5,
                          "output_multiplier": 0.8, "final_logit_softcapping": 6.0, **dflash},
        "head_dim": H, "hidden_act": "silu", "hidden_size": D, "intermediate_size": FF,
        "layer_types": ["full_attention", "full_attention"], "num_attention_heads": NH, "num_hidden_layers": 2,
        "num_key_value_heads": NKV, "num_target_layers": 4, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    }


def public_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under the public tensor names (PyTorch layouts: linear weights [out, in])."""
    g = torch.Generator().manual_seed(seed)
    lin = lambda o, i, s=1.0: s * torch.randn(o, i, generator=g) / i ** 0.5  # noqa: E731
    norm = lambda n: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    t = {"fc.weight": lin(D, D * len(FEATURE_LAYERS)), "hidden_norm.weight": norm(D), "norm.weight": norm(D),
         "candidate_selector.hidden_projection.weight": lin(RANK, D),
         "candidate_selector.predecessor_codebook": 0.5 * torch.randn(VOCAB, RANK, generator=g),
         "candidate_selector.successor_codebook": 0.5 * torch.randn(VOCAB, RANK, generator=g)}
    for i in range(2):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
                  p + "self_attn.q_proj.weight": lin(NH * H, D), p + "self_attn.k_proj.weight": lin(NKV * H, D),
                  p + "self_attn.v_proj.weight": lin(NKV * H, D), p + "self_attn.o_proj.weight": lin(D, NH * H),
                  p + "self_attn.q_norm.weight": norm(H), p + "self_attn.k_norm.weight": norm(H),
                  p + "mlp.gate_proj.weight": lin(FF, D), p + "mlp.up_proj.weight": lin(FF, D),
                  p + "mlp.down_proj.weight": lin(D, FF)})
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.5 * torch.randn(2, TAPS, D, generator=g)
            base[:, 0] += 1.0
            t[p + conv + ".base_kernel"] = base
            t[p + conv + ".kernel_projection.weight"] = lin(2 * TAPS * (D // GROUP), D, 0.5)
    return {k: v.numpy().astype(np.float32) for k, v in t.items()}


def write_checkpoint(path, cfg: dict, tensors: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    """A tiny DFlash2 checkpoint as the public implementations lay it out."""
    cfg, tensors = public_config(), public_tensors()
    return write_checkpoint(tmp_path_factory.mktemp("dflash2") / "public", cfg, tensors), cfg, tensors


# -- the torch rendering (float64) of the equations pinned in docs/drafters.md -------------------------------

def t_rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def t_rope(x, pos, theta=10000.0):  # x [T, n, H]: rotate_half convention
    inv = 1.0 / theta ** (torch.arange(0, H, 2, dtype=torch.float64) / H)
    f = pos[:, None].double() * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., H // 2:], x[..., : H // 2]], -1) * sin


def t_conv(x, delta, base):
    """out[i] = Σ_{t ≤ i} (base[t] + δ[i, t] per group) · x[i − t]: one block, taps inside it only."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for tap in range(min(TAPS, i + 1)):
            out[i] += (base[tap] + delta[i, tap].repeat_interleave(GROUP)) * x[i - tap]
    return out


def t_drafter(w, cfg, emb, head, feats, anchor, ctx_len, windows=True):
    """One row: hidden states of the block [anchor, MASK…] at positions ctx_len … ctx_len + L − 1, after the
    trunk (context K/V from the features, convolutions around both sublayers), then the final norm. A
    ``sliding_attention`` layer (``is_causal`` false) lets a query see the keys less than ``sliding_window``
    positions away on either side (vLLM: flash-attention's window (W − 1, 0) made symmetric for non-causal
    layers); ``windows=False`` ignores the windows."""
    dc = cfg["dflash_config"]
    pos = torch.arange(ctx_len, ctx_len + BLOCK)
    key_pos = torch.cat([torch.arange(ctx_len), pos])
    ctx = t_rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = emb[torch.tensor([anchor] + [dc["mask_token_id"]] * (BLOCK - 1))] * dc["input_embedding_scale"]
    for i in range(2):
        p = f"layers.{i}."
        a = lambda n: w[p + n]  # noqa: E731
        h = t_rms(x, a("input_layernorm.weight"))
        delta = (h @ a("attention_conv.kernel_projection.weight").T).view(BLOCK, 2, TAPS, D // GROUP)
        hc = t_conv(h, delta[:, 0], a("attention_conv.base_kernel")[0])
        q = t_rope(t_rms((hc @ a("self_attn.q_proj.weight").T).view(BLOCK, NH, H), a("self_attn.q_norm.weight")), pos)
        kv = lambda s: (t_rms((s @ a("self_attn.k_proj.weight").T).view(-1, NKV, H),  # noqa: E731
                              a("self_attn.k_norm.weight")), (s @ a("self_attn.v_proj.weight").T).view(-1, NKV, H))
        (kc, vc), (kb, vb) = kv(ctx), kv(hc)
        k = torch.cat([t_rope(kc, torch.arange(ctx_len)), t_rope(kb, pos)])
        v = torch.cat([vc, vb])
        assert cfg.get("is_causal") is False
        seen = torch.ones(BLOCK, len(key_pos), dtype=torch.bool)  # non-causal: the whole context and block
        if windows and cfg["layer_types"][i] == "sliding_attention":
            seen = (pos[:, None] - key_pos[None, :]).abs() < cfg["sliding_window"]
        heads = []
        for n in range(NH):
            kk, vv = k[:, n // (NH // NKV)], v[:, n // (NH // NKV)]
            heads.append(torch.softmax((q[:, n] @ kk.T / H ** 0.5).masked_fill(~seen, -torch.inf), -1) @ vv)
        attn = torch.cat(heads, -1) @ a("self_attn.o_proj.weight").T
        x = x + t_conv(attn, delta[:, 1], a("attention_conv.base_kernel")[1])
        h = t_rms(x, a("post_attention_layernorm.weight"))
        delta = (h @ a("mlp_conv.kernel_projection.weight").T).view(BLOCK, 2, TAPS, D // GROUP)
        hc = t_conv(h, delta[:, 0], a("mlp_conv.base_kernel")[0])
        m = (torch.nn.functional.silu(hc @ a("mlp.gate_proj.weight").T) * (hc @ a("mlp.up_proj.weight").T)) \
            @ a("mlp.down_proj.weight").T
        x = x + t_conv(m, delta[:, 1], a("mlp_conv.base_kernel")[1])
    return t_rms(x, w["norm.weight"])


def t_selector(w, cfg, head, hidden, anchor):
    """Candidates (top-K of the LM head, then multiplier and soft-cap), edge scores [G, K, K] and the greedy walk
    (lowest index on ties) with each choice's softmax probability."""
    dc = cfg["dflash_config"]
    values, ids = torch.topk(hidden[1:] @ head, TOPK, dim=-1)  # positions 1 … L−1 predict
    unary = values * dc["output_multiplier"]
    unary = torch.tanh(unary / dc["final_logit_softcapping"]) * dc["final_logit_softcapping"]
    proj = hidden[1:] @ w["candidate_selector.hidden_projection.weight"].T
    pcb, scb = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    g = BLOCK - 1
    edges = torch.empty(g, TOPK, TOPK, dtype=torch.float64)
    for k in range(g):
        for p in range(TOPK):
            prev = anchor if k == 0 else int(ids[k - 1, p])
            for c in range(TOPK):
                edges[k, p, c] = unary[k, c] + (pcb[prev] * proj[k] * scb[ids[k, c]]).sum()
    drafts, conf, prev = [], [], 0
    for k in range(g):
        row = edges[k, prev]
        c = int(torch.argmax(row))  # the first maximal value
        drafts.append(int(ids[k, c]))
        conf.append(float(torch.softmax(row, -1)[c]))
        prev = c
    return ids, unary, edges, drafts, conf


# A non-causal sliding-window layer (as in the published checkpoint) beside a full one; the window is smaller than
# context + block (6 + 8 positions), so it hides context from every query and the block's far end from its start.
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": 5}


@pytest.mark.parametrize("layers", [None, SLIDING], ids=["full", "sliding"])
def test_public_checkpoint_matches_the_torch_rendering(target, public, layers, tmp_path):
    path, cfg, tensors = public
    if layers:
        cfg = {**cfg, **layers}
        path = write_checkpoint(tmp_path / "sliding", cfg, tensors)
    drafter = load_drafter(path, target)
    c = drafter.config
    assert [c.layer_window(i) for i in range(2)] == ([5, None] if layers else [None, None])
    assert not any(c.layer_causal(i) for i in range(2))
    assert isinstance(drafter.model, DFlash2Drafter) and drafter.config.kind == "dflash2"
    kind = drafters.kind_of(drafter.model)
    assert kind.sequential and kind.has_confidence and kind.trunk_width(BLOCK) == BLOCK
    assert drafter.config.verify_width == BLOCK

    rng = np.random.default_rng(0)
    b, s = 2, 6
    feats = rng.normal(size=(b, s, D * len(FEATURE_LAYERS))).astype(np.float32)
    anchors = np.asarray([5, 40], np.int32)
    temperature = 0.7

    def forward(t, d, feats, anchors, key):
        pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        cache = d.materialize(d.new_cache(b, 32), feats, pos)
        block = jnp.concatenate([anchors[:, None], jnp.full((b, BLOCK - 1), d.config.mask_token_id)], 1)
        hidden = d(t.embed(block), s + jnp.broadcast_to(jnp.arange(BLOCK), (b, BLOCK)), cache,
                   jnp.full((b,), s, jnp.int32))
        ids, unary = d.candidates(hidden[:, 1:], t)
        edges = d.candidate_selector.edge_scores(ids, unary, hidden[:, 1:], anchors)
        k = drafters.kind_of(d)
        greedy = lambda x, keys: (jnp.argmax(x, -1).astype(jnp.int32), None)  # noqa: E731

        def sampled(x, keys):
            q = jax.nn.softmax(x / temperature, -1)
            return jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)))(keys, q).astype(jnp.int32), q

        drafts, q, conf = k.draft(t, hidden[:, 1:], anchors, greedy, None)
        s_drafts, s_q, _ = k.draft(t, hidden[:, 1:], anchors, sampled, jax.random.split(key, b))
        return dict(hidden=hidden, ids=ids, unary=unary, edges=edges, drafts=drafts, q=q, conf=conf,
                    s_drafts=s_drafts, s_q=s_q)

    out = fast_nnx_jit(forward)(target.model, drafter.model, jnp.asarray(feats), jnp.asarray(anchors),
                                jax.random.key(3))
    assert out["q"] is None
    w = {k: torch.from_numpy(v).double() for k, v in tensors.items()}
    emb = torch.tensor(np.asarray(target.model.embed_tokens.embedding[...]), dtype=torch.float64)
    head = torch.tensor(np.asarray(target.model.lm_head.kernel[...]), dtype=torch.float64)  # [D, V]
    for row in range(b):
        hidden = t_drafter(w, cfg, emb, head, torch.from_numpy(feats[row]).double(), int(anchors[row]), s)
        np.testing.assert_allclose(np.asarray(out["hidden"][row]), hidden.numpy(), rtol=1e-4, atol=1e-4)
        if layers:  # the window matters: without it every position's hidden state is another
            unwindowed = t_drafter(w, cfg, emb, head, torch.from_numpy(feats[row]).double(), int(anchors[row]), s,
                                   windows=False)
            assert ((unwindowed - hidden).abs().amax(-1) > 1e-2).all()
        ids, unary, edges, drafts, conf = t_selector(w, cfg, head, hidden, int(anchors[row]))
        np.testing.assert_array_equal(np.asarray(out["ids"][row]), ids.numpy())
        np.testing.assert_allclose(np.asarray(out["unary"][row]), unary.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(out["edges"][row]), edges.numpy(), rtol=1e-4, atol=1e-4)
        assert np.asarray(out["drafts"][row]).tolist() == drafts
        np.testing.assert_allclose(np.asarray(out["conf"][row]), conf, rtol=1e-4, atol=1e-6)
        # The sampled walk: q_k = softmax(edges[k, previous choice] / T) on the K candidates, zero elsewhere.
        sd, sq, prev = np.asarray(out["s_drafts"][row]), np.asarray(out["s_q"][row]), 0
        for k in range(BLOCK - 1):
            expect = np.zeros(VOCAB)
            expect[ids[k].numpy()] = torch.softmax(edges[k, prev] / temperature, -1).numpy()
            np.testing.assert_allclose(sq[k], expect, rtol=1e-4, atol=1e-6)
            prev = ids[k].tolist().index(int(sd[k]))
    # The selector matters: some greedy draft is not its position's top candidate.
    assert (np.asarray(out["drafts"]) != np.asarray(out["ids"])[..., 0]).any()


def test_selector_walk_ties_take_the_lowest_index():
    scores = jnp.zeros((1, 3, 4, 4)).at[0, 1, 2, 3].set(1.0)  # every row ties except row 2 of step 1
    idx, q, conf = selector_walk(scores, lambda x, k: (jnp.argmax(x, -1).astype(jnp.int32), None), None)
    assert np.asarray(idx).tolist() == [[0, 0, 0]] and q is None
    np.testing.assert_allclose(np.asarray(conf), 0.25)



def test_selector_walk_equals_the_sequential_walk():
    """The walk picks every row at once and then follows the chosen indices; a walk that picks position by
    position from the row its previous choice selects (the definition), with the same key per position, draws
    the same drafts, greedy (ties included: scores rounded to one decimal) and sampled, and q / confidence of
    the rows it went through."""
    scores = jnp.asarray(np.random.default_rng(3).normal(size=(3, 6, 5, 5)).round(1), jnp.float32)
    keys = jax.random.split(jax.random.key(4), 3)

    def pick(x, k):
        if k is None:
            return jnp.argmax(x, -1).astype(jnp.int32), None
        q = jax.nn.softmax(x / 0.7, -1)
        return jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)).astype(jnp.int32))(k, q), q

    for key in (None, keys):
        idx, q, conf = selector_walk(scores, pick, key)
        per_position = None if key is None else jax.vmap(lambda x: jax.random.split(x, 6))(key)  # [B, G]
        prev = jnp.zeros((3,), jnp.int32)
        for pos in range(6):
            row = scores[jnp.arange(3), pos, prev]  # [B, K]
            want, want_q = pick(row, None if key is None else per_position[:, pos])
            np.testing.assert_array_equal(np.asarray(idx[:, pos]), np.asarray(want))
            np.testing.assert_allclose(np.asarray(conf[:, pos]), np.asarray(jax.nn.softmax(row, -1).max(-1)),
                                       rtol=1e-6)
            if key is not None:
                np.testing.assert_allclose(np.asarray(q[:, pos]), np.asarray(want_q), rtol=1e-6)
            prev = want

@pytest.mark.parametrize("fused", [False, True], ids=["chunked", "fused"])
def test_drafts_are_unchanged_through_the_chunked_top_k(target, fused):
    """The kind's drafting with the candidates' top-K through the chunked two-stage op (``top_k_chunked``,
    chunks of 16 of the 64 tokens) gives the same candidates, drafts, confidences and sampled q as lax.top_k; with
    the LM head and top-K in one kernel (``head_top_k_kernel``, interpret mode: its own float32 sums) the same
    candidates and drafts, values to rounding."""
    drafter = random_drafter(target, kind="dflash2", block_size=BLOCK, num_layers=1, selector_top_k=TOPK,
                             selector_rank=RANK, conv_group_size=GROUP).model
    kind = drafters.kind_of(drafter)
    hidden = jnp.asarray(np.random.default_rng(2).normal(size=(3, BLOCK - 1, D)), jnp.float32)
    anchors = jnp.asarray([1, 7, 30], jnp.int32)
    chunked = Kernels("cuda", KernelTuning(top_k_chunked=True, top_k_chunk=16, top_k_chunked_max_rows=0,
                                           head_top_k_kernel=fused, head_top_k_block_v=16, head_top_k_max_rows=64))
    greedy = lambda x, keys: (jnp.argmax(x, -1).astype(jnp.int32), None)  # noqa: E731

    def sampled(x, keys):
        q = jax.nn.softmax(x, -1)
        return jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)))(keys, q).astype(jnp.int32), q

    keys = jax.random.split(jax.random.key(4), 3)
    program = str(jax.make_jaxpr(lambda h: drafter.candidates(h, target.model, chunked))(hidden))
    assert program.count("name=dflash_head_top_k") == fused and program.count("top_k[") == (1 if fused else 2)
    same = np.testing.assert_array_equal if not fused else functools.partial(np.testing.assert_allclose, rtol=1e-5)
    want, got = (drafter.candidates(hidden, target.model, k) for k in (Kernels(), chunked))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    same(np.asarray(got[1]), np.asarray(want[1]))
    for pick, key in ((greedy, None), (sampled, keys)):
        want, got = (kind.draft(target.model, hidden, anchors, pick, key, kernels=k) for k in (Kernels(), chunked))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # the drafts
        for w, g in zip(want[1:], got[1:]):
            if w is None:
                assert g is None
            else:
                same(np.asarray(g), np.asarray(w), atol=1e-6) if fused else same(np.asarray(g), np.asarray(w))


def test_published_config_parses():
    """z-lab/Qwen3.8-27B-DFlash2's config.json fields (block size in dflash_config, non-causal sliding layers)."""
    cfg = {"architectures": ["DFlash2DraftModel"], "attention_bias": False, "is_causal": False,
           "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 248070,
                             "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 19, 33, 47, 61]},
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 17408,
           "layer_types": ["sliding_attention"] * 5, "num_attention_heads": 32, "num_hidden_layers": 5,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "model_type": "qwen3",
           "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"}, "sliding_window": 2048,
           "tie_word_embeddings": False, "use_sliding_window": True, "vocab_size": 248320}
    c = config.drafter_config_from_hf(cfg)
    assert (c.kind, c.block_size, c.verify_width, c.mask_token_id) == ("dflash2", 8, 8, 248070)
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_top_k, c.selector_rank) == (2, 16, 16, 256)
    assert c.target_layer_ids == (5, 19, 33, 47, 61) and c.sliding_window == 2048
    assert [c.layer_window(i) for i in range(5)] == [2048] * 5 and not any(c.layer_causal(i) for i in range(5))
    again = config.drafter_config_from_hf(config.drafter_config_to_hf(c))
    assert again == c
    # This project's record of the narrower widths a drafter was trained at travels in dflash_config.
    narrow = dataclasses.replace(c, trained_widths=(2, 4))
    assert config.drafter_config_from_hf(config.drafter_config_to_hf(narrow)) == narrow
    with pytest.raises(config.ConfigError, match="trained_widths must be a list of integers"):
        config.drafter_config_from_hf({**cfg, "dflash_config": {**cfg["dflash_config"], "trained_widths": "4"}})


def test_export_writes_the_public_layout_back(target, public, tmp_path):
    path, cfg, tensors = public
    drafter = load_drafter(path, target)
    out = export_drafter(drafter.model, tmp_path / "exported")
    written = read_safetensors([out / "model.safetensors"])
    assert written.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(written[k], tensors[k], err_msg=k)
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"]
    assert {k: v for k, v in hf["dflash_config"].items()} == cfg["dflash_config"]
    assert load_drafter(out, target).config == drafter.config


def test_malformed_checkpoints_are_refused(target, public, tmp_path):
    _, cfg, tensors = public
    cases = [
        ({k: v for k, v in tensors.items() if k != "candidate_selector.successor_codebook"}, {},
         CheckpointError, r"missing tensors: \['candidate_selector\.successor_codebook'\]"),
        ({k: v for k, v in tensors.items() if "layers.1.mlp_conv" not in k}, {},
         CheckpointError, r"missing tensors: \['layers\.1\.mlp_conv\.base_kernel', 'layers\.1\.mlp_conv\.kernel_pro"),
        (dict(tensors, **{"layers.0.attention_conv.base_kernel": tensors["layers.0.attention_conv.base_kernel"][:, :2]}),
         {}, CheckpointError, r"layers\.0\.attention_conv\.base_kernel: checkpoint \(2, 2, 32\) vs model \(2, 3, 32\)"),
        (tensors, {"conv_group_size": 12}, ConfigError, "conv_group_size 12 must divide hidden_size 32"),
        (tensors, {"selector_top_k": VOCAB + 1}, ConfigError,
         rf"selector_top_k {VOCAB + 1} must be in \[1, vocabulary size {VOCAB}\]"),
    ]
    for i, (t, dflash, error, match) in enumerate(cases):
        path = write_checkpoint(tmp_path / str(i), public_config(**dflash), t)
        with pytest.raises(error, match=match):
            load_drafter(path, target)
    missing = public_config()
    del missing["dflash_config"]["selector_rank"]
    with pytest.raises(ConfigError, match="needs dflash_config.selector_rank"):
        load_drafter(write_checkpoint(tmp_path / "keys", missing, tensors), target)


def test_sts_temperatures_scale_the_confidences(target, public, tmp_path):
    """STS, fitted after training as DSpark's: each confidence becomes σ(logit(c_k) / T_k), the drafts stay; the
    temperatures round-trip through export; a wrong count is refused."""
    drafter = load_drafter(public[0], target)
    g = drafter.config.verify_width - 1
    temps = tuple(0.5 + 0.25 * k for k in range(g))
    scaled = with_confidence_temperatures(drafter, temps)
    hidden = jax.random.normal(jax.random.key(0), (2, g, D), jnp.float32)
    anchor = jnp.asarray([3, 5], jnp.int32)
    greedy = lambda row, key: (jnp.argmax(row, -1).astype(jnp.int32), None)  # noqa: E731
    d0, _, c0 = drafters.kind_of(drafter.model).draft(target.model, hidden, anchor, greedy, None)
    d1, _, c1 = drafters.kind_of(scaled.model).draft(target.model, hidden, anchor, greedy, None)
    np.testing.assert_array_equal(d1, d0)
    c = np.clip(np.asarray(c0, np.float64), 1e-6, 1 - 1e-6)
    want = 1 / (1 + np.exp(-(np.log(c) - np.log1p(-c)) / np.asarray(temps)))
    np.testing.assert_allclose(c1, want, rtol=1e-4, atol=1e-6)
    assert not np.allclose(c1, c0)
    out = export_drafter(scaled.model, tmp_path / "sts")
    assert json.loads((out / "config.json").read_text())["dflash_config"]["confidence_temperatures"] == list(temps)
    assert load_drafter(out, target).config.confidence_temperatures == temps
    with pytest.raises(ConfigError, match=f"confidence_temperatures must be {g} positive numbers"):
        with_confidence_temperatures(drafter, temps[:-1])


# -- decoding ---------------------------------------------------------------------------------------------

PROMPTS = random_prompts(4, [5, 17, 9, 30], VOCAB, seed=2)
MAX_NEW = 30
TABLE = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 1.0, 2: 1.25, 4: 1.8, 8: 3.2}})


class OracleDFlash2(DFlash2Drafter):
    """The real candidate selector and walk over an oracle trunk: position p's candidates are ``table[row, p]``
    far ahead of the rest (the greedy continuation, corrupted in places), so acceptance lengths cover 1 … L."""

    def __init__(self, cfg, table: np.ndarray):
        super().__init__(cfg, rngs=nnx.Rngs(0))
        self.table = nnx.Variable(jnp.asarray(table, jnp.int32))

    def __call__(self, block_embeds, positions, cache, ctx_len, *, kernels=None):
        tok = jnp.take_along_axis(self.table[...], positions, axis=1)  # token ids in the first channel
        return jnp.zeros((*tok.shape, self.config.layers.hidden_size)).at[..., 0].set(tok / VOCAB)

    def head_logits(self, hidden, target, kernels=None):
        tok = jnp.round(hidden[..., 0] * VOCAB).astype(jnp.int32)
        return jax.nn.one_hot(tok, VOCAB) * 40.0 + jnp.sin(jnp.arange(VOCAB, dtype=jnp.float32))

    def head_weight(self, target):
        return None  # its logits are not a product with the target's head


@pytest.fixture(scope="module")
def reference(target):
    return generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])


@pytest.mark.parametrize("mode,cap", [("static", None), ("compact", None), ("cap-accept", None), ("compact", 3)])
def test_dflash2_is_lossless_in_every_verify_mode(target, reference, mode, cap):
    """Greedy, every verify mode (compact and cap-accept choose windows from the selector's confidences); with
    ``Tuning.sequential_draft_cap`` compact steps walk only the first positions and no window passes them."""
    rng = np.random.default_rng(1)
    table = np.zeros((len(PROMPTS), 512), np.int64)
    for r, (p, c) in enumerate(zip(PROMPTS, reference.token_ids)):
        table[r, : len(p) + len(c)] = list(p) + list(c)
    table = np.where(rng.random(table.shape) < 0.2, (table + 1 + rng.integers(0, VOCAB - 1, table.shape)) % VOCAB,
                     table)
    cfg = dataclasses.replace(random_drafter(target, kind="dflash2", block_size=8, num_layers=1, selector_top_k=4,
                                             selector_rank=8, conv_group_size=8).config)
    oracle = Drafter(OracleDFlash2(cfg, table), "oracle dflash2", True)
    out = speculative_generate(target, oracle, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[],
                               verify_mode=mode, cost_table=TABLE, tuning=Tuning(sequential_draft_cap=cap))
    assert out.token_ids == reference.token_ids
    assert out.stats["verify_mode"] == mode
    lengths = {a for row in out.acceptance_lengths for a in row}
    assert 1 in lengths and max(lengths) >= (cap + 1 if cap else 5)
    if cap:
        assert max(lengths) <= cap + 1 and out.stats["mean_window"] <= cap + 1  # the anchor and ≤ cap drafts
    s = out.stats  # the selector's confidences: predicted survival next to the realised one
    assert len(s["predicted_survival"]) == len(s["realized_survival"]) == 7


def test_sampled_dflash2_matches_target_distribution(pair, logits):
    """Drafts walked by sampling among the K = 4 of V = 8 candidates (q zero elsewhere, conditioned on the
    previous choice), and argmax drafts: χ² against the enumerated target distribution."""
    small = pair[0]
    drafter = random_drafter(small, kind="dflash2", block_size=3, num_layers=1, seed=5, mask_token_id=V - 1,
                             selector_top_k=4, selector_rank=4, conv_group_size=4)
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    for draft_sampling in (True, False):
        samples, out = draw(lambda *a, **k: speculative_generate(small, drafter, *a, **k), with_output=True,
                            temperature=1.0, seed=2, draft_sampling=draft_sampling)
        assert chi2_pvalue(samples, probs) > 1e-3
        firsts = [row[0] for row in out.acceptance_lengths if row]
        assert 1 in firsts and max(firsts) >= 2


def test_sampled_dflash2_compact_and_cap_accept_match_target_distribution(pair, logits):
    """Sampled walks verified over the scheduler's windows (compact: the selector's confidences choose each row's,
    the bonus at a window's end is drawn from p there): χ² against the enumerated target distribution; cap-accept
    draws the same tokens with the same seed. (A confidence read at the sampled choice — its own probability —
    made the windows depend on the draft they end at: p ≈ 1e-138 here.)"""
    small = pair[0]
    drafter = random_drafter(small, kind="dflash2", block_size=3, num_layers=1, seed=5, mask_token_id=V - 1,
                             selector_top_k=4, selector_rank=4, conv_group_size=4)
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    table = CostTable("cpu", "test", "float32", "tiny", 3, 8, {1: {1: 1.0, 2: 1.1, 3: 1.4}})
    run = lambda mode: draw(lambda *a, **k: speculative_generate(small, drafter, *a, **k),  # noqa: E731
                            with_output=True, temperature=1.0, seed=3, draft_sampling=True, verify_mode=mode,
                            cost_table=table)
    samples, out = run("compact")
    assert chi2_pvalue(samples, probs) > 1e-3
    # rows differ (two new tokens a draw: no window reaches past a row's budget, so a row verifies 2 or 3 tokens)
    assert out.stats["verify_mode"] == "compact" and len(set(out.stats["row_verify_tokens"])) >= 2
    cap, cap_out = run("cap-accept")
    assert (cap == samples).all() and cap_out.stats["verify_mode"] == "cap-accept"
