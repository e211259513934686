"""The decode loop: prefill, then ``lax.while_loop`` over draft → verify → accept → commit cycles.

Everything is static-shaped: a block is always ``L`` tokens, ragged acceptance is handled with per-row
lengths and masks, and rows that finished keep riding along without committing. Nothing inside the loop
talks to the host. Plain autoregressive decoding is the same loop with ``L = 1`` and no drafter, so the
baseline and the speculative path share every line of target code.

Cache positions: a row's target cache slot ``j`` holds absolute position ``j``. A verify writes K/V for
``anchor_pos … anchor_pos+L-1`` before attending, so entries of rejected drafts are always overwritten
before any query can see them (see :mod:`dflash_jax.kernels.attention`). The drafter's context cache is filled the
same way from the verify's captured features; entries at or past the next anchor are masked by ``ctx_len``.

Hybrid targets (:mod:`dflash_jax.models.hybrid`) also carry, per linear-attention layer, a conv history and a
recurrent state that cannot be overwritten later: a verify runs with ``defer=True`` and ``target.settle`` then
advances them over each row's ``a + 1`` committed tokens only; prefill passes each row's prompt length, so right
padding never enters them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dflash_jax import drafters
from dflash_jax.decode import sampling, schedule, verify_modes
from dflash_jax.decode.state import DecodeState, DecodeView, LoopSpec, ScheduleState
from dflash_jax.kernels.packed import PackedLayout
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.split import merge_model
from dflash_jax.models.target import KVCache, TargetModel
from dflash_jax.sharding import Plan, constrain
from dflash_jax.tuning import Kernels


def _write_tokens(buf: Int[Array, "B O"], new: Int[Array, "B L"], start: Int[Array, "B"]) -> jax.Array:
    return jax.vmap(lambda row, u, s: jax.lax.dynamic_update_slice(row, u, (s,)))(buf, new, start)


def commit(state: DecodeState, proposed: Int[Array, "B L"], count: Int[Array, "B"],
           record: bool = True) -> DecodeState:
    """Commit the first ``count`` tokens of ``proposed`` per active row, cut at stop tokens and budgets.

    ``proposed`` holds the accepted drafts followed by the bonus / replacement token (see
    :func:`sampling.committed_tokens`).
    """
    b, l = proposed.shape
    active = ~state.done
    in_count = jnp.arange(l)[None, :] < count[:, None]
    is_stop = (proposed[..., None] == state.stop_ids[None, None, :]).any(-1) & in_count
    hit_stop = is_stop.any(-1)
    n = jnp.where(hit_stop, jnp.argmax(is_stop, axis=-1) + 1, count)
    n = jnp.minimum(n, state.max_new - state.num_new)
    n = jnp.where(active, n, 0)
    num_new = state.num_new + n
    last = jnp.take_along_axis(proposed, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    acc_lens, num_cycles = state.acc_lens, state.num_cycles
    if record:
        rows = jnp.arange(b)
        slot = jnp.minimum(num_cycles, acc_lens.shape[1] - 1)
        acc_lens = acc_lens.at[rows, slot].set(jnp.where(active, count, acc_lens[rows, slot]))
        num_cycles = num_cycles + active.astype(num_cycles.dtype)
    return dataclasses.replace(
        state,
        tokens=_write_tokens(state.tokens, proposed, state.num_new),  # past num_new: scratch
        num_new=num_new,
        anchor=jnp.where(n > 0, last, state.anchor),
        anchor_pos=state.anchor_pos + n,
        done=state.done | (active & hit_stop) | (num_new >= state.max_new),
        acc_lens=acc_lens,
        num_cycles=num_cycles,
    )


def prefill(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    prompt: Int[Array, "B P"],
    prompt_len: Int[Array, "B"],
    max_new: Int[Array, "B"],
    stop_ids: Int[Array, "Z"],
    spec: LoopSpec,
    capacity: int,
    seed: Int[Array, ""] | None = None,
    sampling_params: sampling.SamplingParams | None = None,
    step_cost: Float[Array, "K"] | None = None,
    return_at_done: Int[Array, ""] | None = None,
    plan: bool = True,
) -> DecodeState:
    """Target over the (right-padded) prompts; first token; drafter context for all prompt positions.

    ``seed``: the PRNG seed (needed when ``spec.sampling``; row ``b`` draws from the ``b``-th key of its split);
    ``sampling_params``: per-row settings; ``step_cost``: the scheduler's cost per tier (scheduled modes);
    ``return_at_done``: see :attr:`DecodeState.return_at_done` (default: all rows); ``plan``: plan the first
    step where the loop plans ahead (:func:`plans_ahead`; a refill plans once the new rows are in place).
    """
    b, p = prompt.shape
    rng = jax.random.split(jax.random.key(seed), b) if spec.sampling else None
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    empty = _shard_cache(target.new_cache(b, capacity), spec.plan, spec.plan and spec.plan.target_kv)
    chunk = spec.prefill_chunk
    if chunk and p > chunk and p % chunk == 0:
        hidden, feats, tcache = _prefill_in_chunks(target, prompt, positions, prompt_len, empty, spec, chunk)
    else:
        hidden, feats, tcache = target(prompt, positions, empty, capture=spec.capture, prefill=True,
                                       kernels=spec.kernels, **_lengths(target, prompt_len))
    last_h = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)  # [B, 1, D]
    logits = target.logits(last_h, spec.kernels)
    if spec.sampling:
        rng, k_first = _split_rows(rng)
        probs = sampling.filtered_probs(logits[:, 0], sampling_params, use_top_k=spec.top_k, use_top_p=spec.top_p)
        first = jax.vmap(sampling.sample)(k_first, probs)[:, None]
    else:
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1]
    dcache = None
    if drafter is not None:
        dcache = drafter.materialize(_shard_cache(drafter.new_cache(b, capacity), spec.plan,
                                                  spec.plan and spec.plan.drafter_kv), feats, positions)
    state = DecodeState(
        tokens=jnp.zeros((b, spec.new_capacity + spec.block_size), jnp.int32),
        num_new=jnp.zeros((b,), jnp.int32),
        max_new=max_new,
        anchor=first[:, 0],
        anchor_pos=prompt_len - 1,  # as if the last prompt token were the anchor; commit advances it
        done=jnp.zeros((b,), bool),
        acc_lens=jnp.zeros((b, spec.new_capacity), jnp.int32),
        num_cycles=jnp.zeros((b,), jnp.int32),
        stop_ids=stop_ids,
        target_cache=tcache,
        draft_cache=dcache,
        rng=rng if spec.sampling else None,
        sampling=sampling_params if spec.sampling else None,
        survival_sum=(jnp.zeros((b, spec.block_size - 1), jnp.float32)
                      if drafter is not None and drafters.kind_of(drafter).has_confidence else None),
        schedule=_new_schedule(drafter, b, spec, step_cost) if spec.scheduled and drafter is not None else None,
        return_at_done=jnp.asarray(b if return_at_done is None else return_at_done, jnp.int32),
    )
    # The first token is committed like any other (it may be a stop token, or the whole budget).
    state = shard_state(commit(state, first, jnp.ones((b,), jnp.int32), record=False), spec.plan)
    if plan and plans_ahead(state, spec):
        state = shard_state(plan_next(target, drafter, state, spec, drafter.config.mask_token_id), spec.plan)
    return state


def _new_schedule(drafter: DFlashDrafter, b: int, spec: LoopSpec, step_cost) -> ScheduleState:
    g, k = spec.block_size - 1, len(spec.tiers) + spec.ar_step
    confident = drafters.kind_of(drafter).has_confidence
    zeros = jnp.zeros((b,), jnp.int32)
    return ScheduleState(step_cost.astype(jnp.float32), None if confident else schedule.AcceptanceCounts.zeros(b, g),
                         zeros, zeros, jnp.zeros((b, k), jnp.int32))


def _lengths(target: TargetModel, n: Int[Array, "B"]) -> dict:
    """Targets with recurrent states advance them over ``n[b]`` tokens of the call (the others ignore it)."""
    return {"lengths": n}


def _prefill_in_chunks(target: TargetModel, prompt: Int[Array, "B P"], positions: Int[Array, "B P"],
                       prompt_len: Int[Array, "B"], cache: KVCache, spec: LoopSpec, chunk: int):
    """Prefill ``chunk`` positions at a time (a ``lax.scan``: one compiled chunk), each chunk writing its
    K/V into the cache and attending to the cache like a verify block.

    A one-shot prefill materializes [B, N, P, P] float32 scores — 32 GB per row for a 16k prompt with 32
    heads; chunks bound that to [B, N, chunk, S]. The result is the same computation (causal attention
    over the same keys), only the order of summation inside the softmax differs.
    """
    b, p = prompt.shape
    n = p // chunk
    split = lambda x: x.reshape(b, n, chunk).swapaxes(0, 1)  # noqa: E731 — [B, P] → [n, B, chunk]

    def one_chunk(cache, xs):
        tokens, pos = xs
        real = jnp.clip(prompt_len - pos[:, 0], 0, chunk)  # the row's prompt tokens in this chunk
        h, f, cache = target(tokens, pos, cache, capture=spec.capture,  # prefill: compute-bound
                             kernels=Kernels("xla", spec.kernels.tuning),
                             **_lengths(target, real))
        return _shard_cache(cache, spec.plan, spec.plan and spec.plan.target_kv), (h, f)

    cache, (hs, fs) = jax.lax.scan(one_chunk, cache, (split(prompt), split(positions)))
    join = lambda x: x.swapaxes(0, 1).reshape(b, p, x.shape[-1])  # noqa: E731
    return join(hs), (join(fs) if fs is not None else None), cache


def _shard_cache(cache: KVCache | None, plan: Plan | None, sharded_heads: bool) -> KVCache | None:
    if cache is None or plan is None:
        return cache
    return cache.constrained(plan, sharded_heads)  # K/V, and whatever state the target's cache kind carries


def shard_state(state: DecodeState, plan: Plan | None) -> DecodeState:
    """Pin the loop carry to its mesh placement (rows over dp, caches by KV head over tp) so shardings are
    the same at every cycle: no resharding inside the loop beyond the collectives TP itself needs."""
    if plan is None:
        return state
    names = ("tokens", "num_new", "max_new", "anchor", "anchor_pos", "done", "acc_lens", "num_cycles") + (
        ("survival_sum",) if state.survival_sum is not None else ())
    rows = {f: constrain(getattr(state, f), plan.rows(getattr(state, f).ndim)) for f in names}
    sch = state.schedule
    if sch is not None:  # its per-row fields too: else a program's output could be placed otherwise than its input
        per_row = lambda x: None if x is None else constrain(x, plan.rows(x.ndim))  # noqa: E731
        sch = dataclasses.replace(sch, counts=None if sch.counts is None else jax.tree.map(per_row, sch.counts),
                                  verify_tokens=per_row(sch.verify_tokens), untrimmed=per_row(sch.untrimmed),
                                  tier_steps=per_row(sch.tier_steps), window=per_row(sch.window),
                                  block=per_row(sch.block), conf=per_row(sch.conf))
    return dataclasses.replace(state, **rows, schedule=sch,
                               target_cache=_shard_cache(state.target_cache, plan, plan.target_kv),
                               draft_cache=_shard_cache(state.draft_cache, plan, plan.drafter_kv))


def block_positions(state: DecodeState, block_size: int) -> Int[Array, "B L"]:
    return state.anchor_pos[:, None] + jnp.arange(block_size, dtype=jnp.int32)[None, :]


def _split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row keys → (next keys, keys to use now)."""
    both = jax.vmap(lambda k: jax.random.split(k))(keys)
    return both[:, 0], both[:, 1]


