"""Lossless acceptance (SPEC §3, §5): greedy, and speculative rejection sampling.

All functions work on a whole block at once and keep the target's distribution exactly:

* **argmax drafts** (default; the draft distribution is a point mass δ_x): accept draft ``x`` at slot ``i``
  with probability ``p_i(x)``; at the first rejection sample from ``p_i`` with ``x`` removed (renormalised);
  if every draft is accepted, the bonus comes from ``p_{L-1}``.
* **sampled drafts** (drafts drawn from the drafter's own filtered distribution ``q``): accept with
  ``min(1, p/q)``; at the first rejection sample from ``norm(max(p - q, 0))``.

The drafter proposes a block in one parallel pass, so slot ``i``'s draft distribution does not depend on
the drafts before it; that is what makes the per-slot ratio test exact here.

Per-row ``temperature`` 0 means greedy for that row: its distributions are one-hot at the argmax, which
turns both rules into "accept iff the draft equals the target's argmax; bonus = argmax".

Shapes: B rows, L block length, V vocabulary. ``p`` / ``q`` are float32 probabilities.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling settings (runtime arrays: changing them never recompiles)."""

    temperature: Float[Array, "B"]  # 0 = greedy
    top_k: Int[Array, "B"]  # 0 = off
    top_p: Float[Array, "B"]  # 1 = off


def filtered_probs(logits: Float[Array, "B *L V"], sp: SamplingParams, *, use_top_k: bool,
                   use_top_p: bool) -> Float[Array, "B *L V"]:
    """HF semantics: temperature, then top-k, then top-p (keep the smallest set of tokens whose cumulative
    probability reaches top_p, always at least one); temperature 0 → one-hot argmax."""
    extra = (1,) * (logits.ndim - 2)
    t = sp.temperature.reshape(-1, *extra, 1)
    greedy = t <= 0
    x = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, t)
    v = x.shape[-1]
    if use_top_k:
        k = sp.top_k.reshape(-1, *extra, 1)
        kth = jnp.take_along_axis(jnp.sort(x, axis=-1), jnp.clip(v - k, 0, v - 1), axis=-1)
        x = jnp.where((k > 0) & (x < kth), -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    if use_top_p:
        order = jnp.argsort(-probs, axis=-1)
        sorted_p = jnp.take_along_axis(probs, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass ranked strictly above each token
        keep_sorted = before < sp.top_p.reshape(-1, *extra, 1)
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdims=True)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


def sample(key: jax.Array, probs: Float[Array, "*b V"]) -> Int[Array, "*b"]:
    """One draw per row of ``probs`` (zero-probability tokens are never drawn)."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def accept_greedy(block: Int[Array, "B L"], logits: Float[Array, "B L V"],
                  window: Int[Array, "B"] | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy: see :func:`accept_greedy_ids` (``choice`` = the target's argmax)."""
    return accept_greedy_ids(block, jnp.argmax(logits, axis=-1).astype(jnp.int32), window)


def accept_greedy_ids(block: Int[Array, "B L"], choice: Int[Array, "B L"],
                      window: Int[Array, "B"] | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """a = leading drafts equal to the target's choice one slot earlier, at most ``window`` (drafts verified
    per row; default all L-1); bonus = the choice at slot a. Returns (a, bonus, a without the window)."""
    matches = block[:, 1:] == choice[:, :-1]
    untrimmed = jnp.cumprod(matches.astype(jnp.int32), axis=1).sum(axis=1)
    a = untrimmed if window is None else jnp.minimum(untrimmed, window)
    return a, jnp.take_along_axis(choice, a[:, None], axis=1)[:, 0], untrimmed


def accept_sampled(keys: jax.Array, block: Int[Array, "B L"], p: Float[Array, "B L V"],
                   q: Float[Array, "B L-1 V"] | None, window: Int[Array, "B"] | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Speculative rejection sampling over a block. ``q`` None: argmax (point-mass) drafts.

    ``keys``: one PRNG key per row. ``window``: drafts verified per row (default all L-1; ``p`` past slot
    ``window`` is never read): a row that accepts its whole window draws its bonus from ``p`` at the window's
    end, exactly as a block of that length would. The draws do not depend on the window, so windows that
    verify more of the same block commit the same tokens up to where the shorter one stopped.
    Returns (a, replacement-or-bonus token, a without the window) per row.
    """
    b, l, v = p.shape
    drafts = block[:, 1:]  # [B, L-1]
    k_u, k_tok = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
    u = jax.vmap(lambda k: jax.random.uniform(k, (l - 1,)))(k_u)  # [B, L-1]
    p_x = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    if q is None:
        ratio = p_x
    else:
        q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        ratio = jnp.where(q_x > 0, p_x / jnp.maximum(q_x, 1e-38), 1.0)
    ok: Bool[Array, "B L-1"] = u < ratio
    untrimmed = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)
    w = jnp.full((b,), l - 1, jnp.int32) if window is None else window
    a = jnp.minimum(untrimmed, w)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # target distribution at slot a
    rejected = a < w
    x_a = jnp.take_along_axis(drafts, jnp.minimum(a, l - 2)[:, None], axis=1)[:, 0]
    if q is None:
        residual = jnp.where(jax.nn.one_hot(x_a, v, dtype=bool), 0.0, p_a)
    else:
        q_a = jnp.take_along_axis(q, jnp.minimum(a, l - 2)[:, None, None], axis=1)[:, 0]
        residual = jnp.maximum(p_a - q_a, 0.0)
    total = residual.sum(-1, keepdims=True)
    # total == 0 happens only when p == q exactly at slot a (then every draft would have been accepted
    # almost surely); fall back to p itself so the draw stays well defined.
    residual = jnp.where(total > 0, residual / jnp.maximum(total, 1e-38), p_a)
    dist = jnp.where(rejected[:, None], residual, p_a)
    token = jax.vmap(sample)(k_tok, dist)
    return a, token, untrimmed


def committed_tokens(block: Int[Array, "B L"], a: Int[Array, "B"], last: Int[Array, "B"]) -> Int[Array, "B L"]:
    """``[d_1 … d_a, last, …]``: accepted drafts, then the bonus / replacement token (the rest is scratch)."""
    l = block.shape[1]
    shifted = jnp.concatenate([block[:, 1:], block[:, :1]], axis=1)
    return jnp.where(jnp.arange(l)[None, :] < a[:, None], shifted, last[:, None])
