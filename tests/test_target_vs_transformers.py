"""Our LLaMA / Qwen3 target models against Hugging Face transformers (torch, CPU, float32).

Tiny random checkpoints are built with transformers, written with ``save_pretrained`` and read back with
``dflash_jax.load_target``; logits and captured layer features must then match HF's to a relative error of
1e-4, for prefill, for cached single- and multi-token decode steps, and at positions where RoPE scaling
(llama3, yarn, linear) changes the frequencies. Config parsing (legacy ``rope_theta`` + ``rope_scaling`` vs
transformers-5 ``rope_parameters``) and the RoPE frequency tables are checked against transformers too.

Weights are made non-trivial on purpose: norm weights are ``1 + 0.1·randn`` (all-ones would hide a missing
or misplaced norm), biases are random (HF initialises them to zero), and ``initializer_range`` is large
enough that attention is peaked rather than uniform (a uniform softmax would hide RoPE and mask bugs).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from dflash_jax import load_target
from dflash_jax.config import ConfigError, RopeConfig, model_config_from_hf, parse_rope, rope_attention_factor
from dflash_jax.loading import Target
from dflash_jax.models.layers import Rope, rope_inv_freq

REL_TOL = 1e-4  # float32 vs float32: typical errors are ~1e-6
VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 128, 4, 2, 16

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


# --------------------------------------------------------------------------------------------------
# Tiny HF checkpoints
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    """One tiny HF model: its family, RoPE and the options that change the weight layout."""

    id: str
    family: str  # "llama" | "qwen3"
    rope: dict[str, Any] = dataclasses.field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e4},
                                             hash=False)
    num_layers: int = 3
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 512

    def hf_config(self) -> transformers.PretrainedConfig:
        kw: dict[str, Any] = dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=self.num_layers,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=1e-6, initializer_range=0.15,
            rope_parameters=dict(self.rope), tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias)
        if self.family == "qwen3":
            assert not self.mlp_bias, "Qwen3 has no mlp_bias option"
            return transformers.Qwen3Config(**kw)
        return transformers.LlamaConfig(mlp_bias=self.mlp_bias, **kw)


SPECS = {s.id: s for s in [
    Spec("qwen3-default", "qwen3", rope={"rope_type": "default", "rope_theta": 1e6}),
    Spec("qwen3-tied-bias", "qwen3", num_layers=2, tie_word_embeddings=True, attention_bias=True),
    Spec("qwen3-yarn", "qwen3", rope=YARN_ROPE, max_position_embeddings=256),
    Spec("llama-default", "llama", rope={"rope_type": "default", "rope_theta": 5e5}),
    Spec("llama-llama3", "llama", rope=LLAMA3_ROPE),
    Spec("llama-linear", "llama", num_layers=2, rope={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    Spec("llama-yarn", "llama", num_layers=2, rope=YARN_ROPE, max_position_embeddings=256),
    Spec("llama-tied", "llama", tie_word_embeddings=True),
    Spec("llama-bias", "llama", attention_bias=True, mlp_bias=True),
]}
SCALED_ROPE_SPECS = ["llama-llama3", "qwen3-yarn", "llama-yarn", "llama-linear"]


def build_hf_model(spec: Spec, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config(), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@dataclasses.dataclass
class Checkpoint:
    spec: Spec
    hf: transformers.PreTrainedModel
    path: Path
    target: Target  # loaded from `path` in float32


class CheckpointStore:
    """Builds, saves and loads each spec once per module (HF model + directory + our float32 target)."""

    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[str, Checkpoint] = {}

    def __call__(self, spec_id: str) -> Checkpoint:
        if spec_id not in self._cache:
            spec = SPECS[spec_id]
            hf = build_hf_model(spec)
            path = self.root / spec_id
            hf.save_pretrained(path, safe_serialization=True)
            self._cache[spec_id] = Checkpoint(spec, hf, path, load_target(path, dtype="float32"))
        return self._cache[spec_id]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("hf_tiny"))


# --------------------------------------------------------------------------------------------------
# Forward helpers
# --------------------------------------------------------------------------------------------------

def random_ids(batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length), dtype=np.int64)


def hf_forward(model, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Un-cached full-sequence HF forward: (logits [B, T, V], hidden_states (L + 1 entries of [B, T, D]))."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(ids)), output_hidden_states=True, use_cache=False)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


def our_prefill(target: Target, ids: np.ndarray, *, capture: tuple[int, ...] = (), capacity: int | None = None):
    """Prefill an empty cache with ``ids`` (positions 0..T-1): (logits, features or None, cache)."""
    b, t = ids.shape
    cache = target.model.new_cache(b, capacity or t + 8)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h, feats, cache = target.model(jnp.asarray(ids, jnp.int32), positions, cache, capture=capture, prefill=True)
    return np.asarray(target.model.logits(h)), None if feats is None else np.asarray(feats), cache


def our_step(target: Target, cache, tokens: np.ndarray, start: np.ndarray | list[int]):
    """A cached (non-prefill) call on ``tokens`` [B, T], row ``b`` at positions start[b] .. start[b]+T-1."""
    b, t = tokens.shape
    positions = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    h, _, cache = target.model(jnp.asarray(tokens, jnp.int32), positions, cache, prefill=False)
    return np.asarray(target.model.logits(h)), cache


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference shape {ref.shape}"
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str, tol: float = REL_TOL) -> None:
    err = rel_err(ours, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def split_features(feats: np.ndarray, capture: tuple[int, ...]) -> dict[int, np.ndarray]:
    assert feats.shape[-1] == len(capture) * HIDDEN
    return {layer: feats[..., i * HIDDEN:(i + 1) * HIDDEN] for i, layer in enumerate(capture)}


# --------------------------------------------------------------------------------------------------
# Whole-model comparisons
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec_id", list(SPECS))
def test_prefill_logits_and_features_match_transformers(checkpoints, spec_id):
    ck = checkpoints(spec_id)
    n = ck.spec.num_layers
    assert ck.target.config.family == ck.spec.family
    assert ck.target.config.rope == parse_rope({"rope_parameters": ck.spec.rope})
    assert (ck.target.model.lm_head is None) == ck.spec.tie_word_embeddings

    ids = random_ids(2, 11, seed=1)
    capture = tuple(sorted({0, 1, n - 1}))
    logits, feats, _ = our_prefill(ck.target, ids, capture=capture)
    ref_logits, ref_hidden = hf_forward(ck.hf, ids)

    assert_close(logits, ref_logits, "prefill logits")
    assert len(ref_hidden) == n + 1
    for layer, feat in split_features(feats, capture).items():
        # HF hidden_states[l + 1] is layer l's output; its last entry is after the final norm, as ours is.
        assert_close(feat, ref_hidden[layer + 1], f"captured feature of layer {layer}")


def test_capture_order_is_respected(checkpoints):
    ck = checkpoints("qwen3-default")
    ids = random_ids(1, 11, seed=2)
    capture = (2, 0)
    _, feats, _ = our_prefill(ck.target, ids, capture=capture)
    _, ref_hidden = hf_forward(ck.hf, ids)
    for layer, feat in split_features(feats, capture).items():
        assert_close(feat, ref_hidden[layer + 1], f"captured feature of layer {layer}")
    _, no_feats, _ = our_prefill(ck.target, ids)
    assert no_feats is None


@pytest.mark.parametrize("spec_id", list(SPECS))
def test_multi_step_cached_decode_matches_full_forward(checkpoints, spec_id):
    """Prefill 7 tokens, then 3 single-token cached steps == HF's full-sequence logits at positions 7, 8, 9."""
    ck = checkpoints(spec_id)
    ids = random_ids(2, 10, seed=3)
    prompt_len = 7
    ref_logits, _ = hf_forward(ck.hf, ids)

    logits, _, cache = our_prefill(ck.target, ids[:, :prompt_len], capacity=16)
    assert_close(logits, ref_logits[:, :prompt_len], "prefill logits")
    for p in range(prompt_len, ids.shape[1]):
        step_logits, cache = our_step(ck.target, cache, ids[:, p:p + 1], [p, p])
        assert_close(step_logits[:, 0], ref_logits[:, p], f"decode step at position {p}")


