"""The fallback to plain autoregressive steps (verify mode "auto", :mod:`dflash_jax.engine.switching`): switches
change speed, never output — greedy float32 runs equal AR with switches forced at random segments (static and
compact, DFlash and DSpark, whole calls, streams and pools), sampled runs are exact (χ²), the drafter's context
after a fallback segment is the one drafting would have written — and the policy's decisions."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import oracle_drafter, random_prompts, tiny_target
from dflash_jax import generate, random_drafter, speculative_generate, speculative_stream
from dflash_jax.costs import CostTable
from dflash_jax.decode import loop, verify_modes
from dflash_jax.engine import job as jobs
from dflash_jax.engine import switching
from dflash_jax.engine.switching import AUTOREGRESSIVE, DRAFT, Fallback, SwitchPolicy
from dflash_jax.settings import traced
from dflash_jax.tuning import SwitchTuning, Tuning
from test_dspark import oracle_dspark
from test_sampling import N, PROMPT, STEPS, V, chi2_pvalue, exact_distribution
from test_sampling import logits, pair  # noqa: F401 — fixtures

L = 4


def tuning(mode: str = "static", **kw) -> Tuning:
    """Short segments, so that a short run switches many times; auto resolves to ``mode`` with the table below.
    (Built in the test: the default Tuning reads the test's compile options from the environment.)"""
    return Tuning(ar_fallback=True, drafted_segment_cycles=2, fallback_steps=4,
                  auto_compact_ratio=math.inf if mode == "static" else 1.0).replace(**kw)


def table(batch: int) -> CostTable:
    """A drafted step costs 1.4–1.8 autoregressive ones: the fallback is armed, and compact's scheduler drafts."""
    return CostTable("cpu", "test", "float32", "tiny", L, 64, {batch: {1: 1.4, 2: 1.6, L: 1.8}},
                     ar_ms={batch: 1.0}, static_ms={batch: 1.8})


class RandomSwitches(SwitchPolicy):
    """A test double: each segment drafted or autoregressive at random (seeded), whatever was observed."""

    seed = 0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rng = np.random.default_rng(RandomSwitches.seed)

    def drafted(self, *args, **kw) -> None:
        pass

    def next_segment(self) -> str:
        return DRAFT if self.rng.random() < 0.5 else AUTOREGRESSIVE


class Scripted(SwitchPolicy):
    """A test double: the segments' modes in a given order (then autoregressive)."""

    modes: tuple[str, ...] = ()

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.left_modes = list(Scripted.modes)

    def drafted(self, *args, **kw) -> None:
        pass

    def next_segment(self) -> str:
        return self.left_modes.pop(0) if self.left_modes else AUTOREGRESSIVE


def check_log(stats: dict) -> list[dict]:
    """The run's segment log agrees with its counts: one entry per segment (one for a call run by ``generate``'s
    programs), the fallback's steps, the switches."""
    log = stats["fallback_log"]
    assert len(log) == stats["fallback_segments"] or [e["segment"] for e in log] == ["generate"]  # (a whole call)
    assert sum(e["steps"] for e in log if e["segment"] in (AUTOREGRESSIVE, "check", "generate")) \
        == stats["ar_fallback_steps"]
    ran = [AUTOREGRESSIVE if e["segment"] == "check" else e["segment"].replace("probe", DRAFT) for e in log]
    assert sum(a != b for a, b in zip(ran, ran[1:])) == stats["fallback_switches"]
    # a scheduled mode's drafted segments say which tiers their steps ran (steps on its own autoregressive tier,
    # where offered, are not among them)
    tiered = [e for e in log if "tiers" in e]
    for e in tiered:
        assert e["segment"] in (DRAFT, "probe") and stats["verify_mode"] != "static"
        assert 0 < sum(e["tiers"].values()) <= e["steps"] and set(e["tiers"]) <= set(stats["tier_steps"])
    if stats["verify_mode"] != "static" and sum(stats.get("tier_steps", {}).values()):
        assert tiered
    return log


@pytest.fixture
def random_switches(monkeypatch):
    monkeypatch.setattr(switching, "SwitchPolicy", RandomSwitches)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target("qwen3", seed=11)
    prompts = random_prompts(3, [4, 13, 9], target.config.vocab_size, seed=12)
    ref = generate(target, prompts, max_new_tokens=40, stop_token_ids=[7, 21])
    return target, prompts, ref


@pytest.mark.parametrize("kind,mode", [("dflash", "static"), ("dflash", "compact"), ("dspark", "compact")])
def test_random_switches_are_lossless(tiny, random_switches, kind, mode):
    """Greedy float32: the tokens of generate() whatever the segments ran, stop tokens and budgets included."""
    target, prompts, ref = tiny
    if kind == "dflash":
        drafter = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.3)
    else:
        drafter = oracle_dspark(target, prompts, ref.token_ids, drafts=L - 1, corrupt=0.3)
    for seed in (0, 1):
        RandomSwitches.seed = seed
        out = speculative_generate(target, drafter, prompts, max_new_tokens=40, stop_token_ids=[7, 21],
                                   cost_table=table(len(prompts)), tuning=tuning(mode))
        assert out.token_ids == ref.token_ids
        assert out.stats["verify_mode"] == mode
        assert out.stats["ar_fallback_steps"] > 0 and out.stats["fallback_switches"] >= 2
        check_log(out.stats)
        assert sum(map(sum, out.acceptance_lengths)) == sum(map(len, out.token_ids)) - len(prompts)
        assert max(a for row in out.acceptance_lengths for a in row) > 1  # drafted cycles accepted drafts


