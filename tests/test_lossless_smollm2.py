"""Lossless on the real SmolLM2-135M-Instruct weights: a random drafter (block sizes 4 and 16; every block size
from 2 to 16 is covered on tiny models in test_lossless.py) and the shipped trained drafter."""

from __future__ import annotations

import pytest

from dflash_jax import generate, random_drafter, speculative_generate
from dflash_jax.loading import SMOLLM2_MASK_TOKEN_ID

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a haiku about the sea.",
    "What is 17 times 3? Explain briefly.",
    "Name a primary colour.",
    "Give me two tips for writing clean Python code, with a short example of each one.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def drafter(smollm2):
    return random_drafter(smollm2, block_size=16, num_layers=1, mask_token_id=SMOLLM2_MASK_TOKEN_ID, seed=3)


@pytest.fixture(scope="module")
def reference(smollm2):
    return {stops: generate(smollm2, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=None if stops else [])
            for stops in (True, False)}


@pytest.mark.parametrize("block_size", [16])
def test_batch4_with_stop_tokens(smollm2, drafter, reference, block_size):
    out = speculative_generate(smollm2, drafter, PROMPTS, max_new_tokens=MAX_NEW, block_size=block_size)
    ref = reference[True]
    assert len({len(p) for p in out.prompt_token_ids}) == 4  # different prompt lengths in one batch
    assert out.token_ids == ref.token_ids
    assert out.texts == ref.texts
    assert "stop" in ref.finish_reasons  # the short answer ends with <|im_end|> inside the budget


@pytest.mark.parametrize("block_size", [4])
def test_batch1_without_stop_tokens(smollm2, drafter, reference, block_size):
    out = speculative_generate(smollm2, drafter, PROMPTS[3:], max_new_tokens=MAX_NEW, block_size=block_size,
                               stop_token_ids=[])
    assert out.token_ids == reference[False].token_ids[3:]
    assert len(out.token_ids[0]) == MAX_NEW


def test_shipped_drafter_is_lossless_with_real_acceptance(smollm2, smollm2_drafter):
    """The embedded trained drafter accepts several tokens per cycle and changes nothing."""
    drafter = smollm2_drafter
    assert drafter.trained and drafter.config.block_size == 16
    prompts = ["Write a Python function that checks whether a number is prime.", PROMPTS[3]]
    out = speculative_generate(smollm2, drafter, prompts, max_new_tokens=48)
    ref = generate(smollm2, prompts, max_new_tokens=48)
    assert out.token_ids == ref.token_ids
    assert out.tau > 1.3 and max(a for row in out.acceptance_lengths for a in row) >= 4
    assert_training_objective_sees_the_same_blocks(smollm2, drafter, out)


def assert_training_objective_sees_the_same_blocks(target, drafter, out):
    """At the anchors the decoding loop actually visited, the training objective's batched blocks predict
    exactly the accepted lengths the loop recorded: training and inference are aligned at real scale
    (SPEC §6's pitfalls would show here as a mismatch, not just as a low τ)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax.train.objective import anchor_acceptance

    block = drafter.config.block_size
    rows = []  # per prompt: its sequence, the anchors of the cycles checked, their recorded acceptance lengths
    for prompt, new, acc in zip(out.prompt_token_ids, out.token_ids, out.acceptance_lengths):
        seq = prompt + new
        # cycle c starts after the prefill token and the tokens of cycles < c; its anchor is the last one
        anchors = [len(prompt) + sum(acc[:c]) for c in range(len(acc))]
        cycles = [c for c in range(len(acc)) if anchors[c] + block <= len(seq)]  # whole block labelled
        assert len(cycles) >= 5
        rows.append((seq, [anchors[c] for c in cycles], [acc[c] for c in cycles]))
    # Both rows in one batch (right-padded, as training batches are): one compiled program.
    tokens = np.zeros((len(rows), max(len(r[0]) for r in rows)), np.int32)
    anchors = np.zeros((len(rows), max(len(r[1]) for r in rows)), np.int32)
    valid = np.zeros(anchors.shape, bool)
    for i, (seq, anc, _) in enumerate(rows):
        tokens[i, :len(seq)], anchors[i, :len(anc)], valid[i, :len(anc)] = seq, anc, True
    batch = {"tokens": jnp.asarray(tokens), "lengths": jnp.asarray([len(r[0]) for r in rows], jnp.int32),
             "anchors": jnp.asarray(anchors), "valid": jnp.asarray(valid)}
    accepted = np.asarray(nnx.jit(anchor_acceptance, static_argnums=(3,))(drafter.model, target.model, batch, block))
    for i, (_, anc, want) in enumerate(rows):
        assert accepted[i, :len(anc)].tolist() == want