def propose(target: TargetModel, drafter: DFlashDrafter | None, state: DecodeState, spec: LoopSpec,
            mask_token_id: int) -> tuple[Int[Array, "B L"], jax.Array | None, jax.Array | None, DecodeState]:
    """The block to verify, ``[anchor, d_1 … d_{L-1}]``, from one drafter forward (SPEC §2; DSpark §7): the
    trunk here, the drafts from the drafter's kind (:meth:`dflash_jax.drafters.DrafterKind.draft`).

    Returns the block, the drafts' distribution ``q`` [B, L-1, V] when drafts are sampled (else None), the
    drafts' confidences [B, L-1] (drafters that score their drafts, else None), and the state (its PRNG keys
    advanced when sampling).
    """
    anchor = state.anchor[:, None]
    if drafter is None or spec.block_size == 1:
        return anchor, None, None, state
    kind = drafters.kind_of(drafter)
    h = draft_hidden(target, drafter, state, spec, mask_token_id)
    state, k_draft = _draft_keys(state, spec)
    drafts, q, conf = kind.draft(target, h, state.anchor, _picker(state, spec), k_draft,
                                 cap=spec.verify_mode.draft_cap(spec.tuning), kernels=spec.kernels)
    return jnp.concatenate([anchor, drafts], axis=1), q, conf, state


