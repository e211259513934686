"""Verify modes as strategies: how much of each drafted block the target verifies, and what a cycle commits.

A verify mode is a frozen, hashable value (it sits in :class:`~dflash_jax.decode.state.LoopSpec`, part of every
program's key) that owns three things:

* its **resolution** against the step-cost table (:meth:`VerifyPolicy.resolve`): the mode a batch really runs,
  the packed-verify tiers it compiles and their costs — compact falls back to :class:`Static` where none of its
  tiers can pay;
* its **cycle** in the decode loop (:meth:`VerifyMode.cycle`, :meth:`VerifyMode.plans_ahead`,
  :meth:`VerifyMode.packed_groups`, :meth:`VerifyMode.draft_cap`): a composition of the loop's operations
  (:class:`StepOps`, which the loop binds to its models and spec);
* its **statistics** (:meth:`VerifyMode.stats`): what verifying cost, from the final state's host view.

The modes: :class:`Static` (the whole block every cycle), :class:`Compact` (the confidence scheduler picks each
row's window; only the windows are verified, packed into a compiled tier), :class:`CapAccept` (whole blocks
verified, the scheduler's windows committed: what compact commits, with what trimming gave up measured).
:class:`Auto` is a policy, not a mode: it resolves to compact or static from the cost table.

Users name them by string (:func:`by_name`, :func:`names` — the CLI's choices). A new mode is one subclass
registered with :func:`register` (and its tests): the registry, the public API's validation, the loop and the
statistics need no other change. docs/verify-modes.md describes each mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Protocol

import numpy as np

from dflash_jax.decode import schedule
from dflash_jax.sharding import mesh_size
from dflash_jax.tuning import Tuning


class StepOps(Protocol):
    """The decode loop's operations a verify mode composes into one cycle (bound to the target, the drafter,
    the spec and the mask token; :class:`dflash_jax.decode.loop.Step`). ``state`` is a
    :class:`~dflash_jax.decode.state.DecodeState`; each returns the state it advanced."""

    spec: Any

    def propose(self, state) -> tuple[Any, Any, Any, Any]:
        """(block [B, L] = anchor + drafts, q or None, confidences [B, G] or None, state)."""

    def schedule(self, state, rates) -> tuple[Any, Any, Any]:
        """(state with the step counted in the tier histogram, windows [B], tier) from per-draft rates."""

    def count_tier(self, state, tier) -> Any: ...

    def record_survival(self, state, conf) -> Any: ...

    def verify(self, state, block, q, window=None) -> Any:
        """The whole block through the target; commit at most ``window`` drafts per row (None: all)."""

    def verify_packed(self, state, block, q, window, tier) -> Any:
        """Only each row's window (anchor + ``window`` drafts) through the target, packed into ``tier``."""

    def draft_and_verify_packed(self, state, window, tier) -> Any:
        """Draft (windows known before drafting), then :meth:`verify_packed`."""

    def plan_next(self, state) -> Any:
        """The next step's windows and tier (and, with confidences, its drafts) into the state."""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A verify mode resolved for one batch: the mode to run, its compiled tiers, the step cost per tier (plus a
    step without drafting when offered) and whether that step is offered. Unpacks as a 4-tuple."""

    mode: "VerifyMode"
    tiers: tuple[int, ...] = ()
    step_cost: np.ndarray | None = None
    ar_step: bool = False

    def __iter__(self):
        return iter((self.mode, self.tiers, self.step_cost, self.ar_step))


@dataclasses.dataclass
class BatchCosts:
    """What a verify mode is resolved against: the batch's shape and drafter, and its cost table (loaded on
    first use: the static verify needs none). Under a ``dp`` mesh the costs are those of a device's
    ``batch / dp`` rows (what each device runs)."""

    batch: int
    block_size: int
    dp: int
    has_confidence: bool  # the drafter scores its drafts (windows are then chosen after drafting)
    load_table: Callable[[], Any]  # → a dflash_jax.costs.CostTable
    tiers_per_row: tuple[int, ...] | None = None  # Tuning.tiers_per_row (None: 1, 2, 4 … L)

    @functools.cached_property
    def table(self):
        return self.load_table()

    @property
    def rows(self) -> int:
        return self.batch // self.dp

    @functools.cached_property
    def tiers(self) -> tuple[int, ...]:
        return schedule.tiers_for(self.batch, self.block_size, self.tiers_per_row)

    @functools.cached_property
    def step_cost(self) -> np.ndarray:
        """ms of a step at each of :attr:`tiers`."""
        return self.table.step_costs(self.rows, tuple(t // self.dp for t in self.tiers)).astype(np.float32)

    @property
    def static_cost(self) -> float | None:
        """ms of the static verify's step (None: the table does not time it)."""
        return self.table.static_cost(self.rows)

    @property
    def ar_cost(self) -> float | None:
        """ms of a step without drafting (None: not timed)."""
        return self.table.ar_cost(self.rows)

    @property
    def fallback_cost(self) -> float | None:
        """ms of a plain autoregressive step (:meth:`dflash_jax.costs.CostTable.fallback_cost`; None: not timed)."""
        return self.table.fallback_cost(self.rows)


