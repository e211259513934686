"""Continuous batching (dflash_jax.engine.pool): more prompts than rows, finished rows refilled with the next
prompts. Every prompt must get exactly the tokens of one-batch decoding, in every verify mode."""

from __future__ import annotations

import collections

import pytest

from conftest import content_oracle_drafter, random_prompts, tiny_target
from dflash_jax import generate, random_drafter, speculative_generate
from dflash_jax.costs import CostTable
from dflash_jax.engine import pool
from dflash_jax.engine.programs import compile_count
from dflash_jax.settings import DecodeSettings

# Two prompt buckets (16, 32): refills compile one program per bucket.
PROMPTS = random_prompts(9, [5, 9, 14, 7, 30], 64, seed=7)
MAX_NEW = 24
TABLE = CostTable("cpu", "test", "float32", "tiny", 8, 32, {3: {1: 1.0, 2: 1.25, 4: 1.8, 8: 3.2}})


def run_pool(target, drafter, ids, *, max_new_tokens, refill_size=None, **options):
    """:func:`pool.run` of token-id prompts ``ids`` with the settings of ``options``."""
    settings = DecodeSettings.build(target, drafter, len(ids), max_new_tokens, **options)
    return pool.run(target, drafter, ids, settings, refill_size=refill_size)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)


@pytest.fixture(scope="module")
def stop(target):
    """A token most rows emit somewhere after their first few tokens: rows then stop at different lengths."""
    free = generate(target, PROMPTS, MAX_NEW, stop_token_ids=[])
    rows_with = collections.Counter(t for row in free.token_ids for t in set(row[2:]))
    return rows_with.most_common(1)[0][0]


@pytest.fixture(scope="module")
def reference(target, stop):
    out = generate(target, PROMPTS, MAX_NEW, stop_token_ids=[stop])
    assert len({len(t) for t in out.token_ids}) >= 3  # ragged: rows finish at different times
    return out


@pytest.fixture(scope="module")
def oracle(target, reference):
    return content_oracle_drafter(target, PROMPTS, reference.token_ids, block_size=8, corrupt=0.2, seed=1)


