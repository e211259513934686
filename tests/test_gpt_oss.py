"""gpt-oss targets against transformers' ``GptOssForCausalLM`` (torch, CPU, float32), and MXFP4 expert weights.

One tiny random checkpoint (2 layers: sliding window 4, then full attention; 8 experts, top-2; YaRN RoPE with
``truncate: false``) is built with transformers, written with ``save_pretrained`` and read with ``load_target``.
Biases, sinks and norms are made non-trivial and ``swiglu_limit`` small, so that a missing bias, sink, clamp
or window shows in the logits. Logits must match HF's to 1e-4 relative for prefill, cached single-token steps
and verify-style chunks at different offsets per row; greedy ``generate`` must equal HF's, and speculative
decoding with a random drafter must equal autoregressive decoding, over prompts longer than the window.
MXFP4 dequantization is checked against the format's definition and transformers' helper, and an MXFP4
checkpoint must load exactly like the plain one transformers' helper dequantizes it to.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import hf_greedy_tokens, random_prompts
from dflash_jax import generate, load_target, random_drafter, speculative_generate
from dflash_jax.config import ConfigError, model_config_from_hf, rope_attention_factor
from dflash_jax.models import gpt_oss
from dflash_jax.kernels import attention
from dflash_jax.kernels import moe as kmoe
from dflash_jax.tuning import Kernels
from dflash_jax.models.layers import rope_inv_freq
from dflash_jax.tuning import Tuning

VOCAB, LAYERS, EXPERTS, TOP_K, WINDOW = 128, 2, 8, 2, 4
REL_TOL = 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 32}


def hf_config(**kw) -> transformers.GptOssConfig:
    # hidden and expert widths are multiples of 32 so the MXFP4 test can quantize this shape
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS,
                num_experts_per_tok=TOP_K, sliding_window=WINDOW, max_position_embeddings=128,
                initializer_range=0.2, swiglu_limit=1.0, rope_parameters=dict(YARN))
    return transformers.GptOssConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(HF model, checkpoint directory, our float32 target)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(), attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF initialises biases to zero and norms to one: either would hide a missing one
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    path = tmp_path_factory.mktemp("gpt_oss") / "tiny"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path, load_target(path, dtype="float32")


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def compiled(fn, *args):
    """``fn`` compiled for ``args`` with the session's compiler options (conftest: fast compiles on the CPU)."""
    return jax.jit(fn).lower(*args).compile(Tuning().compiler_options_dict())


_PROGRAMS: dict = {}


def our_logits(target, ids: np.ndarray, start, cache=None):
    """Logits of ``ids`` [B, T] at positions start[b] …; ``cache=None`` prefills a fresh one."""
    b, t = ids.shape
    prefill = cache is None
    cache = target.model.new_cache(b, 32) if prefill else cache
    positions = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)
    graphdef, state = nnx.split(target.model)

    def forward(state, ids, positions, cache):
        model = nnx.merge(graphdef, state)
        h, _, cache = model(ids, positions, cache, prefill=prefill)
        return model.logits(h), cache

    args = (state, jnp.asarray(ids, jnp.int32), positions, cache)
    key = (id(target.model), ids.shape, prefill)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = compiled(forward, *args)
    logits, cache = _PROGRAMS[key](*args)
    return np.asarray(logits), cache


def test_config_layers_and_rope(ckpt):
    hf, _, target = ckpt
    cfg = target.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("gpt_oss", 8, 2, 64)
    assert cfg.sliding_layers == (0,) and cfg.sliding_window == WINDOW and cfg.attention_bias and not cfg.qk_norm
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 1.0)
    assert [layer.self_attn.window for layer in target.model.layers] == [WINDOW, None]
    # YaRN without truncation, as transformers computes it for gpt-oss (the tiny model's and the released one's)
    released = hf_config(hidden_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_parameters=None)  # None: GptOssConfig's default
    for hf_cfg in (hf.config, released):
        ours = model_config_from_hf(hf_cfg.to_dict())
        inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
        np.testing.assert_allclose(rope_inv_freq(ours.rope, ours.head_dim, ours.max_position_embeddings),
                                   inv.numpy(), rtol=1e-6)
        assert math.isclose(rope_attention_factor(ours.rope), scale) and not ours.rope.truncate
    # fields a config.json leaves out take GptOssConfig's defaults
    sparse = {k: v for k, v in hf.config.to_dict().items()
              if k not in ("attention_bias", "rms_norm_eps", "layer_types", "swiglu_alpha", "rope_parameters")}
    defaults = model_config_from_hf(sparse)
    assert defaults.attention_bias and defaults.rms_norm_eps == 1e-5 and defaults.sliding_layers == (0,)
    assert (defaults.rope.kind, defaults.rope.factor, defaults.rope.theta) == ("yarn", 32.0, 150000.0)


