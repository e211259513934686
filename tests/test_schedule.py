"""The confidence scheduler and the verify modes (static / compact / cap-accept): the admission rule against a
brute-force search, ragged packing, identical commits of compact and cap-accept, losslessness in every mode,
one program whatever tier a step picks, cost tables."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import types
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ZLAB, fast_jit, oracle_drafter, random_prompts, tiny_target
from test_sampling import V, chi2_pvalue, draw, exact_distribution, logits, pair  # noqa: F401 (fixtures)
from dflash_jax import cli, costs, generate, random_drafter, speculative_generate
from dflash_jax.kernels import common
from dflash_jax.kernels.attention import cache_attention
from dflash_jax.kernels.packed import PackedLayout, packed_verify_attention
from dflash_jax.costs import CostTable
from dflash_jax.decode import schedule, verify_modes
from dflash_jax.decode.state import LoopSpec
from dflash_jax.engine import calibrate, job
from dflash_jax.engine import programs as engine_programs
from dflash_jax.loading import with_config
from dflash_jax.models.target import KVCache, PendingKV
from dflash_jax.tuning import TRAINED_WIDTHS_SPAN, Kernels, KernelTuning, Tuning

MODES = ("static", "compact", "cap-accept")


# --------------------------------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------------------------------

def brute_force_best(surv: np.ndarray, active: np.ndarray, tiers: tuple[int, ...], step_cost: np.ndarray,
                     caps: tuple[int, ...] | None = None, weights: np.ndarray | None = None) -> float:
    """The best expected tokens per unit of cost over every window assignment (exponential in the batch);
    ``caps``: the longest window each tier holds; ``weights``: what a token of each row is worth."""
    rows = [r for r in range(surv.shape[0]) if active[r]]
    w8 = np.ones(surv.shape[0]) if weights is None else weights
    best = -np.inf
    for windows in itertools.product(range(surv.shape[1] + 1), repeat=len(rows)):
        gain = sum(float(w8[r]) * (1 + float(surv[r, :w].sum())) for r, w in zip(rows, windows))
        tier = min(int(np.searchsorted(tiers, len(rows) + sum(windows))), len(tiers) - 1)
        if caps is None or max(windows, default=0) <= caps[tier]:
            best = max(best, gain / float(step_cost[tier]))
    return best


def rate_of(windows: np.ndarray, surv: np.ndarray, active: np.ndarray, tiers, step_cost,
            weights: np.ndarray | None = None) -> float:
    w8 = np.ones(surv.shape[0]) if weights is None else weights
    gain = sum(float(w8[r]) * (1 + float(surv[r, :w].sum())) for r, w in enumerate(windows) if active[r])
    tokens = active.sum() + windows.sum()
    return gain / float(step_cost[min(int(np.searchsorted(tiers, tokens)), len(tiers) - 1)])


@pytest.mark.parametrize("b,g", [(1, 3), (2, 3), (3, 2), (3, 3)])
def test_admission_is_the_best_window_assignment(b, g):
    tiers = schedule.tiers_for(b, g + 1)
    admit = fast_jit(schedule.admit, tiers=tiers)
    rng = np.random.default_rng(b * 10 + g)
    for case in range(25):
        conf = rng.uniform(0.05, 1.0, (b, g)) ** rng.uniform(0.2, 3)
        if case % 5 == 0:
            conf[:, 1:] = conf[:, :1]  # ties along a row
        surv = np.cumprod(conf, axis=1).astype(np.float32)
        active = rng.random(b) < 0.8
        active[rng.integers(b)] = True
        # Costs rising with the tier: from flat (verify is free) to proportional (verify is everything).
        step_cost = np.cumsum(rng.uniform(0.0, 1.0, len(tiers)) * rng.uniform(0, 2)) + 1.0
        windows, tier = admit(jnp.asarray(surv), jnp.asarray(active), jnp.asarray(step_cost, jnp.float32))
        windows = np.asarray(windows)
        assert (windows[~active] == 0).all() and (0 <= windows).all() and (windows <= g).all()
        assert int(tier) == min(int(np.searchsorted(tiers, active.sum() + windows.sum())), len(tiers) - 1)
        want = brute_force_best(surv, active, tiers, step_cost)
        assert rate_of(windows, surv, active, tiers, step_cost) == pytest.approx(want, rel=1e-5), (case, windows)


@pytest.mark.parametrize("b,g,span", [(2, 3, 1), (3, 3, 2), (3, 4, 1)])
def test_capped_admission_is_the_best_window_assignment(b, g, span):
    """Tiers whose trunk drafts fewer positions than the block (schedule.trunk_widths) hold windows up to their
    width less one: the admission is the best assignment under those caps."""
    tiers = schedule.tiers_for(b, g + 1)
    widths = schedule.trunk_widths(tiers, b, g + 1, span)
    caps = tuple(w - 1 for w in widths)
    assert widths[-1] == g + 1 and min(caps) < g
    admit = fast_jit(schedule.admit, tiers=tiers, caps=caps)
    rng = np.random.default_rng(b * 10 + g + span)
    for case in range(20):
        surv = np.cumprod(rng.uniform(0.05, 1.0, (b, g)) ** rng.uniform(0.2, 3), axis=1).astype(np.float32)
        active = rng.random(b) < 0.8
        active[rng.integers(b)] = True
        step_cost = np.cumsum(rng.uniform(0.0, 1.0, len(tiers)) * rng.uniform(0, 2)) + 1.0
        windows, tier = admit(jnp.asarray(surv), jnp.asarray(active), jnp.asarray(step_cost, jnp.float32))
        windows = np.asarray(windows)
        assert int(tier) == min(int(np.searchsorted(tiers, active.sum() + windows.sum())), len(tiers) - 1)
        assert (windows[~active] == 0).all() and windows.max() <= caps[int(tier)], (case, windows, int(tier))
        want = brute_force_best(surv, active, tiers, step_cost, caps)
        assert rate_of(windows, surv, active, tiers, step_cost) == pytest.approx(want, rel=1e-5), (case, windows)


def test_weighted_admission_is_the_best_window_assignment():
    """Rows weighted by their remaining budget (schedule.finish_weights): the admission maximises the weighted
    rate, and a row that is behind gets at least the window of an equally confident row ahead of it."""
    b, g = 3, 3
    tiers = schedule.tiers_for(b, g + 1)
    admit = fast_jit(lambda s, a, c, w: schedule.admit(s, a, c, tiers=tiers, weights=w))
    rng = np.random.default_rng(7)
    longer = 0
    for case in range(25):
        conf = np.repeat(rng.uniform(0.3, 0.95, (1, g)), b, axis=0)  # equally confident rows
        surv = np.cumprod(conf, axis=1).astype(np.float32)
        active = np.ones(b, bool)
        active[2] = case % 3 != 0
        remaining = rng.integers(1, 40, b)
        weights = np.asarray(schedule.finish_weights(jnp.asarray(remaining), jnp.asarray(active), 2.0))
        assert weights[active] == pytest.approx((remaining[active] / remaining[active].mean()) ** 2, rel=1e-5)
        step_cost = np.cumsum(rng.uniform(0.0, 1.0, len(tiers)) * rng.uniform(0, 2)) + 1.0
        windows, tier = admit(jnp.asarray(surv), jnp.asarray(active), jnp.asarray(step_cost, jnp.float32),
                              jnp.asarray(weights, jnp.float32))
        windows = np.asarray(windows)
        assert int(tier) == min(int(np.searchsorted(tiers, active.sum() + windows.sum())), len(tiers) - 1)
        want = brute_force_best(surv, active, tiers, step_cost, weights=weights)
        assert rate_of(windows, surv, active, tiers, step_cost, weights) == pytest.approx(want, rel=1e-5)
        behind, ahead = np.argmax(np.where(active, remaining, -1)), np.argmin(np.where(active, remaining, 99))
        assert windows[behind] >= windows[ahead]
        longer += int(windows[behind] > windows[ahead])
    assert longer > 0  # the weights changed some assignment
    assert (np.asarray(schedule.finish_weights(jnp.asarray([5, 9]), jnp.asarray([True, True]), 0.0)) == 1).all()


@pytest.mark.parametrize("compare_all_max", [Tuning().rank_compare_all_max, 0])  # all pairs compared; a sort
def test_descending_rank_is_a_stable_sort_s(compare_all_max):
    x = jnp.asarray([0.5, 0.9, 0.5, -1.0, 0.0, 0.9, 0.5, 0.0], jnp.float32)
    want = np.argsort(np.argsort(-np.asarray(x), kind="stable"), kind="stable")
    assert schedule.descending_rank(x, compare_all_max).tolist() == want.tolist()


def admit_by_sorting(surv, active, step_cost, *, tiers, ar_cost=None):
    """The admission as first written: every k from a sort of all drafts, the first best rate."""
    b, g = surv.shape
    n = active.sum().astype(jnp.int32)
    flat = jnp.where(active[:, None], surv, -1.0).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    k = jnp.arange(b * g + 1, dtype=jnp.int32)
    gain = n + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.maximum(flat[order], 0.0))])
    rate = jnp.where(k <= n * g, gain / step_cost[schedule.tier_index(n + k, tiers)], -jnp.inf)
    chosen = jnp.argmax(rate).astype(jnp.int32)
    tier = schedule.tier_index(n + chosen, tiers)
    if ar_cost is not None:
        skip = n / ar_cost > rate[chosen]
        chosen, tier = jnp.where(skip, 0, chosen), jnp.where(skip, len(tiers), tier)
    admitted = jnp.zeros((b * g,), bool).at[order].set(k[:-1] < chosen)
    return admitted.reshape(b, g).sum(1).astype(jnp.int32), tier


@pytest.mark.parametrize("b,g,compare_all_max", [(3, 4, None), (16, 15, 0), (64, 15, None)])  # 0: ranks by sorting
def test_admission_matches_the_sorted_search(b, g, compare_all_max):
    """Against every k of the sorted drafts (batches past brute force): the same rate — the same windows but
    where a draft's survival is too small to move a float32 sum (the sorted search then stops before it; it
    costs nothing in the same tier) or two tiers' rates tie to rounding."""
    rank = {} if compare_all_max is None else {"compare_all_max": compare_all_max}
    tiers = schedule.tiers_for(b, g + 1)
    new = fast_jit(lambda s, a, c, ar: schedule.admit(s, a, c, tiers=tiers, ar_cost=ar, **rank))
    old = fast_jit(lambda s, a, c, ar: admit_by_sorting(s, a, c, tiers=tiers, ar_cost=ar))
    rng = np.random.default_rng(b * 100 + g)
    same = 0
    for case in range(40):
        conf = rng.uniform(0.0, 1.0, (b, g)) ** rng.uniform(0.2, 3)
        if case % 4 == 0:
            conf[:, 1:] = conf[:, :1]  # ties along a row
        if case % 5 == 1:
            conf[rng.random((b, g)) < 0.2] = 0.0  # survivals of exactly 0
        surv = schedule.survival(jnp.asarray(conf, jnp.float32))
        active = jnp.asarray(rng.random(b) < (0.0 if case == 7 else 0.8))
        cost = jnp.asarray(np.cumsum(rng.uniform(0, 1, len(tiers)) * rng.uniform(0, 2)) + 1.0, jnp.float32)
        if case % 6 == 0:
            cost = jnp.ones(len(tiers), jnp.float32)  # verifying is free
        rising = case % 8 != 3
        if not rising:  # a table that is not monotone: some tiers hold no k at all and must not be picked
            cost = jnp.asarray(rng.uniform(1.0, 2.0, len(tiers)), jnp.float32)
        ar = jnp.float32(rng.uniform(0.3, 3.0))
        (w, t), (w0, t0) = new(surv, active, cost, ar), old(surv, active, cost, ar)
        assert (np.asarray(w)[~np.asarray(active)] == 0).all() and (np.asarray(w) <= g).all()
        if rising and int(t) < len(tiers):  # the fewest drafts for the gain: none of survival 0
            assert (np.asarray(w) <= np.sum(np.asarray(surv) > 0, axis=1)).all(), case

        def rate(windows, tier):  # float64, as brute_force_best counts it
            if int(tier) == len(tiers):
                return float(np.sum(active)) / float(ar)
            gain = float(np.sum(active)) + sum(float(np.asarray(surv, np.float64)[r, :x].sum())
                                               for r, x in enumerate(np.asarray(windows)))
            return gain / float(cost[int(tier)])
        assert rate(w, t) == pytest.approx(rate(w0, t0), rel=1e-5, abs=1e-6), case
        same += int(np.array_equal(w, w0) and int(t) == int(t0))
    assert same >= 30  # most cases pick the very same windows


