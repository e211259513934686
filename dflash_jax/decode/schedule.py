"""The confidence scheduler (SPEC §7): how many drafts each row verifies this step.

Every step, for each active row ``r`` and draft ``j`` (0-based, G = L − 1 drafts), the *survival*
``a[r, j]`` is the probability that drafts ``0 … j`` are all accepted: the product of the row's per-draft
acceptance probabilities — a DSpark drafter's calibrated confidences, or (drafters without a confidence head)
running acceptance counts kept on the device (:class:`AcceptanceCounts`). Verifying draft ``j`` adds
``a[r, j]`` expected committed tokens and one verify token. The step's cost is a function of its total verify
tokens ``T``: the packed verify runs at the smallest compiled *tier* ``≥ T`` (tiers are a few fixed token
counts), so ``cost(T) = step_cost[tier(T)]`` (draft + verify time, from a measured cost table,
:mod:`dflash_jax.costs`). The scheduler admits drafts across the batch in descending survival and keeps the
count ``k`` that maximises expected committed tokens per second,

    (n_active + Σ of the k best survivals) / step_cost[tier(n_active + k)].

Survival falls along each row, so the k best are always a prefix of each row's block (ties go to the lower
draft index): the result is a window per row, which may be empty (the step then commits the bonus only). For
any total ``k`` the k best survivals are the most expected tokens that ``k`` drafts can buy, so the maximum
over ``k`` is the best window assignment there is (tests/test_schedule.py checks it against brute force).

Shapes: B rows, G drafts per block (L = G + 1 verify tokens), K tiers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dflash_jax.kernels.common import find_bucket

# Running acceptance counts start from this prior per draft position (a Beta(PRIOR_ACCEPT, PRIOR_REJECT), mean
# 0.8): optimistic on purpose — compact mode never sees past a window, so a pessimistic estimate for a position
# would never be corrected, while an optimistic one is verified and corrected; a few cycles outweigh it.
PRIOR_ACCEPT, PRIOR_REJECT = 4.0, 1.0
# A row's own counts are pooled with the batch's (weight POOL in pseudo-observations): the batch's rates
# steer a row early on and whenever its window has stopped short of a position for a while.
POOL = 4.0
# A step without drafting observes nothing, so the counts then fade by this factor (towards the optimistic
# prior): a run of such steps ends with drafting tried again, and the text may have become easier.
UNOBSERVED_DECAY = 0.7


def tiers_for(batch: int, block_size: int, per_row: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The compiled packed-verify sizes for ``batch`` rows of ``block_size`` (= L) tokens: 1, 2, 4, 8 … tokens
    per row, and the whole block (L per row). Five or fewer programs inside one step, the largest the
    static verify's size, so the whole block always fits. ``per_row`` (``Tuning.tiers_per_row``) replaces the
    powers of two (sizes above L dropped; the whole block is kept last)."""
    if per_row is not None:
        return tuple(batch * n for n in sorted({n for n in per_row if 0 < n < block_size} | {block_size}))
    per_row = [1]
    while per_row[-1] * 2 < block_size:
        per_row.append(per_row[-1] * 2)
    per_row.append(block_size)
    return tuple(batch * n for n in per_row)


