"""Lossless: speculative_generate == generate token for token (float32), across block sizes, batches,
prompt lengths, stop tokens and budgets; and no recompilation within a bucket.

Compiling is nearly all of this file's time, so the tests share program shapes: batches of 4 prompts in the
32-token bucket (or 1 prompt in the 16-token one) with 64 new-token slots, 4-layer tiny targets, and one random
drafter shape (block size 16, one layer) run at the block size each test needs. The weights (seeds) differ
from test to test: they are arguments of the programs, not part of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import oracle_drafter, random_prompts, tiny_target
from dflash_jax import compile_count, generate, random_drafter, speculative_generate


def assert_same(spec, ref):
    assert spec.token_ids == ref.token_ids
    assert spec.finish_reasons == ref.finish_reasons
    for acc, toks in zip(spec.acceptance_lengths, spec.token_ids):
        assert all(1 <= a for a in acc)
        # Every cycle commits its acceptance length except where a stop token or the budget cuts it.
        assert sum(acc) >= len(toks) - 1


PROMPT_LENS = [5, 17, 9, 30]  # one row: the 16-token bucket; four rows: the 32-token bucket
# Every block size from 2 to 16 on Qwen3, each batch size at small and large blocks, and LLaMA at both batch
# sizes (each (family, block size, batch) is its own pair of programs; the oracle test below adds batch 4 at
# block sizes 2 and 8).
CASES = [("qwen3", 2, 1), ("qwen3", 4, 4), ("qwen3", 8, 1), ("qwen3", 16, 4), ("llama", 4, 4), ("llama", 16, 1)]


def shared_drafter(target, seed: int = 2):
    """The random drafter shape every test here shares (its programs depend on its shape, not its weights)."""
    return random_drafter(target, block_size=16, num_layers=1, seed=seed)


@pytest.mark.parametrize("family,block_size,batch", CASES)
def test_random_drafter_lossless(family, block_size, batch):
    target = tiny_target(family, seed=1)
    drafter = shared_drafter(target)
    prompts = random_prompts(batch, PROMPT_LENS, target.config.vocab_size, seed=block_size)
    ref = generate(target, prompts, max_new_tokens=40, stop_token_ids=[])
    out = speculative_generate(target, drafter, prompts, max_new_tokens=40, block_size=block_size,
                               stop_token_ids=[])
    assert_same(out, ref)
    assert all(len(t) == 40 for t in out.token_ids)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("corrupt", [0.0, 0.1, 0.4])
def test_oracle_drafter_lossless_every_acceptance_length(block_size, corrupt):
    """Drafts that are right most of the time: acceptance lengths spread over 1..L, output unchanged."""
    target = tiny_target("qwen3", seed=3)
    prompts = random_prompts(4, [3, 12, 7, 21], target.config.vocab_size, seed=4)
    ref = generate(target, prompts, max_new_tokens=60, stop_token_ids=[])
    drafter = oracle_drafter(target, prompts, ref.token_ids, block_size=block_size, corrupt=corrupt)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=60, stop_token_ids=[])
    assert_same(out, ref)
    lengths = {a for row in out.acceptance_lengths for a in row}
    if corrupt == 0.0:
        assert max(lengths) == block_size and out.tau > block_size * 0.7
    else:
        assert len(lengths) >= min(block_size, 3)


@pytest.mark.parametrize("block_size", [4, 16])
def test_stop_tokens_and_budgets(block_size):
    """Stop tokens anywhere inside an accepted block end that row there (stop token included)."""
    target = tiny_target("llama", seed=5)
    prompts = random_prompts(4, [4, 11, 6, 19], target.config.vocab_size, seed=6)
    free = generate(target, prompts, max_new_tokens=50, stop_token_ids=[])
    # Stop on tokens that really occur mid-way through some rows' continuations.
    stops = sorted({free.token_ids[0][7], free.token_ids[2][20]})
    ref = generate(target, prompts, max_new_tokens=50, stop_token_ids=stops)
    assert any(r == "stop" for r in ref.finish_reasons)
    for row, free_row in zip(ref.token_ids, free.token_ids):
        cut = next((i + 1 for i, t in enumerate(free_row) if t in stops), len(free_row))
        assert row == free_row[:cut]
    drafter = oracle_drafter(target, prompts, free.token_ids, block_size=block_size, corrupt=0.2)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=50, stop_token_ids=stops)
    assert_same(out, ref)
    if block_size == 16:  # a budget shorter than one block (its own programs: 16 new-token slots)
        short = speculative_generate(target, drafter, prompts, max_new_tokens=3, stop_token_ids=stops)
        assert short.token_ids == generate(target, prompts, max_new_tokens=3, stop_token_ids=stops).token_ids
        assert all(len(t) <= 3 for t in short.token_ids)


def test_first_token_is_a_stop_token():
    target = tiny_target("qwen3", seed=7)
    prompts = random_prompts(4, [6, 9, 20, 14], target.config.vocab_size, seed=8)
    free = generate(target, prompts, max_new_tokens=40, stop_token_ids=[]).token_ids
    first = free[0][0]
    drafter = shared_drafter(target, seed=0)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=40, block_size=4, stop_token_ids=[first])
    assert out.token_ids[0] == [first] and out.finish_reasons[0] == "stop"
    assert out.acceptance_lengths[0] == []
    assert any(len(row) > 1 for row in out.token_ids[1:])  # the other rows go on decoding
    assert out.token_ids == generate(target, prompts, max_new_tokens=40, stop_token_ids=[first]).token_ids


def test_no_recompilation_within_a_bucket():
    target = tiny_target("qwen3", seed=9)
    drafter = shared_drafter(target, seed=0)
    kw = dict(max_new_tokens=50, block_size=4)
    speculative_generate(target, drafter, random_prompts(4, PROMPT_LENS, 64, seed=1), stop_token_ids=[1], **kw)
    generate(target, random_prompts(4, PROMPT_LENS, 64, seed=1), max_new_tokens=50, stop_token_ids=[1])
    before = compile_count()
    # Different prompts, prompt lengths in the same bucket, different stop ids and a smaller budget.
    speculative_generate(target, drafter, random_prompts(4, [7, 30, 3, 12], 64, seed=2), stop_token_ids=[4, 5],
                         **{**kw, "max_new_tokens": 40})
    generate(target, random_prompts(4, [7, 30, 3, 12], 64, seed=2), max_new_tokens=40, stop_token_ids=[])
    assert compile_count() == before
    # A new block size is a new program (3: a size no other test of this shape runs).
    speculative_generate(target, drafter, random_prompts(4, [7, 30, 3, 12], 64, seed=2), max_new_tokens=40,
                         block_size=3)
    assert compile_count() == before + 2


def test_prompt_buckets():
    """Powers of two (at least 16) up to 1024, multiples of 1024 above: the default prefill chunk (1024) divides
    every bucket longer than it, so long prompts are prefilled in whole chunks."""
    from dflash_jax.engine.job import bucket
    from dflash_jax.tuning import Tuning

    PREFILL_CHUNK = Tuning().prefill_chunk

    assert [bucket(n) for n in (1, 16, 17, 100, 1000, 1024)] == [16, 16, 32, 128, 1024, 1024]
    assert [bucket(n) for n in (1025, 1500, 2048, 2100, 5000)] == [2048, 2048, 2048, 3072, 5120]
    assert all(bucket(n) % PREFILL_CHUNK == 0 for n in range(PREFILL_CHUNK + 1, 10_000, 37))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_long_prompts_prefilled_in_chunks_give_the_same_tokens(family):
    """Prompts longer than the prefill chunk are prefilled chunk by chunk through the cache; tokens, acceptance
    lengths (so the drafter's context from the chunked features too) match the one-shot prefill.

    A chunk of 8 makes the 32-token prompt bucket 4 chunks (rows end in chunks 2, 3 and 4); the one-shot
    runs share their programs with the tests above."""
    from dflash_jax.engine import job as jobs
    from dflash_jax.tuning import Tuning

    target = tiny_target(family, seed=7)
    drafter = shared_drafter(target, seed=8)
    prompts = random_prompts(4, [30, 19, 25, 9], 64, seed=9)  # bucket 32
    kw = dict(max_new_tokens=40, stop_token_ids=[])
    one_shot_ar = generate(target, prompts, **kw)
    one_shot = speculative_generate(target, drafter, prompts, block_size=4, **kw)
    oracle = oracle_drafter(target, prompts, one_shot_ar.token_ids, block_size=4, corrupt=0.3)
    one_shot_oracle = speculative_generate(target, oracle, prompts, **kw)
    kw_chunked = dict(kw, tuning=Tuning(prefill_chunk=8))
    chunked = speculative_generate(target, drafter, prompts, block_size=4, **kw_chunked)
    assert chunked.token_ids == one_shot_ar.token_ids == one_shot.token_ids
    assert chunked.acceptance_lengths == one_shot.acceptance_lengths
    assert generate(target, prompts, **kw_chunked).token_ids == one_shot_ar.token_ids
    chunked_oracle = speculative_generate(target, oracle, prompts, **kw_chunked)
    assert chunked_oracle.token_ids == one_shot_ar.token_ids
    assert chunked_oracle.acceptance_lengths == one_shot_oracle.acceptance_lengths
    # The prefilled state itself: target K/V and the drafter's context K/V (built from the chunks' features).
    states = []
    for chunk in (8, 1024):
        job = jobs.make(target, drafter, prompts, 40, block_size=4, tuning=Tuning(prefill_chunk=chunk))
        assert job.spec.prefill_chunk == chunk  # really chunked (or not)
        states.append(job.programs.prefill(*job.pre_args)[0])
    for name in ("target_cache", "draft_cache"):
        a, b = getattr(states[0], name), getattr(states[1], name)
        for x, y in zip(a.k + a.v, b.k + b.v):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)