REGISTRY: dict[str, type["VerifyPolicy"]] = {}


def register(cls: type["VerifyPolicy"]) -> type["VerifyPolicy"]:
    """Make ``cls`` (a :class:`VerifyMode` or a policy) nameable by users under ``cls.name``."""
    REGISTRY[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    """Every name a user may give (policies first, then modes): the CLI's choices."""
    policies = [n for n, c in REGISTRY.items() if not issubclass(c, VerifyMode)]
    return tuple(policies) + tuple(n for n in REGISTRY if n not in policies)


def by_name(name: "str | VerifyPolicy") -> "VerifyPolicy":
    """The mode or policy named ``name`` (a mode or policy given already is returned as is); ValueError naming
    the choices otherwise."""
    if isinstance(name, VerifyPolicy):
        return name
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        modes = [n for n, c in REGISTRY.items() if issubclass(c, VerifyMode)]
        policies = [repr(n) for n in REGISTRY if n not in modes]
        raise ValueError(f"verify_mode must be {' or '.join(policies + [''])}one of "
                         f"{', '.join(map(repr, modes))}, got {name!r}")
    return cls()


def mode(name: "str | VerifyMode") -> "VerifyMode":
    """The loop-level mode named ``name`` (a policy such as ``"auto"`` must be resolved first)."""
    out = by_name(name)
    if not isinstance(out, VerifyMode):
        raise ValueError(f"verify mode {out.name!r} is a policy: resolve it against a cost table first")
    return out


@dataclasses.dataclass(frozen=True)
class VerifyPolicy:
    """Something a user may name as ``verify_mode``: it resolves to a :class:`VerifyMode` per batch."""

    name: ClassVar[str]
    # Falls back to plain autoregressive steps where the acceptance observed says drafting does not pay
    # (dflash_jax.engine.switching).
    falls_back: ClassVar[bool] = False

    def resolve(self, costs: BatchCosts, tuning: Tuning) -> Resolved:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class VerifyMode(VerifyPolicy):
    """A verify mode the decode loop runs (the base: the whole block, every cycle, no scheduler)."""

    # Uses the confidence scheduler: the loop state carries a ScheduleState, the programs take the step costs,
    # and the statistics report tiers and windows.
    scheduled: ClassVar[bool] = False
    # Counts the whole block as verified (else only the windows were).
    verifies_whole_blocks: ClassVar[bool] = True

    def resolve(self, costs: BatchCosts, tuning: Tuning) -> Resolved:
        return Resolved(self)

    def cycle(self, ops: StepOps, state):
        """One draft → verify → accept → commit step of every row."""
        block, q, conf, state = ops.propose(state)
        state = ops.record_survival(state, conf)
        return ops.verify(state, block, q)

    def plans_ahead(self, spec, sch) -> bool:
        """Whether each step's windows (and tier) are planned at the end of the step before
        (:func:`dflash_jax.decode.loop.plans_ahead`); ``sch``: the state's ScheduleState (or its shapes)."""
        return False

    def packed_groups(self, plan) -> int:
        """Groups of rows packed apart in a packed verify (one per dp shard where the mode packs)."""
        return 1

    def draft_cap(self, tuning: Tuning) -> int | None:
        """Draft positions a sequential drafter drafts in this mode's steps (None: all)."""
        return None

    def trunk_widths(self, spec, kind, batch: int, trained: tuple[int, ...] | None = None
                     ) -> tuple[int, ...] | None:
        """The drafter trunk's width at each compiled tier, where this mode's steps draft only what a tier can
        verify (``kind``: the drafter's :class:`~dflash_jax.drafters.DrafterKind`; ``trained``: the narrower
        widths it was trained at, ``DrafterConfig.trained_widths``; None: the whole block)."""
        return None

    def stats(self, spec, view, n: int, acc_lens: list[list[int]], fallback_cycles: int = 0) -> dict:
        """What verifying cost, from the host view of ``n`` real rows: ``verify_mode``, ``verify_tokens`` (tokens
        through the target's verify, summed over rows and cycles), ``mean_window`` (the tokens per row and cycle
        the schedule verifies or — cap-accept — commits from, anchor included: L for static); for scheduled modes
        ``tier_steps`` (steps per compiled tier: {tokens: steps}), ``ar_steps`` (steps the scheduler ran without
        drafting, when offered) and ``row_verify_tokens`` (each row's windows, summed). ``fallback_cycles``: the
        rows' cycles that were autoregressive fallback steps (:mod:`dflash_jax.engine.switching`; the anchor
        alone verified)."""
        cycles = int(view.num_cycles[:n].sum())
        drafted = cycles - fallback_cycles
        windows = (int(view.verify_tokens[:n].sum()) if spec.scheduled else drafted * spec.block_size) + fallback_cycles
        verified = (drafted * spec.block_size + fallback_cycles) if self.verifies_whole_blocks else windows
        out = {"verify_mode": self.name, "verify_tokens": verified, "mean_window": windows / max(cycles, 1)}
        if spec.scheduled:
            out["tier_steps"] = {int(t): int(c) for t, c in zip(spec.tiers, view.tier_steps[0]) if c}
            if spec.ar_step:
                out["ar_steps"] = int(view.tier_steps[0, len(spec.tiers)])
            out["row_verify_tokens"] = view.verify_tokens[:n, 0].tolist()
        return out


@register
@dataclasses.dataclass(frozen=True)
class Static(VerifyMode):
    """The whole block (anchor + every draft) is verified every cycle: one compiled verify shape."""

    name: ClassVar[str] = "static"


STATIC = Static()


@dataclasses.dataclass(frozen=True)
class Scheduled(VerifyMode):
    """The confidence scheduler (:mod:`dflash_jax.decode.schedule`) picks each row's window every cycle: from the
    running acceptance counts before drafting, or from the drafts' confidences after it."""

    scheduled: ClassVar[bool] = True

    def resolve(self, costs: BatchCosts, tuning: Tuning) -> Resolved:
        return Resolved(self, costs.tiers, costs.step_cost, False)

    def cycle(self, ops: StepOps, state):
        counts = state.schedule.counts
        if counts is not None:  # windows before drafting
            state, window, tier = ops.schedule(state, counts.conditional_rates())
            block, q, conf, state = ops.propose(state)
        else:
            block, q, conf, state = ops.propose(state)
            state, window, tier = ops.schedule(state, conf)
        state = ops.record_survival(state, conf)
        return self.verify_windows(ops, state, block, q, window, tier)

    def verify_windows(self, ops: StepOps, state, block, q, window, tier):
        raise NotImplementedError

    def trunk_widths(self, spec, kind, batch: int, trained: tuple[int, ...] | None = None
                     ) -> tuple[int, ...] | None:
        # Only where the windows are chosen before drafting (the running counts) and every position's drafts come
        # from one pass (a parallel drafter): a compact tier of n tokens per row then drafts min(L, span · n)
        # positions. Cap-accept caps its windows alike (it drafts whole blocks): both modes schedule the same.
        if not spec.scheduled or kind.sequential or kind.has_confidence:
            return None
        return schedule.trunk_widths(spec.tiers, batch, spec.block_size, spec.tuning.draft_span(trained), trained)


@register
@dataclasses.dataclass(frozen=True)
class Compact(Scheduled):
    """Only each row's window is verified, packed into the smallest compiled tier that holds the step's tokens
    (one ``lax.switch`` over a few tiers). Where the windows depend only on what the step before committed,
    each step is planned at the end of the one before (its tier known as it starts)."""

    name: ClassVar[str] = "compact"
    verifies_whole_blocks: ClassVar[bool] = False

    def resolve(self, costs: BatchCosts, tuning: Tuning) -> Resolved:
        """Keep the tiers worth their conditional; offer a step without drafting where the table times one that
        saves as much on the cheapest tier kept (drafters without confidences: windows known before drafting).
        Left with the whole block alone, or (where the table times the static verify's step) with no tier that
        saves as much on static's step: the static program."""
        saving = 1 - schedule.TIER_MIN_SAVING
        tiers, step_cost = schedule.prune_tiers(costs.tiers, costs.step_cost)
        static_cost = costs.static_cost
        if static_cost is not None and step_cost[0] > saving * static_cost:
            # Every drafted step would cost about static's or more and commit no more than static's whole block.
            # (The step without drafting is left out of this: it pays only where drafts are mostly rejected, and
            # static's whole blocks then still commit a token per row.)
            return Resolved(STATIC)
        ar_cost = costs.ar_cost if not costs.has_confidence else None
        if ar_cost is not None and ar_cost > saving * step_cost[0]:
            ar_cost = None  # the AR step would be one more branch (and a conditional around drafting) for ~nothing
        if ar_cost is not None:
            return Resolved(self, tiers, np.append(step_cost, np.float32(ar_cost)), True)
        if len(tiers) == 1:  # nothing to trim: compact would verify whole blocks, i.e. run static's steps
            return Resolved(STATIC)
        return Resolved(self, tiers, step_cost, False)

    def cycle(self, ops: StepOps, state):
        sch = state.schedule
        if not self.plans_ahead(ops.spec, sch):
            return super().cycle(ops, state)
        # The windows this step verifies were chosen at the end of the step before.
        state = ops.count_tier(state, sch.tier)
        if sch.block is None:  # windows from the counts: a parallel drafter drafts in the tier's branch
            state = ops.draft_and_verify_packed(state, sch.window, sch.tier)
        else:  # drafted at the end of the step before, windows from the drafts' confidences
            state = ops.record_survival(state, sch.conf)
            state = ops.verify_packed(state, sch.block, None, sch.window, sch.tier)
        return ops.plan_next(state)

    def verify_windows(self, ops: StepOps, state, block, q, window, tier):
        return ops.verify_packed(state, block, q, window, tier)

    def plans_ahead(self, spec, sch) -> bool:
        # Not for drafts sampled from a drafter with confidences: their distribution q [B, G, V] would have to be
        # carried from one step to the next.
        return spec.block_size > 1 and sch is not None and (sch.counts is not None or not spec.draft_sampling)

    def packed_groups(self, plan) -> int:
        # Each dp shard packs, verifies and writes its own rows' windows (dflash_jax.kernels.packed.PackedLayout).
        return mesh_size(plan.mesh, "dp") if plan is not None else 1

    def draft_cap(self, tuning: Tuning) -> int | None:
        return tuning.sequential_draft_cap


@register
@dataclasses.dataclass(frozen=True)
class CapAccept(Scheduled):
    """The whole block is verified, but each row commits at most its window (what compact commits with the
    same table, where the drafts do not depend on the trunk's width: compact's narrower tiers draft over fewer
    positions, ``Tuning.tier_draft_span``): measures what trimming gives up (``stats["utilization"]``)."""

    name: ClassVar[str] = "cap-accept"

    def verify_windows(self, ops: StepOps, state, block, q, window, tier):
        return ops.verify(state, block, q, window)

    def stats(self, spec, view, n: int, acc_lens: list[list[int]], fallback_cycles: int = 0) -> dict:
        """:meth:`VerifyMode.stats` and ``utilization``: committed tokens ÷ what committing every accepted draft of
        the whole block would have given (1.0: trimming gave up nothing), ``row_untrimmed`` (that figure per row)."""
        out = super().stats(spec, view, n, acc_lens, fallback_cycles)
        committed = sum(sum(row) for row in acc_lens)
        out["utilization"] = committed / max(int(view.untrimmed[:n].sum()), 1)
        out["row_untrimmed"] = view.untrimmed[:n, 0].tolist()
        return out


@register
@dataclasses.dataclass(frozen=True)
class Auto(VerifyPolicy):
    """Compact where the cost table says trimming can pay at this batch, static elsewhere: where the table
    times the static verify's step, compact (whose resolution runs static's program wherever no tier saves on
    that step); without it, compact where the whole-block step costs at least ``tuning.auto_compact_ratio``
    times the one-token-per-row step (``inf``: always static). Falls back to autoregressive steps while drafting
    does not pay (:mod:`dflash_jax.engine.switching`)."""

    name: ClassVar[str] = "auto"
    falls_back: ClassVar[bool] = True

    def resolve(self, costs: BatchCosts, tuning: Tuning) -> Resolved:
        ratio = tuning.auto_compact_ratio
        step_cost = costs.step_cost
        trims_pay = costs.static_cost is not None or step_cost[-1] >= ratio * step_cost[0]
        if ratio == math.inf or not trims_pay:
            return Resolved(STATIC)
        return Compact().resolve(costs, tuning)