def draft_hidden(target: TargetModel, drafter: DFlashDrafter, state: DecodeState, spec: LoopSpec,
                 mask_token_id: int, width: int | None = None) -> Float[Array, "B G D"]:
    """The drafter trunk over ``[anchor, MASK…]`` (as many inputs as the kind's
    :meth:`~dflash_jax.drafters.DrafterKind.trunk_width` for a block of ``width`` tokens, default L): its hidden
    states at the G = width − 1 positions that predict the drafts."""
    width = width or spec.block_size
    n_in = drafters.kind_of(drafter).trunk_width(width)
    masks = jnp.full((state.anchor.shape[0], n_in - 1), mask_token_id, jnp.int32)
    h = drafter(target.embed(jnp.concatenate([state.anchor[:, None], masks], axis=1)),
                block_positions(state, n_in), state.draft_cache, state.anchor_pos, kernels=spec.kernels)
    return h[:, n_in - (width - 1):]


def _draft_keys(state: DecodeState, spec: LoopSpec) -> tuple[DecodeState, jax.Array | None]:
    """The state with its PRNG keys advanced and the keys to draw drafts with (sampled drafts only)."""
    if not (spec.sampling and spec.draft_sampling):
        return state, None
    rng, k_draft = _split_rows(state.rng)
    return dataclasses.replace(state, rng=rng), k_draft


def _picker(state: DecodeState, spec: LoopSpec) -> drafters.Pick:
    """How drafts are picked from draft logits [B, *, Vd]: the argmax without keys, else draws from the filtered
    distribution q (over the draft vocabulary: exactly the distribution drafts are drawn from)."""
    def pick(logits, keys):
        if keys is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        q = sampling.filtered_probs(logits, state.sampling, use_top_k=spec.top_k, use_top_p=spec.top_p)
        return jax.vmap(sampling.sample)(keys, q), q
    return pick


def verify(target: TargetModel, drafter: DFlashDrafter | None, state: DecodeState, block: Int[Array, "B L"],
           spec: LoopSpec, q: jax.Array | None = None, window: Int[Array, "B"] | None = None) -> DecodeState:
    """Target forward over the whole block, acceptance (greedy or rejection sampling) + bonus, commit, drafter
    context update (SPEC §3, §5). ``window`` (cap-accept): commit at most that many drafts per row."""
    positions = block_positions(state, block.shape[1])
    hidden, feats, tcache = target(block, positions, state.target_cache, capture=spec.capture, kernels=spec.kernels,
                                   defer=True)
    logits = target.logits(hidden, spec.kernels)  # [B, L, V] float32
    state, accepted, last, untrimmed = _accept(state, block, logits, None, spec, q, window)
    # recurrent states after the anchor and the accepted drafts (a row cut short by commit is done)
    tcache = target.settle(tcache, accepted + 1)
    return _commit_verified(drafter, state, block, positions, tcache, feats, accepted, last, untrimmed, window)


def verify_compact(target: TargetModel, drafter: DFlashDrafter, state: DecodeState, block: Int[Array, "B L"],
                   spec: LoopSpec, q: jax.Array | None, window: Int[Array, "B"], tier: Int[Array, ""]
                   ) -> DecodeState:
    """Verify only each row's window (anchor + ``window`` drafts) of a block drafted already (by a drafter
    that scores its drafts, whose confidences chose the windows), packed into the compiled tier
    ``spec.tiers[tier]``. Finished rows verify nothing. Commits what :func:`verify` with the same window commits."""
    return _packed_step(target, drafter, state, spec, window, tier, lambda size, drafted: drafted,
                        (block, q, state.rng))