def test_admission_extremes():
    tiers = schedule.tiers_for(2, 4)  # (2, 4, 8)
    admit = fast_jit(schedule.admit, tiers=tiers)
    surv = jnp.asarray([[0.9, 0.8, 0.7], [0.01, 0.001, 0.0001]], jnp.float32)
    both = jnp.asarray([True, True])
    w, _ = admit(surv, both, jnp.asarray([1.0, 1.0, 1.0]))  # verifying is free: everything
    assert w.tolist() == [3, 3]
    w, _ = admit(surv, both, jnp.asarray([1.0, 2.0, 4.0]))  # every token costs a step: nothing pays
    assert w.tolist() == [0, 0]
    w, _ = admit(surv, both, jnp.asarray([1.0, 1.2, 2.0]))  # the sure row keeps its drafts, the hopeless loses them
    assert w.tolist()[1] <= 1 and w.tolist()[0] >= 2
    # A plain autoregressive step (tier index K = 3): taken only when it beats every window assignment.
    cost = jnp.asarray([1.0, 1.2, 2.0])
    admit_ar = fast_jit(lambda s, a, c, ar: schedule.admit(s, a, c, tiers=tiers, ar_cost=ar))
    w, tier = admit_ar(surv, both, cost, jnp.float32(0.5))  # 4 tokens/unit beat the best (< 3.2)
    assert w.tolist() == [0, 0] and int(tier) == 3
    w_ar, tier = admit_ar(surv, both, cost, jnp.float32(0.9))  # 2.2 tokens/unit lose to drafting
    assert w_ar.tolist() == admit(surv, both, cost)[0].tolist() and int(tier) < 3