def test_streams_and_pools_switch_as_whole_calls(tiny, random_switches):
    """A stream's segments of any length switch where the whole call does (decisions fall on the same cycles), so
    even sampled streams give the whole call's tokens; a pool of 2 rows over 3 prompts stays lossless."""
    target, prompts, ref = tiny
    drafter = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.3)
    kw = dict(max_new_tokens=40, stop_token_ids=[7, 21], cost_table=table(len(prompts)), tuning=tuning())
    for temperature in (0.0, 1.0):
        whole = speculative_generate(target, drafter, prompts, temperature=temperature, seed=3, **kw)
        assert whole.stats["fallback_switches"] >= 2
        for cycles in (1, 3):
            stream = speculative_stream(target, drafter, prompts, segment_cycles=cycles, temperature=temperature,
                                        seed=3, **kw)
            for _ in stream:
                pass
            assert stream.output.token_ids == whole.token_ids
            assert stream.output.acceptance_lengths == whole.acceptance_lengths
    real = random_drafter(target, block_size=L, num_layers=1, seed=3)  # an oracle knows rows, not prompts
    pooled = speculative_generate(target, real, prompts, batch_size=2,
                                  **{**kw, "cost_table": table(2)})
    assert pooled.token_ids == ref.token_ids and pooled.stats["ar_fallback_steps"] > 0


def test_the_drafter_context_after_fallback_steps(tiny, monkeypatch):
    """A real (random) drafter: after drafted cycles, then a fallback segment that ends mid-buffer, the drafter's
    context cache holds, at every committed position, what a prefill over the whole text writes there."""
    target, prompts, _ = tiny
    drafter = random_drafter(target, block_size=L, num_layers=1, seed=3)
    monkeypatch.setattr(switching, "SwitchPolicy", Scripted)
    monkeypatch.setattr(Scripted, "modes", (DRAFT, AUTOREGRESSIVE))
    job = jobs.make(target, drafter, prompts, 13, stop_token_ids=[], cost_table=table(len(prompts)), tuning=tuning())
    assert job.fallback is not None
    state, _ = job.programs.prefill(*job.pre_args)
    state, _ = job.decoder(state, np.int32(1000))  # 2 drafted cycles, then autoregressive steps to the budget
    assert job.record.ar_steps > 0 and job.record.segments >= 2
    texts = [p + row[: int(n)].tolist() for p, row, n in zip(prompts, np.asarray(state.tokens), np.asarray(state.num_new))]
    # The reference: a prefill over each row's whole text (the same target and drafter), no decoding.
    longest = max(map(len, texts))
    padded = jnp.asarray([t + [0] * (longest - len(t)) for t in texts], jnp.int32)
    spec = dataclasses.replace(job.spec, verify_mode=verify_modes.STATIC, tiers=(), ar_step=False)
    ref = loop.prefill(target.model, drafter.model, padded, jnp.asarray(list(map(len, texts)), jnp.int32),
                       jnp.ones((len(texts),), jnp.int32), jnp.asarray([-1], jnp.int32), spec,
                       int(state.draft_cache.k[0].shape[1]), plan=False)
    anchor = np.asarray(state.anchor_pos)
    for got, want in zip(state.draft_cache.k + state.draft_cache.v, ref.draft_cache.k + ref.draft_cache.v):
        for row, a in enumerate(anchor):
            np.testing.assert_allclose(np.asarray(got[row, :a]), np.asarray(want[row, :a]), atol=2e-5, rtol=2e-5)