def compact_step(target: TargetModel, drafter: DFlashDrafter, state: DecodeState, spec: LoopSpec,
                 mask_token_id: int, window: Int[Array, "B"], tier: Int[Array, ""]) -> DecodeState:
    """Draft, then verify the given windows packed into tier ``tier``: windows known before drafting
    (drafters without a confidence head; also what ``dflash-jax calibrate`` times). A parallel (DFlash)
    drafter's LM head runs over the windows only, inside the tier's branch (on a CPU the full head is a
    third of a draft's time); a sequential one drafts its whole block. With ``spec.ar_step`` the drafting is
    skipped when the scheduler picked a plain autoregressive step (tier index K): a parallel drafter drafts
    inside each tier's branch (traced once per tier), so a step runs one conditional, not a ``lax.cond``
    around the drafting before the tier switch as well (measured a few percent faster on a GPU at large
    batches); a sequential one keeps that cond. Drafts past a window are 0 (never verified).

    Where the verify mode drafts only what a tier can verify (:meth:`~dflash_jax.decode.verify_modes.VerifyMode.
    trunk_widths`: compact, ``Tuning.tier_draft_span``), each tier's branch runs the trunk over that tier's width
    (its windows were capped to it by the admission)."""
    kind = drafters.kind_of(drafter)
    widths = _trunk_widths(spec, drafter, state.anchor.shape[0])
    if kind.sequential:
        def draft():
            block, q, _, drafted = propose(target, drafter, state, spec, mask_token_id)
            return block, q, drafted.rng
        make_block = lambda size, drafted: drafted  # noqa: E731
    else:
        def draft(width: int | None = None):  # the trunk's hidden states [B, width-1, D], the keys after drawing
            drafted, k_draft = _draft_keys(state, spec)
            return draft_hidden(target, drafter, state, spec, mask_token_id, width), k_draft, drafted.rng

        def make_block(size: int, drafted):
            hidden, k_draft, rng = drafted
            b, g = hidden.shape[:2]
            layout = PackedLayout.build(jnp.where(state.done, 0, window), jnp.zeros((b,), jnp.int32),
                                        size, g, spec.packed_groups, spec.kernels.tuning)
            logits = kind.draft_logits(layout.pack(hidden)[None], target, spec.kernels)[0]  # [T, Vd]
            pick = _picker(state, spec)
            if k_draft is None:
                drafts, q = layout.unpack(kind.to_target_ids(pick(logits, None)[0])), None
            else:
                ids, q = pick(layout.unpack(logits), k_draft)
                drafts, q = kind.to_target_ids(ids), kind.to_target_probs(q)
            short = spec.block_size - 1 - g  # a narrower trunk's block: drafts past its width are 0, q too
            drafts = jnp.pad(drafts, ((0, 0), (0, short)))
            q = None if q is None else jnp.pad(q, ((0, 0), (0, short), (0, 0)))
            return jnp.concatenate([state.anchor[:, None], drafts], axis=1), q, rng

    if widths is not None and not kind.sequential:  # each tier's branch drafts over its own width
        width_of = dict(zip(spec.tiers, widths))
        return _packed_step(target, drafter, state, spec, window, tier,
                            lambda size, _: make_block(size, draft(width_of[size])), None, widths)
    if not spec.ar_step:
        return _packed_step(target, drafter, state, spec, window, tier, make_block, draft())
    if not kind.sequential:
        return _packed_step(target, drafter, state, spec, window, tier,
                            lambda size, _: make_block(size, draft()), None)
    skipped = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(draft))  # noqa: E731
    drafted = jax.lax.cond(tier == len(spec.tiers), skipped, draft)
    return _packed_step(target, drafter, state, spec, window, tier, make_block, drafted)