def test_grouped_admission_admits_each_group_alone():
    """Compact under dp: each group of rows (a device's) is admitted against its share of every tier; the step
    runs the largest tier a group with active rows chose, and drafts unless all of those chose the AR step."""
    tiers = schedule.tiers_for(4, 4)  # (4, 8, 16): per group of 2 rows (2, 4, 8)
    cost, ar = jnp.asarray([1.0, 1.2, 2.0]), jnp.float32(0.6)
    grouped = fast_jit(lambda s, a, ar: schedule.admit(s, a, cost, tiers=tiers, ar_cost=ar, groups=2))
    alone = fast_jit(lambda s, a, ar: schedule.admit(s, a, cost, tiers=(2, 4, 8), ar_cost=ar))
    sure, hopeless = [[0.9, 0.8, 0.7], [0.9, 0.85, 0.8]], [[0.01, 0.001, 0.0001], [0.02, 0.001, 0.0001]]
    surv = jnp.asarray(sure + hopeless, jnp.float32)
    for active in ([True] * 4, [True, True, False, False], [False, False, True, True]):
        active = jnp.asarray(active)
        w, tier = grouped(surv, active, ar)
        parts = [alone(surv[i:i + 2], active[i:i + 2], ar) for i in (0, 2)]
        assert w.tolist() == parts[0][0].tolist() + parts[1][0].tolist()
        chose = [int(t) for (_, t), a in zip(parts, (active[:2].any(), active[2:].any())) if a and int(t) < 3]
        assert int(tier) == (max(chose) if chose else 3), (active, parts, tier)
    w, tier = grouped(surv, jnp.asarray([True] * 4), ar)  # the sure rows draft, the hopeless take the AR step
    assert w.tolist()[:2] != [0, 0] and w.tolist()[2:] == [0, 0] and int(tier) < 3


def test_tiers_per_row_replace_the_powers_of_two():
    """``Tuning.tiers_per_row`` sets compact's compiled tiers (sizes past the block dropped, the whole block kept
    last) and reaches the verify mode's resolution."""
    assert schedule.tiers_for(4, 16) == (4, 8, 16, 32, 64)
    assert schedule.tiers_for(4, 16, (3, 1, 6, 12, 32)) == (4, 12, 24, 48, 64)
    table = CostTable("cpu", "x", "float32", "p", 16, 64, {4: {n: 1.0 + n for n in (1, 3, 6, 12, 16)}})
    handle = types.SimpleNamespace(cost_tables=None, model=DFLASH_HANDLE.model)
    mode, tiers, _, _ = job.resolve_verify_mode("cap-accept", handle, 4, 16, table,
                                                tuning=Tuning(tiers_per_row=(1, 3, 6, 12)))
    assert mode.name == "cap-accept" and tiers == (4, 12, 24, 48, 64)


def test_tiers_that_cannot_pay_for_their_conditional_are_pruned():
    tiers = (4, 8, 16, 32, 64)
    kept, cost = schedule.prune_tiers(tiers, np.asarray([2.55, 2.68, 2.62, 2.54, 2.60]))  # an H200 at batch 1
    assert kept == (64,) and cost.tolist() == [2.60]
    kept, cost = schedule.prune_tiers(tiers, np.asarray([150.0, 151.0, 172.0, 204.0, 256.0]))  # a CPU
    assert kept == (8, 16, 32, 64) and cost.tolist() == [151.0, 172.0, 204.0, 256.0]


# What resolve_verify_mode reads of a drafter handle: its kind (a DFlash drafter: no confidences) and tables.
DFLASH_HANDLE = types.SimpleNamespace(cost_tables=None,
                                      model=types.SimpleNamespace(config=types.SimpleNamespace(kind="dflash")))
STATIC_RESOLVED = (verify_modes.STATIC, (), None, False)


def test_the_ar_step_is_offered_only_where_it_saves_on_the_cheapest_tier():
    dflash = DFLASH_HANDLE  # no confidence head
    h200 = CostTable("gpu", "x", "bfloat16", "p", 16, 256, {1: {1: 1.93, 2: 1.78, 4: 1.71, 8: 1.68, 16: 1.69}},
                     ar_ms={1: 1.67})  # batch 1 on an H200: one tier kept, the AR step as dear
    assert job.resolve_verify_mode("compact", dflash, 1, 16, h200) == STATIC_RESOLVED
    mode, tiers, cost, ar_step = job.resolve_verify_mode("compact", dflash, 1, 16,
                                                                dataclasses.replace(h200, ar_ms={1: 1.2}))
    assert (mode, tiers, ar_step) == (verify_modes.Compact(), (16,), True)
    assert cost.tolist() == pytest.approx([1.69, 1.2])


def test_compact_runs_static_where_no_tier_saves_on_static_s_step():
    """With the static verify's step in the table, compact runs static's program where even its cheapest tier
    kept does not save on that step (each of its steps would then cost as much and commit no more), even with a
    cheap step without drafting; elsewhere its tiers are pruned against its own costs, as without it."""
    dflash = DFLASH_HANDLE  # no confidence head
    b4 = CostTable("gpu", "x", "bfloat16", "p", 16, 256, {4: {1: 2.10, 2: 1.94, 4: 1.95, 8: 2.01, 16: 2.11}},
                   ar_ms={4: 1.71})  # batch 4 on an H200
    mode, tiers, cost, ar_step = job.resolve_verify_mode("compact", dflash, 4, 16, b4)
    assert (mode, tiers, ar_step) == (verify_modes.Compact(), (8, 32, 64), True)
    with_static = dataclasses.replace(b4, static_ms={4: 1.96})
    assert job.resolve_verify_mode("compact", dflash, 4, 16, with_static) == STATIC_RESOLVED
    for static in (2.05, 6.0):  # tiers cheaper than static's step: compact, its tiers as without static
        got = job.resolve_verify_mode("compact", dflash, 4, 16, dataclasses.replace(b4, static_ms={4: static}))
        assert got[0].name == "compact" and got[1] == tiers and got[2].tolist() == pytest.approx(cost.tolist())


@pytest.mark.auto_verify
def test_auto_is_compact_where_the_table_times_static_s_step():
    """With static's step in the table, auto is compact (which runs static's program itself where no tier saves
    on that step), whatever the whole block's ratio to one token a row; without it, that ratio decides."""
    dflash = DFLASH_HANDLE
    b4 = CostTable("gpu", "x", "bfloat16", "p", 16, 256, {4: {1: 2.10, 2: 1.94, 4: 1.95, 8: 2.01, 16: 2.11}},
                   ar_ms={4: 1.71})  # whole blocks ~1.0× one token a row: far under the ratio
    assert job.resolve_verify_mode("auto", dflash, 4, 16, b4)[0].name == "static"
    got = job.resolve_verify_mode("auto", dflash, 4, 16, dataclasses.replace(b4, static_ms={4: 2.05}))
    assert got[:2] == job.resolve_verify_mode("compact", dflash, 4, 16, b4)[:2] and got[0].name == "compact"
    cheap_static = dataclasses.replace(b4, static_ms={4: 1.96})
    assert job.resolve_verify_mode("auto", dflash, 4, 16, cheap_static) == STATIC_RESOLVED
    opt_out = Tuning(auto_compact_ratio=float("inf"))  # the opt-out still holds
    got = job.resolve_verify_mode("auto", dflash, 4, 16, dataclasses.replace(b4, static_ms={4: 2.05}),
                                         tuning=opt_out)
    assert got[0].name == "static"


def test_a_flipped_kernel_knob_is_a_program_of_its_own(monkeypatch):
    """Benchmarks flip kernel knobs between calls (A/B in one process): each setting gets its own program."""
    keys = []
    monkeypatch.setattr(engine_programs, "programs", lambda key, *a, **kw: keys.append(key))
    target = tiny_target()
    for short in (4, 0, 4):
        job.make(target, None, [[1, 2, 3]], 4,
                 tuning=Tuning(kernels=KernelTuning(packed_short_q_len=short or None)))
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_acceptance_counts_pool_rows_and_see_only_the_window():
    counts = schedule.AcceptanceCounts.zeros(2, 3)
    prior = schedule.PRIOR_ACCEPT / (schedule.PRIOR_ACCEPT + schedule.PRIOR_REJECT)
    assert np.allclose(counts.conditional_rates(), prior)
    # Row 0 verified 3 drafts and accepted 1 (draft 0 passed, draft 1 failed, draft 2 unseen); row 1 is done.
    counts = counts.update(jnp.asarray([1, 2]), jnp.asarray([3, 3]), jnp.asarray([True, False]))
    assert counts.reached.tolist() == [[1, 1, 0], [0, 0, 0]]
    assert counts.accepted.tolist() == [[1, 0, 0], [0, 0, 0]]
    rates = np.asarray(counts.conditional_rates())
    assert rates[0, 0] > prior > rates[0, 1] and rates[0, 2] == pytest.approx(prior)
    assert rates[1, 0] > prior > rates[1, 1]  # the batch's evidence reaches the row that saw nothing