def test_sampled_switch_is_exact(pair, logits, monkeypatch):  # noqa: F811
    """N draws of 3 tokens: one drafted cycle, then autoregressive steps — the target's exact distribution
    (χ² against the enumeration of tests/test_sampling.py), drafts sampled and argmax."""
    target, drafter = pair
    monkeypatch.setattr(switching, "SwitchPolicy", Scripted)
    monkeypatch.setattr(Scripted, "modes", (DRAFT,))
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    one_cycle = tuning(drafted_segment_cycles=1, probe_cycles=1)
    cost = CostTable("cpu", "test", "float32", "tiny", L, 64, {N: {1: 2.0, L: 3.0}}, ar_ms={N: 1.0},
                     static_ms={N: 3.0})
    for draft_sampling in (True, False):
        out = speculative_generate(target, drafter, [PROMPT] * N, max_new_tokens=STEPS, stop_token_ids=[],
                                   temperature=1.0, seed=4, draft_sampling=draft_sampling, cost_table=cost,
                                   tuning=one_cycle)
        assert out.stats["ar_fallback_steps"] == 1 and out.stats["fallback_switches"] == 1
        firsts = [row[0] for row in out.acceptance_lengths]
        assert 1 in firsts and max(firsts) >= 2  # some rows took their 3rd token from the fallback's step
        assert chi2_pvalue(np.asarray(out.token_ids), probs) > 1e-3


def test_compiled_ahead_nothing_compiles_mid_run(tiny, random_switches):
    """What the batch command does before its first batch (``job.decoder.compile()``): afterwards a run that
    switches compiles nothing."""
    from dflash_jax.engine import programs

    target, prompts, ref = tiny
    drafter = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.3)
    kw = dict(stop_token_ids=[7, 21], cost_table=table(len(prompts)), tuning=tuning(fallback_steps=8))
    job = jobs.make(target, drafter, prompts, 40, **kw)
    job.decoder.compile()
    before = programs.compile_count()
    out = jobs.run(job)
    assert out.token_ids == ref.token_ids and out.stats["fallback_switches"] >= 2
    assert programs.compile_count() == before


def test_a_program_compiled_mid_run_is_compile_time_not_decode_time(tiny, monkeypatch):
    """The fallback's program compiles on first use, inside the decode: its compile time goes to ``compile_s``,
    not ``decode_s`` (nor tokens/s). A frozen clock that only moves while a program compiles (5 s each) makes the
    split exact: the decode itself then took no time."""
    import time

    from dflash_jax.engine import programs

    target, prompts, ref = tiny
    drafter = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.3)
    job = jobs.make(target, drafter, prompts, 40, stop_token_ids=[7, 21], cost_table=table(len(prompts)),
                    tuning=tuning(fallback_steps=12))  # a fallback program no other test compiles
    clock, compile_steps = [0.0], programs.compile_steps

    def compiling(*args, **kw):
        clock[0] += 5.0
        return compile_steps(*args, **kw)

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(programs, "compile_steps", compiling)
    monkeypatch.setattr(Scripted, "modes", (DRAFT, AUTOREGRESSIVE, DRAFT))
    job.decoder.policy.__class__ = Scripted
    job.decoder.policy.left_modes = list(Scripted.modes)
    out = jobs.run(job)
    assert out.token_ids == ref.token_ids and out.stats["ar_fallback_steps"] > 0
    assert out.stats["compile_s"] >= 5.0 and out.stats["decode_s"] == 0.0


def test_the_policy_falls_back_where_drafting_loses(tiny):
    """The real policy on scripted acceptance: an oracle that is always wrong (τ = 1) makes the loop fall back
    after its first segment (its probes come later than this run: tests above); an oracle always right never
    falls back."""
    target, prompts, ref = tiny
    kw = dict(max_new_tokens=40, stop_token_ids=[7, 21], cost_table=table(len(prompts)), tuning=tuning())
    wrong = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=1.0)
    out = speculative_generate(target, wrong, prompts, **kw)
    assert out.token_ids == ref.token_ids
    assert out.stats["ar_fallback_steps"] > 0.6 * out.stats["cycles"]  # most steps: fallback ones
    first, *rest = check_log(out.stats)  # the log says why: the probe saw τ = 1, drafting lost
    assert first["segment"] == "probe" and first["tau"] == 1.0 and first["value"] < 1.0
    assert first["then"] == AUTOREGRESSIVE and rest and all(e["segment"] == AUTOREGRESSIVE for e in rest)
    right = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.0)
    out = speculative_generate(target, right, prompts, **kw)
    assert out.token_ids == ref.token_ids and out.stats["ar_fallback_steps"] == 0


