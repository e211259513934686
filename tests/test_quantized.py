"""Quantized targets: the quantized matmul against the dequantized product, HF fine-grained FP8 checkpoints and
int8 quantize-on-load against transformers run on the same weights dequantized (float32 compute: logits and greedy
tokens), malformed FP8 checkpoints refused by name, weight bytes, and speculative decoding lossless against the
same quantized target (DFlash and DSpark drafters, static and compact verification).

The FP8 checkpoints are written here in HF's layout by the test's own blockwise quantizer (``hf_fp8``), with an
asymmetric block (32 output rows × 16 input columns) and widths that leave partial blocks at the edges, so a
transposed or misaligned scale grid cannot pass.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from conftest import hf_greedy_tokens, oracle_drafter, random_prompts, tiny_target
from dflash_jax import (CheckpointError, ConfigError, generate, load_target, quantize, random_drafter,
                        speculative_generate)
from dflash_jax.checkpoints.safetensors_io import read_safetensors
from dflash_jax.costs import CostTable
from dflash_jax.kernels.quantized import quantized_matmul
from dflash_jax.pairs import parse_pair
from dflash_jax.quant import Scheme, dequantize, param_bytes
from dflash_jax.quant import quantize as quantize_array

VOCAB, HIDDEN, INTERMEDIATE = 256, 64, 72  # 72: partial blocks along both axes of the MLP weights
BLOCK = (32, 16)  # HF weight_block_size: [output rows, input columns]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REL_TOL = 1e-4


def hf_model(tied: bool, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.15,
                                   tie_word_embeddings=tied,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return hf


def hf_fp8(w: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """HF fine-grained FP8 of a ``[out, in]`` weight: e4m3 values and ``weight_scale_inv [ceil(out/bo),
    ceil(in/bi)]`` (each block's absolute maximum / 448)."""
    out, inp = w.shape
    rows, cols = -(-out // block[0]), -(-inp // block[1])
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = np.abs(part).max() / 448.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scale[i, j]).astype(q.dtype)
    return q, scale


def hf_fp8_dequantized(q: np.ndarray, scale: np.ndarray, block=BLOCK) -> np.ndarray:
    out = q.astype(np.float32)
    for i, j in np.ndindex(*scale.shape):
        out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j]
    return out


def int8_dequantized(w: np.ndarray) -> np.ndarray:
    """Symmetric int8 per output channel of a ``[out, in]`` weight, dequantized."""
    scale = np.abs(w).max(axis=1, keepdims=True) / 127.0
    return np.clip(np.rint(w / scale), -127, 127) * scale


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def with_weights(hf, weights: dict[str, np.ndarray]):
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in weights:
                p.copy_(torch.from_numpy(np.asarray(weights[name], np.float32)))
    return hf