def _packed_step(target, drafter, state: DecodeState, spec: LoopSpec, window, tier, make_block, drafted,
                 widths: tuple[int, ...] | None = None) -> DecodeState:
    """The compact step's packed verify, in one ``lax.switch`` over the compiled tiers (chosen per step on the
    device; on a GPU a host-side conditional whose index is ready as the step starts where the tiers are planned
    ahead (:func:`plans_ahead`), else a conditional node of the step's CUDA graph) and, with
    ``spec.ar_step``, index K: a plain autoregressive step (the anchors alone, window 0, no drafting: what the
    scheduler picks when no drafting pays; the acceptance counts then fade, having observed nothing, so
    drafting is tried again after a while). ``make_block(size, drafted)`` → (block [B, L], q, PRNG keys after
    drafting) runs first inside a tier's branch (``drafted``: what was drafted before the switch). ``widths``:
    the longest window + 1 a row can have at each tier (default L).

    The branches only read the caches: the target's new K/V come out of the switch (:class:`PendingKV`) and
    are written after it, with the drafter's context and the commit. XLA gives a conditional's branch its
    own copy of every operand the branch writes — every layer's cache, every step (tens of ms a step at batch
    3 on a small CPU; the cache's size again in memory traffic on a GPU) — and a read-only operand none."""
    l = spec.block_size
    b = state.anchor.shape[0]
    lens = jnp.where(state.done, 0, window + 1)
    positions = block_positions(state, l)
    forward = functools.partial(_packed_forward, target, state, spec, lens)

    def tier_branch(size: int, width: int):
        def branch(drafted):
            block, q, rng = make_block(size, drafted)
            return block, q, rng, *forward(block, size, min(size, width))
        return branch

    branches = [tier_branch(size, width) for size, width in zip(spec.tiers, widths or (l,) * len(spec.tiers))]
    if spec.ar_step:
        q_like = jax.eval_shape(lambda: make_block(spec.tiers[0], drafted)[1])

        def undrafted(_):
            block = jnp.zeros((b, l), jnp.int32).at[:, 0].set(state.anchor)
            q = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), q_like)  # never read: the window is 0
            return block, q, state.rng, *forward(block, spec.tiers[0], 1)
        branches.append(undrafted)

    block, q, rng, scored, feats, pending = jax.lax.switch(tier, branches, drafted)
    state = dataclasses.replace(state, rng=rng)
    if spec.ar_step and state.schedule.counts is not None:
        sch = state.schedule
        counts = jax.tree.map(lambda faded, kept: jnp.where(tier == len(spec.tiers), faded, kept),
                              sch.counts.faded(schedule.UNOBSERVED_DECAY), sch.counts)
        state = dataclasses.replace(state, schedule=dataclasses.replace(sch, counts=counts))
    logits, choice = (scored, None) if spec.sampling else (None, scored)
    state, accepted, last, _ = _accept(state, block, logits, choice, spec, q, window)
    tcache = pending.write(state.target_cache, spec.kernels)
    tcache = target.settle(tcache, accepted + 1)  # recurrent states after the anchor and the accepted drafts
    return _commit_verified(drafter, state, block, positions, tcache, feats, accepted, last, None, window)