def test_a_later_run_starts_from_what_earlier_runs_observed(tiny, monkeypatch):
    """The drafter handle keeps the fallback's running estimate per batch shape: after a run where drafting lost,
    the next run of that shape starts on the fallback — no drafted probe first — and counts down to the earlier
    run's next probe; a whole call with no probe due runs ``generate``'s programs (not the switching loop); its
    tokens are still AR's. With ``remember_acceptance=False`` each run probes first."""
    target, prompts, ref = tiny
    kw = dict(stop_token_ids=[7, 21], cost_table=table(len(prompts)))
    wrong = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=1.0)
    first = speculative_generate(target, wrong, prompts, 40, tuning=tuning(), **kw)
    assert first.token_ids == ref.token_ids
    assert first.stats["ar_fallback_steps"] < first.stats["cycles"]  # it drafted a probe first
    (snap,) = wrong.observed.values()
    assert snap["mode"] == AUTOREGRESSIVE and snap["until_probe"] > 4  # more fallback segments than a short run has
    short = [t[:16] for t in ref.token_ids]
    with monkeypatch.context() as m:  # the drafted loop and the fallback's segments are not run at all
        m.setattr(switching.SwitchingDecoder, "__call__", lambda *a: pytest.fail("the switching loop ran"))
        second = speculative_generate(target, wrong, prompts, 16, tuning=tuning(), **kw)  # 4 segments of 4 steps
    assert second.token_ids == short and second.stats["ar_fallback_steps"] == second.stats["cycles"]
    assert second.stats["fallback_segments"] == 4 and {a for row in second.acceptance_lengths for a in row} == {1}
    assert [e["segment"] for e in check_log(second.stats)] == ["generate"]
    assert wrong.observed[next(iter(wrong.observed))]["until_probe"] == snap["until_probe"] - 4  # counted down
    fresh = speculative_generate(target, wrong, prompts, 16, tuning=tuning(remember_acceptance=False), **kw)
    assert fresh.token_ids == short and fresh.stats["ar_fallback_steps"] < fresh.stats["cycles"]  # a probe first
    # a drafter that pays keeps drafting from the start
    right = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.0)
    for _ in range(2):
        out = speculative_generate(target, right, prompts, 40, tuning=tuning(), **kw)
        assert out.token_ids == ref.token_ids and out.stats["ar_fallback_steps"] == 0


FB = Fallback(ar_ms=1.0, drafted_ms=(2.0,), tokens_per_row=(L,))


def segment(tau: float, rows: int = 16, steps: int = 8, left: int = 100):
    """A drafted segment's statistics: every row at ``tau`` tokens per step."""
    return np.full(rows, tau * steps), np.full(rows, steps), np.full(rows, left)


def test_a_snapshot_resumes_the_policy():
    p = SwitchPolicy(FB)
    p.drafted(*segment(1), 2.0)
    p.drafted(*segment(1), 2.0)
    assert p.mode == AUTOREGRESSIVE
    p.next_segment()
    q = SwitchPolicy(FB)
    q.resume(p.snapshot())
    assert (q.mode, q.tau, q.until_probe, q.probing) == (AUTOREGRESSIVE, p.tau, p.until_probe, False)
    assert [q.next_segment() for _ in range(p.until_probe + 1)][-1] == DRAFT  # the earlier run's countdown
    r = SwitchPolicy(FB)
    r.resume(None)  # nothing observed: a probe first
    assert r.next_segment() == DRAFT and r.probing
    d = SwitchPolicy(FB)  # drafting that clearly pays: segments double, and a later run starts at that length
    for _ in range(4):
        d.drafted(*segment(3), 2.0)
    assert d.mode == DRAFT and d.cycles == 2 * 2 ** 4
    e = SwitchPolicy(FB)
    e.resume(d.snapshot())
    assert e.cycles == d.cycles and not e.probing and e.next_segment() == DRAFT
    f = SwitchPolicy(FB)  # a run that ended on the fallback: its next drafted segment is a probe-sized one
    f.resume(dict(d.snapshot(), mode=AUTOREGRESSIVE))
    assert f.mode == AUTOREGRESSIVE and f.cycles == f.probe_cycles


def test_a_table_timed_elsewhere_is_checked_here():
    """The table says drafting pays (τ 3 at 2 ms against 1 ms: 1.5×, under `ar_check`); timed here, a drafted step
    takes 6 autoregressive ones: one short fallback segment times the other side, then the fallback. Where the
    timing agrees with the table (within `timing_trust`), drafting goes on and is not checked again; untimed
    segments use the table."""
    p = SwitchPolicy(FB)
    p.drafted(*segment(3), 2.0, wall_ms=6.0)
    assert p.mode == DRAFT and p.checking and p.next_segment() == AUTOREGRESSIVE
    p.fell_back(1.0)
    assert p.mode == AUTOREGRESSIVE and not p.checking and p.value() == pytest.approx(0.5)
    q = SwitchPolicy(FB)
    q.drafted(*segment(3), 2.0, wall_ms=2.2)  # 10 % off the table: within TIMING_TRUST, the table decides
    assert q.checking and q.next_segment() == AUTOREGRESSIVE
    q.fell_back(1.0)
    assert q.mode == DRAFT and q.next_segment() == DRAFT and q.value() == pytest.approx(1.5)
    q.drafted(*segment(3), 2.0, wall_ms=2.2)
    assert not q.checking and q.next_segment() == DRAFT
    r = SwitchPolicy(FB)
    r.drafted(*segment(3), 2.0)
    assert not r.checking and r.value() == pytest.approx(1.5)