def write_fp8(path, hf, tensors: dict, quantization_config: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = quantization_config or {"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                                         "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(checkpoint dir, its tensors, transformers on the dequantized weights, our float32 target as stored)."""
    hf = hf_model(tied=False, seed=0)
    tensors, dequantized = {}, {}
    for name, w in hf.state_dict().items():
        w = w.numpy()
        if is_linear(name):
            tensors[name], tensors[name + "_scale_inv"] = hf_fp8(w)
            dequantized[name] = hf_fp8_dequantized(tensors[name], tensors[name + "_scale_inv"])
        else:  # embeddings, norms and lm_head stay unquantized, as Qwen's FP8 checkpoints keep them
            tensors[name] = w
    path = tmp_path_factory.mktemp("fp8") / "tiny"
    write_fp8(path, hf, tensors)
    return path, tensors, with_weights(hf, dequantized), load_target(path, "float32")


PROMPTS = random_prompts(2, [7, 12], VOCAB, seed=3)


def prefill_logits(target, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h, _, _ = target.model(jnp.asarray(ids, jnp.int32), positions, None, prefill=True)
    return np.asarray(target.model.logits(h))


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------------------------------
# The quantized matmul
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", [Scheme("int8"), Scheme("int8", (16, 1)), Scheme("fp8"), Scheme("fp8", (16, 32)),
                                    Scheme("fp8", (128, 128))])
def test_quantized_matmul_is_the_product_with_the_dequantized_kernel(scheme):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(72, 40)).astype(np.float32) * rng.uniform(0.1, 3, size=(1, 40)).astype(np.float32)
    q, s = quantize_array(w, scheme)
    assert q.dtype == scheme.dtype and s.shape == scheme.scale_shape(72, 40)
    block = scheme.blocks(72, 40)
    dq = dequantize(q, s, block)
    if scheme.kind == "int8":  # rounding to the nearest step: within half a step of the float weight
        step = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:72, :40]
        assert np.all(np.abs(dq - w) <= 0.5 * step + 1e-6)
    else:  # e4m3 keeps 3 mantissa bits: within 2^-4 relative (plus the smallest normal's step)
        assert np.all(np.abs(dq - w) <= np.abs(w) / 16 + 1e-3 * np.abs(w).max())
    x = rng.normal(size=(2, 3, 72)).astype(np.float32)
    y = quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), block)
    assert y.dtype == jnp.float32 and y.shape == (2, 3, 40)
    np.testing.assert_allclose(np.asarray(y), x @ dq, rtol=2e-5, atol=2e-5)
    y16 = quantized_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(q), jnp.asarray(s), block,
                           out_dtype=jnp.float32)
    assert rel_err(y16, x.astype(ml_dtypes.bfloat16).astype(np.float32) @ dq) < 1e-5
    with pytest.raises(ValueError, match="do not fit"):
        quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.ones((s.shape[0] + 1, s.shape[1])), block)


# --------------------------------------------------------------------------------------------------
# HF fine-grained FP8 checkpoints
# --------------------------------------------------------------------------------------------------

def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(fp8):
    path, tensors, hf, target = fp8
    assert read_safetensors([path / "model.safetensors"])["model.layers.0.mlp.up_proj.weight"].dtype == \
        np.dtype(ml_dtypes.float8_e4m3fn)
    down = target.model.layers[1].mlp.down_proj
    assert down.kernel[...].dtype == jnp.float8_e4m3fn and down.quant == Scheme("fp8", (16, 32))
    assert down.scale[...].shape == (5, 2)  # [ceil(72 / 16), ceil(64 / 32)]: the HF grid transposed
    assert target.model.lm_head.quant is None and target.model.embed_tokens.embedding[...].dtype == jnp.float32
    ids = np.asarray([p[:7] for p in PROMPTS])
    assert rel_err(prefill_logits(target, ids), hf_logits(hf, ids)) < REL_TOL
    ours = generate(target, PROMPTS, max_new_tokens=10, stop_token_ids=[]).token_ids
    assert ours == hf_greedy_tokens(hf, PROMPTS, 10)


def test_fp8_checkpoint_quantized_as_int8_or_fp8(fp8):
    """``"int8"`` dequantizes the stored blocks and requantizes per channel (within half an int8 step of the
    stored weights); ``"fp8"`` keeps the stored blocks and quantizes the float LM head too."""
    path, tensors, hf, stored = fp8
    as_int8 = load_target(path, "float32", quantization="int8")
    up = as_int8.model.layers[0].mlp.up_proj
    assert up.kernel[...].dtype == jnp.int8 and up.quant == Scheme("int8")
    assert as_int8.model.lm_head.quant == Scheme("int8")
    name = "model.layers.0.mlp.up_proj.weight"
    want = hf_fp8_dequantized(tensors[name], tensors[name + "_scale_inv"]).T
    got = dequantize(np.asarray(up.kernel[...]), np.asarray(up.scale[...]), (None, 1))
    assert np.all(np.abs(got - want) <= 0.5 * np.asarray(up.scale[...]) + 1e-6)
    ids = np.asarray([p[:7] for p in PROMPTS])
    assert rel_err(prefill_logits(as_int8, ids), hf_logits(hf, ids)) < 0.05
    as_fp8 = load_target(path, "float32", quantization="fp8")
    for a, b in zip(as_fp8.model.layers, stored.model.layers):
        assert a.self_attn.q_proj.quant == b.self_attn.q_proj.quant == Scheme("fp8", (16, 32))
        assert np.array_equal(np.asarray(a.mlp.down_proj.scale[...]), np.asarray(b.mlp.down_proj.scale[...]))
    assert as_fp8.model.lm_head.quant == Scheme("fp8") and as_fp8.model.lm_head.kernel[...].dtype == jnp.float8_e4m3fn


def test_malformed_fp8_checkpoints_are_refused_naming_the_tensor(fp8, tmp_path):
    path, tensors, hf, _ = fp8
    down = "model.layers.1.mlp.down_proj.weight"
    cases = {
        "misshaped": ({**tensors, down + "_scale_inv": tensors[down + "_scale_inv"][:, :4]}, None,
                      rf"scales {down}_scale_inv of FP8 tensor {down} \(64, 72\) are float32 \(2, 4\).*\(2, 5\)"),
        "missing": ({k: v for k, v in tensors.items() if k != down + "_scale_inv"}, None,
                    rf"FP8 tensor {down} \(64, 72\) has no scale tensor {down}_scale_inv"),
        "orphan": ({**tensors, "model.norm.weight_scale_inv": np.ones((1, 1), np.float32)}, None,
                   "scale model.norm.weight_scale_inv belongs to no FP8 tensor"),
        "int scales": ({**tensors, down + "_scale_inv": tensors[down + "_scale_inv"].astype(np.int32)}, None,
                       rf"scales {down}_scale_inv .* are int32"),
        "static": (tensors, {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "static"},
                   "activation_scheme 'static' is not supported"),
        "block": (tensors, {"quant_method": "fp8", "weight_block_size": [128], "activation_scheme": "dynamic"},
                  "weight_block_size must be two positive integers"),
    }
    for case, (bad, qc, message) in cases.items():
        where = tmp_path / case
        write_fp8(where, hf, bad, qc)
        with pytest.raises(CheckpointError, match=message):
            load_target(where, "float32")


# --------------------------------------------------------------------------------------------------
# Quantized on load, weight bytes
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tied_float(tmp_path_factory):
    """A tied float checkpoint (the head is the embedding) and its HF model."""
    hf = hf_model(tied=True, seed=1)
    path = tmp_path_factory.mktemp("float") / "tied"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def test_int8_on_load_matches_transformers_on_the_dequantized_weights(tied_float):
    """Every linear layer and the (tied) LM head in int8 per output channel; the embedding stays float. The
    reference: transformers, untied, with each linear weight and the head int8-rounded by the test's formula."""
    path, hf = tied_float
    target = load_target(path, "float32", quantization="int8")
    assert target.model.lm_head.quant == Scheme("int8") and target.model.embed_tokens.embedding[...].dtype == jnp.float32
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    untied = hf_model(tied=False, seed=1)
    weights = {k: int8_dequantized(v) if is_linear(k) else v for k, v in state.items()}
    weights["lm_head.weight"] = int8_dequantized(state["model.embed_tokens.weight"])
    untied = with_weights(untied, weights)
    ids = np.asarray([p[:7] for p in PROMPTS])
    assert rel_err(prefill_logits(target, ids), hf_logits(untied, ids)) < REL_TOL
    assert generate(target, PROMPTS, max_new_tokens=10, stop_token_ids=[]).token_ids == \
        hf_greedy_tokens(untied, PROMPTS, 10)


def test_weight_bytes_count_what_is_stored(tied_float):
    """int8 linear layers take half their bfloat16 bytes plus a float32 scale per output channel."""
    path, _ = tied_float
    bf16 = load_target(path, "bfloat16")
    int8 = load_target(path, "bfloat16", quantization="int8")
    shapes = [tuple(d.kernel.shape) for d in (int8.model.layers[0].self_attn.q_proj, int8.model.layers[0].mlp.down_proj)]
    layers = lambda p: p[0] == "layers" and p[-1] != "weight"  # noqa: E731 — the linear layers, not the norms
    linear_bf16, linear_int8 = param_bytes(bf16.model, layers), param_bytes(int8.model, layers)
    want_int8 = sum(d_in * d_out + 4 * d_out for d_in, d_out in
                    (tuple(m.kernel.shape) for _, m in _linears(int8.model)))
    assert linear_int8 == want_int8 and linear_bf16 == sum(2 * a * b for a, b in
                                                           (tuple(m.kernel.shape) for _, m in _linears(bf16.model)))
    assert 0.5 < linear_int8 / linear_bf16 <= 0.5 + 2 / min(s[0] for s in shapes)
    head = VOCAB * HIDDEN + 4 * VOCAB  # the tied head's own int8 copy
    assert int8.weight_bytes == bf16.weight_bytes - linear_bf16 + linear_int8 + head
    assert int8.model.embed_tokens.embedding[...].dtype == jnp.bfloat16


def _linears(model):
    from dflash_jax.models.layers import quantizable

    return [(p, m) for p, m in quantizable(model) if p[0] == "layers"]


def test_quantization_values_are_checked_once():
    for bad in ("int4", 8, "FP16"):
        with pytest.raises(ConfigError, match=r"quantization must be None, 'int8' or 'fp8'"):
            load_target("does/not-matter", quantization=bad)
    base = {"name": "p", "target": "t", "drafter": "d"}
    assert parse_pair({**base, "quantization": "int8"}, "x").quantization == "int8"
    assert parse_pair({**base, "quantization": "none"}, "x").quantization is None
    assert parse_pair(base, "x").drafter_quantization is None
    with pytest.raises(ConfigError, match="quantization must be one of"):
        parse_pair({**base, "quantization": "int4"}, "x")


# --------------------------------------------------------------------------------------------------
# Lossless against the quantized target
# --------------------------------------------------------------------------------------------------

LOSSLESS_PROMPTS = random_prompts(4, [5, 17, 9, 30], 64, seed=2)
MAX_NEW = 30
TABLE = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 1.0, 2: 1.25, 4: 1.8, 8: 3.2}})