@pytest.mark.parametrize("batch_size,refill_size", [(3, None), (4, 2)])
def test_autoregressive_pool_is_token_identical(target, stop, reference, batch_size, refill_size):
    out = run_pool(target, None, PROMPTS, batch_size=batch_size, refill_size=refill_size, max_new_tokens=MAX_NEW,
                   stop_token_ids=[stop])
    assert out.token_ids == reference.token_ids
    assert out.finish_reasons == reference.finish_reasons
    s = out.stats
    assert s["batch_size"] == batch_size and s["refill_size"] == (refill_size or 1)
    assert s["refills"] >= -(-(len(PROMPTS) - batch_size) // s["refill_size"]) and s["segments"] >= 2
    assert len(s["request_latency_s"]) == len(PROMPTS) and min(s["request_latency_s"]) > 0
    # The pool ran fewer steps than one row at a time, more than the longest answer.
    assert max(map(len, out.token_ids)) - 1 <= s["cycles"] < sum(map(len, out.token_ids))


def test_edge_cases_of_the_pool(target):
    """One row; every row done at its prefill (max_new 1); rows whose first token is a stop token."""
    prompts = PROMPTS[:6]
    free = generate(target, prompts, 12, stop_token_ids=[])
    firsts = sorted({row[0] for row in free.token_ids})[:2]
    for kw in (dict(max_new_tokens=12, stop_token_ids=[], batch_size=1),
               dict(max_new_tokens=1, stop_token_ids=[], batch_size=3),
               dict(max_new_tokens=12, stop_token_ids=firsts, batch_size=2)):
        one_batch = generate(target, prompts, **{k: v for k, v in kw.items() if k != "batch_size"})
        pool = generate(target, prompts, **kw)
        assert pool.token_ids == one_batch.token_ids and pool.finish_reasons == one_batch.finish_reasons, kw
        assert pool.stats["refills"] >= 1
    assert any(len(t) == 1 and t[0] in firsts for t in pool.token_ids)  # stopped at the first token


@pytest.fixture(scope="module")
def runs(target, oracle, stop):
    return {mode: speculative_generate(target, oracle, PROMPTS, MAX_NEW, stop_token_ids=[stop], verify_mode=mode,
                                       cost_table=TABLE, batch_size=3) for mode in ("static", "compact", "cap-accept")}


def test_every_verify_mode_in_a_pool_is_lossless(runs, reference):
    for mode, out in runs.items():
        assert out.token_ids == reference.token_ids, mode
        assert out.stats["verify_mode"] == mode and out.stats["refills"] >= 2
        assert out.tau > 1.5, mode  # the oracle drafts well although prompts move between rows
    compact, cap = runs["compact"], runs["cap-accept"]
    assert compact.acceptance_lengths == cap.acceptance_lengths  # the pool's schedule is the same
    # The tier histogram counts the pool's steps (kept across refills).
    assert sum(compact.stats["tier_steps"].values()) == compact.stats["cycles"]
    assert compact.stats["verify_tokens"] < runs["static"].stats["verify_tokens"]


def test_a_dspark_pool_is_lossless_and_reports_calibration(target, stop, reference):
    """A DSpark drafter (windows from its confidences, known after drafting) in a compact pool: the target's
    tokens; the predicted survival is summed per prompt across refills."""
    dspark = random_drafter(target, kind="dspark", block_size=7, num_layers=1, markov_rank=16, seed=3)
    out = speculative_generate(target, dspark, PROMPTS, MAX_NEW, stop_token_ids=[stop], verify_mode="compact",
                               cost_table=TABLE, batch_size=4)
    assert out.token_ids == reference.token_ids and out.stats["refills"] >= 2
    assert len(out.stats["predicted_survival"]) == 7 and 1 <= out.stats["predicted_tau"] <= 8
    # Compact drafts each step at the end of the one before, a refill drafts its pool again: cap-accept (which
    # drafts at each step's start) schedules and commits the same.
    cap = speculative_generate(target, dspark, PROMPTS, MAX_NEW, stop_token_ids=[stop], verify_mode="cap-accept",
                               cost_table=TABLE, batch_size=4)
    assert cap.acceptance_lengths == out.acceptance_lengths
    assert cap.stats["predicted_survival"] == out.stats["predicted_survival"]


def test_refills_reuse_their_programs(target, oracle, stop, runs):
    before = compile_count()
    again = speculative_generate(target, oracle, PROMPTS[::-1], MAX_NEW, stop_token_ids=[stop],
                                 verify_mode="compact", cost_table=TABLE, batch_size=3)
    assert compile_count() == before
    assert again.token_ids == runs["compact"].token_ids[::-1]


def test_every_refill_program_is_compiled_before_decoding(target, stop, reference, monkeypatch):
    """A compile between two segments would leave the device idle: the refill programs of every prompt bucket
    in the queue (16 and 32 here) are compiled before the first segment."""
    seen = []
    plain = pool.Pool.decode
    monkeypatch.setattr(pool.Pool, "decode", lambda self: seen.append(compile_count()) or
                        plain(self))
    before = compile_count()
    out = run_pool(target, None, PROMPTS, batch_size=2, refill_size=1, max_new_tokens=MAX_NEW,
                   stop_token_ids=[stop])  # a pool shape of its own: its programs compile here
    assert out.token_ids == reference.token_ids
    assert seen[0] - before >= 4 and set(seen) == {compile_count()}


def test_a_pool_as_large_as_the_prompts_is_one_batch(target, stop, reference):
    out = generate(target, PROMPTS, MAX_NEW, stop_token_ids=[stop], batch_size=len(PROMPTS) + 3)
    assert out.token_ids == reference.token_ids and "refills" not in out.stats


@pytest.mark.parametrize("kw,match", [(dict(batch_size=0), "batch_size"), (dict(batch_size=2.5), "batch_size"),
                                      (dict(batch_size=3, refill_size=4), "refill_size")])
def test_bad_pool_sizes(target, kw, match):
    with pytest.raises(ValueError, match=match):
        run_pool(target, None, PROMPTS, max_new_tokens=4, **kw)