@pytest.mark.parametrize("spec_id", ["qwen3-default", "llama-llama3"])
def test_multi_token_cached_call_matches_full_forward(checkpoints, spec_id):
    """A verify-style call: prefill 7, then 4 tokens at once with prefill=False (causal within the chunk)."""
    ck = checkpoints(spec_id)
    ids = random_ids(2, 11, seed=4)
    ref_logits, _ = hf_forward(ck.hf, ids)
    _, _, cache = our_prefill(ck.target, ids[:, :7], capacity=16)
    chunk_logits, _ = our_step(ck.target, cache, ids[:, 7:], [7, 7])
    assert_close(chunk_logits, ref_logits[:, 7:], "4-token cached chunk")


def test_decode_rows_at_different_positions_over_stale_entries(checkpoints):
    """Row 1 commits only 6 of its 9 prefilled tokens (the rest are stale, like rejected drafts) and then
    decodes from position 6 while row 0 decodes from 9: each must match HF on its own committed sequence."""
    ck = checkpoints("llama-llama3")
    prefill_ids = random_ids(2, 9, seed=5)
    new = random_ids(2, 2, seed=6)
    committed = [9, 6]
    _, _, cache = our_prefill(ck.target, prefill_ids, capacity=16)
    for step in range(new.shape[1]):
        logits, cache = our_step(ck.target, cache, new[:, step:step + 1], [c + step for c in committed])
        for row, c in enumerate(committed):
            seq = np.concatenate([prefill_ids[row, :c], new[row, :step + 1]])[None]
            ref_logits, _ = hf_forward(ck.hf, seq)
            assert_close(logits[row, 0], ref_logits[0, -1], f"row {row}, decode step {step}")