@pytest.fixture(scope="module")
def int8_target():
    target = quantize(tiny_target("qwen3", seed=21), "int8")
    return target, generate(target, LOSSLESS_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_speculative_equals_autoregressive_on_an_int8_target(int8_target, mode):
    target, reference = int8_target
    oracle = oracle_drafter(target, LOSSLESS_PROMPTS, reference.token_ids, block_size=8, corrupt=0.2, seed=1)
    out = speculative_generate(target, oracle, LOSSLESS_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[],
                               verify_mode=mode, cost_table=TABLE)
    assert out.token_ids == reference.token_ids and out.stats["verify_mode"] == mode
    assert len({a for row in out.acceptance_lengths for a in row}) >= 3
    dspark = random_drafter(target, kind="dspark", block_size=7, num_layers=1, markov_rank=16, seed=3)
    out = speculative_generate(target, dspark, LOSSLESS_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[],
                               verify_mode=mode)
    assert out.token_ids == reference.token_ids and out.stats["verify_mode"] == mode


def test_speculative_equals_autoregressive_on_a_block_fp8_target():
    """Blocks over the input rows (partial products summed), a tied LLaMA head given its own FP8 copy, and an
    int8 drafter."""
    target = quantize(tiny_target("llama", seed=4), Scheme("fp8", (16, 16)))
    assert target.model.lm_head.quant == Scheme("fp8", (16, 16)) and target.model.layers[0].mlp.down_proj.scale[
        ...].shape == (4, 2)
    head = target.model.lm_head
    ids = jnp.asarray([3, 40, 17], jnp.int32)  # the rows a reduced draft vocabulary reads: dequantized
    full = dequantize(np.asarray(head.kernel[...]), np.asarray(head.scale[...]), (16, 16))
    np.testing.assert_allclose(np.asarray(target.model.head_rows(ids)), full.T[np.asarray(ids)], rtol=1e-6)
    drafter = quantize(random_drafter(target, block_size=4, num_layers=1, seed=2), "int8")
    assert drafter.model.fc.quant == Scheme("int8") and drafter.model.dtype == jnp.float32
    ref = generate(target, LOSSLESS_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])
    out = speculative_generate(target, drafter, LOSSLESS_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert out.token_ids == ref.token_ids


def test_qwen3_moe_fp8_checkpoint_matches_transformers(tmp_path):
    """Qwen3-MoE in fine-grained FP8 (per-expert weights, each with its scales): attention, the dense MLP layer and
    the routed experts read as stored (the experts stacked with their per-expert block scales), the router
    unquantized as the checkpoint keeps it; logits as transformers' on the dequantized weights; int8 on load
    quantizes the experts too; speculative decoding equals autoregressive decoding of the FP8 target."""
    torch.manual_seed(2)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=40,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256,
        initializer_range=0.15, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    hf.save_pretrained(tmp_path / "float", safe_serialization=True)
    stored = read_safetensors([tmp_path / "float" / "model.safetensors"])
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in stored and "model.layers.0.mlp.gate.weight" in stored
    tensors, dequantized = {}, {}
    for name, w in stored.items():
        if is_linear(name):
            tensors[name], tensors[name + "_scale_inv"] = hf_fp8(w)
            dequantized[name] = hf_fp8_dequantized(tensors[name], tensors[name + "_scale_inv"])
        else:
            tensors[name] = dequantized[name] = w
    write_fp8(tmp_path / "fp8", hf, tensors)
    save_file(dequantized, str(tmp_path / "float" / "model.safetensors"), metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float", attn_implementation="eager")
    target = load_target(tmp_path / "fp8", "float32")
    layer0, layer1 = target.model.layers
    assert layer0.self_attn.o_proj.quant == layer1.mlp.up_proj.quant == Scheme("fp8", (16, 32))
    experts = layer0.mlp.experts
    assert layer0.mlp.gate.quant is None and experts.quant == Scheme("fp8", (16, 32))
    assert experts.gate_proj[...].dtype == jnp.float8_e4m3fn and experts.gate_proj_scale[...].shape == (4, 4, 2)
    assert experts.down_proj_scale[...].shape == (4, 3, 2)  # [E, ceil(40 / 16), ceil(64 / 32)]
    ids = np.asarray([p[:7] for p in PROMPTS])
    want = hf_logits(reference.float().eval(), ids)
    assert rel_err(prefill_logits(target, ids), want) < REL_TOL  # every expert, one at a time
    assert rel_err(prefill_logits(target, ids[:1, :1]), want[:1, :1]) < REL_TOL  # one token: the gathered experts
    int8 = load_target(tmp_path / "fp8", "float32", quantization="int8")
    assert int8.model.layers[0].mlp.experts.quant == Scheme("int8")
    assert int8.model.layers[0].mlp.experts.up_proj[...].dtype == jnp.int8
    # 1 byte a weight and a float32 scale per expert and output channel: [4, 1, 40] × 2 and [4, 1, 64]
    assert param_bytes(int8.model.layers[0].mlp.experts) == 3 * 4 * 64 * 40 + 4 * (2 * 4 * 40 + 4 * 64)
    prompts = [list(p[:5]) for p in PROMPTS[:2]]
    ref = generate(target, prompts, max_new_tokens=12, stop_token_ids=[])
    drafter = random_drafter(target, block_size=4, num_layers=1, seed=1)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=12, stop_token_ids=[])
    assert out.token_ids == ref.token_ids


def test_sampled_decoding_on_an_int8_target_matches_its_distribution():
    """Sampled speculative decoding is exact for the quantized target: χ² against the distribution its own logits
    give (tests/test_sampling.py's enumeration)."""
    import itertools

    from flax import nnx

    from test_sampling import PROMPT, V, chi2_pvalue, draw, exact_distribution

    small = quantize(tiny_target("qwen3", seed=11, vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                                 num_heads=2, num_kv_heads=1, head_dim=8), "int8")
    drafter = random_drafter(small, block_size=4, num_layers=1, seed=5, mask_token_id=V - 1)
    seqs = jnp.asarray([PROMPT + [a, b] for a, b in itertools.product(range(V), range(V))], jnp.int32)
    n, t = seqs.shape

    @nnx.jit
    def forward(model, seqs):
        h, _, _ = model(seqs, jnp.broadcast_to(jnp.arange(t), (n, t)), None, prefill=True)
        return model.logits(h[:, -3:])

    probs = exact_distribution(forward(small.model, seqs), 1.0, 0, 1.0)
    samples = draw(lambda *a, **k: speculative_generate(small, drafter, *a, **k), temperature=1.0, seed=4)
    assert chi2_pvalue(samples, probs) > 1e-3


@pytest.mark.parametrize("scheme", [Scheme("int8"), Scheme("fp8", (16, 8))], ids=str)
def test_quantized_experts_match_the_dequantized_experts(scheme):
    """The routed experts' jnp forms on int8 / fp8 experts (per-expert scales; blocks over the input rows with
    partial blocks at the edges) equal the float forms on the dequantized weights: the gathered form (decode)
    and every expert a few at a time (beyond), which never converts more than ``step_bytes`` of the stack."""
    from dflash_jax.kernels import moe

    rng = np.random.default_rng(3)
    e, d, f, n, k = 4, 40, 24, 5, 2
    stacks, floats = {}, {}
    for name, shape in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d))):
        pairs = [quantize_array(rng.standard_normal(shape, np.float32) / np.sqrt(shape[0]), scheme) for _ in range(e)]
        q, s = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
        stacks[name] = (jnp.asarray(q), jnp.asarray(s))
        floats[name] = jnp.asarray(np.stack([dequantize(a, b, scheme.blocks(*shape)) for a, b in pairs]))
    scales = moe.ExpertScales(stacks["gate"][1], stacks["up"][1], stacks["down"][1], scheme.blocks(d, f),
                              scheme.blocks(f, d))
    x = jnp.asarray(rng.standard_normal((n, d), np.float32))
    weights = jnp.asarray(rng.uniform(0.1, 1, (n, k)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    want = moe.experts_gathered(x, weights, idx, floats["gate"], floats["up"], floats["down"])
    values = (stacks["gate"][0], stacks["up"][0], stacks["down"][0])
    got = moe.experts_gathered(x, weights, idx, *values, quant=scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    per_expert = (2 * d * f + f * d) * 4  # float32 activations: the converted values' bytes
    for step_bytes in (0, 2 * per_expert, 3 * per_expert, 4 * per_expert):  # 1, 2, 2, 4 experts a step
        got = moe.experts_dense_quantized(x, weights, idx, *values, quant=scales, step_bytes=step_bytes)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    # G experts a step: a scan of E / G steps (G the largest divisor of E that fits step_bytes)
    jaxpr = str(jax.make_jaxpr(lambda x: moe.experts_dense_quantized(x, weights, idx, *values, quant=scales,
                                                                     step_bytes=3 * per_expert))(x))
    assert "length=2" in jaxpr


# --------------------------------------------------------------------------------------------------
# Qwen3.5 / Qwen3.6 hybrids in FP8
# --------------------------------------------------------------------------------------------------

HYBRID_BLOCK = (16, 16)
# What Qwen's FP8 hybrids quantize: the attention and Gated-DeltaNet projections, the dense MLP, the shared expert
# and every routed expert (per expert); in_proj_a / in_proj_b (Qwen3-Next's in_proj_ba), conv1d, A_log, dt_bias, norms, the router, the shared
# expert's gate, embeddings and lm_head stay unquantized.
HYBRID_FP8 = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz?|in_proj_z|out_proj)|(mlp|shared_expert|"
                        r"experts\.\d+)\.(gate|up|down)_proj)\.weight$")


def fp8_hybrid(tmp_path, kind: str):
    """A tiny Qwen3.5 (``"dense"``), Qwen3.5-MoE (``"moe"``) or Qwen3-Next (``"next"``) FP8 checkpoint as Qwen's
    are stored (Qwen3.5: the text model under ``model.language_model.``; routed experts one by one, 16×16 blocks,
    bfloat16 scales, an FP8 MTP tensor the text model does not use), and transformers' text model on its
    dequantized weights. The dense one's key heads are 8 wide, so grouping ``in_proj_qkv``'s rows by key head cuts
    its 16-row blocks: one scale per row there. Qwen3-Next's fused ``in_proj_qkvz`` is split by key head."""
    torch.manual_seed(5)
    moe, vl = kind != "dense", kind != "next"
    text = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8 if kind == "dense" else 16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-6,
                layer_types=["linear_attention", "full_attention", "linear_attention"])
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
    if kind == "next":
        cfg = transformers.Qwen3NextConfig(**text, **experts, intermediate_size=40, decoder_sparse_step=1)
        hf = transformers.Qwen3NextForCausalLM(cfg)
    elif moe:
        cfg = transformers.Qwen3_5MoeTextConfig(**text, **experts)
        hf = transformers.Qwen3_5MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3_5TextConfig(**text, intermediate_size=40)
        hf = transformers.Qwen3_5ForCausalLM(cfg)
    hf = hf.float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    for name in [n for n in state if n.endswith("experts.gate_up_proj")]:  # → per expert, as Qwen stores them
        base, f = name[: -len("gate_up_proj")], state[name].shape[1] // 2
        for e, (gate_up, down) in enumerate(zip(state.pop(name), state.pop(base + "down_proj"))):
            state.update({f"{base}{e}.gate_proj.weight": gate_up[:f], f"{base}{e}.up_proj.weight": gate_up[f:],
                          f"{base}{e}.down_proj.weight": down})
    state["mtp.layers.0.mlp.experts.0.up_proj.weight"] = np.ones((24, 32), np.float32)
    tensors, dequantized = {}, {}
    for name, w in state.items():
        stored = name.replace("model.", "model.language_model.", 1) if vl and name.startswith("model.") else name
        if HYBRID_FP8.search(name):
            tensors[stored], scale = hf_fp8(w, HYBRID_BLOCK)
            tensors[stored + "_scale_inv"] = scale.astype(ml_dtypes.bfloat16)
            dequantized[name] = hf_fp8_dequantized(tensors[stored], scale.astype(ml_dtypes.bfloat16), HYBRID_BLOCK)
        else:
            tensors[stored] = dequantized[name] = w
    path = tmp_path / kind
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              "model_type": "qwen3_5_moe" if moe else "qwen3_5", "tie_word_embeddings": False,
              "text_config": cfg.to_dict()} if vl else cfg.to_dict()
    config["quantization_config"] = {
        "quant_method": "fp8", "weight_block_size": list(HYBRID_BLOCK), "activation_scheme": "dynamic",
        "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate", "in_proj_a", "in_proj_b", "in_proj_ba",
                                   "shared_expert_gate", "model.visual"]}
    (path / "config.json").write_text(json.dumps(config))
    fused = {}
    for name in [n for n in dequantized if ".experts.0.gate_proj" in n]:  # the reference's fused experts again
        base = name[: -len("0.gate_proj.weight")]
        e = range(cfg.num_experts)
        fused[base + "gate_up_proj"] = np.stack([np.concatenate([dequantized[f"{base}{i}.gate_proj.weight"],
                                                                 dequantized[f"{base}{i}.up_proj.weight"]]) for i in e])
        fused[base + "down_proj"] = np.stack([dequantized[f"{base}{i}.down_proj.weight"] for i in e])
    return path, with_weights(hf, {**dequantized, **fused})