def test_only_generates_own_step_raises_the_autoregressive_cost():
    """Timed dearer than the table, a fallback segment's step does not make drafting look better (the table's
    cost stays); ``generate``'s own step, timed in a call that skipped drafting, does — and where it is cheaper
    than the table's, drafting that the table says pays is left."""
    p = SwitchPolicy(FB)
    p.drafted(*segment(1.8), 2.0, wall_ms=2.0)  # 0.9× AR by the table (kept, within leave_optimism: checked)
    assert p.mode == DRAFT and p.checking
    p.fell_back(3.3)  # the fallback segment's step timed 3.3× the table's: drafting would read 3.0×
    assert p.ar_ms == pytest.approx(1.0) and p.value() == pytest.approx(0.9)
    p.skipped(2, wall_ms=3.3)  # a whole call on generate's programs: the step is that dear here
    assert p.ar_ms == pytest.approx(3.3) and p.value() == pytest.approx(1.8 * 3.3 / 2.0)
    q = SwitchPolicy(FB)
    q.skipped(1, wall_ms=0.5)
    q.drafted(*segment(3), 2.0, wall_ms=2.0)  # 1.5× by the table, but generate's step is half the table's
    assert q.ar_ms == pytest.approx(0.5) and q.mode == AUTOREGRESSIVE


@pytest.mark.parametrize("rows", [3, 32])
def test_probes_are_shorter_where_the_batch_observes_enough_rows(tiny, rows):
    """A first drafted segment (a probe) runs ``probe_cycles`` cycles at a few rows, and one where the batch gives
    PROBE_ROW_STEPS row steps in one cycle: a drafter that never pays drafts that many cycles, then falls back."""
    target = tiny[0]
    prompts = random_prompts(rows, [4, 13, 9], target.config.vocab_size, seed=12)
    ref = generate(target, prompts, max_new_tokens=12, stop_token_ids=[])
    wrong = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=1.0)
    out = speculative_generate(target, wrong, prompts, 12, stop_token_ids=[], cost_table=table(rows),
                               tuning=tuning(fallback_steps=16, remember_acceptance=False))
    assert out.token_ids == ref.token_ids
    drafted = out.stats["cycles"] - out.stats["ar_fallback_steps"]
    assert drafted == (1 if rows >= SwitchTuning().probe_row_steps else 2)
    # only probes are shortened: a drafted segment after an unclear one keeps probe_cycles (host returns)
    p = SwitchPolicy(FB, rows=rows)
    assert p.probe_len == (1 if rows >= SwitchTuning().probe_row_steps else 2) and p.next_segment() == DRAFT
    p.drafted(*segment(1.3), 1.2)  # 1.08× AR: drafting stays, not clearly
    assert p.mode == DRAFT and p.cycles == p.probe_cycles == 2


def test_a_probe_call_pays_its_segments():
    """A call that holds a probe runs all its steps in segments, not ``generate``'s programs: where a segment's
    step was timed dearer than theirs, a probe costs that difference over the call's steps too, and probes
    come further apart (here 47 fallback segments instead of 7)."""
    def segments_to_probe(segment_wall_ms: float) -> int:
        p = SwitchPolicy(FB)
        p.begin_call(2)  # calls of 2 fallback segments' steps; the first drafts
        assert not p.skips_call(2) and p.call_segments == 2
        p.skipped(2, 1.0)  # generate's programs: 1 ms a step
        p.fell_back(segment_wall_ms)
        for tau in (3, 1, 1):
            p.drafted(*segment(tau), 2.0)
        assert p.mode == AUTOREGRESSIVE
        return p.until_probe

    # 2 probe cycles × 2 ms, plus (segment − plain) × 32 steps × 2 segments in the table's units (× 1 / 1.25 ms).
    assert segments_to_probe(1.0) == 7 and segments_to_probe(1.5) == 47