@pytest.mark.parametrize("spec_id", SCALED_ROPE_SPECS + ["qwen3-default"])
def test_long_prompt_then_decode_matches_transformers(checkpoints, spec_id):
    """A 200-token prompt (well past llama3's / yarn's original_max_position_embeddings of 32 / 64), then two
    cached decode steps at positions 200 and 201, against HF's full forward over all 202 tokens."""
    ck = checkpoints(spec_id)
    prompt_len, total = 200, 202
    ids = random_ids(1, total, seed=7)
    ref_logits, _ = hf_forward(ck.hf, ids)

    logits, _, cache = our_prefill(ck.target, ids[:, :prompt_len], capacity=256)
    assert_close(logits, ref_logits[:, :prompt_len], "200-token prefill logits")
    for p in range(prompt_len, total):
        step_logits, cache = our_step(ck.target, cache, ids[:, p:p + 1], [p])
        assert_close(step_logits[:, 0], ref_logits[:, p], f"decode step at position {p}")


def test_rope_scaling_changes_the_model(checkpoints, tmp_path):
    """Guard for the scaled-RoPE tests above: the same weights with default RoPE give clearly different logits
    (so a loader that ignored the scaling would fail them)."""
    ck = checkpoints("llama-llama3")
    unscaled = tmp_path / "unscaled"
    shutil.copytree(ck.path, unscaled)
    cfg = json.loads((unscaled / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (unscaled / "config.json").write_text(json.dumps(cfg))
    ids = random_ids(1, 40, seed=8)
    scaled_logits, _, _ = our_prefill(ck.target, ids)
    unscaled_logits, _, _ = our_prefill(load_target(unscaled, dtype="float32"), ids)
    assert rel_err(unscaled_logits, scaled_logits) > 100 * REL_TOL


def test_tied_checkpoint_has_no_lm_head_tensor(checkpoints):
    from safetensors import safe_open

    for spec_id, tied in [("llama-tied", True), ("llama-default", False)]:
        ck = checkpoints(spec_id)
        with safe_open(str(ck.path / "model.safetensors"), framework="numpy") as f:
            assert ("lm_head.weight" in f.keys()) is not tied
        assert ck.target.config.tie_word_embeddings is tied


def test_sharded_checkpoint_loads_identically(checkpoints, tmp_path):
    ck = checkpoints("llama-default")
    sharded = tmp_path / "sharded"
    ck.hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2

    ids = random_ids(2, 11, seed=9)
    sharded_logits, sharded_feats, _ = our_prefill(load_target(sharded, dtype="float32"), ids, capture=(0, 2))
    single_logits, single_feats, _ = our_prefill(ck.target, ids, capture=(0, 2))
    np.testing.assert_array_equal(sharded_logits, single_logits)
    np.testing.assert_array_equal(sharded_feats, single_feats)
    assert_close(sharded_logits, hf_forward(ck.hf, ids)[0], "sharded checkpoint logits")


def test_legacy_rope_scaling_config_json_loads_identically(checkpoints, tmp_path):
    """The same llama3 checkpoint with config.json in the legacy ``rope_theta`` + ``rope_scaling`` form."""
    ck = checkpoints("llama-llama3")
    legacy = tmp_path / "legacy"
    shutil.copytree(ck.path, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (legacy / "config.json").write_text(json.dumps(cfg))

    target = load_target(legacy, dtype="float32")
    assert target.config == ck.target.config
    ids = random_ids(1, 40, seed=10)
    legacy_logits, _, _ = our_prefill(target, ids)
    np.testing.assert_array_equal(legacy_logits, our_prefill(ck.target, ids)[0])
    # transformers reads the legacy form the same way
    hf_legacy = transformers.AutoModelForCausalLM.from_pretrained(legacy, attn_implementation="eager").float().eval()
    assert_close(legacy_logits, hf_forward(hf_legacy, ids)[0], "legacy-config logits vs HF on the legacy config")


def test_bfloat16_logits_close_to_float32(checkpoints):
    ck = checkpoints("qwen3-default")
    ids = random_ids(2, 32, seed=11)
    bf16 = load_target(ck.path, dtype="bfloat16")
    assert bf16.model.dtype == jnp.bfloat16
    logits_bf16, feats_bf16, _ = our_prefill(bf16, ids, capture=(1,))
    assert logits_bf16.dtype == np.float32  # logits are always accumulated in float32
    assert feats_bf16.dtype == jnp.bfloat16
    logits_f32, _, _ = our_prefill(ck.target, ids)

    assert rel_err(logits_bf16, logits_f32) < 3e-2
    top_bf16, top_f32 = logits_bf16.argmax(-1), logits_f32.argmax(-1)
    assert np.mean(top_bf16 == top_f32) >= 0.8
    # Where they disagree, bf16's choice must be a near-tie in float32 (observed: <= 0.07 std).
    chosen = np.take_along_axis(logits_f32, top_bf16[..., None], -1)[..., 0]
    assert np.all(logits_f32.max(-1) - chosen <= 0.2 * logits_f32.std())


# --------------------------------------------------------------------------------------------------
# Config parsing and RoPE tables
# --------------------------------------------------------------------------------------------------

ROPE_FORMS = {
    "default": (
        {"rope_theta": 500000.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        RopeConfig(theta=500000.0),
    ),
    "linear-old-type-key": (
        {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        RopeConfig(theta=10000.0, kind="linear", factor=2.0),
    ),
    "llama3": (
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    ),
    "yarn": (
        {"rope_theta": 1000000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32768, "beta_fast": 16,
                                                   "truncate": False}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32768, "beta_fast": 16.0, "truncate": False}},
        RopeConfig(theta=1000000.0, kind="yarn", factor=4.0, original_max_position_embeddings=32768,
                   beta_fast=16.0, truncate=False),
    ),
}


@pytest.mark.parametrize("name", list(ROPE_FORMS))
def test_parse_rope_legacy_and_transformers5_forms_agree(name):
    legacy, v5, expected = ROPE_FORMS[name]
    assert parse_rope(legacy) == expected
    assert parse_rope(v5) == expected
    # the per-layer-type nested form of transformers 5
    assert parse_rope({"rope_parameters": {"full_attention": v5["rope_parameters"]}}) == expected
    # what transformers itself writes to config.json for the legacy form
    hf_dict = transformers.LlamaConfig(max_position_embeddings=131072, **legacy).to_dict()
    assert parse_rope(hf_dict) == expected
    # and through the full config parser
    full = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    assert model_config_from_hf({**full, **legacy}).rope == model_config_from_hf({**full, **v5}).rope == expected


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_parse_rope_rejects_unsupported_kinds(kind):
    with pytest.raises(ConfigError, match=kind):
        parse_rope({"rope_scaling": {"rope_type": kind, "factor": 2.0}})


ROPE_TABLE_CASES = {
    "default-small": ({"rope_type": "default", "rope_theta": 10000.0}, 16, 512),
    "default-qwen3": ({"rope_type": "default", "rope_theta": 1000000.0}, 128, 40960),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 64, 4096),
    "llama3-tiny": (LLAMA3_ROPE, 16, 512),
    "llama3.1-8b": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 128, 131072),
    "llama3-other-factors": ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0, "low_freq_factor": 2.0,
                              "high_freq_factor": 8.0, "original_max_position_embeddings": 256}, 64, 4096),
    "yarn-tiny": (YARN_ROPE, 16, 256),
    "yarn-qwen3": ({"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                    "original_max_position_embeddings": 32768}, 128, 131072),
    "yarn-betas-no-truncate": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16.0,
                                "beta_slow": 2.0, "truncate": False, "original_max_position_embeddings": 128},
                               64, 1024),
    "yarn-mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, 64, 163840),
    "yarn-attention-factor": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 1.5,
                               "original_max_position_embeddings": 64}, 32, 256),
}