# --------------------------------------------------------------------------------------------------
# Ragged packing
# --------------------------------------------------------------------------------------------------

def _cache(rng, b=3, s=24, k=2, h=16):
    return (jnp.asarray(rng.normal(size=(b, s, k, h)), jnp.float32), jnp.asarray(rng.normal(size=(b, s, k, h)),
                                                                                   jnp.float32))


@pytest.mark.parametrize("method_max", [KernelTuning().compare_all_max, 0])  # every value against every edge; a sort
def test_find_bucket_is_searchsorted(method_max):
    rng = np.random.default_rng(0)
    edges = np.sort(rng.integers(0, 50, 17)).astype(np.int32)  # repeated edges too
    values = rng.integers(-2, 53, (3, 40)).astype(np.int32)
    for side in ("left", "right"):
        got = common.find_bucket(jnp.asarray(edges), jnp.asarray(values), side=side,
                                 tuning=KernelTuning(compare_all_max=method_max))
        np.testing.assert_array_equal(got, np.searchsorted(edges, values, side=side))


def test_packed_layout_round_trip_and_writes():
    lens = jnp.asarray([2, 0, 4], jnp.int32)
    anchor = jnp.asarray([5, 9, 3], jnp.int32)
    layout = PackedLayout.build(lens, anchor, 8, 4)
    assert layout.cu_q_lens.tolist() == [0, 2, 2, 6]
    assert layout.rows[:6].tolist() == [0, 0, 2, 2, 2, 2] and layout.valid.tolist() == [True] * 6 + [False] * 2
    assert layout.positions[:6].tolist() == [5, 6, 3, 4, 5, 6]
    block = jnp.arange(12).reshape(3, 4)
    back = layout.unpack(layout.pack(block))
    assert back.tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [8, 9, 10, 11]]
    # K/V writes land in each row's block from its anchor position on: its window, then zeros up to the
    # block's end (masked, and overwritten before they are read); nothing else changes.
    cache = jnp.full((3, 24, 1, 1), 7.0)
    new = jnp.arange(1, 9, dtype=jnp.float32).reshape(8, 1, 1)
    pending = PendingKV.of(layout, (jnp.stack([new, -new], axis=1),)).widened(6, 10)  # 2 slots of padding
    assert pending.kv.shape == (10, 1, 2, 1, 1) and pending.width == 6
    written = pending.write(KVCache((cache,), (cache,)))
    out = np.asarray(written.k[0])[..., 0, 0]
    assert out[0, 5:11].tolist() == [1, 2, 0, 0, 0, 0] and out[2, 3:9].tolist() == [3, 4, 5, 6, 0, 0]
    assert out[1, 9:15].tolist() == [0] * 6
    untouched = np.ones_like(out, bool)
    untouched[0, 5:11] = untouched[1, 9:15] = untouched[2, 3:9] = False
    assert (out[untouched] == 7).all()
    assert np.array_equal(np.asarray(written.v[0])[..., 0, 0][~untouched], -out[~untouched])


def test_dense_layout_is_the_packed_one_in_row_blocks():
    """A tier with room for every whole block keeps the windows in their rows' blocks (packing a reshape):
    the same tokens at the same positions as the packed layout, in other slots."""
    lens = jnp.asarray([2, 0, 4], jnp.int32)
    anchor = jnp.asarray([5, 9, 3], jnp.int32)
    packed, dense = PackedLayout.build(lens, anchor, 8, 4), PackedLayout.build(lens, anchor, 12, 4)
    assert not packed.dense and dense.dense and dense.rows.shape == (12,)
    block = jnp.arange(12).reshape(3, 4)
    assert dense.pack(block).tolist() == list(range(12))
    np.testing.assert_array_equal(dense.unpack(dense.pack(block)), packed.unpack(packed.pack(block)))
    d, p = np.asarray(dense.valid), np.asarray(packed.valid)
    assert d.sum() == p.sum() == 6
    for field in ("rows", "offsets", "positions"):
        np.testing.assert_array_equal(np.asarray(getattr(dense, field))[d], np.asarray(getattr(packed, field))[p])


def _packed_case(rng, lens, anchor, size, heads=4):
    """Packed windows' q and own K/V ``kv`` [T, 2, K, H] (NaN in the padding slots; a dense layout's slots past
    a window hold the block's later tokens: finite) and the reference: the windows' K/V written into the
    cache, then causal attention over it."""
    k_cache, v_cache = _cache(rng)
    layout = PackedLayout.build(jnp.asarray(lens, jnp.int32), jnp.asarray(anchor, jnp.int32), size, 4)
    def poison(x):
        return x if layout.dense else jnp.where(layout.valid.reshape(-1, *[1] * (x.ndim - 1)), x, jnp.nan)
    q = poison(jnp.asarray(rng.normal(size=(size, heads, 16)), jnp.float32))
    kv = poison(jnp.asarray(rng.normal(size=(size, 2, 2, 16)), jnp.float32))
    written = PendingKV.of(layout, (kv,)).write(KVCache((k_cache,), (v_cache,)))
    return layout, q, kv, k_cache, v_cache, (written.k[0], written.v[0])


def _qkv(q, kv):
    """packed_verify_attention's operand: the queries' heads, then the keys', then the values'."""
    return jnp.concatenate([q, kv.reshape(kv.shape[0], -1, kv.shape[-1])], axis=1)