def test_a_cold_probe_costs_its_wall_and_times_no_step():
    """A call's first drafted segment (``cold``: after the prefill or fallback segments) may take several steps'
    time more than its steps — 92 ms for a 26 ms step once at 128 rows on an H100. Its wall is then what a probe
    costs (probes come further apart: here 63 fallback segments instead of 7), never a drafted step's time: the
    timed ratio of the two steps, and with it the value of drafting, stays the table's (a cold wall read as a step
    once made a 1.26× batch fall back)."""
    def after(wall_ms: float, cold: bool) -> SwitchPolicy:
        p = SwitchPolicy(FB)
        p.fell_back(1.0)  # the fallback timed here as the table says: 1 ms a step
        p.drafted(*segment(1, steps=2), 2.0, wall_ms=wall_ms, cold=cold)  # a probe of 2 cycles, τ 1: 0.5×
        assert p.mode == AUTOREGRESSIVE
        return p

    warm, cold = after(2.0, cold=False), after(20.0, cold=True)
    assert warm.until_probe == 7 and cold.until_probe == 63  # 40 ms ≤ 2 % of 63 segments × 32 ms
    assert cold.drafted_wall_ms is None and cold.ar_ms == 1.0 and cold.value() == pytest.approx(0.5)
    late = after(20.0, cold=False)  # the same wall read as two steps: 10× the table's step
    assert late.ar_ms == pytest.approx(0.1) and late.value() == pytest.approx(0.05)
    resumed = SwitchPolicy(FB)
    resumed.resume(cold.snapshot())
    assert resumed.probe_wall_ms == cold.probe_wall_ms == 40.0


def test_each_calls_first_drafted_segment_is_cold(tiny, monkeypatch):
    """The decoder tells the policy which drafted segments came first after another program: after the prefill,
    and after fallback segments; a drafted segment after a drafted one is not, nor is one that a stream's next
    call continues on the state the last call returned."""
    target, prompts, ref = tiny
    seen = []

    class Spy(Scripted):
        def drafted(self, *args, cold=False, **kw) -> None:
            seen.append(cold)

    monkeypatch.setattr(Scripted, "modes", (DRAFT, DRAFT, AUTOREGRESSIVE, DRAFT))
    monkeypatch.setattr(switching, "SwitchPolicy", Spy)
    right = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.0)
    out = speculative_generate(target, right, prompts, 40, stop_token_ids=[7, 21], cost_table=table(3),
                               tuning=tuning(drafted_segment_cycles=1, probe_cycles=1, remember_acceptance=False))
    assert out.token_ids == ref.token_ids
    assert seen[:3] == [True, False, True]
    seen.clear()
    monkeypatch.setattr(Scripted, "modes", (DRAFT,) * 40)
    stream = speculative_stream(target, right, prompts, 40, stop_token_ids=[7, 21], cost_table=table(3),
                                segment_cycles=1, tuning=tuning(drafted_segment_cycles=1, probe_cycles=1,
                                                                remember_acceptance=False))
    for _ in stream:  # one cycle a call, one a segment: every drafted segment starts a call
        pass
    assert stream.output.token_ids == ref.token_ids
    assert len(seen) > 3 and seen[0] and not any(seen[1:])


def test_policy_decisions():
    p = SwitchPolicy(FB)  # probes of 2 cycles, fallback segments of 32 steps
    assert p.next_segment() == DRAFT and p.probing  # the first segment is probe-sized
    p.drafted(*segment(3), 2.0)  # τ 3 at 2 ms: 1.5× AR, clearly (1.3× read 1.5 standard errors down)
    assert p.mode == DRAFT and p.value() == pytest.approx(1.5) and not p.probing
    assert p.cycles == 4  # the next drafted segment twice as long
    p.drafted(*segment(1), 2.0)  # τ 1 now: running 2 → 1.0×, stays, but back to short segments
    assert p.mode == DRAFT and p.cycles == 2
    p.drafted(*segment(1), 2.0)  # running 1.5 (rows 1.6 with their prior) → 0.8×: falls back
    assert p.mode == AUTOREGRESSIVE
    # A probe (2 cycles × 2 ms) costs ≤ 2 % of the fallback time between two: 7 segments of 32 × 1 ms first.
    assert [p.next_segment() for _ in range(8)] == [AUTOREGRESSIVE] * 7 + [DRAFT] and p.probing
    p.drafted(*segment(1), 2.0)  # the probe loses: the backoff doubles
    assert p.mode == AUTOREGRESSIVE and [p.next_segment() for _ in range(15)] == [AUTOREGRESSIVE] * 14 + [DRAFT]
    p.drafted(*segment(4), 2.0)  # the text got easy: drafting again
    assert p.mode == DRAFT and p.next_segment() == DRAFT and p.backoff == 1 and not p.probing


def test_a_segment_that_would_leave_a_short_tail_runs_until_the_rows_are_done(tiny):
    """The rows' budgets nearly spent within one more drafted segment: that segment runs until they are, instead of
    ending a few steps short and leaving a tail segment (its return to the host) — same tokens, one segment fewer."""
    target, prompts, _ = tiny
    ref = generate(target, prompts, max_new_tokens=50, stop_token_ids=[])
    right = oracle_drafter(target, prompts, ref.token_ids, block_size=L, corrupt=0.0)  # τ = L throughout
    logs = {}
    for finish_within in (SwitchTuning().finish_within, -1.0):  # (-1: never run past the running length)
        t = tuning(drafted_segment_cycles=4, remember_acceptance=False).replace(
            switching=SwitchTuning(finish_within=finish_within))
        out = speculative_generate(target, right, prompts, 50, stop_token_ids=[], cost_table=table(3), tuning=t)
        assert out.token_ids == ref.token_ids
        logs[finish_within] = [e["steps"] for e in check_log(out.stats) if e["segment"] in (DRAFT, "probe")]
    extended, plain = logs.values()
    assert len(extended) == len(plain) - 1 and sum(extended) == sum(plain)
    assert extended[-1] > 4 >= max(plain) and plain[-1] < 4  # the tail held in a longer last segment