@pytest.mark.parametrize("change,field", [
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_local_experts": None}, "num_local_experts"),
])
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        model_config_from_hf(hf_config().to_dict() | change)


def numpy_experts(x, router, bias, gate, up, down, biases, k, alpha, limit):
    """Float64, token by token, as transformers does it: top-k logits, softmax over them, clamped SwiGLU."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = row @ router + bias
        top = np.argsort(-logits)[:k]
        w = np.exp(logits[top] - logits[top].max())
        for expert, weight in zip(top, w / w.sum()):
            g = np.minimum(row @ gate[expert] + biases[0][expert], limit)
            u = np.clip(row @ up[expert] + biases[1][expert], -limit, limit)
            h = (u + 1) * g / (1 + np.exp(-alpha * g))
            out[t] += weight * (h @ down[expert] + biases[2][expert])
    return out


def test_grouped_experts_match_a_numpy_reference():
    """Routing and moe.py's grouped expert computation with gpt-oss's biases and clamped SwiGLU (the dense and
    gathered ones meet transformers in the logits tests: prefill runs dense, steps and chunks gather)."""
    rng = np.random.default_rng(0)
    n, d, e, f = 20, 16, EXPERTS, 8
    shapes = [((n, d), 1), ((d, e), 1), ((e,), 1), ((e, d, f), 0.5), ((e, d, f), 0.5), ((e, f, d), 0.3),
              ((e, f), 0.5), ((e, f), 0.5), ((e, d), 0.5)]
    arrays = [rng.normal(size=s) * c for s, c in shapes]
    x, router, bias, gate, up, down, *biases = (jnp.asarray(a, jnp.float32) for a in arrays)
    act = lambda g, u: gpt_oss.clamped_swiglu(g, u, alpha=1.702, limit=1.0)  # noqa: E731

    def grouped(x):
        w, idx = gpt_oss.route(x, router, bias, TOP_K)
        return idx, kmoe.experts_grouped(x, w, idx, gate, up, down, biases=tuple(biases), act=act)

    idx, out = compiled(grouped, x)(x)
    assert np.bincount(np.asarray(idx).ravel()).max() > 1  # the grouped path really groups
    assert np.mean(np.abs(arrays[0] @ arrays[3][0]) > 1.0) > 0.2  # the clamp is active for many values
    assert rel_err(out, numpy_experts(*arrays[:6], arrays[6:], TOP_K, 1.702, 1.0)) < 1e-5


def test_prefill_and_cached_decode_match_transformers(ckpt):
    """Prefill of 7 (> window), single steps, then verify chunks of 4 at offsets 9 and 8 in the two rows."""
    hf, _, target = ckpt
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 13))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    logits, cache = our_logits(target, ids[:, :7], [0, 0])  # 28 routed pairs > 8 experts: the dense path
    assert rel_err(logits, ref[:, :7]) <= REL_TOL
    for p in (7, 8):  # 4 pairs (≤ 8 experts): the gathered path
        step, cache = our_logits(target, ids[:, p:p + 1], [p, p], cache)
        assert rel_err(step[:, 0], ref[:, p]) <= REL_TOL, f"decode step at {p}"
    chunk_ids = np.stack([ids[0, 9:13], ids[1, 8:12]])  # row 1 re-verifies position 8 (same K/V rewritten)
    chunk, cache = our_logits(target, chunk_ids, [9, 8], cache)
    assert rel_err(chunk[0], ref[0, 9:13]) <= REL_TOL and rel_err(chunk[1], ref[1, 8:12]) <= REL_TOL


def test_kernel_impls_take_sinks_and_windows(caplog):
    """The verify kernels run gpt-oss's sinks and windows (the Pallas TPU kernel here, interpreted); the GPU
    kernel needs head_dim >= 16, so at this head_dim it falls back to the reference, saying why."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, 2, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8)))
    pos, sinks = jnp.asarray([[4, 5]]), jnp.asarray(rng.normal(size=4), jnp.float32)
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):  # one compile for all three (logs: at trace)
        ref, out, gpu = compiled(lambda *a: [attention.cache_attention(*a, kernels=Kernels(impl), sinks=sinks, window=3)
                                             for impl in ("xla", "pallas", "cuda")], q, k, v, pos)(q, k, v, pos)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(gpu, ref)
    fallbacks = [r.getMessage() for r in caplog.records if "uses the XLA reference" in r.getMessage()]
    assert len(fallbacks) == 1 and "'cuda'" in fallbacks[0] and "head_dim" in fallbacks[0]
    # direct: position 5 sees keys 3..5 with window 3; the sink adds exp(sink) to the denominator only
    s = np.einsum("h,sh->s", np.asarray(q[0, 1, 0]), np.asarray(k[0, 3:6, 0])) / math.sqrt(8)
    p = np.exp(s) / (np.exp(s).sum() + np.exp(float(sinks[0])))
    np.testing.assert_allclose(out[0, 1, 0], p @ np.asarray(v[0, 3:6, 0]), rtol=1e-5)