@pytest.fixture
def ieee_dots():
    """Float32 dots in IEEE float32 (a GPU's XLA dots default to TF32, its kernels do not): tight tolerances."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.usefixtures("ieee_dots")
@pytest.mark.parametrize("impl,size", [("xla", 10), ("cuda", 10), ("xla", 12), ("cuda", 12)])
def test_packed_attention_sees_only_its_own_row(impl, size):
    """Each slot attends to its own row's cache before its window and to its window's K/V up to itself, as
    causal attention over the cache with the window written in; other rows' caches, the cache's entries from
    the window on, and NaN in the padding slots change nothing. Size 12 = B·L: the dense layout (the GPU
    kernel takes its rows as whole blocks; what lies past a window, later in the block, changes nothing)."""
    rng = np.random.default_rng(0)
    lens, anchor = [3, 0, 4], [6, 10, 2]
    layout, q, kv, k_cache, v_cache, (k_full, v_full) = _packed_case(rng, lens, anchor, size)
    assert layout.dense == (size == 12)
    run = fast_jit(lambda *a: packed_verify_attention(*a, kernels=Kernels(impl)))
    out = np.asarray(run(_qkv(q, kv), k_cache, v_cache, layout))
    valid = np.asarray(layout.valid)
    assert np.isfinite(out[valid]).all()
    for r in (0, 2):
        n, start = lens[r], int(layout.starts[r])
        pos = anchor[r] + jnp.arange(n)
        want = cache_attention(q[start:start + n][None], k_full[r:r + 1], v_full[r:r + 1], pos[None])[0]
        np.testing.assert_allclose(out[start:start + n], want, rtol=2e-5, atol=2e-5)
    # Other rows' caches, row 0's entries from its anchor on (stale drafts) and the slots past the windows do
    # not matter.
    k2 = k_cache.at[1].set(1e4).at[2].set(-1e4).at[0, 6:].set(7.0)
    kv2 = jnp.where(layout.valid[:, None, None, None], kv, 5.0 if layout.dense else jnp.nan)
    out2 = np.asarray(run(_qkv(q, kv2), k2, v_cache.at[1].set(3.0), layout))
    np.testing.assert_allclose(out2[:3], out[:3], rtol=1e-6)  # row 0's window (its cache alone unchanged)


@pytest.mark.usefixtures("ieee_dots")
@pytest.mark.parametrize("impl", ["pallas", "cuda"])
def test_packed_attention_kernels(impl, caplog):
    """The packed verify through the block kernels (causal, gpt-oss's sliding window) without a fallback, as
    the reference computes it; with gpt-oss's sinks the reference runs (the block kernels take none)."""
    rng = np.random.default_rng(1)
    layout, q, kv, k_cache, v_cache, _ = _packed_case(rng, [3, 0, 4], [16, 10, 2], 10)
    sinks = jnp.asarray(rng.normal(size=4), jnp.float32)

    def run(impl, sinks=None):
        def attend(*a):
            return packed_verify_attention(*a, kernels=Kernels(impl), sinks=sinks, window=5)
        return np.asarray(fast_jit(attend)(_qkv(q, kv), k_cache, v_cache, layout))

    common.log_once.cache_clear()  # the fallback's warning is logged once per session
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):
        out = run(impl)
    np.testing.assert_allclose(out[:7], run("xla")[:7], rtol=2e-5, atol=2e-5)
    assert not any("uses the XLA reference" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):
        np.testing.assert_allclose(run(impl, sinks)[:7], run("xla", sinks)[:7], rtol=2e-5, atol=2e-5)
    assert any("sinks uses the XLA reference" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------------
# Verify modes in the decode loop
# --------------------------------------------------------------------------------------------------

PROMPTS = random_prompts(4, [5, 9, 14, 7], 64, seed=7)
MAX_NEW = 28
# Step cost per tokens-per-row: a machine where verifying gets dearer, so windows vary.
TABLE = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 1.0, 2: 1.25, 4: 1.8, 8: 3.2}})
FLAT = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 1.0, 8: 1.01}})  # verifying is ~free
MILD = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 0.9, 2: 1.05, 4: 1.2, 8: 1.5}})  # TABLE's tiers
# Drafting costs as much as verifying three more tokens per row: some steps are cheaper without it.
WITH_AR = CostTable("cpu", "test", "float32", "tiny", 8, 32, {4: {1: 1.0, 2: 1.25, 4: 1.8, 8: 3.2}}, ar_ms={4: 0.7})


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)


@pytest.fixture(scope="module")
def reference(target):
    return generate(target, PROMPTS, MAX_NEW, stop_token_ids=[])


@pytest.fixture(scope="module")
def oracle(target, reference):
    """Right ~80 % of the time: acceptance lengths over the whole range (count-based survival)."""
    return oracle_drafter(target, PROMPTS, reference.token_ids, block_size=8, corrupt=0.2, seed=1)


@pytest.fixture(scope="module")
def runs(target, oracle):
    return {mode: speculative_generate(target, oracle, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode=mode,
                                       cost_table=TABLE) for mode in MODES}


def test_every_mode_is_lossless_and_compact_commits_what_cap_accept_commits(runs, reference):
    for mode, out in runs.items():
        assert out.token_ids == reference.token_ids, mode
        assert out.stats["verify_mode"] == mode
    compact, cap = runs["compact"], runs["cap-accept"]
    assert compact.acceptance_lengths == cap.acceptance_lengths
    assert compact.stats["tier_steps"] == cap.stats["tier_steps"] and len(compact.stats["tier_steps"]) >= 2
    assert compact.stats["verify_tokens"] < runs["static"].stats["verify_tokens"]
    assert 1 <= compact.stats["mean_window"] < 8
    assert 0 < cap.stats["utilization"] < 1  # trimming gave something up on this drafter
    assert cap.stats["verify_tokens"] == 8 * sum(map(len, cap.acceptance_lengths))  # it verified whole blocks
    assert cap.stats["mean_window"] == compact.stats["mean_window"]
    # Tokens per verified token: what the scheduler buys.
    per_token = {m: o.stats["new_tokens"] / o.stats["verify_tokens"] for m, o in runs.items()}
    assert per_token["compact"] > per_token["static"]


def test_the_tier_is_chosen_on_the_device_without_recompiling(target, oracle, runs):
    before = engine_programs.compile_count()
    mild = speculative_generate(target, oracle, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode="compact",
                                cost_table=MILD)
    assert engine_programs.compile_count() == before  # another cost table keeping the same tiers: the same program
    assert mild.stats["tier_steps"] != runs["compact"].stats["tier_steps"]
    assert mild.stats["mean_window"] > runs["compact"].stats["mean_window"]  # verifying is cheaper there
    flat = speculative_generate(target, oracle, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode="compact",
                                cost_table=FLAT)
    # No smaller tier saves anything: compact would verify whole blocks, so it runs the static program.
    assert flat.stats["verify_mode"] == "static" and engine_programs.compile_count() == before
    assert flat.acceptance_lengths == runs["static"].acceptance_lengths


def test_steps_without_drafting_are_lossless(target, runs, reference):
    """A drafter right half the time: once the counts say so, steps without drafting pay (WITH_AR); they observe
    nothing, so the counts fade back towards the prior and drafting is tried again — both kinds of step run."""
    poor = oracle_drafter(target, PROMPTS, reference.token_ids, block_size=8, corrupt=0.5, seed=2)
    out = speculative_generate(target, poor, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode="compact",
                               cost_table=WITH_AR)
    assert out.token_ids == reference.token_ids
    drafted = sum(out.stats["tier_steps"].values())
    assert out.stats["ar_steps"] > 0 and drafted > 0, out.stats
    assert out.stats["ar_steps"] + drafted == max(map(len, out.acceptance_lengths))
    assert "ar_steps" not in runs["compact"].stats  # TABLE has no autoregressive step time: not offered


def test_capped_sequential_drafting_stays_lossless(target, reference):
    """The GPU experiment knob of compact's drafting (``Tuning.sequential_draft_cap``, off by default; a program
    key of its own, so neither the programs it compiles nor the default ones leak across tests): a sequential
    drafter drafting only its first positions stays lossless and no window passes them."""
    dspark = random_drafter(target, kind="dspark", block_size=5, num_layers=1, markov_rank=8, seed=4)
    capped = speculative_generate(target, dspark, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode="compact",
                                  cost_table=TABLE, tuning=Tuning(sequential_draft_cap=2))
    assert capped.token_ids == reference.token_ids
    assert capped.stats["mean_window"] <= 2 + 1  # the anchor and ≤ 2 drafts (3.73 without the cap)


def _cache_copies(text: str, shape: tuple) -> list[str]:
    """The HLO instructions of ``text`` that copy a buffer of the cache's shape."""
    kind = "[" + ",".join(map(str, shape)) + "]"
    return [line for line in text.splitlines() if " copy(" in line and kind in line.split(" copy(")[0]]


