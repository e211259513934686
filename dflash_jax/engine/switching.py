"""Falling back to plain autoregressive decoding where drafting does not pay (verify mode ``"auto"``).

A drafted step costs more than an autoregressive one — at large batches several times more (docs/verify-modes.md)
— and pays only while the rows commit enough tokens per step. Where the cost table times both steps and every
drafted step costs more than ``arm_breakeven`` autoregressive ones (the thresholds here are the fields of
``Tuning.switching``, :class:`~dflash_jax.tuning.SwitchTuning`), :func:`decoder` runs a job's decode loop in
*segments* and, between them, compares the two rates with the acceptance observed so far:

    drafted:        τ̂ / (ms of the drafted steps run)     tokens per row and ms
    autoregressive: 1 / (ms of an autoregressive step)

τ̂ is the tokens a row committed per drafted step, averaged over recent segments (an estimate that follows the
text), and the drafted steps' cost is the table's cost of the tiers they ran. Each segment is also timed here
(from its dispatch to its counts on the host); once both kinds were timed and the ratio of their costs is off the
table's by more than ``timing_trust``, the autoregressive step's cost is the drafted one's times the ratio
timed, so a table measured on another machine cannot keep a batch drafting at a loss: where the table says
drafting pays by less than ``ar_check``, one short fallback segment times the other side early. While drafting
loses, the loop runs the plain autoregressive program (:func:`dflash_jax.decode.loop.fallback`: the step
``generate`` runs, whose captured features write the drafter's context once per segment) and, from time to
time, one drafted *probe* segment to see whether the text has become easier (:class:`SwitchPolicy` says when).
Every token is still the target's own — the fallback's steps are the target's autoregressive steps — so a
switch changes speed, never output.

Cost: one return to the host per segment (a call of a compiled loop and one small device-to-host read): hence
segments that grow while drafting clearly pays, and no segments at all where a drafted step costs little more
than an autoregressive one.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode import loop, verify_modes
from dflash_jax.decode.state import DecodeState
from dflash_jax.engine import programs as progs
from dflash_jax.tuning import SwitchTuning, Tuning

DRAFT, AUTOREGRESSIVE = "draft", "autoregressive"


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A batch's costs from the table (per device: a dp shard's rows): ms of an autoregressive step, and of the
    drafted program's steps — the static verify's step, or a scheduled mode's step at each tier (and its own
    autoregressive tier where offered) — with the tokens per row the most each can commit."""

    ar_ms: float
    drafted_ms: tuple[float, ...]
    tokens_per_row: tuple[int, ...]

    @property
    def can_pay(self) -> bool:
        """Some drafted step commits enough, at best, to beat autoregressive steps."""
        return any(n * self.ar_ms > ms for n, ms in zip(self.tokens_per_row, self.drafted_ms))