PROMPTS = random_prompts(2, [6, 11], VOCAB, seed=4)  # both longer than the window
NEW = 12


@pytest.fixture(scope="module")
def greedy(ckpt):
    return generate(ckpt[2], PROMPTS, max_new_tokens=NEW, stop_token_ids=[]).token_ids


def test_greedy_generate_matches_transformers(ckpt, greedy):
    assert greedy == hf_greedy_tokens(ckpt[0], PROMPTS, NEW)


def test_speculative_decoding_is_lossless(ckpt, greedy):
    """A random DFlash drafter (Qwen3 layers) on the gpt-oss target: block 4, verify windows crossing the
    sliding window at every offset."""
    drafter = random_drafter(ckpt[2], block_size=4, num_layers=1, seed=6)
    out = speculative_generate(ckpt[2], drafter, PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert out.token_ids == greedy


def test_speculative_decoding_through_the_pallas_kernels(ckpt, greedy, caplog):
    """The same through the Pallas TPU kernels (interpreted): verify with sinks, and windows on the sliding
    layer, with no fallback to the reference."""
    drafter = random_drafter(ckpt[2], block_size=4, num_layers=1, seed=6)
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):
        out = speculative_generate(ckpt[2], drafter, PROMPTS, max_new_tokens=NEW, stop_token_ids=[],
                                   attention_impl="pallas")
    assert out.token_ids == greedy
    assert not any("uses the XLA reference" in r.getMessage() for r in caplog.records)


def _fp4(code: int) -> float:
    """E2M1 from its bits: sign, 2 exponent bits (bias 1; 0 = subnormal), 1 mantissa bit."""
    sign, exp, man = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + 0.5 * man))


def test_mxfp4_dequantization():
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)  # [E, R, G, 16]
    scales = rng.integers(110, 140, size=(3, 5, 2), dtype=np.uint8)
    ours = gpt_oss.dequantize_mxfp4(blocks, scales)
    direct = np.empty((3, 5, 64), np.float32)
    for (e, r, g, j), byte in np.ndenumerate(blocks):
        for half, code in enumerate((byte & 0xF, byte >> 4)):  # low nibble first
            direct[e, r, g * 32 + 2 * j + half] = math.ldexp(_fp4(int(code)), int(scales[e, r, g]) - 127)
    np.testing.assert_array_equal(ours, direct)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours, np.swapaxes(theirs.numpy(), 1, 2))  # theirs is [E, G·32, R]
    np.testing.assert_array_equal(gpt_oss.dequantize_mxfp4(blocks, scales, jnp.bfloat16).astype(np.float32), ours)


def test_mxfp4_checkpoint_loads_like_its_plain_dequantization(ckpt, tmp_path):
    """Released checkpoints' ``*_blocks``/``*_scales`` vs the plain tensors transformers' helper makes of them."""
    _, path, _ = ckpt
    rng = np.random.default_rng(5)
    tensors = load_file(str(path / "model.safetensors"))
    plain, quant = dict(tensors), dict(tensors)
    for i in range(LAYERS):
        base = f"model.layers.{i}.mlp.experts."
        for proj, rows, groups in (("gate_up_proj", 128, 1), ("down_proj", 32, 2)):  # [E, 2F or D, in/32, 16]
            blocks = rng.integers(0, 256, size=(EXPERTS, rows, groups, 16), dtype=np.uint8)
            scales = rng.integers(120, 130, size=(EXPERTS, rows, groups), dtype=np.uint8)
            quant.pop(base + proj)
            quant[base + proj + "_blocks"], quant[base + proj + "_scales"] = blocks, scales
            plain[base + proj] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                            dtype=torch.float32).numpy()  # [E, in, out]
    for name, t in (("plain", plain), ("mxfp4", quant)):
        (tmp_path / name).mkdir()
        save_file(t, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text((path / "config.json").read_text())
    models = [load_target(tmp_path / n).model for n in ("plain", "mxfp4")]
    a, b = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in models)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (p, va), (_, vb) in zip(a, b):
        np.testing.assert_array_equal(va[...], vb[...], err_msg=str(p))
    e = models[0].layers[1].mlp.experts  # the interleaved columns, split as transformers splits them
    np.testing.assert_array_equal(e.up_proj[...], plain["model.layers.1.mlp.experts.gate_up_proj"][..., 1::2])