def test_compact_steps_update_the_caches_in_place(target, oracle, runs):
    """A tier's branch only reads the caches; their writes come after the conditional. (XLA gives a branch that
    writes an operand its own copy of it: every layer's cache, every step.) The static program, which has
    no conditional, is the control: it copies no cache either."""
    texts = {}
    for key, programs in engine_programs.CACHE.items():
        spec = next((k for k in key if isinstance(k, LoopSpec)), None)
        if spec is not None and spec.verify_mode.name in ("static", "compact") and spec.block_size == 8:
            shape = programs.prefill.out_info[0].target_cache.k[0].shape
            texts[spec.verify_mode.name, spec.ar_step] = (programs.decode.as_text(), shape)
    assert {("static", False), ("compact", False), ("compact", True)} <= set(texts), set(texts)
    for (mode, _), (text, shape) in texts.items():
        # compact's one conditional is its tier switch: with the AR offer too, a parallel drafter drafts inside
        # the tiers' branches rather than in a cond of its own before them
        assert text.count(" conditional(") == (mode == "compact"), mode
        assert _cache_copies(text, shape) == [], mode
        # No binary search as a loop (searchsorted's default, in the packed layouts and the tier lookup): on a GPU
        # each of its iterations is kernel launches, every step.
        loops = [ln for ln in text.splitlines() if " while(" in ln]
        assert loops and not [ln for ln in loops if "searchsorted" in ln], mode


def test_dspark_confidences_schedule_compact_and_cap_accept_alike(target, reference):
    dspark = random_drafter(target, kind="dspark", block_size=5, num_layers=1, markov_rank=8, seed=4)
    outs = [speculative_generate(target, dspark, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode=m,
                                 cost_table=TABLE) for m in ("compact", "cap-accept")]
    for out in outs:
        assert out.token_ids == reference.token_ids
    assert outs[0].acceptance_lengths == outs[1].acceptance_lengths
    assert outs[0].stats["tier_steps"] == outs[1].stats["tier_steps"]
    # Compact drafts each step at the end of the one before (loop.plans_ahead): the same survival recorded.
    assert outs[0].stats["predicted_survival"] == outs[1].stats["predicted_survival"]
    # Sampling the target (drafts still greedy, planned ahead): the same draws with the same seed.
    sampled = [speculative_generate(target, dspark, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode=m,
                                    cost_table=TABLE, temperature=1.0, seed=7) for m in ("compact", "cap-accept")]
    assert sampled[0].token_ids == sampled[1].token_ids != reference.token_ids
    assert sampled[0].acceptance_lengths == sampled[1].acceptance_lengths
    # …with no copy of a cache for it (the drafting reads the caches the step before just wrote)
    for key, programs in engine_programs.CACHE.items():
        spec = next((k for k in key if isinstance(k, LoopSpec)), None)
        if not isinstance(programs, engine_programs.Programs):  # a single program (the fallback's, a pool's)
            continue
        state = programs.prefill.out_info[0]
        if spec is not None and spec.verify_mode.name == "compact" and state.schedule.counts is None:  # confidences
            text = programs.decode.as_text()
            assert _cache_copies(text, state.target_cache.k[0].shape) == []
            assert _cache_copies(text, state.draft_cache.k[0].shape) == []
            break
    else:
        raise AssertionError("no compact program of the DSpark drafter")


def test_sampled_compact_matches_target_distribution(pair, logits):
    """Rejection sampling over a window: the bonus at a window's end is drawn from p there (χ²), and cap-accept
    draws the same tokens with the same seed."""
    target, drafter = pair
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    table = CostTable("cpu", "test", "float32", "tiny", 4, 8, {1: {1: 1.0, 2: 1.1, 4: 1.6}})
    samples, out = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), with_output=True,
                        temperature=1.0, seed=3, verify_mode="compact", cost_table=table)
    assert chi2_pvalue(samples, probs) > 1e-3
    assert len(out.stats["tier_steps"]) >= 2
    cap = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), temperature=1.0, seed=3,
               verify_mode="cap-accept", cost_table=table)
    assert (cap == samples).all()
    # Steps without drafting draw the token from p itself.
    with_ar = dataclasses.replace(table, ar_ms={1: 0.75})
    samples, out = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), with_output=True,
                        temperature=1.0, seed=5, verify_mode="compact", cost_table=with_ar)
    assert chi2_pvalue(samples, probs) > 1e-3 and out.stats["ar_steps"] > 0
    # A tier that runs the drafter's trunk over fewer positions than the block (Tuning.tier_draft_span = 1: the
    # 2-tokens-per-row tier drafts over [anchor, MASK]) draws from p all the same.
    samples, out = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), with_output=True,
                        temperature=1.0, seed=7, verify_mode="compact", cost_table=table,
                        tuning=Tuning(tier_draft_span=1))
    assert chi2_pvalue(samples, probs) > 1e-3 and out.stats["tier_steps"].get(2 * len(samples), 0) > 0