def _packed_forward(target, state: DecodeState, spec: LoopSpec, lens: Int[Array, "B"], block: Int[Array, "B L"],
                    size: int, width: int):
    """The target over each row's first ``lens`` block tokens packed into ``size`` slots (``width``: the longest
    window a row can have there — the attention's block): (scores [B, L] — logits, or the argmax when greedy —,
    captured features [B, L, F] or None, both zero past each window; the new K/V — and a hybrid target's
    linear-layer records — as a :class:`PendingKV` of the whole block's width over the largest tier's slots, so
    that every branch returns one shape)."""
    l = spec.block_size
    layout = PackedLayout.build(lens, state.anchor_pos, size, width, spec.packed_groups, spec.kernels.tuning)
    hidden, feats, pending = target(layout.pack(block)[None], layout.positions[None], state.target_cache,
                                    capture=spec.capture, kernels=spec.kernels, packed=layout)
    logits = target.logits(hidden[0], spec.kernels)  # [T, V]: the LM head only over the packed rows
    scored = layout.unpack(logits if spec.sampling else jnp.argmax(logits, axis=-1).astype(jnp.int32))
    widen = lambda x: jnp.pad(x, [(0, 0), (0, l - width)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    slots = max(*spec.tiers, state.anchor.shape[0] * l)  # every tier's T fits (a dense one has B·L slots)
    return (widen(scored), widen(layout.unpack(feats[0])) if feats is not None else None,
            pending.widened(l, slots, spec.kernels))


def _accept(state: DecodeState, block, logits, choice, spec: LoopSpec, q, window):
    """(state with its PRNG keys advanced, accepted drafts a, bonus / replacement token, a without the
    window). ``choice``: the target's argmax per slot when the logits were reduced already (greedy)."""
    if spec.sampling:
        rng, k_accept = _split_rows(state.rng)
        p = sampling.filtered_probs(logits, state.sampling, use_top_k=spec.top_k, use_top_p=spec.top_p)
        accepted, last, untrimmed = sampling.accept_sampled(k_accept, block, p, q, window)
        return dataclasses.replace(state, rng=rng), accepted, last, untrimmed
    if choice is None:
        return state, *sampling.accept_greedy(block, logits, window)
    return state, *sampling.accept_greedy_ids(block, choice, window)


def _commit_verified(drafter, state: DecodeState, block, positions, tcache, feats, accepted, last, untrimmed,
                     window) -> DecodeState:
    """Drafter context from the verify's features, scheduler statistics, commit. ``untrimmed``: what the
    row would have accepted without its window (None: not known, compact)."""
    dcache = state.draft_cache
    if drafter is not None and feats is not None:
        # All L rows are written; those past the new anchor are masked by ctx_len and overwritten later.
        dcache = drafter.materialize(dcache, feats, positions)
    state = dataclasses.replace(state, target_cache=tcache, draft_cache=dcache)
    if state.schedule is not None:
        state = _record_schedule(state, accepted, untrimmed, window)
    return commit(state, sampling.committed_tokens(block, accepted, last), accepted + 1)


def _record_schedule(state: DecodeState, accepted, untrimmed, window) -> DecodeState:
    """Running acceptance counts and the per-row statistics. The counts see only the window (what compact
    verified), in cap-accept too: both modes then schedule, and commit, the same."""
    sch = state.schedule
    active = ~state.done
    counts = sch.counts.update(accepted, window, active) if sch.counts is not None else None
    trimmed_off = sch.untrimmed if untrimmed is None else sch.untrimmed + jnp.where(active, untrimmed + 1, 0)
    return dataclasses.replace(state, schedule=dataclasses.replace(
        sch, counts=counts, verify_tokens=sch.verify_tokens + jnp.where(active, window + 1, 0),
        untrimmed=trimmed_off))


class Step:
    """The loop's operations bound to its models and spec: what a verify mode composes into a cycle
    (:class:`dflash_jax.decode.verify_modes.StepOps`)."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, spec: LoopSpec, mask_token_id: int):
        self.target, self.drafter, self.spec, self.mask_token_id = target, drafter, spec, mask_token_id

    def propose(self, state: DecodeState):
        return propose(self.target, self.drafter, state, self.spec, self.mask_token_id)

    def schedule(self, state: DecodeState, rates):
        return _schedule(state, rates, self.spec, self.drafter)

    def count_tier(self, state: DecodeState, tier):
        return _count_tier(state, tier, self.spec)

    def record_survival(self, state: DecodeState, conf):
        return _record_survival(state, conf)

    def verify(self, state: DecodeState, block, q, window=None):
        return verify(self.target, self.drafter, state, block, self.spec, q, window)

    def verify_packed(self, state: DecodeState, block, q, window, tier):
        return verify_compact(self.target, self.drafter, state, block, self.spec, q, window, tier)

    def draft_and_verify_packed(self, state: DecodeState, window, tier):
        return compact_step(self.target, self.drafter, state, self.spec, self.mask_token_id, window, tier)

    def plan_next(self, state: DecodeState):
        return plan_next(self.target, self.drafter, state, self.spec, self.mask_token_id)


def cycle(target: TargetModel, drafter: DFlashDrafter | None, state: DecodeState, spec: LoopSpec,
          mask_token_id: int) -> DecodeState:
    """One draft → verify → accept → commit step for every row (finished rows commit nothing), as the verify
    mode composes it (:meth:`dflash_jax.decode.verify_modes.VerifyMode.cycle`; without a drafter or a
    scheduler: the static verify's).

    Scheduled modes pick each row's window from the drafts' survival: the confidences of a drafter that scores
    its drafts (known after drafting), else the running acceptance counts (known before: compact then drafts
    only the windows)."""
    mode = spec.verify_mode if spec.scheduled and drafter is not None else verify_modes.STATIC
    return shard_state(mode.cycle(Step(target, drafter, spec, mask_token_id), state), spec.plan)


def _schedule(state: DecodeState, rates: Float[Array, "B G"], spec: LoopSpec, drafter: DFlashDrafter):
    """(state, windows, tier) from per-draft acceptance rates; the step counted in the tier histogram."""
    window, tier = _admit(state, rates, spec, drafter)
    return _count_tier(state, tier, spec), window, tier


def _admit(state: DecodeState, rates: Float[Array, "B G"], spec: LoopSpec, drafter: DFlashDrafter):
    """(windows [B], tier index) of a step from per-draft acceptance rates (:func:`schedule.admit`); where a
    tier's trunk is narrower than the block, its windows are capped to it."""
    sch, k = state.schedule, len(spec.tiers)
    widths = _trunk_widths(spec, drafter, state.anchor.shape[0])
    active = ~state.done
    # A row commits at most its remaining budget: drafts past it (j ≥ remaining − 1, the bonus counted) add nothing.
    remaining = state.max_new - state.num_new
    surv = schedule.survival(rates)
    surv = jnp.where(jnp.arange(surv.shape[1])[None, :] < remaining[:, None] - 1, surv, 0.0)
    return schedule.admit(surv, active, sch.step_cost[:k], tiers=spec.tiers,
                          ar_cost=sch.step_cost[k] if spec.ar_step else None, groups=spec.packed_groups,
                          compare_all_max=spec.tuning.rank_compare_all_max,
                          caps=None if widths is None else tuple(w - 1 for w in widths),
                          weights=schedule.finish_weights(remaining, active, spec.tuning.finish_together))


def _trunk_widths(spec: LoopSpec, drafter: DFlashDrafter, batch: int) -> tuple[int, ...] | None:
    """The drafter trunk's width at each tier where the verify mode drafts only what a tier can verify."""
    return spec.verify_mode.trunk_widths(spec, drafters.kind_of(drafter), batch, drafter.config.trained_widths)


def _count_tier(state: DecodeState, tier: Int[Array, ""], spec: LoopSpec) -> DecodeState:
    """The step about to run counted in the tier histogram."""
    sch = state.schedule
    steps = sch.tier_steps + jax.nn.one_hot(tier, len(spec.tiers) + spec.ar_step, dtype=jnp.int32)[None, :]
    return dataclasses.replace(state, schedule=dataclasses.replace(sch, tier_steps=steps))


def plans_ahead(state: DecodeState, spec: LoopSpec) -> bool:
    """Compact steps planned at the end of the step before: everything a step's windows depend on — the
    running acceptance counts (drafters without a confidence head) or the drafts' confidences (with one: the
    drafts are then made there too) — is final once the step before has committed, so a step starts with its
    tier known. Its tier switch can then run as a host-side conditional whose index is ready when the step
    starts (on a GPU the host reads it while the GPU would idle anyway, instead of waiting for the GPU to drain
    in mid-step; :func:`dflash_jax.engine.programs.decode_compiler_options`). The same computations in another
    order: the same drafts, windows, tokens and statistics. The verify mode decides
    (:meth:`dflash_jax.decode.verify_modes.VerifyMode.plans_ahead`: compact, but not for drafts sampled from a
    drafter with confidences — their distribution q, [B, G, V], would have to be carried)."""
    return spec.verify_mode.plans_ahead(spec, state.schedule)


def plan_next(target: TargetModel, drafter: DFlashDrafter, state: DecodeState, spec: LoopSpec,
              mask_token_id: int) -> DecodeState:
    """The next step's windows and tier (and, with a confidence head, its drafts) into ``state.schedule``
    (:func:`plans_ahead`)."""
    if state.schedule.counts is not None:
        window, tier = _admit(state, state.schedule.counts.conditional_rates(), spec, drafter)
        return dataclasses.replace(state, schedule=dataclasses.replace(state.schedule, window=window, tier=tier))
    # The barrier keeps the drafting as it was at the start of a step: otherwise XLA merges each drafter
    # layer's K/V projection of the drafts with the one of the context just committed (same weights), which
    # splits the drafter's fused projections into more GEMMs (a GPU compile at 64 rows: 35 instead of 30 in
    # the loop's body).
    block, _, conf, state = propose(target, drafter, jax.lax.optimization_barrier(state), spec, mask_token_id)
    window, tier = _admit(state, conf, spec, drafter)
    return dataclasses.replace(state, schedule=dataclasses.replace(state.schedule, window=window, tier=tier,
                                                                   block=block, conf=conf))


def _record_survival(state: DecodeState, conf) -> DecodeState:
    """Predicted survival of each draft (Π of the confidences up to it), summed over the row's cycles."""
    if conf is None or state.survival_sum is None:
        return state
    return dataclasses.replace(state, survival_sum=state.survival_sum + jnp.where(
        state.done[:, None], 0.0, jnp.cumprod(conf, axis=1)))


def decode(target: TargetModel, drafter: DFlashDrafter | None, state: DecodeState, spec: LoopSpec,
           mask_token_id: int, max_cycles: Int[Array, ""]) -> DecodeState:
    """Cycles until ``state.return_at_done`` rows are done (every row, but for continuous batching), or
    ``max_cycles`` cycles (a runtime value: a stream runs the loop in segments with the very program a whole
    call runs, so both commit identical tokens)."""
    def body(carry):
        s, i = carry
        return cycle(target, drafter, s, spec, mask_token_id), i + 1

    def running(carry):
        s, i = carry
        until = s.done.shape[0] if s.return_at_done is None else s.return_at_done
        return (jnp.sum(s.done, dtype=jnp.int32) < until) & (i < max_cycles)

    state, _ = jax.lax.while_loop(running, body, (state, jnp.zeros((), jnp.int32)))
    return state


def fallback(target: TargetModel, drafter: DFlashDrafter, state: DecodeState, spec: LoopSpec, mask_token_id: int,
             max_steps: Int[Array, ""], steps: int) -> DecodeState:
    """At most ``min(steps, max_steps)`` plain autoregressive steps of a speculative state — the step
    :func:`generate <dflash_jax.generate>`'s loop runs (the anchor alone through the target, then accept and
    commit), with the captured features kept aside — and then the drafter's context for the tokens they
    committed, written once, so that drafting can resume where they stopped (:mod:`dflash_jax.engine.switching`:
    the loop falls back to these steps where drafting does not pay). Returns as :func:`decode` does, once
    ``return_at_done`` rows are done. Each step is recorded as a cycle that committed one token.

    ``steps`` (static) sizes the feature buffer [B, steps, F]; it is a multiple of L, so the buffer is written
    L positions at a time from a position some step's anchor held — never past the cache (capacity ≥ anchor + L).
    Entries of steps not run (or run after a row was done) land past the row's anchor: outside its context,
    overwritten before they enter it."""
    b, l = state.anchor.shape[0], spec.block_size

    def body(carry):
        s, feats_buf, pos_buf, i = carry
        s, feats, positions = autoregressive_step(target, s, spec)
        feats_buf = jax.lax.dynamic_update_slice_in_dim(feats_buf, feats.astype(feats_buf.dtype), i, axis=1)
        pos_buf = jax.lax.dynamic_update_slice_in_dim(pos_buf, positions, i, axis=1)
        return s, _shard_rows(feats_buf, spec.plan), pos_buf, i + 1

    def running(carry):
        s, _, _, i = carry
        until = s.done.shape[0] if s.return_at_done is None else s.return_at_done
        return (jnp.sum(s.done, dtype=jnp.int32) < until) & (i < jnp.minimum(max_steps, steps))

    feats_like = jax.eval_shape(lambda: target(state.anchor[:, None], block_positions(state, 1), state.target_cache,
                                               capture=spec.capture, kernels=spec.kernels, defer=True)[1])
    feats_buf = _shard_rows(jnp.zeros((b, steps, feats_like.shape[-1]), feats_like.dtype), spec.plan)
    pos_buf = jnp.zeros((b, steps), jnp.int32)
    state, feats_buf, pos_buf, ran = jax.lax.while_loop(running, body, (state, feats_buf, pos_buf,
                                                                         jnp.zeros((), jnp.int32)))
    pos_buf = jnp.where(jnp.arange(steps)[None, :] < ran, pos_buf, state.anchor_pos[:, None])
    dcache = state.draft_cache
    for j in range(0, steps, l):
        dcache = drafter.materialize(dcache, feats_buf[:, j: j + l], pos_buf[:, j: j + l])
    state = shard_state(dataclasses.replace(state, draft_cache=dcache), spec.plan)
    if plans_ahead(state, spec):  # the plan made before these steps drafted from an anchor since committed
        state = shard_state(plan_next(target, drafter, state, spec, mask_token_id), spec.plan)
    return state


def autoregressive_step(target: TargetModel, state: DecodeState, spec: LoopSpec
                        ) -> tuple[DecodeState, Float[Array, "B 1 F"] | None, Int[Array, "B 1"]]:
    """One plain autoregressive step of every row — the anchor alone through the target, accept (the target's
    choice), commit: what the loop runs with L = 1 and no drafter — and its captured features and position."""
    block = state.anchor[:, None]
    positions = block_positions(state, 1)
    hidden, feats, tcache = target(block, positions, state.target_cache, capture=spec.capture, kernels=spec.kernels,
                                   defer=True)
    state, accepted, last, _ = _accept(state, block, target.logits(hidden, spec.kernels), None, spec, None, None)
    state = dataclasses.replace(state, target_cache=target.settle(tcache, accepted + 1))
    state = commit(state, sampling.committed_tokens(block, accepted, last), accepted + 1)
    return shard_state(state, spec.plan), feats, positions


def _shard_rows(x: jax.Array, plan: Plan | None) -> jax.Array:
    return x if plan is None else constrain(x, plan.rows(x.ndim))


# --------------------------------------------------------------------------------------------------
# Pure entry points (graph definitions static, parameters as pytrees) for jit / AOT compilation.
# --------------------------------------------------------------------------------------------------

def merge_models(statics, params):
    """(target, drafter) modules from their splits (:func:`dflash_jax.loading.split_model`): ``statics`` are
    static arguments, ``params`` the parameter leaves."""
    target = merge_model(statics[0], params[0])
    drafter = merge_model(statics[1], params[1]) if statics[1] is not None else None
    return target, drafter


def unpack_inputs(ints: Int[Array, "N"], floats: jax.Array | None, spec: LoopSpec, batch: int, prompt_len: int,
                  num_stops: int) -> tuple:
    """The prefill's inputs from the host's two packed vectors (one host-to-device copy each): ``ints`` =
    prompt [B·P] | prompt_len [B] | max_new [B] | stop ids [Z] | seed | return_at_done (| a refill's rows
    [B], unpacked by :func:`refill_fn`); ``floats`` (sampling only) =
    temperature [B] | top_k [B] | top_p [B], then (scheduled verify modes) the step cost per tier [K] (and
    an autoregressive step's, ``spec.ar_step``).
    Inverse of :func:`dflash_jax.engine.job.pack_inputs`."""
    b, p, z = batch, prompt_len, num_stops
    cuts = np.cumsum([b * p, b, b, z, 1, 1])
    prompt, lens, max_new, stops, seed, return_at, _ = jnp.split(ints, cuts)
    sp = cost = None
    if spec.sampling:
        t, k, top_p = floats[0:b], floats[b:2 * b], floats[2 * b:3 * b]
        sp = sampling.SamplingParams(t, k.astype(jnp.int32), top_p)
    if spec.scheduled:
        cost = floats[floats.shape[0] - len(spec.tiers) - spec.ar_step:]
    return (prompt.reshape(b, p), lens, max_new, stops, jax.lax.bitcast_convert_type(seed[0], jnp.uint32), sp,
            cost, return_at[0])


def prefill_fn(graphdefs, params, ints, floats, *, spec: LoopSpec, capacity: int, batch: int, prompt_len: int,
               num_stops: int):
    """→ (state, its packed view)."""
    target, drafter = merge_models(graphdefs, params)
    prompt, lens, max_new, stops, seed, sp, cost, return_at = unpack_inputs(ints, floats, spec, batch, prompt_len,
                                                                            num_stops)
    state = prefill(target, drafter, prompt, lens, max_new, stops, spec, capacity, seed, sp, cost, return_at)
    return state, DecodeView.pack(state)


def refill_fn(graphdefs, params, state, ints, floats, *, spec: LoopSpec, capacity: int, batch: int,
              prompt_len: int, num_stops: int):
    """Continuous batching: prefill ``batch`` new prompts and put them in the rows of ``state`` (donated) that
    ``ints`` ends with (rows past the state's batch are dropped: padding); the state's ``return_at_done``
    becomes the one packed with them. → (state, its packed view)."""
    target, drafter = merge_models(graphdefs, params)
    prompt, lens, max_new, stops, seed, sp, cost, return_at = unpack_inputs(ints, floats, spec, batch, prompt_len,
                                                                            num_stops)
    new = prefill(target, drafter, prompt, lens, max_new, stops, spec, capacity, seed, sp, cost, plan=False)
    state = state.replace_rows(new, ints[ints.shape[0] - batch:])
    state = shard_state(dataclasses.replace(state, return_at_done=return_at), spec.plan)
    if plans_ahead(state, spec):  # the new rows change every row's windows (one admission over the batch)
        state = shard_state(plan_next(target, drafter, state, spec, drafter.config.mask_token_id), spec.plan)
    return state, DecodeView.pack(state)


def decode_fn(graphdefs, params, state, max_cycles, *, spec: LoopSpec, mask_token_id: int):
    """→ (state, its packed view) after at most ``max_cycles`` cycles."""
    target, drafter = merge_models(graphdefs, params)
    state = decode(target, drafter, state, spec, mask_token_id, max_cycles)
    return state, DecodeView.pack(state)


def fallback_fn(graphdefs, params, state, max_steps, *, spec: LoopSpec, mask_token_id: int, steps: int):
    """→ (state, its packed view) after at most ``max_steps`` autoregressive steps (:func:`fallback`)."""
    target, drafter = merge_models(graphdefs, params)
    state = fallback(target, drafter, state, spec, mask_token_id, max_steps, steps)
    return state, DecodeView.pack(state)