def test_segment_cycles_follow_the_rows_budgets():
    p = SwitchPolicy(FB, max_cycles=8)
    assert p.segment_cycles(np.array([40, 10])) == p.cycles  # nothing observed yet
    p.drafted(*segment(4), 2.0)
    assert p.cycles == 4
    assert p.segment_cycles(np.array([40, 0])) == 4  # 10 steps needed: more than 1.5 segments
    assert p.segment_cycles(np.array([24, 3])) == 8  # 6 steps, read at 3 tokens a step: 8 cycles
    assert p.segment_cycles(np.array([8, 0])) == 4  # within the running length: unchanged
    assert p.segment_cycles(np.zeros(2, int)) == 4
    p.drafted(*segment(0.2), 2.0)  # τ now 2.1 (running): 1.05× AR, not clearly (1.5 standard errors down)
    assert p.mode == DRAFT and p.cycles == 2 and p.segment_cycles(np.array([5, 1])) == 2  # (clearly: 4)
    pool = SwitchPolicy(FB, pooled=True, max_cycles=8)  # a pool's rows are refilled: its budgets end nothing
    pool.drafted(*segment(4), 2.0)
    assert pool.segment_cycles(np.array([24, 3])) == pool.cycles == 4


def test_a_few_unlucky_cycles_do_not_end_drafting():
    """One row, two cycles that accepted nothing: 0.5× by the point estimate, but 1.5 standard errors up (τ̂ / √2
    each) it could pay: drafting goes on; twenty such cycles end it."""
    p = SwitchPolicy(FB)
    p.drafted(np.array([2]), np.array([2]), np.array([100]), 2.0)
    assert p.value() == pytest.approx(0.5) and p.mode == DRAFT
    for _ in range(9):
        p.drafted(np.array([2]), np.array([2]), np.array([100]), 2.0)
    assert p.mode == AUTOREGRESSIVE


def test_a_whole_call_waits_for_its_slowest_row_and_a_pool_does_not():
    """Rows at τ 4 and τ 1.2 over 200 steps with the same budget left: the call ends with the slow row (its τ shrunk
    towards the batch's 2.6 over 16 pseudo-steps: 1.30 tokens per 2 ms < 1 per ms: fall back), while a pool is paid
    by the mean (2.6 per 2 ms: keep drafting); a row done no longer holds the call back. After 2 steps alone the
    slow row is mostly noise: the batch's τ outweighs it."""
    tokens, steps, left = np.array([800, 240]), np.array([200, 200]), np.array([30, 30])
    whole, pooled = SwitchPolicy(FB), SwitchPolicy(FB, pooled=True)
    for p in (whole, pooled):
        p.drafted(tokens, steps, left, 2.0)
    assert whole.value() == pytest.approx((240 + 16 * 2.6) / 216 / 2) and whole.mode == AUTOREGRESSIVE
    assert pooled.value() == pytest.approx(1.3) and pooled.mode == DRAFT
    done = SwitchPolicy(FB)
    done.drafted(tokens, steps, np.array([30, 0]), 2.0)
    assert done.value() == pytest.approx((800 + 16 * 2.6) / 216 / 2) and done.mode == DRAFT
    early = SwitchPolicy(FB)
    early.drafted(np.array([8, 2]), np.array([2, 2]), left, 2.0)
    assert early.mode == DRAFT and early.row_tau[1] == pytest.approx((2 + 16 * 2.5) / 18)