def trunk_widths(tiers: tuple[int, ...], batch: int, block_size: int, span: int | None,
                 trained: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """The drafter trunk's width (inputs ``[anchor, MASK…]``, = the longest window + 1) at each tier of ``batch``
    rows: ``min(L, span · n)`` for a tier of n tokens per row, at least 2 (``Tuning.tier_draft_span``), rounded up
    to the nearest of ``trained`` (the narrower widths the drafter was trained at) and L where given. None where
    every tier would draft the whole block (or ``span`` is None)."""
    if span is None:
        return None
    widths = [min(block_size, max(2, span * (t // batch))) for t in tiers]
    if trained:
        allowed = sorted({w for w in trained if w < block_size} | {block_size})
        widths = [next(a for a in allowed if a >= w) for w in widths]
    return None if all(w == block_size for w in widths) else tuple(widths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AcceptanceCounts:
    """Per row and draft position, how often the draft was verified with every draft before it accepted
    (``reached``) and how often it was then accepted (``accepted``). Only positions that were verified count:
    compact mode never sees past a row's window."""

    reached: Float[Array, "B G"]
    accepted: Float[Array, "B G"]

    @staticmethod
    def zeros(batch: int, drafts: int) -> "AcceptanceCounts":
        z = jnp.zeros((batch, drafts), jnp.float32)
        return AcceptanceCounts(z, z)

    def update(self, accepted: Int[Array, "B"], verified: Int[Array, "B"], active: Bool[Array, "B"]):
        """One cycle per active row: ``accepted`` leading drafts accepted out of ``verified`` verified ones."""
        j = jnp.arange(self.reached.shape[1])[None, :]
        reached = (j <= accepted[:, None]) & (j < verified[:, None]) & active[:, None]
        passed = (j < accepted[:, None]) & active[:, None]
        return AcceptanceCounts(self.reached + reached, self.accepted + passed)

    def faded(self, factor: float) -> "AcceptanceCounts":
        return AcceptanceCounts(self.reached * factor, self.accepted * factor)

    def conditional_rates(self) -> Float[Array, "B G"]:
        """P(draft j accepted | drafts before it accepted), per row: the row's counts pooled with the batch's
        (which start from the Beta prior)."""
        pooled = (self.accepted.sum(0) + PRIOR_ACCEPT) / (self.reached.sum(0) + PRIOR_ACCEPT + PRIOR_REJECT)
        return (self.accepted + POOL * pooled[None, :]) / (self.reached + POOL)


def survival(conditional: Float[Array, "B G"]) -> Float[Array, "B G"]:
    """a[r, j] = Π_{i ≤ j} c[r, i]."""
    return jnp.cumprod(jnp.clip(conditional.astype(jnp.float32), 0.0, 1.0), axis=1)


def finish_weights(remaining: Int[Array, "B"], active: Bool[Array, "B"], power: float) -> Float[Array, "B"]:
    """Per row, (its remaining token budget ÷ the active rows' mean)^``power`` (``Tuning.finish_together``).

    A batch ends with its slowest row, so tokens of a row that is behind are worth more than tokens of one
    that will finish anyway: weighting the admission this way gives the rows behind longer windows, and a
    batch of rows that draw unequal luck ends in fewer steps (a few percent at 64 rows). 0: all rows alike."""
    r = remaining.astype(jnp.float32)
    mean = jnp.sum(jnp.where(active, r, 0.0)) / jnp.maximum(jnp.sum(active), 1)
    return jnp.where(active, (r / jnp.maximum(mean, 1.0)) ** power, 1.0) if power else jnp.ones_like(r)


def tier_index(tokens: Int[Array, "*n"], tiers: tuple[int, ...]) -> Int[Array, "*n"]:
    """The smallest tier holding ``tokens`` (the largest if none does)."""
    return jnp.minimum(find_bucket(jnp.asarray(tiers, jnp.int32), tokens), len(tiers) - 1)


def admit(surv: Float[Array, "B G"], active: Bool[Array, "B"], step_cost: Float[Array, "K"], *,
          tiers: tuple[int, ...], ar_cost: Float[Array, ""] | None = None, groups: int = 1,
          compare_all_max: int = 2048, caps: tuple[int, ...] | None = None,
          weights: Float[Array, "B"] | None = None) -> tuple[Int[Array, "B"], Int[Array, ""]]:
    """Windows (drafts to verify per row; 0 for inactive rows) and the tier index of the step. ``ar_cost``:
    the cost of a plain autoregressive step (no drafting, one token per active row); when it buys more
    tokens per second than any window assignment, the windows are 0 and the tier index is K.

    ``groups`` > 1 (compact under a dp mesh, rows in equal groups that each pack into their share of the
    tier's slots): each group is admitted alone, against tiers of 1/``groups`` the size (a device's share of
    the step), and the step runs the largest tier a group with active rows chose — drafting unless every such
    group chose the autoregressive step (a group that chose it then verifies its anchors only).

    ``compare_all_max``: :func:`descending_rank` compares all pairs up to this many drafts (``Tuning.
    rank_compare_all_max``), and sorts above it.

    ``caps`` (one per tier): a row's window at that tier is at most this many drafts (the drafter drafted no
    more there, :func:`trunk_widths`); the best assignment is then sought at each tier among the drafts it can
    hold.

    ``weights`` (one per row, default 1): what a token of that row is worth; the admission then maximises the
    weighted tokens per second (:func:`finish_weights`)."""
    if weights is None:
        weights = jnp.ones(active.shape, jnp.float32)
    if groups > 1:
        k = len(tiers)
        windows, tier = jax.vmap(lambda s, a, w: admit(s, a, step_cost, tiers=tuple(t // groups for t in tiers),
                                                    ar_cost=ar_cost, compare_all_max=compare_all_max,
                                                    caps=caps, weights=w))(
            surv.reshape(groups, -1, surv.shape[1]), active.reshape(groups, -1), weights.reshape(groups, -1))
        drafted = (tier < k) & active.reshape(groups, -1).any(axis=1)
        tier = jnp.where(drafted.any(), jnp.max(jnp.where(drafted, tier, 0)), k if ar_cost is not None else 0)
        return windows.reshape(-1), tier.astype(jnp.int32)
    # Admitting the k best drafts (by survival, across the batch) buys n + (their survivals' sum) tokens for the
    # step cost of the tier holding n + k tokens; the best k maximises that rate. Within one tier the cost is
    # flat and the gain only grows with k, so each tier's best k is the most it holds: K candidates, not B·G.
    # Each draft's place in the descending order comes from comparing every pair where B·G is small enough
    # (:func:`descending_rank`): on a GPU a handful of fused reductions instead of a sort, its gathers, a
    # cumulative sum and a scatter — the scheduler runs every step, between the commit and the next step.
    b, g = surv.shape
    n = active.sum().astype(jnp.int32)
    worth = jnp.sum(jnp.where(active, weights, 0.0))  # the bonus tokens every active row commits
    # [B·G], each draft's survival at its row's weight; inactive rows rank last, never admitted
    flat = jnp.where(active[:, None], surv * weights[:, None], -1.0).reshape(-1)
    if caps is None:  # one ranking serves every tier: [1, B·G]
        held, most = flat[None, :], jnp.full((len(tiers),), g, jnp.int32)
    else:  # per tier, the drafts past its cap rank last too: [K, B·G]
        most = jnp.minimum(jnp.asarray(caps, jnp.int32), g)
        held = jnp.where(jnp.tile(jnp.arange(g), b)[None, :] < most[:, None], flat[None, :], -1.0)
    rank = jax.vmap(lambda x: descending_rank(x, compare_all_max))(held)
    positive = jnp.maximum(held, 0.0)
    sizes = jnp.asarray(tiers, jnp.int32)
    # Tier t runs steps of n + k tokens for k in [lo_t, hi_t] (the largest tier: everything past the others).
    lo = jnp.maximum(jnp.concatenate([jnp.zeros((1,), jnp.int32), sizes[:-1] + 1 - n]), 0)
    hi = jnp.minimum(sizes - n, n * most).at[-1].set(n * most[-1])
    gain = worth + jnp.sum(jnp.where(rank < hi[:, None], positive, 0.0), axis=1)  # [K]
    rate = jnp.where(lo <= hi, gain / step_cost, -jnp.inf)
    tier = jnp.argmax(rate).astype(jnp.int32)
    row = jnp.minimum(tier, held.shape[0] - 1)  # the chosen tier's ranking
    # The fewest drafts with that gain: drafts of survival 0 add nothing (they rank after every positive one).
    chosen = jnp.clip(jnp.sum(held[row] > 0, dtype=jnp.int32), lo[tier], hi[tier])
    if ar_cost is not None:
        skip = worth / ar_cost > rate[tier]
        chosen, tier = jnp.where(skip, 0, chosen), jnp.where(skip, len(tiers), tier)
    windows = (rank[row] < chosen).reshape(b, g).sum(1).astype(jnp.int32)
    return windows, tier


def descending_rank(x: Float[Array, "N"], compare_all_max: int = 2048) -> Int[Array, "N"]:
    """Each element's index in ``x`` sorted in descending order, ties in index order (a stable sort's):
    ``argsort(argsort(-x, stable=True))`` — from all N² comparisons in one reduction up to ``compare_all_max``
    elements (N² = 4M: a few µs on a GPU, a few ms on a CPU; B·G = 1,920 at 128 rows and blocks of 16), or a
    sort above it (a 10,000-row batch would be ~10⁹ comparisons a step)."""
    n = x.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    if n > compare_all_max:
        return jnp.zeros((n,), jnp.int32).at[jnp.argsort(-x, stable=True)].set(i)
    ahead = (x[None, :] > x[:, None]) | ((x[None, :] == x[:, None]) & (i[None, :] < i[:, None]))
    return jnp.sum(ahead, axis=1, dtype=jnp.int32)


# A smaller tier is compiled only if its step costs at least this much less than the next larger tier kept (and
# the step without drafting is offered only if it costs this much less than the cheapest tier kept):
# choosing a tier is a conditional on the device (on a GPU one host read per step), and the table's noise is a
# few percent. A 10 % margin was measured to drop tiers that paid at batches 64-128 on a GPU.
TIER_MIN_SAVING = 0.03


def prune_tiers(tiers: tuple[int, ...], step_cost: Float[Array, "K"]) -> tuple[tuple[int, ...], Float[Array, "K"]]:
    """The tiers worth compiling and their costs: the largest (the whole block) always, each smaller one only
    if it saves ``TIER_MIN_SAVING`` of the next larger one kept. With a single tier left, compact would verify
    every draft (the admission sees a flat cost): the static verify's steps, which is what then runs."""
    keep = [len(tiers) - 1]
    for i in range(len(tiers) - 2, -1, -1):
        if step_cost[i] <= (1 - TIER_MIN_SAVING) * step_cost[keep[-1]]:
            keep.append(i)
    keep.reverse()
    return tuple(tiers[i] for i in keep), step_cost[keep]