@pytest.mark.parametrize("kind", ["moe", "dense", "next"])
def test_qwen3_5_fp8_checkpoint_matches_transformers(tmp_path, kind):
    """Qwen3.5 / Qwen3.6 hybrids (and Qwen3-Next) in fine-grained FP8, read as stored: full-attention and
    DeltaNet projections, the MLP, the shared expert and the routed experts (stacked with their per-expert block
    scales) FP8; the rest as the checkpoint keeps it. Greedy tokens as transformers' on the dequantized weights
    (float32); speculative decoding (a random DFlash drafter) equals autoregressive decoding of the FP8 target."""
    path, hf = fp8_hybrid(tmp_path, kind)
    moe = kind != "dense"
    target = load_target(path, "float32")
    full, linear = target.model.layers[1], target.model.layers[0]
    assert full.self_attn.q_proj.quant == Scheme("fp8", (16, 16))
    assert full.self_attn.q_proj.kernel[...].dtype == jnp.float8_e4m3fn
    delta = linear.linear_attn
    for dense in (delta.in_proj_z, delta.out_proj):
        assert dense.quant == Scheme("fp8", (16, 16)) and dense.kernel[...].dtype == jnp.float8_e4m3fn
    # grouped by key head: rows moved by whole blocks keep them; 8-wide key heads leave one scale per row
    qkv = delta.in_proj_qkv
    assert qkv.quant == Scheme("fp8", (16, 16) if moe else (16, 1)) and qkv.kernel[...].dtype == jnp.float8_e4m3fn
    c = qkv.kernel.shape[1]
    assert param_bytes(qkv) == 32 * c + 4 * 2 * (c // 16 if moe else c)  # 1 byte a weight + float32 scales
    assert delta.in_proj_a.quant is None and delta.in_proj_a.kernel[...].dtype == jnp.float32
    assert target.model.lm_head.quant is None and target.model.embed_tokens.embedding[...].dtype == jnp.float32
    if moe:
        mlp = linear.mlp
        assert mlp.gate.quant is None and mlp.shared_expert_gate.quant is None
        assert mlp.shared_expert.down_proj.quant == Scheme("fp8", (16, 16))
        assert mlp.experts.quant == Scheme("fp8", (16, 16)) and mlp.experts.up_proj[...].dtype == jnp.float8_e4m3fn
        assert mlp.experts.up_proj_scale[...].shape == (4, 2, 2)  # [E, ceil(32 / 16), ceil(24 / 16)]
    else:
        assert linear.mlp.down_proj.quant == Scheme("fp8", (16, 16))
    prompts = [list(p[:6]) for p in PROMPTS]
    ref = generate(target, prompts, max_new_tokens=10, stop_token_ids=[])
    assert ref.token_ids == hf_greedy_tokens(hf, prompts, 10)
    drafter = random_drafter(target, block_size=4, num_layers=1, seed=1)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=10, stop_token_ids=[])
    assert out.token_ids == ref.token_ids
    if kind == "moe":  # a scale missing or mis-shaped: refused by its stored name
        tensors = read_safetensors([path / "model.safetensors"])
        qkv, down = (f"model.language_model.layers.{n}" for n in ("2.linear_attn.in_proj_qkv.weight",
                                                                  "0.mlp.experts.2.down_proj.weight"))
        for bad, message in (({k: v for k, v in tensors.items() if k != qkv + "_scale_inv"},
                              rf"FP8 tensor {qkv} \(128, 32\) has no scale tensor {qkv}_scale_inv"),
                             ({**tensors, down + "_scale_inv": tensors[down + "_scale_inv"][:1]},
                              rf"scales {down}_scale_inv of FP8 tensor {down} \(32, 24\) are bfloat16 \(1, 2\)")):
            save_file(bad, str(path / "model.safetensors"), metadata={"format": "pt"})
            with pytest.raises(CheckpointError, match=message):
                load_target(path, "float32")