def test_the_slowest_row_of_many_needs_more_steps_than_tau_says():
    """E[max] of normals: two alike rows 1/√π deviations past the mean, 128 rows 2.59; a row far ahead decides
    alone. The variance of tokens per step is read within rows (rows of unlike τ do not add to it) where a row ran
    two steps or more, else over every row's step."""
    slowest = switching.expected_slowest
    assert slowest(np.array([50.0, 50.0]), np.ones(2)) == pytest.approx(50 + 1 / math.sqrt(math.pi), abs=1e-3)
    assert slowest(np.full(128, 50.0), np.ones(128)) == pytest.approx(52.594, abs=2e-3)
    assert slowest(np.array([10.0, 50.0]), np.array([1.0, 0.5])) == pytest.approx(50.0, abs=1e-3)
    rng = np.random.default_rng(0)  # rows of unlike means and spreads: against sampling
    means, sds = rng.uniform(40, 43, 128), rng.uniform(1.5, 2.5, 128)
    sampled = (rng.standard_normal((20000, 128)) * sds + means).max(axis=1).mean()
    assert slowest(means, sds) == pytest.approx(sampled, abs=0.03)
    # rows at τ 2 and 4, each alternating ±1 around it over 4 steps: within-row variance 4 · 1 / 3 each
    tokens, steps, squares = np.array([8, 16]), np.array([4, 4]), np.array([1 + 9 + 1 + 9, 9 + 25 + 9 + 25])
    assert switching.step_variance(tokens, steps, squares) == pytest.approx(8 / 6)
    assert switching.step_variance(np.array([1, 3]), np.array([1, 1]), np.array([1, 9])) == pytest.approx(1.0)


@pytest.mark.parametrize("rows,pooled,squares,drafts", [(128, False, True, False), (128, False, False, True),
                                                        (128, True, True, True), (4, False, True, True)])
def test_a_whole_call_of_many_rows_counts_their_bad_luck(rows, pooled, squares, drafts):
    """A probe: every row committed 4, 4 and 1 tokens in 3 steps (τ 3, variance 3 a step), 128 tokens left, a
    drafted step 2.6 autoregressive ones (the 8B shape's 4-token tier at 128 rows on an H100). By τ alone drafting
    pays 1.15×, but the slowest of 128 rows needs 2.6 standard deviations (3.8 steps each) more than 128 / τ: 0.94×,
    the fallback stays. A pool is paid by the mean, and the slowest of 4 rows lags less (1.06×): both draft again;
    so does a call whose squares were not observed."""
    p = SwitchPolicy(Fallback(ar_ms=1.0, drafted_ms=(2.6,), tokens_per_row=(4,)), pooled=pooled)
    p.mode = AUTOREGRESSIVE  # on the fallback: the next drafted segment is a probe
    p.drafted(np.full(rows, 9), np.full(rows, 3), np.full(rows, 128), 2.6, None,
              np.full(rows, 16 + 16 + 1) if squares else None)
    assert p.mode == (DRAFT if drafts else AUTOREGRESSIVE)
    expected = {(128, False, True): 128 / (2.6 * (128 / 3 + 2.594 * math.sqrt(128 * 3 / 27))),
                (4, False, True): 128 / (2.6 * (128 / 3 + 1.029 * math.sqrt(128 * 3 / 27)))}
    assert p.value() == pytest.approx(expected.get((rows, pooled, squares), 3 / 2.6), rel=1e-3)


def test_when_the_fallback_is_armed():
    """Armed for "auto" where the table times an autoregressive step 1.3 times cheaper than every drafted step;
    never for a mode named explicitly, without the column, or where a drafted step is that cheap; never drafting where no
    drafted step can pay even with every draft accepted."""
    costs = verify_modes.BatchCosts(4, L, 1, False, lambda: table(4))
    auto, static = verify_modes.by_name("auto"), verify_modes.STATIC
    fast = tuning()
    resolved = static.resolve(costs, fast)
    armed = switching.fallback_for(auto, resolved, costs, fast)
    assert armed == Fallback(1.0, (1.8,), (L,)) and armed.can_pay
    assert switching.fallback_for(static, resolved, costs, fast) is None
    assert switching.fallback_for(auto, resolved, costs, fast.replace(ar_fallback=False)) is None
    no_ar = verify_modes.BatchCosts(4, L, 1, False, lambda: dataclasses.replace(table(4), ar_ms={}))
    assert switching.fallback_for(auto, resolved, no_ar, fast) is None
    cheap = verify_modes.BatchCosts(4, L, 1, False, lambda: dataclasses.replace(table(4), ar_ms={4: 1.8 / 1.25}))
    assert switching.fallback_for(auto, resolved, cheap, fast) is None  # drafted steps ≤ 1.3 AR steps: not armed
    lower = fast.replace(switching=SwitchTuning(arm_breakeven=1.2))  # the threshold is a knob
    assert switching.fallback_for(auto, resolved, cheap, lower) == Fallback(1.8 / 1.25, (1.8,), (L,))
    assert traced(lower) == traced(fast)  # host-side only: it never splits the program cache
    compact = verify_modes.by_name("compact").resolve(costs, fast)
    got = switching.fallback_for(auto, compact, costs, fast)
    assert got.tokens_per_row[:len(compact.tiers)] == tuple(t // 4 for t in compact.tiers)
    hopeless = Fallback(1.0, (5.0,), (L,))
    assert not hopeless.can_pay and SwitchPolicy(hopeless).next_segment() == AUTOREGRESSIVE