def test_narrow_trunk_tiers_stay_lossless(target, reference):
    """Compact tiers whose trunk drafts fewer positions than the block (a random drafter: its drafts depend on the
    trunk's width), by default for a drafter that says it was trained at narrower widths: the target's tokens,
    with the narrow tiers run and no window past a tier's width."""
    drafter = with_config(random_drafter(target, block_size=8, num_layers=1, seed=9), trained_widths=(4,))
    out = speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode="compact",
                               cost_table=MILD)
    assert out.token_ids == reference.token_ids
    ran = {n // len(PROMPTS): c for n, c in out.stats["tier_steps"].items()}
    assert set(ran) - {8}, ran  # some step ran a narrower tier than the whole block


def test_trunk_widths_follow_the_drafters_trained_widths():
    """Tuning.tier_draft_span None: span 2 for a drafter trained at narrower widths, else whole blocks; 0: whole
    blocks always. Widths round up to one the drafter was trained at."""
    assert Tuning().draft_span(None) is None and Tuning().draft_span((4,)) == TRAINED_WIDTHS_SPAN == 2
    assert Tuning(tier_draft_span=0).draft_span((4,)) is None and Tuning(tier_draft_span=3).draft_span(None) == 3
    tiers = schedule.tiers_for(4, 16)  # 1, 2, 4, 8, 16 tokens a row
    assert schedule.trunk_widths(tiers, 4, 16, 2) == (2, 4, 8, 16, 16)
    assert schedule.trunk_widths(tiers, 4, 16, 2, trained=(4, 8)) == (4, 4, 8, 16, 16)
    assert schedule.trunk_widths(tiers, 4, 16, 2, trained=(3,)) == (3, 16, 16, 16, 16)
    assert schedule.trunk_widths(tiers, 4, 16, None, trained=(4,)) is None


@pytest.mark.auto_verify
def test_auto_is_compact_where_the_table_says_trimming_pays(target, oracle, runs):
    before = engine_programs.compile_count()
    auto = speculative_generate(target, oracle, PROMPTS, MAX_NEW, stop_token_ids=[], cost_table=TABLE)
    assert auto.stats["verify_mode"] == "compact" and engine_programs.compile_count() == before  # runs' program
    assert auto.acceptance_lengths == runs["compact"].acceptance_lengths
    flat = speculative_generate(target, oracle, PROMPTS, MAX_NEW, stop_token_ids=[], cost_table=FLAT)
    assert flat.stats["verify_mode"] == "static"  # verifying costs the same whatever the window


def test_verify_mode_errors(target, oracle):
    with pytest.raises(ValueError, match="verify_mode must be 'auto' or one of .*got 'fast'"):
        speculative_generate(target, oracle, PROMPTS, 4, verify_mode="fast")
    with pytest.raises(costs.CostTableError, match="does not exist"):
        speculative_generate(target, oracle, PROMPTS, 4, verify_mode="compact", cost_table="/nonexistent.json")


def test_verify_modes_are_named_by_their_registry():
    """Every registered name round-trips to a hashable strategy (what the loop spec holds); an unknown name is one
    error naming the choices; a policy (auto) is not a loop mode until resolved."""
    assert verify_modes.names() == ("auto", "static", "compact", "cap-accept")
    for name in verify_modes.names():
        strategy = verify_modes.by_name(name)
        assert strategy.name == name and str(strategy) == name and verify_modes.by_name(strategy) is strategy
        assert strategy == verify_modes.by_name(name) and hash(strategy) == hash(verify_modes.by_name(name))
    for name in MODES:
        spec = LoopSpec(block_size=8, new_capacity=16, capture=(), verify_mode=name)
        assert spec.verify_mode == verify_modes.by_name(name) and spec == dataclasses.replace(spec)
        assert spec.scheduled == (name != "static")
    assert len({verify_modes.by_name(m) for m in MODES}) == len(MODES)
    with pytest.raises(ValueError, match="verify_mode must be 'auto' or one of 'static', 'compact', 'cap-accept', "
                                         "got 'fast'"):
        verify_modes.by_name("fast")
    with pytest.raises(ValueError, match="policy"):
        LoopSpec(block_size=8, new_capacity=16, capture=(), verify_mode="auto")


def test_a_new_verify_mode_is_one_registered_class(target, oracle, runs, monkeypatch):
    """A mode defined and registered here — cap-accept's steps under another name — is accepted by the registry,
    the public API and the CLI with no other change, and runs."""
    monkeypatch.setattr(verify_modes, "REGISTRY", dict(verify_modes.REGISTRY))

    @verify_modes.register
    @dataclasses.dataclass(frozen=True)
    class Trimmed(verify_modes.CapAccept):
        name: ClassVar[str] = "trimmed"

    assert verify_modes.names()[-1] == "trimmed" and verify_modes.by_name("trimmed") == Trimmed()
    for name, code in (("trimmed", 0), ("fast", 2)):  # the CLI's choices come from the registry
        with pytest.raises(SystemExit) as exit_:
            cli.main(["generate", "--verify-mode", name, "--help"])
        assert exit_.value.code == code, name
    out = speculative_generate(target, oracle, PROMPTS, MAX_NEW, stop_token_ids=[], verify_mode="trimmed",
                               cost_table=TABLE)
    cap = runs["cap-accept"]
    assert out.stats["verify_mode"] == "trimmed" and out.token_ids == cap.token_ids
    assert out.acceptance_lengths == cap.acceptance_lengths and out.stats["utilization"] == cap.stats["utilization"]


# --------------------------------------------------------------------------------------------------
# Cost tables
# --------------------------------------------------------------------------------------------------

def test_a_shipped_table_of_another_device_is_pointed_out_once(monkeypatch, caplog):
    costs._note_other_device.cache_clear()
    monkeypatch.setattr(costs, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):
        for _ in range(2):
            assert costs.resolve(None, "gpu").device == "NVIDIA H200"
    assert [r.getMessage() for r in caplog.records].count(
        "the step cost table was measured on NVIDIA H200, this is NVIDIA H100 80GB HBM3: `dflash-jax calibrate "
        "--config <pair>` measures one here (compact mode schedules with it)") == 1
    caplog.clear()
    monkeypatch.setattr(costs, "device_kind", lambda: "NVIDIA H200")
    with caplog.at_level(logging.WARNING, logger="dflash_jax"):
        costs.resolve(None, "gpu")
    assert not caplog.records


def test_cost_table_interpolation_and_files(tmp_path):
    table = CostTable("cpu", "x", "float32", "p", 16, 64, {1: {1: 1.0, 16: 4.0}, 4: {1: 2.0, 16: 10.0}})
    assert table.step_costs(1, (1, 16)).tolist() == [1.0, 4.0]
    assert table.step_costs(2, (2, 32)).tolist() == pytest.approx([1.5, 7.0])  # halfway in log₂ batch
    assert table.step_costs(8, (8, 128)).tolist() == pytest.approx([4.0, 20.0])  # beyond: scaled with the batch
    assert table.step_costs(1, (1, 2, 4)).tolist() == pytest.approx([1.0, 1.2, 1.6])  # tokens per row
    path = tmp_path / "pair.costs.json"
    costs.save_table(path, table)
    gpu = CostTable("gpu", "H200", "bfloat16", "p", 16, 64, {1: {1: 0.5, 16: 0.6}}, ar_ms={1: 0.4},
                    static_ms={1: 0.55, 4: 0.7})
    costs.save_table(path, gpu)
    tables = costs.load_tables(path)
    assert sorted(tables) == ["cpu", "gpu"] and tables["cpu"] == table and tables["gpu"] == gpu
    assert table.static_cost(1) is None and gpu.static_cost(2) == pytest.approx(0.625)
    # A calibration of more batches (the same measurement) adds them; another measurement replaces the table.
    more = dataclasses.replace(gpu, step_ms={4: {1: 0.9, 16: 1.2}}, ar_ms={4: 0.8}, static_ms={4: 1.1})
    assert costs.save_table(path, more).step_ms == {1: {1: 0.5, 16: 0.6}, 4: {1: 0.9, 16: 1.2}}
    merged = costs.load_tables(path)["gpu"]
    assert merged.ar_ms == {1: 0.4, 4: 0.8} and merged.static_ms == {1: 0.55, 4: 1.1}
    assert costs.save_table(path, dataclasses.replace(more, context=256)).step_ms == more.step_ms
    # A plain step timed at batch 4 only, merged into batches that timed the scheduler's step without drafting:
    # each batch keeps its own measurement (batch 1's is not batch 4's carried down).
    plain = dataclasses.replace(more, fallback_ms={4: 0.6}).merged_into(gpu)
    assert plain.fallback_cost(4) == 0.6 and plain.fallback_cost(1) == 0.4
    assert plain.fallback_cost(2) == pytest.approx(0.5)  # halfway in log₂ batch
    assert gpu.fallback_cost(1) == 0.4 and table.fallback_cost(1) is None
    assert costs.resolve(str(path), "gpu").device == "H200"
    with pytest.raises(costs.CostTableError, match="no table for the tpu backend"):
        costs.resolve(str(path), "tpu")
    path.write_text(json.dumps({"cpu": {"backend": "cpu", "block_size": 16, "step_ms": {"1": {"1": -1}}}}))
    with pytest.raises(costs.CostTableError, match="positive step times"):
        costs.load_tables(path)
    assert costs.shipped_table("cpu").backend == "cpu"  # the shipped defaults
    assert costs.shipped_table("gpu").device == "NVIDIA H200"
    assert costs.shipped_table("tpu").backend == "gpu"  # none measured on a TPU yet
    # A pair's own tables sit next to its config: the DSpark pair ships its H200 table and, beside it, an H100's
    # (static's step timed in both).
    from dflash_jax.pairs import load_pair_config
    dspark = costs.load_tables(costs.tables_path(load_pair_config("smollm2-135m-dspark").path))
    h100 = "NVIDIA H100 80GB HBM3"
    assert sorted(dspark) == ["gpu", f"gpu@{h100}"] and dspark["gpu"].device == "NVIDIA H200"
    for table in dspark.values():
        assert table.pair == "smollm2-135m-dspark"
        assert sorted(table.static_ms) == sorted(table.step_ms) == [1, 4, 16, 32, 64, 128]
    assert costs.pick(dspark, "gpu", h100).device == h100 and costs.pick(dspark, "gpu", "NVIDIA A100").device \
        == "NVIDIA H200" and costs.pick(dspark, "cpu", h100) is None
    # The DFlash2 pair ships the H200 rows timed before its session-46 bench (1 / 16 / 64 rows; others
    # interpolated, or scaled past 64).
    dflash2 = costs.load_tables(costs.tables_path(load_pair_config("smollm2-135m-dflash2").path))
    assert sorted(dflash2) == ["gpu"] and dflash2["gpu"].pair == "smollm2-135m-dflash2"
    assert sorted(dflash2["gpu"].step_ms) == sorted(dflash2["gpu"].ar_ms) == [1, 16, 64]


def test_a_costs_file_keeps_each_device_s_table(tmp_path, monkeypatch, caplog):
    """A calibration on another device of the backend goes beside the backend's table (which stays), and each
    device schedules with its own; a device without one takes the backend's, and is told so."""
    path = tmp_path / "pair.costs.json"
    h200 = CostTable("gpu", "H200", "bfloat16", "p", 16, 64, {1: {1: 0.5, 16: 0.6}})
    h100 = dataclasses.replace(h200, device="H100", step_ms={1: {1: 0.7, 16: 0.9}})
    costs.save_table(path, h200)
    costs.save_table(path, h100)
    costs.save_table(path, dataclasses.replace(h100, step_ms={4: {1: 1.0, 16: 1.5}}))  # more H100 batches
    tables = costs.load_tables(path)
    assert sorted(tables) == ["gpu", "gpu@H100"] and tables["gpu"] == h200
    assert tables["gpu@H100"].step_ms == {1: {1: 0.7, 16: 0.9}, 4: {1: 1.0, 16: 1.5}}
    costs._note_other_device.cache_clear()
    for here, expected in (("H100", tables["gpu@H100"]), ("H200", h200), ("A100", h200)):
        monkeypatch.setattr(costs, "device_kind", lambda: here)
        with caplog.at_level(logging.WARNING, logger="dflash_jax"):
            assert costs.resolve(str(path), "gpu") == expected
            assert costs.resolve(None, "gpu", tables) == expected
        assert ("measured on H200, this is A100" in caplog.text) == (here == "A100")
    # a table filed under another device's key is refused
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({"gpu@A100": raw["gpu@H100"]}))
    with pytest.raises(costs.CostTableError, match="its key must be 'gpu' or 'gpu@H100'"):
        costs.load_tables(path)