def fallback_for(policy: verify_modes.VerifyPolicy, resolved: verify_modes.Resolved,
                 costs: verify_modes.BatchCosts, tuning: Tuning) -> Fallback | None:
    """The fallback's costs for a batch, where ``policy`` falls back (``"auto"``, :attr:`Tuning.ar_fallback`)
    and the table times an autoregressive step more than ``tuning.switching.arm_breakeven`` times cheaper than
    every drafted step (else None)."""
    if not (policy.falls_back and tuning.ar_fallback) or costs.block_size < 2:
        return None
    ar_ms = costs.fallback_cost
    if ar_ms is None:
        return None
    mode = resolved.mode
    if mode.scheduled:
        per_row = [t // costs.batch for t in resolved.tiers]
        ms = [float(c) for c in resolved.step_cost[: len(per_row)]]
        drafted = min(ms)
        if resolved.ar_step:  # the scheduler's own step without drafting, at the table's cost
            per_row.append(1)
            ms.append(float(resolved.step_cost[len(resolved.tiers)]))
    else:
        static = costs.static_cost
        per_row, ms = [costs.block_size], [float(costs.step_cost[-1] if static is None else static)]
        drafted = ms[0]
    if drafted <= tuning.switching.arm_breakeven * ar_ms:
        return None
    return Fallback(float(ar_ms), tuple(ms), tuple(per_row))


class SwitchPolicy:
    """When to draft and when to fall back, from the segments' statistics (host only).

    A batch that waits for its slowest row (a whole call) finishes when the row with the most work left does:
    the fallback's time is ``max_r(left_r) × autoregressive ms``, drafting's ``max_r(left_r / τ_r) × drafted ms``
    — with ``τ_r`` each row's own running estimate and ``left_r`` its budget left — and chance adds to the slowest
    row: a row's steps to commit ``left_r`` tokens vary by ``√(left_r σ² / τ_r³)`` (σ² the variance of a row's
    tokens per step), so drafting's steps are the expected slowest of the rows' (:func:`expected_slowest`; at 128
    rows, markedly more than τ alone says: docs/verify-modes.md). A pool (``pooled``: finished rows get new prompts)
    is paid by its throughput: the rows' mean τ.

    The first segment and every probe draft ``probe_len`` cycles (short: where drafting loses, each costs);
    drafting is left only when it loses even by an optimistic reading of what was seen (τ̂ ``leave_optimism``
    standard errors up, a standard error taken as τ̂ / √(row steps seen)): a row or two of a few cycles may have
    been unlucky. Probes come after enough fallback segments that a probe costs at most ``probe_share`` of the
    time between two (more while probes keep losing: up to ``max_backoff`` times that). Drafted segments are
    probe-sized while it is not clear that drafting pays, and double (up to ``max_cycles``) while it clearly
    does (even with the τs read leave_optimism standard errors down): each segment ends with a return to the
    host, a few ms with a large model. The thresholds: ``settings`` (:class:`~dflash_jax.tuning.SwitchTuning`)."""

    def __init__(self, fallback: Fallback, pooled: bool = False, probe_cycles: int = 2, fallback_steps: int = 32,
                 max_cycles: int = 128, rows: int | None = None, settings: SwitchTuning = SwitchTuning()):
        self.fallback, self.pooled, self.settings = fallback, pooled, settings
        self.probe_cycles, self.fallback_steps, self.max_cycles = probe_cycles, fallback_steps, max_cycles
        # a probe's cycles: fewer where ``rows`` rows observe ``probe_row_steps`` row steps in fewer
        self.probe_len = (probe_cycles if rows is None
                          else max(1, min(probe_cycles, -(-settings.probe_row_steps // rows))))
        self.tau: float | None = None  # tokens per row and drafted step over the batch, running
        self.seen = 0  # row steps behind self.tau since it was last restarted
        self.var: float | None = None  # variance of a row's tokens per drafted step, running (None: not observed)
        self.row_tokens: np.ndarray | None = None  # [B] each row's tokens from drafted steps so far
        self.row_steps: np.ndarray | None = None  # [B] and its drafted steps
        self.left: np.ndarray | None = None  # [B] tokens each active row may still commit (0: done)
        self.step_ms: float | None = None  # ms of a drafted step, running (the cost table's)
        # Wall ms per step as timed here, running: drafted segments' and fallback segments'. Their ratio corrects
        # the table's autoregressive cost (:attr:`ar_ms`).
        self.drafted_wall_ms: float | None = None
        self.ar_wall_ms: float | None = None
        # The autoregressive step timed apart by where it ran: in this loop's fallback segments (which also write
        # the drafter's context) and in whole calls run by ``generate``'s programs. A call that holds a probe runs
        # every step in segments, so it pays their difference too (:meth:`_fall_back`).
        self.segment_wall_ms: float | None = None
        self.plain_wall_ms: float | None = None
        # Wall ms of a whole probe as timed here, running: a probe is the first drafted segment after another
        # program ran, and that can take several steps' time more than its steps (benchmarks/README.md).
        self.probe_wall_ms: float | None = None
        self.call_segments = 1  # fallback segments in a call, as the last call began (:meth:`begin_call`)
        self.checking = False  # the next autoregressive segment is a short timing check (drafting goes on after)
        self.mode = DRAFT if fallback.can_pay else AUTOREGRESSIVE
        self.backoff = 1  # grows while probes lose
        self.until_probe = 0  # fallback segments left before the next probe (AUTOREGRESSIVE)
        self.probing = True  # the next drafted segment is a probe (or the first): probe_len long
        self.cycles = probe_cycles  # the next drafted segment's length

    @property
    def ar_ms(self) -> float:
        """An autoregressive step's cost in the table's drafted-step units: the table's own, or — once both
        kinds of step were timed here and the ratio timed is off the table's by more than ``timing_trust`` — the
        drafted cost times the ratio timed. Cheaper than the table says: by any autoregressive step timed
        (drafting then pays less). Dearer: only by ``generate``'s own step, timed in whole calls that skipped
        drafting — falling back leads to those calls, and a fallback segment's step can be timed dearer than
        theirs (its host return, its context write, a program's early runs), which once kept a batch drafting at
        a loss (benchmarks/README.md, "Large batches")."""
        table = self.fallback.ar_ms
        if self.ar_wall_ms is None or self.drafted_wall_ms is None or self.step_ms is None:
            return table
        trust, per_wall = self.settings.timing_trust, self.step_ms / self.drafted_wall_ms
        cheapest = min(w for w in (self.ar_wall_ms, self.plain_wall_ms) if w is not None) * per_wall
        if cheapest * trust < table:
            return cheapest
        if self.plain_wall_ms is not None and self.plain_wall_ms * per_wall > table * trust:
            return self.plain_wall_ms * per_wall
        return table

    @property
    def row_tau(self) -> np.ndarray:
        """Each row's τ: its own drafted steps, shrunk towards the batch's running τ by ``row_prior_steps``
        pseudo-steps (a few cycles of one row say little: the slowest-looking row of a large batch would
        otherwise be mostly noise)."""
        prior = self.settings.row_prior_steps
        return (self.row_tokens + prior * self.tau) / (self.row_steps + prior)

    def value(self, optimism: float = 0.0) -> float:
        """Drafting's speed ÷ the fallback's (> 1: drafting pays), from the running estimates; ``optimism``: the
        τs read that many standard errors up."""
        ar_ms = self.ar_ms
        up = max(0.0, 1.0 + optimism / np.sqrt(max(self.seen, 1)))
        if self.pooled or self.left is None or not (self.left > 0).any():
            return up * self.tau * ar_ms / self.step_ms
        active = self.left > 0
        left = self.left[active]
        tau = self.row_tau[active]
        steps = float((left / tau).max())
        if self.var:  # the slowest row's bad luck still to come (class docstring)
            steps = expected_slowest(left / tau, np.sqrt(left * self.var / tau ** 3))
        return up * (left.max() * ar_ms) / (steps * self.step_ms)

    def segment_cycles(self, left: np.ndarray) -> int:
        """A drafted segment's cycles, given each row's budget ``left`` [B] (tokens; 0: done) as it starts: the
        running length (:attr:`cycles`), or — while drafting clearly pays (as for doubling the length) and the rows
        are expected to spend their budgets within ``finish_within`` segments more — enough for them to (their
        slowest row's luck allowed for by reading the batch's τ a quarter low): a segment ends with a return to the
        host, and the call's last one would otherwise often be a few steps (``SwitchTuning.finish_within``). Not
        for probes, nor in a pool."""
        active = left > 0
        if self.pooled or self.tau is None or self.mode != DRAFT or not active.any():
            return self.cycles
        cfg = self.settings
        if self.value(optimism=-cfg.leave_optimism) < 1.0 + cfg.leave_margin:
            return self.cycles  # near break-even: keep deciding at the running length
        need = float(left[active].max()) / self.tau
        if need > (1.0 + cfg.finish_within) * self.cycles:
            return self.cycles
        return max(self.cycles, int(np.ceil(need / 0.75)))

    def drafted(self, tokens: np.ndarray, steps: np.ndarray, left: np.ndarray, step_ms: float,
                wall_ms: float | None = None, squares: np.ndarray | None = None, cold: bool = False) -> None:
        """A drafted segment: per row, the tokens it committed in its ``steps`` active steps and the budget it has
        ``left`` (0 once done); ``step_ms``: what a step of the segment cost by the table; ``wall_ms``: what one
        took here (None: not timed); ``squares``: per row, the sum over its steps of the squared tokens a step
        (None: not observed — then chance is left out of a whole call's time); ``cold``: the segment was the first
        drafted one after another program ran (the prefill, a pool's refill, fallback segments), whose wall may
        hold more than its steps: it then times a probe's cost, not a drafted step's."""
        ran = steps > 0
        if not ran.any():
            return
        cfg = self.settings
        stale = self.mode == AUTOREGRESSIVE or self.tau is None  # a probe: the running figures are stale
        if wall_ms is not None and not cold:
            self.drafted_wall_ms = self._running(self.drafted_wall_ms, wall_ms)
        elif wall_ms is not None and stale:
            self.probe_wall_ms = self._running(self.probe_wall_ms, wall_ms * int(steps.max()))
        w = 1.0 if stale else cfg.smoothing
        tau = float(tokens[ran].sum() / steps[ran].sum())
        self.tau = tau if stale else w * tau + (1 - w) * self.tau
        if squares is not None:
            var = step_variance(tokens[ran], steps[ran], squares[ran])
            self.var = var if stale or self.var is None else w * var + (1 - w) * self.var
        self.seen = int(steps.sum()) + (0 if stale else self.seen)
        self.step_ms = step_ms if stale else w * step_ms + (1 - w) * self.step_ms
        if self.row_tokens is None or self.row_tokens.shape != tokens.shape:
            self.row_tokens, self.row_steps = np.zeros(tokens.shape), np.zeros(tokens.shape)
        self.row_tokens = self.row_tokens + tokens
        self.row_steps = self.row_steps + steps
        self.left = left
        self.probing = False
        if self.mode == AUTOREGRESSIVE:  # a probe
            if self.value() >= 1.0:
                self.mode, self.backoff = DRAFT, 1
            else:
                self.backoff = min(2 * self.backoff, cfg.max_backoff)
                self._fall_back()
        elif self.value(optimism=cfg.leave_optimism) < 1.0 - cfg.leave_margin:
            self.mode = AUTOREGRESSIVE
            self._fall_back()
        if self.mode == DRAFT and self.value(optimism=-cfg.leave_optimism) >= 1.0 + cfg.leave_margin:
            self.cycles = min(2 * self.cycles, self.max_cycles)  # clearly paying: fewer returns to the host
        else:
            self.cycles = self.probe_cycles  # not clear yet: decide again soon
        # Paying by the table, but not by so much that the table cannot be wrong here: time the other side once.
        self.checking = (self.mode == DRAFT and wall_ms is not None and not cold and self.ar_wall_ms is None
                         and self.value() < cfg.ar_check)

    def fell_back(self, wall_ms: float | None) -> None:
        """A fallback segment ran (``wall_ms``: what a step of it took here; None: not timed). After a timing check,
        drafting goes on only if it still pays with the autoregressive step as timed."""
        if wall_ms is not None:
            self.ar_wall_ms = self._running(self.ar_wall_ms, wall_ms)
            self.segment_wall_ms = self._running(self.segment_wall_ms, wall_ms)
        if self.mode == DRAFT and self.checking:
            self.checking = False  # (untimed: the next timed drafted segment asks again)
            cfg = self.settings
            if self.value(optimism=cfg.leave_optimism) < 1.0 - cfg.leave_margin:
                self.mode = AUTOREGRESSIVE
                self._fall_back()

    def snapshot(self) -> dict:
        """What a later run of the same batch shape starts from (:meth:`resume`): the batch's running τ and
        drafted step cost, the mode, the probes' backoff and countdown, the drafted segments' length. Rows' own
        figures are left out: a later run's rows hold other text."""
        return dict(tau=self.tau, seen=self.seen, var=self.var, step_ms=self.step_ms, mode=self.mode,
                    backoff=self.backoff, until_probe=self.until_probe, drafted_wall_ms=self.drafted_wall_ms,
                    ar_wall_ms=self.ar_wall_ms,
                    segment_wall_ms=self.segment_wall_ms, plain_wall_ms=self.plain_wall_ms,
                    probe_wall_ms=self.probe_wall_ms, call_segments=self.call_segments, cycles=self.cycles)

    def resume(self, snap: dict | None) -> None:
        """Start from an earlier run's :meth:`snapshot` (None: from nothing — a first drafted probe). A run that
        starts on the fallback keeps counting down to the earlier run's next probe, so that a stream of short
        calls still probes as one long call would."""
        if not snap or snap.get("tau") is None or not self.fallback.can_pay:
            return
        self.tau, self.seen, self.step_ms, self.var = snap["tau"], snap["seen"], snap["step_ms"], snap.get("var")
        self.backoff, self.until_probe = snap["backoff"], snap["until_probe"]
        self.mode = snap["mode"]
        self.drafted_wall_ms, self.ar_wall_ms = snap.get("drafted_wall_ms"), snap.get("ar_wall_ms")
        self.segment_wall_ms, self.plain_wall_ms = snap.get("segment_wall_ms"), snap.get("plain_wall_ms")
        self.probe_wall_ms = snap.get("probe_wall_ms")
        self.call_segments = snap.get("call_segments", 1)
        self.probing = False
        # Drafting that clearly paid goes on in segments as long as the earlier run's last: each segment ends with
        # a return to the host, and on a launch-bound pair the doubling from probe_cycles again (2, 4, 8, 16 cycles)
        # cost a call at 16 rows several ms a return (benchmarks/README.md, "Large batches").
        if self.mode == DRAFT:
            self.cycles = max(self.probe_cycles, min(snap.get("cycles", self.probe_cycles), self.max_cycles))

    def begin_call(self, segments: int) -> None:
        """A call of at most ``segments`` fallback segments' steps begins: a probe within it would run the whole
        call in segments, which :meth:`_fall_back` charges to the probe."""
        self.call_segments = max(1, segments)

    def skips_call(self, segments: int) -> bool:
        """Whether a whole call of at most ``segments`` fallback segments should run without drafting at all:
        no drafted step can pay at this batch, or the policy is on the fallback (from earlier runs of the shape)
        with no probe due within them. Such a call runs ``generate``'s own programs: not even its prefill
        writes the drafter's context, which only a drafted segment would read."""
        if not self.fallback.can_pay:
            return True
        return self.mode == AUTOREGRESSIVE and not self.probing and self.until_probe >= segments

    def skipped(self, segments: int, wall_ms: float | None = None) -> None:
        """A call ran ``segments`` segments' worth of autoregressive steps without this policy (``wall_ms`` a
        step): count them towards the next probe."""
        if wall_ms is not None:
            self.ar_wall_ms = self._running(self.ar_wall_ms, wall_ms)
            self.plain_wall_ms = self._running(self.plain_wall_ms, wall_ms)
        if self.mode == AUTOREGRESSIVE:
            self.until_probe = max(0, self.until_probe - segments)

    def _fall_back(self) -> None:
        """Fallback segments until the next probe: a probe's cost ≤ ``probe_share`` of the time between two, times
        the backoff. Its cost is its drafted cycles (or, where timed, its whole wall time) and, where timed, what
        running the rest of its call in segments costs over ``generate``'s programs (the whole call's fallback
        steps at the difference)."""
        probe_ms = self.probe_len * self.step_ms
        segment_ms = self.fallback_steps * self.ar_ms
        if self.ar_wall_ms:
            to_table = self.ar_ms / self.ar_wall_ms  # wall ms → the table's units
            if self.probe_wall_ms is not None:
                probe_ms = max(probe_ms, self.probe_wall_ms * to_table)
            if self.segment_wall_ms is not None and self.plain_wall_ms is not None:
                extra_wall = (max(0.0, self.segment_wall_ms - self.plain_wall_ms) * self.fallback_steps
                              * self.call_segments)
                probe_ms += extra_wall * to_table
        share = self.settings.probe_share
        self.until_probe = self.backoff * max(1, int(np.ceil(probe_ms / (share * segment_ms))))

    def next_segment(self) -> str:
        """What the next segment runs (a fallback segment counts down to the next probe)."""
        if self.checking and self.fallback.can_pay:
            return AUTOREGRESSIVE  # the timing check (its segment is short; drafting resumes after it)
        if self.mode == DRAFT or not self.fallback.can_pay:
            return self.mode
        if self.until_probe <= 0:
            self.probing = True
            return DRAFT
        self.until_probe -= 1
        return AUTOREGRESSIVE

    def _running(self, old: float | None, new: float) -> float:
        w = self.settings.smoothing
        return new if old is None else w * new + (1 - w) * old


def step_variance(tokens: np.ndarray, steps: np.ndarray, squares: np.ndarray) -> float:
    """The variance of a row's tokens per step, from rows' sums over a segment: within rows (each about its own
    mean) where some row ran two steps or more — rows draft texts of unlike difficulty, which the rows' own τs
    already hold — else over every row's step."""
    tokens, steps, squares = (np.asarray(a, np.float64) for a in (tokens, steps, squares))
    several = steps >= 2
    if several.any():
        t, n, q = tokens[several], steps[several], squares[several]
        return float(max(0.0, (q - t * t / n).sum()) / (n - 1).sum())
    mean = tokens.sum() / steps.sum()
    return float(max(0.0, squares.sum() / steps.sum() - mean * mean))


def expected_slowest(means: np.ndarray, sds: np.ndarray) -> float:
    """E[max_r X_r] for independent X_r ~ N(means_r, sds_r²), X ≥ 0 (steps a row still needs): ``low`` +
    ∫ P(max > x) dx from ``low``, below which some row is past x all but surely."""
    low = max(0.0, float((means - 6.0 * sds).max()))
    top = float((means + 6.0 * sds).max())
    if top <= low:
        return low
    x = np.linspace(low, top, 129)  # [G]: the integrand is smooth over these 12 standard deviations
    z = (x[None, :] - means[:, None]) / np.maximum(sds[:, None], 1e-9)  # [B, G]
    below = np.prod(_normal_cdf(z), axis=0)  # P(every row done within x)
    above = 1.0 - below
    return low + float((above.sum() - 0.5 * (above[0] + above[-1])) * (x[1] - x[0]))  # trapezoids


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """Φ(z) to 1e-7 (Abramowitz & Stegun 7.1.26 for erf), vectorised: the host has no scipy to lean on."""
    u = np.abs(z) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * u)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-u * u)
    return 0.5 * (1.0 + np.sign(z) * erf)


@dataclasses.dataclass
class Record:
    """What switching did in one run (the output's stats): the counts, and ``log``, one entry per segment (the
    first ``LOG_SEGMENTS``) saying what it ran and what the policy concluded after it — so that a run that fell
    back, or kept drafting, shows why."""

    LOG_SEGMENTS = 256

    ar_steps: int = 0  # autoregressive steps run by the fallback program
    row_ar_steps: int = 0  # the same, summed over the rows active in them
    switches: int = 0  # segments that ran another program than the one before
    segments: int = 0
    log: list = dataclasses.field(default_factory=list)

    def note(self, segment: str, steps: int, wall_ms: float | None, policy: "SwitchPolicy",
             tiers: dict[int, int] | None = None) -> None:
        """A segment ran: ``segment`` (``"draft"``, ``"probe"``, ``"autoregressive"``, ``"check"`` — the short
        timing segment — or ``"generate"``: a whole call on ``generate``'s programs), its ``steps`` and wall ms a
        step (None: untimed), a drafted segment's ``tiers`` (a scheduled mode's steps per tier, by the tier's
        verified tokens: which of the program's branches ran); then the policy's running figures and the mode it
        chose for what follows."""
        if len(self.log) >= self.LOG_SEGMENTS:
            return
        value = policy.value() if policy.tau is not None and policy.step_ms else None
        entry = dict(segment=segment, steps=int(steps), wall_ms=_rounded(wall_ms), tau=_rounded(policy.tau),
                     value=_rounded(value), ar_ms=_rounded(policy.ar_ms), step_ms=_rounded(policy.step_ms),
                     then=policy.mode)
        if tiers:
            entry["tiers"] = tiers
        self.log.append(entry)

    def stats(self) -> dict:
        return {"ar_fallback_steps": self.ar_steps, "fallback_switches": self.switches,
                "fallback_segments": self.segments, "fallback_log": list(self.log)}


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


class Decoder:
    """A job's decode: ``decoder(state, max_cycles)`` → (state, packed view), like the compiled decode program
    (at most ``max_cycles`` cycles; returns once ``return_at_done`` rows are done)."""

    def __init__(self, job):
        self.job = job

    def __call__(self, state, max_cycles):
        return self.job.programs.decode(self.job.params, state, max_cycles)

    def compile(self) -> None:
        """Compile now whatever a run may use later (a batch run compiles every program before its first batch)."""

    def begin_call(self, max_new: int) -> bool:
        """A call begins whose rows commit at most ``max_new`` tokens each: whether it should run ``generate``'s
        programs instead (:meth:`SwitchPolicy.skips_call`)."""
        return False

    def skipped(self, steps: int, row_steps: int, seconds: float) -> None:
        """Such a call ran ``steps`` autoregressive steps (``row_steps``: summed over its rows) in ``seconds``."""


class SwitchingDecoder(Decoder):
    """The decode loop in segments, each drafted or autoregressive as ``policy`` says (module docstring)."""

    def __init__(self, job, policy: SwitchPolicy, record: Record, memory: dict | None = None, key=None):
        super().__init__(job)
        self.policy, self.record = policy, record
        self.memory, self.key = memory, key  # where the policy's snapshot is kept between runs
        self.last_mode: str | None = None
        self.segment: _Segment | None = None  # the segment under way (a call may end inside one)
        self.ar_steps = policy.fallback_steps
        self.ran_drafted = False  # this call ran the drafted program (warm from the next call on)
        self.drafting = False  # the last segment run on this state was drafted (the next drafted one is not cold)
        # id of the state the last call returned: a call on another (a prefill's, a pool's refill) starts cold; a
        # stream's next call continues (an id, not a reference: the decoder must not keep a state's buffers alive)
        self.returned: int | None = None

    def __call__(self, state, max_cycles):
        left = int(np.asarray(max_cycles))
        if left <= 0:
            return self.job.programs.decode(self.job.params, state, np.int32(0))
        before = np.asarray(self._counts_program()(state))
        if id(state) != self.returned:
            self.drafting = False
        while True:
            if self.segment is None:
                self.segment = self._start_segment(before)
            seg = self.segment
            length = seg.length
            n = min(left, length - seg.ran)
            program = self.job.programs.decode if seg.mode == DRAFT else self._fallback_program()
            key = self.job.key + ((seg.mode, self.ar_steps) if seg.mode == AUTOREGRESSIVE else ())
            seg.timed &= key in progs.CACHE.warm
            if seg.mode == AUTOREGRESSIVE:
                progs.CACHE.warm.add(key)
            else:
                self.ran_drafted = True
            t0 = time.perf_counter()  # after any compile: the segment's own time, to its counts on the host
            state, packed = program(self.job.params, state, np.int32(n))
            after = np.asarray(self._counts_program()(state))
            seg.seconds += time.perf_counter() - t0
            ran = seg.add(before, after)
            before = after
            left -= ran
            if seg.ran >= length or ran < n:  # whole, or the loop returned (rows done)
                self._finish(seg, after)
            if ran < n or left <= 0:
                if self.ran_drafted:
                    progs.CACHE.warm.add(self.job.key)
                self.returned = id(state)
                return state, packed

    def _start_segment(self, counts: np.ndarray) -> "_Segment":
        """The next segment, as the policy chooses it, with its length fixed (``counts``: :func:`_counts` now)."""
        policy = self.policy
        mode = policy.next_segment()
        seg = _Segment(mode, counts.shape[0], mode == DRAFT and policy.probing,
                       check=mode == AUTOREGRESSIVE and policy.checking, cold=mode == DRAFT and not self.drafting)
        if mode == AUTOREGRESSIVE:
            seg.length = policy.settings.ar_check_steps if seg.check else self.ar_steps
        else:
            seg.length = policy.probe_len if seg.probe else policy.segment_cycles(_budget_left(counts))
        return seg

    def begin_call(self, max_new: int) -> bool:
        segments = -(-max_new // self.ar_steps)
        self.policy.begin_call(segments)
        return self.policy.skips_call(segments)

    def skipped(self, steps: int, row_steps: int, seconds: float) -> None:
        segments = -(-steps // self.ar_steps)
        self.record.ar_steps += steps
        self.record.row_ar_steps += row_steps
        self.record.segments += segments  # (no switch: the call had no segment before it)
        wall_ms = 1e3 * seconds / steps if steps else None
        self.policy.skipped(segments, wall_ms)
        self.record.note("generate", steps, wall_ms, self.policy)
        self._remember()

    def _finish(self, seg: "_Segment", after: np.ndarray) -> None:
        """Record a segment and tell the policy what a drafted one observed."""
        self.segment = None
        if seg.ran == 0:
            return
        self.record.segments += 1
        self.record.switches += self.last_mode is not None and seg.mode != self.last_mode
        self.last_mode = seg.mode
        self.drafting = seg.mode == DRAFT
        if seg.mode == AUTOREGRESSIVE:
            self.record.ar_steps += seg.ran
            self.record.row_ar_steps += int(seg.cycles.sum())
            self.policy.fell_back(seg.wall_ms)
            self.record.note("check" if seg.check else AUTOREGRESSIVE, seg.ran, seg.wall_ms, self.policy)
            self._remember()
            return
        kind = "probe" if seg.probe else DRAFT
        ran_tiers = {int(t): int(c) for t, c in zip(self.job.spec.tiers, seg.tiers) if c}
        done = after[:, 2] > 0
        if done.all():  # the run is over: nothing left to decide, and its last cycles say little (below)
            self.record.note(kind, seg.ran, seg.wall_ms, self.policy, ran_tiers)
            return
        left = _budget_left(after)
        fb = self.policy.fallback
        tiers = seg.tiers
        step_ms = float(tiers @ np.asarray(fb.drafted_ms) / tiers.sum()) if tiers.sum() else fb.drafted_ms[-1]
        # Rows that finished in the segment are left out of its acceptance: their last cycle was cut short by a
        # stop token or the budget, so counting it reads τ low (at the end of every run, which a later run of the
        # shape would then start from).
        keep = ~done
        self.policy.drafted(np.where(keep, seg.tokens, 0), np.where(keep, seg.cycles, 0), left, step_ms, seg.wall_ms,
                            np.where(keep, seg.squares, 0), cold=seg.cold)
        self.record.note(kind, seg.ran, seg.wall_ms, self.policy, ran_tiers)
        self._remember()

    def _remember(self) -> None:
        if self.memory is not None:
            self.memory[self.key] = self.policy.snapshot()

    def compile(self) -> None:
        self._fallback_program()
        self._counts_program()

    def _counts_program(self):
        """:func:`_counts` compiled for this job's state (once per shape, in the program cache)."""
        job = self.job

        def build():
            with progs.mesh_context(job.spec):
                return jax.jit(_counts).lower(job.programs.prefill.out_info[0]).compile()

        program, seconds = progs.CACHE.timed_get(job.key + ("counts",), build)
        job.compile_s += seconds
        return program

    def _fallback_program(self):
        """The fallback's compiled loop, compiled on first use (its time counted as the job's compile time)."""
        job = self.job
        key = job.key + ("fallback", self.ar_steps)

        def build():
            spec = job.spec
            graphdefs = (job.target.split().static, job.drafter.split().static)
            fn = jax.jit(functools.partial(loop.fallback_fn, spec=spec, steps=self.ar_steps,
                                           mask_token_id=job.drafter.config.mask_token_id),
                         static_argnums=0, donate_argnums=2)
            state_info = job.programs.prefill.out_info[0]
            with progs.mesh_context(spec):
                lowered = fn.lower(graphdefs, job.params, state_info, jax.ShapeDtypeStruct((), jnp.int32))
                return progs.compile_steps(lowered, spec, state_info)

        program, seconds = progs.CACHE.timed_get(key, build)
        job.compile_s += seconds
        return program


class _Segment:
    """What one segment ran so far, summed over the calls it spans (rows refilled between two calls count from
    their refill: each call's counts are taken against its own start)."""

    def __init__(self, mode: str, rows: int, probe: bool = False, check: bool = False, cold: bool = False):
        self.mode, self.probe, self.check, self.cold, self.ran = mode, probe, check, cold, 0
        self.length = 0  # the loop iterations it runs at most, fixed as it starts
        self.seconds = 0.0  # wall time of its calls, each from dispatch to its counts on the host
        self.timed = True  # no call was its program's first run in this process
        self.tokens = np.zeros(rows, np.int64)
        self.squares = np.zeros(rows, np.int64)  # Σ over the row's steps of (tokens a step)²
        self.cycles = np.zeros(rows, np.int64)
        self.tiers = np.zeros(0)

    @property
    def wall_ms(self) -> float | None:
        """Wall ms per loop iteration (None: none ran, or its program was not warm yet)."""
        return 1e3 * self.seconds / self.ran if self.ran and self.timed else None

    def add(self, before: np.ndarray, after: np.ndarray) -> int:
        """Add one call's counts; → the loop iterations it ran (a row active at the last was active at every one)."""
        cycles = after[:, 0] - before[:, 0]
        ran = int(cycles.max(initial=0))
        self.ran += ran
        self.cycles += cycles
        self.tokens += after[:, 1] - before[:, 1]
        self.squares += after[:, 4] - before[:, 4]
        tiers = (after[0, 5:] - before[0, 5:]).astype(np.float64)  # steps per tier (scheduled modes)
        self.tiers = tiers if not self.tiers.size else self.tiers + tiers
        return ran


def _budget_left(counts: np.ndarray) -> np.ndarray:
    """[B] tokens each row may still commit, from :func:`_counts`'s columns (0: done)."""
    return np.where(counts[:, 2] > 0, 0, counts[:, 3] - counts[:, 1])


def _counts(state: DecodeState) -> jax.Array:
    """[B, 5 + K]: each row's cycles, new tokens, done, budget and Σ of its cycles' squared tokens, and the tier
    histogram (scheduled modes; the same in every row) — what a segment's statistics are read from."""
    squares = jnp.sum(jnp.square(state.acc_lens), axis=1)  # acc_lens: 0 past the row's cycles
    cols = [state.num_cycles[:, None], state.num_new[:, None], state.done[:, None], state.max_new[:, None],
            squares[:, None]]
    if state.schedule is not None:
        cols.append(state.schedule.tier_steps)
    return jnp.concatenate(cols, axis=1).astype(jnp.int32)


def decoder(job, record: Record | None = None, pooled: bool = False) -> Decoder:
    """The job's decoder: switching where its verify mode armed the fallback (``job.fallback``), else the compiled
    decode program itself. ``pooled``: rows that finish get new prompts (:mod:`dflash_jax.engine.pool`)."""
    if job.fallback is None:
        return Decoder(job)
    tuning = job.settings.tuning  # the loop spec carries these host-side knobs at a fixed value
    l = job.spec.block_size
    fallback_steps = max(1, -(-tuning.fallback_steps // l)) * l
    policy = SwitchPolicy(job.fallback, pooled, max(1, tuning.probe_cycles), fallback_steps,
                          max(1, tuning.drafted_segment_cycles), rows=max(1, len(job.ids)), settings=tuning.switching)
    # Runs of one batch shape with this drafter share what they observed (the drafter handle keeps it).
    spec = job.spec
    key = (id(job.target), job.fallback, pooled, spec.verify_mode, spec.tiers, spec.block_size, spec.sampling,
           spec.draft_sampling)
    memory = job.drafter.observed if tuning.remember_acceptance else None
    if memory is not None:
        policy.resume(memory.get(key))
    return SwitchingDecoder(job, policy, record if record is not None else Record(), memory, key)