def hf_rope_config(rope: dict, head_dim: int, max_pos: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=4,
                                    head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=dict(rope))


@pytest.mark.parametrize("case", list(ROPE_TABLE_CASES))
def test_rope_inv_freq_and_attention_factor_match_transformers(case):
    rope, head_dim, max_pos = ROPE_TABLE_CASES[case]
    config = hf_rope_config(rope, head_dim, max_pos)
    init_fn = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    ref_inv_freq, ref_factor = init_fn(config)

    ours = parse_rope(config.to_dict())  # the config.json transformers would write
    assert ours.kind == rope["rope_type"]
    inv_freq = rope_inv_freq(ours, head_dim, max_pos)
    assert inv_freq.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv_freq, ref_inv_freq.numpy(), rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(ref_factor, rel=1e-6)


@pytest.mark.parametrize("case", ["default-small", "linear", "llama3-tiny", "yarn-tiny", "yarn-mscale"])
def test_rope_cos_sin_match_transformers_rotary_embedding(case):
    rope, head_dim, max_pos = ROPE_TABLE_CASES[case]
    config = hf_rope_config(rope, head_dim, max_pos)
    positions = np.arange(300, dtype=np.int64)[None]
    with torch.no_grad():
        ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32),
                                                        torch.from_numpy(positions))
    cos, sin = Rope(model_config_from_hf(config.to_dict()))(jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(cos), ref_cos.numpy(), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(sin), ref_sin.numpy(), atol=2e-5, rtol=0)


def test_llama3_rope_without_original_max_position_embeddings_falls_back_like_transformers():
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}
    head_dim, max_pos = 16, 512
    ref_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_rope_config(rope, head_dim, max_pos))
    # a hand-written / legacy config.json that omits the key (transformers fills it in from max_position_embeddings)
    cfg = model_config_from_hf({"model_type": "llama", "vocab_size": 32, "hidden_size": 4 * head_dim,
                                "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                                "max_position_embeddings": max_pos, "rope_parameters": rope})
    np.testing.assert_allclose(rope_inv_freq(cfg.rope, head_dim, max_pos), ref_inv_freq.numpy(), rtol=1e-6)