def test_calibrate_command_writes_a_table_and_its_plot(tmp_path, capsys):
    """`dflash-jax calibrate` on the z-lab fixture pair: a table per backend in the costs file, and its plot."""
    from dflash_jax.cli import main

    out = tmp_path / "pair.costs.json"
    assert main(["calibrate", "--target", str(ZLAB / "target"), "--drafter", str(ZLAB / "drafter"),
                 "--batches", "2", "--context", "16", "--repeats", "2", "--out", str(out),
                 "--no-compile-cache"]) == 0
    table = costs.load_tables(out)["cpu"]
    assert sorted(table.step_ms) == [2] and sorted(table.step_ms[2]) == [1, 2, 4]  # the drafter's block of 4
    assert all(ms > 0 for ms in table.step_ms[2].values()) and table.block_size == 4
    assert sorted(table.ar_ms) == sorted(table.static_ms) == [2] and table.static_ms[2] > 0
    assert (tmp_path / "pair.costs.cpu.png").stat().st_size > 1000
    assert "wrote the cpu table" in capsys.readouterr().out


def test_a_step_is_timed_without_its_calls_own_cost():
    """calibrate times a step as the slope of a call's time over its steps: a call that costs 3 ms of its own
    (a GPU's dispatch and wait) plus 1 ms a step reads 1 ms a step, not 1.25 (3 ms over 12 steps); calls that
    noise makes look equal still read a fifth of the long call's mean step, never 0."""
    now = [0.0]

    def clock():
        return now[0]

    def program(call_s, step_s):
        def fn(params, state, index, n):
            now[0] += call_s + int(n) * step_s
            return state + 1
        return fn

    ms, state = calibrate._timed(program(3e-3, 1e-3), None, np.int32(0), 0, repeats=18, clock=clock)
    assert ms == pytest.approx(1.0) and int(state) == 1 + 2 * calibrate.ROUNDS  # a warm-up, then 2 calls a round
    ms, _ = calibrate._timed(program(3e-3, 0.0), None, np.int32(0), 0, repeats=18, clock=clock)
    assert ms == pytest.approx(0.2 * 3.0 / 12)


def test_an_interrupted_calibration_keeps_the_batches_it_timed(tmp_path, monkeypatch):
    """Each batch's row is in the costs file as soon as it is timed: a calibration stopped during its second batch
    leaves the first (and the rows an earlier run of the same measurement timed)."""
    from dflash_jax.cli import main

    out = tmp_path / "pair.costs.json"
    costs.save_table(out, CostTable("cpu", costs.device_kind(), "float32", "target", 4, 16, {8: {1: 9.0, 4: 9.5}}))

    def measure(target, drafter, *, batches, **kw):
        if batches == (2,):
            raise KeyboardInterrupt
        rows = {b: {1: 1.0, 4: 2.0} for b in batches}
        return CostTable("cpu", costs.device_kind(), "float32", "target", 4, 16, rows)

    monkeypatch.setattr(calibrate, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        main(["calibrate", "--target", str(ZLAB / "target"), "--drafter", str(ZLAB / "drafter"), "--batches", "1,2",
              "--context", "16", "--out", str(out), "--no-compile-cache"])
    assert sorted(costs.load_tables(out)["cpu"].step_ms) == [1, 8]


def test_a_calibration_on_another_device_goes_beside_the_backend_s_table(tmp_path, monkeypatch, capsys):
    """`dflash-jax calibrate` where the costs file's table for the backend is another device's: that one stays,
    this device's is keyed by its kind, and its plot is named after the key."""
    from dflash_jax.cli import main

    out = tmp_path / "pair.costs.json"
    other = CostTable("cpu", "Other CPU", "float32", "target", 4, 16, {8: {1: 9.0, 4: 9.5}})
    costs.save_table(out, other)
    monkeypatch.setattr(costs, "device_kind", lambda: "Some CPU")
    monkeypatch.setattr(calibrate, "measure", lambda target, drafter, *, batches, **kw: CostTable(
        "cpu", "Some CPU", "float32", "target", 4, 16, {b: {1: 1.0, 4: 2.0} for b in batches}))
    assert main(["calibrate", "--target", str(ZLAB / "target"), "--drafter", str(ZLAB / "drafter"), "--batches", "1",
                 "--context", "16", "--out", str(out), "--no-compile-cache"]) == 0
    tables = costs.load_tables(out)
    assert sorted(tables) == ["cpu", "cpu@Some CPU"] and tables["cpu"] == other
    assert sorted(tables["cpu@Some CPU"].step_ms) == [1]
    assert (tmp_path / "pair.costs.cpu@Some_CPU.png").is_file()
    assert "wrote the cpu@Some CPU table" in capsys.readouterr().out


def test_cost_table_explains_break_even():
    """The demo's explanation when speculative decoding is slower: drafted-step costs in AR steps, read from the
    table at the batch (interpolated), or nothing without an AR column."""
    table = CostTable("cpu", "x", "float32", "p", 16, 64, {1: {1: 1.5, 16: 3.0}, 4: {1: 6.0, 16: 12.0}},
                      ar_ms={1: 1.0, 4: 4.0})
    assert "1.50 autoregressive steps" in table.explain(1) and "3.00 verifying all 16" in table.explain(1)
    assert "at batch 4 a drafted step costs 1.50" in table.explain(4)
    assert table.explain(2) and "3.00 verifying" in table.explain(2)
    assert dataclasses.replace(table, ar_ms={}).explain(1) is None
