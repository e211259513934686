"""The DFlash (SPEC §6), DSpark (SPEC §7) and DFlash2 training objectives, written to match inference exactly.

For each sequence we pick anchors ``p`` (positions where ``p`` and ``p+1`` are response tokens). Anchor ``a``'s
block is ``[token_p, MASK × (L-1)]`` at positions ``p … p+L-1``. Its queries see

* the projected target features of positions **strictly before p** (the injected context — at inference the
  anchor is the last committed token and its own features are not known yet), and
* every token of their own block (bidirectional), and never another block.

Slot ``k = 1 … L-1`` predicts ``token_{p+k}`` (same-position labels: the anchor slot has no loss) with weight
``exp(-(k-1)/γ)``. Worked example, L = 4, anchor p = 5: queries at positions 5,6,7,8 attend to context
positions 0…4 and block keys 5…8; labels are tokens 6, 7, 8 with weights 1, e^{-1/γ}, e^{-2/γ}.

DSpark blocks (``dspark_loss``) have G inputs ``[token_p, MASK × (G-1)]`` and every slot predicts, the anchor's
too: slot ``k = 0 … G-1`` predicts ``token_{p+k+1}`` through the Markov head, fed the row's own ``token_{p+k}``.

DFlash2 blocks (``dflash2_loss``) are DFlash's (the trunk's convolutions run inside each block); slot k's
candidate selector is also fed the row's own ``token_{p+k-1}`` (the anchor for k = 1) as the previous token.

Shapes: Bs sequences of length T, A anchors per sequence, block length L (DFlash, DFlash2), G drafts per block
(DSpark), V vocabulary, R Markov rank, K candidates per slot (DFlash2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dflash_jax import drafters
from dflash_jax.config import ConfigError, DrafterConfig
from dflash_jax.kernels.common import NEG_INF
from dflash_jax.loading import Drafter, dflash2_from_dflash, dspark_from_dflash
from dflash_jax.models.drafter import DFlash2Drafter, DFlashDrafter, DSparkDrafter
from dflash_jax.models.layers import apply_rope
from dflash_jax.models.target import TargetModel


def default_gamma(block_size: int) -> float:
    """SPEC §6: γ = 7 for L = 16, 5 for L = 10, 4 for L = 8 (interpolated elsewhere)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 0.45 * block_size))


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """w_k for slots k = 1 … L-1."""
    k = np.arange(1, block_size)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def repeated_blocks(tokens: np.ndarray, lengths: np.ndarray, ngram: int = 8) -> np.ndarray:
    """``[N, T]`` bool: anchor ``p``'s first ``ngram`` labels (tokens ``p+1 … p+ngram``) already occurred
    earlier in the same row, i.e. the block starts by copying text (a repetition loop, a quoted line).

    Small greedy targets loop a lot (over half of SmolLM2's self-distilled response tokens), and copying is
    the easy part of drafting; anchors there teach little. Speculative τ is decided at the hard positions,
    where cycles end, so the trainer can down-weight these anchors (``TrainSettings.repeat_anchor_weight``).
    """
    n_rows, t = tokens.shape
    out = np.zeros((n_rows, t), bool)
    if t <= ngram:
        return out
    # One 64-bit hash per n-gram start (polynomial rolling hash; a collision only mislabels one anchor).
    windows = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.uint64), ngram, axis=1)
    mult = np.uint64(1000003) ** np.arange(ngram, dtype=np.uint64)
    hashes = (windows * mult).sum(-1)  # [N, T-ngram+1]; start j covers tokens j … j+ngram-1
    for i in range(n_rows):
        count = int(lengths[i]) - ngram + 1
        if count <= 1:
            continue
        _, first, inverse = np.unique(hashes[i, :count], return_index=True, return_inverse=True)
        repeat_start = first[inverse] < np.arange(count)  # n-gram at start j seen at an earlier start
        out[i, : count - 1] = repeat_start[1:]  # anchor p ↔ n-gram starting at p+1
    return out


def sample_anchors(rng: np.random.Generator, lengths: np.ndarray, prompt_lengths: np.ndarray,
                   max_anchors: int, repeated: np.ndarray | None = None,
                   repeat_weight: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``max_anchors`` distinct anchors per row among ``prompt_len ≤ p ≤ len-2``.

    Uniform (SPEC §6) by default. With ``repeated [Bs, T]`` and ``repeat_weight < 1`` an anchor whose block
    starts by copying earlier text is drawn with that relative weight, so a looping row spends its anchors on
    its novel positions first; the number of anchors per row is unchanged.
    Returns ``anchors [Bs, A]`` (sorted; padding repeats a valid anchor) and ``valid [Bs, A]``.
    """
    bs = len(lengths)
    anchors = np.zeros((bs, max_anchors), np.int32)
    valid = np.zeros((bs, max_anchors), bool)
    for i in range(bs):
        lo, hi = int(prompt_lengths[i]), int(lengths[i]) - 2  # inclusive range of eligible anchors
        n = hi - lo + 1
        if n <= 0:
            continue
        take = min(n, max_anchors)
        if repeated is None or repeat_weight == 1.0:
            chosen = rng.choice(n, size=take, replace=False)
        else:
            w = np.where(repeated[i, lo: hi + 1], repeat_weight, 1.0)
            chosen = rng.choice(n, size=take, replace=False, p=w / w.sum())
        chosen = np.sort(chosen) + lo
        anchors[i, :take] = chosen
        anchors[i, take:] = chosen[0]
        valid[i, :take] = True
    return anchors, valid


def block_inputs(tokens: Int[Array, "Bs T"], lengths: Int[Array, "Bs"], anchors: Int[Array, "Bs A"],
                 valid: Bool[Array, "Bs A"], block_size: int, mask_token_id: int,
                 widths: Int[Array, "Bs A"] | None = None):
    """Block token ids / positions, labels and label validity for every anchor. ``widths``: each anchor's block
    width w ≤ L (``TrainSettings.block_widths``): its slots ≥ w have no label (and are hidden from the block by
    :func:`_multi_block_attention`)."""
    k = jnp.arange(block_size)
    positions = anchors[..., None] + k  # [Bs, A, L]
    t = tokens.shape[1]
    gathered = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(positions, t - 1), axis=2)
    block_ids = jnp.where(k == 0, gathered, mask_token_id)
    labels = gathered[..., 1:]  # slot k predicts token p+k
    label_ok = valid[..., None] & (positions[..., 1:] < lengths[:, None, None])
    if widths is not None:
        label_ok = label_ok & (k[1:] < widths[..., None])
    return block_ids, positions, labels, label_ok


def _multi_block_attention(q, ctx_k, ctx_v, blk_k, blk_v, anchors, widths=None):
    """q/blk_k/blk_v [Bs, A, L, ·, H]; ctx_k/ctx_v [Bs, T, K, H]; context visible iff position < anchor; block
    slot m visible iff m < the anchor's width (``widths [Bs, A]``; None: the whole block). A block of width w
    then drafts exactly as ``[anchor, MASK × (w-1)]`` alone would at inference."""
    bs, a, l, n, h = q.shape
    kh = ctx_k.shape[2]
    qg = q.reshape(bs, a, l, kh, n // kh, h)
    scale = h ** -0.5
    s_ctx = jnp.einsum("balkgh,btkh->bkgalt", qg, ctx_k, preferred_element_type=jnp.float32) * scale
    s_blk = jnp.einsum("balkgh,bamkh->bkgalm", qg, blk_k, preferred_element_type=jnp.float32) * scale
    t = ctx_k.shape[1]
    ctx_mask = jnp.arange(t)[None, None, :] < anchors[:, :, None]  # [Bs, A, T]
    s_ctx = jnp.where(ctx_mask[:, None, None, :, None, :], s_ctx, NEG_INF)
    if widths is not None:
        blk_mask = jnp.arange(l)[None, None, :] < widths[:, :, None]  # [Bs, A, L] over the keys
        s_blk = jnp.where(blk_mask[:, None, None, :, None, :], s_blk, NEG_INF)
    m = jnp.maximum(s_ctx.max(-1), s_blk.max(-1))[..., None]
    p_ctx, p_blk = jnp.exp(s_ctx - m), jnp.exp(s_blk - m)
    denom = p_ctx.sum(-1) + p_blk.sum(-1)  # [Bs, K, G, A, L]
    out = (jnp.einsum("bkgalt,btkh->balkgh", p_ctx.astype(ctx_v.dtype), ctx_v, preferred_element_type=jnp.float32)
           + jnp.einsum("bkgalm,bamkh->balkgh", p_blk.astype(blk_v.dtype), blk_v,
                        preferred_element_type=jnp.float32))
    out = out / jnp.transpose(denom, (0, 3, 4, 1, 2))[..., None]
    return out.reshape(bs, a, l, n, h).astype(q.dtype)


def drafter_forward_blocks(drafter: DFlashDrafter, target: TargetModel, features: Float[Array, "Bs T F"],
                           block_ids: Int[Array, "Bs A L"], positions: Int[Array, "Bs A L"],
                           anchors: Int[Array, "Bs A"], widths: Int[Array, "Bs A"] | None = None
                           ) -> Float[Array, "Bs A L D"]:
    """All blocks of all sequences in one pass (the inference drafter forward, batched over anchors); ``widths``:
    each block's width (:func:`_multi_block_attention`)."""
    cfg = drafter.config
    if any(t != "full_attention" for t in cfg.layer_types):
        raise NotImplementedError("training drafters with sliding_attention layers is not supported")
    bs, a, l = block_ids.shape
    t = features.shape[1]
    ctx = drafter.project_context(features)  # [Bs, T, D]
    ctx_cos, ctx_sin = drafter.rope(jnp.broadcast_to(jnp.arange(t), (bs, t)))
    cos, sin = drafter.rope(positions.reshape(bs, a * l))
    x = target.embed(block_ids).reshape(bs, a * l, -1).astype(drafter.dtype) * cfg.input_embedding_scale
    for layer in drafter.layers:
        att = layer.self_attn
        ctx_k, ctx_v = att.kv(ctx, ctx_cos, ctx_sin)

        def attend(x_hat, att=att, ctx_k=ctx_k, ctx_v=ctx_v):
            q = apply_rope(att.q_norm(att.q_proj(x_hat).reshape(bs, a * l, att.n, att.h)), cos, sin)
            blk_k, blk_v = att.kv(x_hat, cos, sin)
            o = _multi_block_attention(q.reshape(bs, a, l, att.n, att.h), ctx_k, ctx_v,
                                       blk_k.reshape(bs, a, l, att.k, att.h), blk_v.reshape(bs, a, l, att.k, att.h),
                                       anchors, widths)
            return att.o_proj(o.reshape(bs, a * l, att.n * att.h))

        # ``sublayer``: the branch as is, or wrapped by the kind (DFlash2's convolutions, blocks of l positions)
        x = x + layer.sublayer("attention", layer.input_layernorm(x), attend, l)
        x = x + layer.sublayer("mlp", layer.post_attention_layernorm(x), layer.mlp, l)
    return drafter.norm(x).reshape(bs, a, l, -1)


def forward_blocks(drafter: DFlashDrafter, target: TargetModel, batch: dict, block_size: int,
                   features: Float[Array, "Bs T F"] | None = None):
    """The drafter over each anchor's block of ``batch`` (``block_size`` inputs, the anchor first): (block ids,
    labels, which labels exist, hidden states [Bs, A, L, D]); ``features``: the target's, when computed already."""
    if features is None:
        features = target_features(target, batch["tokens"], drafter.config.target_layer_ids)
    widths = batch.get("widths")
    block_ids, positions, labels, label_ok = block_inputs(batch["tokens"], batch["lengths"], batch["anchors"],
                                                          batch["valid"], block_size, drafter.config.mask_token_id,
                                                          widths)
    hidden = drafter_forward_blocks(drafter, target, features, block_ids, positions, batch["anchors"], widths)
    return block_ids, labels, label_ok, hidden


def target_states(target: TargetModel, tokens: Int[Array, "Bs T"], capture: tuple[int, ...]
                  ) -> tuple[Float[Array, "Bs T D"], Float[Array, "Bs T F"]]:
    """Frozen target final-normed hidden states and features of every position (one forward, no cache)."""
    bs, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bs, t))
    hidden, feats, _ = target(tokens, positions, None, capture=capture, prefill=True)
    return jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(feats)


def target_features(target: TargetModel, tokens: Int[Array, "Bs T"], capture: tuple[int, ...]) -> jax.Array:
    """Frozen target features of every position (no cache is kept)."""
    return target_states(target, tokens, capture)[1]


def _leading(correct: Bool[Array, "Bs A L1"]) -> Int[Array, "Bs A"]:
    """Leading correct slots of each block: the drafts a greedy verify would accept."""
    return jnp.cumprod(correct.astype(jnp.int32), axis=-1).sum(-1)


def anchor_acceptance(drafter: DFlashDrafter, target: TargetModel, batch: dict,
                      block_size: int) -> Int[Array, "Bs A"]:
    """For each anchor of ``batch``: the tokens a greedy decoding cycle anchored there would commit
    (1 + leading correct drafts), labels being the row's own tokens. Inference gives exactly these numbers
    at the anchors it visits (tests/test_real_pair.py checks this on the real pair). A DSpark drafter
    drafts sequentially (``dspark_acceptance``; ``block_size`` then counts its drafts)."""
    return objective_for(drafter.config.kind).acceptance(drafter, target, batch, block_size)


def dflash_acceptance(drafter: DFlashDrafter, target: TargetModel, batch: dict,
                      block_size: int) -> Int[Array, "Bs A"]:
    """``anchor_acceptance`` for DFlash: every draft of a block read at once."""
    _, labels, label_ok, hidden = forward_blocks(drafter, target, batch, block_size)
    guess = drafter.to_target_ids(jnp.argmax(drafter.draft_logits(hidden[:, :, 1:], target), -1))
    return _leading((guess == labels) & label_ok) + 1


def walked_cycles(acceptance: np.ndarray, prompt_length: int, length: int) -> list[int]:
    """Replay greedy decoding along one row: the first cycle is anchored at the first response token (the
    prefill's), each next one where the previous cycle's commits end. ``acceptance [T]``: the tokens a
    cycle anchored at each position commits (``anchor_acceptance``). Returns each cycle's committed tokens,
    as decoding records them, except that the last cycle stops at the row's end (decoding's last cycle may
    count drafts accepted past ``max_new_tokens``; the row has no labels there)."""
    cycles, p = [], int(prompt_length)
    while p <= length - 2:
        a = min(int(acceptance[p]), int(length) - 1 - p)
        cycles.append(a)
        p += a
    return cycles


def walked_tau(cycles: list[list[int]]) -> float:
    """Tokens committed per cycle over rows of ``walked_cycles`` (the τ evaluation reports)."""
    n = sum(len(c) for c in cycles)
    return sum(map(sum, cycles)) / n if n else 0.0


def map_slots(fn, args: tuple, lead: tuple[int, ...], chunk_rows: int | None):
    """``fn(*args)`` over slots whose leading dims are ``lead``: all at once (``chunk_rows`` None), or
    ``chunk_rows`` slots at a time through ``lax.map`` under ``jax.checkpoint``, so only one chunk's [.., V]
    float32 arrays exist at once and the backward pass recomputes them (one more lm_head matmul per chunk).
    Same numbers either way, up to summation order."""
    if chunk_rows is None:
        return fn(*args)
    n, k = math.prod(lead), len(lead)
    chunks = -(-n // chunk_rows)
    pad = chunks * chunk_rows - n

    def split(x):
        rest = x.shape[k:]
        x = jnp.pad(x.reshape(n, *rest), ((0, pad),) + ((0, 0),) * len(rest))
        return x.reshape(chunks, chunk_rows, *rest)

    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(map(split, args)))
    return jax.tree.map(lambda y: y.reshape(chunks * chunk_rows, *y.shape[2:])[:n].reshape(*lead, *y.shape[2:]),
                        out)


def slot_cross_entropy(drafter: DFlashDrafter, target: TargetModel, hidden: Float[Array, "Bs A L1 D"],
                       labels: Int[Array, "Bs A L1"], chunk_rows: int | None = None
                       ) -> tuple[Float[Array, "Bs A L1"], Bool[Array, "Bs A L1"]]:
    """Cross-entropy of each draft slot's logits against its label, and whether its top-1 is the label.

    ``chunk_rows`` None materializes every slot's float32 logits at once, [Bs, A, L-1, V] (12 GB for the
    SmolLM2 recipe's 32 × 128 anchors × 15 slots × 49,152 words), and the backward pass keeps them; with
    ``chunk_rows`` only one chunk's logits exist at once (``map_slots``)."""

    def per_slot(h, y):
        logits = drafter.draft_logits(h, target)
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return ce, jnp.argmax(logits, -1) == y

    return map_slots(per_slot, (hidden, labels), labels.shape, chunk_rows)


def dflash_loss(drafter: DFlashDrafter, target: TargetModel, batch: dict, *, weights: jax.Array,
                features: jax.Array | None = None, ce_chunk_rows: int | None = None) -> tuple[jax.Array, dict]:
    """Weighted cross-entropy over block slots 1…L-1, plus accuracy metrics.

    ``batch``: tokens [Bs, T], lengths [Bs], anchors [Bs, A], valid [Bs, A]. ``weights``: [L-1].
    ``ce_chunk_rows``: see ``slot_cross_entropy``.
    Metrics: ``acc`` (top-1 per labelled slot) and ``tau`` — the acceptance length greedy decoding would get
    on these blocks, 1 + the number of leading correct slots, averaged over anchors.
    """
    if drafter.d2t is not None:  # labels live in the target vocabulary; train on the whole vocabulary
        raise NotImplementedError("training a drafter restricted to a reduced draft vocabulary is not supported")
    _, labels, label_ok, hidden = forward_blocks(drafter, target, batch, weights.shape[0] + 1, features)
    ce, top1 = slot_cross_entropy(drafter, target, hidden[:, :, 1:], labels, ce_chunk_rows)
    w = weights[None, None, :] * label_ok
    loss = (ce * w).sum() / jnp.maximum(w.sum(), 1e-6)
    correct = top1 & label_ok
    leading = _leading(correct)
    anchors_ok = batch["valid"]
    metrics = {
        "loss": loss,
        "acc": correct.sum() / jnp.maximum(label_ok.sum(), 1),
        "tau": ((leading + 1) * anchors_ok).sum() / jnp.maximum(anchors_ok.sum(), 1),
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# DSpark (SPEC §7)
# --------------------------------------------------------------------------------------------------

DSPARK_LOSS_COEFS = (0.1, 0.9, 1.0)  # SPEC §7: CE, ‖p_d − p_t‖₁, confidence BCE


def dspark_block_inputs(tokens: Int[Array, "Bs T"], lengths: Int[Array, "Bs"], anchors: Int[Array, "Bs A"],
                        valid: Bool[Array, "Bs A"], num_drafts: int, mask_token_id: int):
    """DSpark blocks: ids and positions of the G inputs ``[token_p, MASK × (G-1)]`` at ``p … p+G-1``, labels
    ``token_{p+1} … token_{p+G}`` with their validity, and the teacher-forced Markov inputs ``token_p …
    token_{p+G-1}`` (slot k's previous token; ``x_{-1}`` is the anchor)."""
    ids, positions, labels, label_ok = block_inputs(tokens, lengths, anchors, valid, num_drafts + 1, mask_token_id)
    prev = jnp.concatenate([ids[..., :1], labels[..., :-1]], axis=-1)
    return ids[..., :-1], positions[..., :-1], labels, label_ok, prev


def dspark_slot_terms(drafter: DSparkDrafter, target: TargetModel, hidden: Float[Array, "Bs A G D"],
                      target_hidden: Float[Array, "Bs A G D"], prev: Int[Array, "Bs A G"],
                      labels: Int[Array, "Bs A G"], chunk_rows: int | None = None):
    """Per slot: cross-entropy of ``U_k + W2·W1[prev]`` against the label, ``‖p_d − p_t‖₁`` against the
    target's own distribution at that position, and whether the top-1 is the label (``map_slots`` chunks)."""
    head = drafter.markov_head

    def per_slot(h, ht, x, y):
        logits = drafter.base_logits(h, target) + head.bias(head.embed(x))
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        p_t = jax.nn.softmax(jax.lax.stop_gradient(target.logits(ht)), axis=-1)
        tv = jnp.abs(jax.nn.softmax(logits, axis=-1) - p_t).sum(-1)
        return ce, tv, jnp.argmax(logits, -1) == y

    return map_slots(per_slot, (hidden, target_hidden, prev, labels), labels.shape, chunk_rows)


def _at_positions(x: Float[Array, "Bs T D"], positions: Int[Array, "Bs A G"]) -> Float[Array, "Bs A G D"]:
    return jax.vmap(lambda row, pos: row[jnp.minimum(pos, row.shape[0] - 1)])(x, positions)


def dspark_loss(drafter: DSparkDrafter, target: TargetModel, batch: dict, *, weights: jax.Array,
                ce_chunk_rows: int | None = None, coefs: tuple[float, float, float] = DSPARK_LOSS_COEFS
                ) -> tuple[jax.Array, dict]:
    """SPEC §7: ``0.1·CE + 0.9·‖p_d − p_t‖₁`` (both weighted by slot, ``weights`` [G] = w_k) ``+ 1.0·BCE``
    of the confidence ``σ(z_k)`` against ``1 − ½‖p_d − p_t‖₁`` = Σ min(p_d, p_t), the probability that a draft
    sampled from p_d passes a sampled verify (a constant target: no gradient flows through it). ``p_t`` is the
    frozen target's distribution for the same token, from the forward that gives the features.
    Teacher-forced: slot k's Markov input is the row's own token p+k, which is what the sequential drafter fed
    itself whenever all drafts before k were right, so the leading-correct count (``tau``) is exactly greedy
    decoding's.

    Metrics: the loss and its parts (``ce``, ``tv``, ``bce``), ``acc``, ``tau``, ``conf`` (mean σ(z)) next to
    ``conf_target`` (its BCE target's mean), and per draft position the predicted survival Π σ(z) and the
    realised one over anchors (``survival_pred``, ``survival_real`` [G]: a running view of calibration).
    """
    if drafter.d2t is not None:  # labels and p_t live in the target vocabulary
        raise NotImplementedError("training a DSpark drafter with a reduced draft vocabulary is not supported")
    cfg = drafter.config
    g = weights.shape[0]
    target_hidden, features = target_states(target, batch["tokens"], cfg.target_layer_ids)
    ids, positions, labels, label_ok, prev = dspark_block_inputs(batch["tokens"], batch["lengths"],
                                                                 batch["anchors"], batch["valid"], g,
                                                                 cfg.mask_token_id)
    hidden = drafter_forward_blocks(drafter, target, features, ids, positions, batch["anchors"])
    ce, tv, top1 = dspark_slot_terms(drafter, target, hidden, _at_positions(target_hidden, positions), prev,
                                     labels, ce_chunk_rows)
    w = weights[None, None, :] * label_ok
    w_sum = jnp.maximum(w.sum(), 1e-6)
    n_ok = jnp.maximum(label_ok.sum(), 1)
    parts = {"ce": (ce * w).sum() / w_sum, "tv": (tv * w).sum() / w_sum}
    correct = top1 & label_ok
    leading = _leading(correct)
    anchors_ok = batch["valid"]
    n_anchors = jnp.maximum(anchors_ok.sum(), 1)
    metrics = {"acc": correct.sum() / n_ok, "tau": ((leading + 1) * anchors_ok).sum() / n_anchors}
    if drafter.confidence_head is not None:
        z = drafter.confidence_head(hidden, drafter.markov_head.embed(prev))
        parts["bce"], conf_metrics = _confidence_terms(z, tv, label_ok, leading, anchors_ok)
        metrics |= conf_metrics
    loss = sum(coef * parts[k] for coef, k in zip(coefs, ("ce", "tv", "bce")) if k in parts)
    return loss, {"loss": loss, **parts, **metrics}


def _confidence_terms(z: Float[Array, "Bs A G"], tv: Float[Array, "Bs A G"], label_ok: Bool[Array, "Bs A G"],
                      leading: Int[Array, "Bs A"], anchors_ok: Bool[Array, "Bs A"]) -> tuple[jax.Array, dict]:
    """The confidence head's BCE (mean over labelled slots) against ``1 − ½‖p_d − p_t‖₁``, and its metrics."""
    n_ok, n_anchors = jnp.maximum(label_ok.sum(), 1), jnp.maximum(anchors_ok.sum(), 1)
    y = jax.lax.stop_gradient(1.0 - 0.5 * tv)
    bce = ((jax.nn.softplus(z) - y * z) * label_ok).sum() / n_ok  # −y·log σ(z) − (1−y)·log(1−σ(z))
    c = jax.nn.sigmoid(z)
    survived = jnp.arange(z.shape[-1]) < leading[..., None]
    per_anchor = lambda x: (x * anchors_ok[..., None]).sum((0, 1)) / n_anchors  # noqa: E731 — [G]
    return bce, {"conf": (c * label_ok).sum() / n_ok, "conf_target": (y * label_ok).sum() / n_ok,
                 "survival_pred": per_anchor(jnp.cumprod(c, -1)), "survival_real": per_anchor(survived)}


def sequential_drafts(drafter: DSparkDrafter, target: TargetModel, hidden: Float[Array, "*b G D"],
                      anchor: Int[Array, "*b"]) -> tuple[Int[Array, "*b G"], Float[Array, "*b G"]]:
    """Greedy DSpark drafts left to right, as inference draws them (``x_k = argmax(U_k + W2·W1[x_{k-1}])``,
    ``x_{-1}`` = the anchor), and their confidence logits ``z_k`` (zeros without a confidence head)."""
    head = drafter.markov_head

    def step(prev, h):
        e = head.embed(prev)
        x = drafter.to_target_ids(jnp.argmax(drafter.base_logits(h, target) + head.bias(e), -1).astype(jnp.int32))
        z = drafter.confidence_head(h, e) if drafter.confidence_head is not None else jnp.zeros(prev.shape)
        return x, (x, z)

    _, (drafts, z) = jax.lax.scan(step, anchor, jnp.moveaxis(hidden, -2, 0))
    return jnp.moveaxis(drafts, 0, -1), jnp.moveaxis(z, 0, -1)


def dspark_acceptance(drafter: DSparkDrafter, target: TargetModel, batch: dict, num_drafts: int
                      ) -> tuple[Int[Array, "Bs A"], Float[Array, "Bs A G"]]:
    """``anchor_acceptance`` for DSpark, drafting sequentially (not teacher-forced), plus each draft's
    confidence logit z: exactly what a greedy decoding cycle anchored there computes, past the first wrong
    draft too, which calibration (STS) needs."""
    cfg = drafter.config
    features = target_features(target, batch["tokens"], cfg.target_layer_ids)
    ids, positions, labels, label_ok, _ = dspark_block_inputs(batch["tokens"], batch["lengths"], batch["anchors"],
                                                              batch["valid"], num_drafts, cfg.mask_token_id)
    hidden = drafter_forward_blocks(drafter, target, features, ids, positions, batch["anchors"])
    drafts, z = sequential_drafts(drafter, target, hidden, ids[..., 0])
    return _leading((drafts == labels) & label_ok) + 1, z


# --------------------------------------------------------------------------------------------------
# DFlash2: the DFlash trunk's loss plus the candidate selector's
# --------------------------------------------------------------------------------------------------

DFLASH2_SELECTOR_WEIGHT = 1.0  # the selector's K-way CE next to the trunk's CE (both slot-weighted)


def dflash2_slot_terms(drafter: DFlash2Drafter, target: TargetModel, hidden: Float[Array, "Bs A L1 D"],
                       labels: Int[Array, "Bs A L1"], prev: Int[Array, "Bs A L1"], chunk_rows: int | None = None,
                       target_hidden: Float[Array, "Bs A L1 D"] | None = None):
    """Per draft slot, from one LM head over its hidden state (``map_slots`` chunks):

    * ``ce``, ``top1`` — DFlash's: cross-entropy of the (scaled) logits against the label, and whether their
      argmax is the label;
    * ``sel_ce`` — the selector's: cross-entropy over the slot's K candidates (the top-K of the logits, as
      drafting takes them) of their scores after the true previous token ``prev``, against the label; where the
      label is not among them it takes the K-th candidate's place, so every labelled slot has a target;
    * ``sel_top1`` — whether the walk, given ``prev``, picks the label among the strict top-K (no label put in):
      exactly the draft greedy decoding makes at this slot whenever every draft before it was right;
    * ``found`` — whether the label is among the top-K at all;
    * ``teacher_ce`` (with ``target_hidden``, the target's final hidden state whose logits predict the slot's
      token) — cross-entropy of the same scores against the target's own distribution over the same K
      candidates (``softmax`` of its logits there): every candidate's rank, not only the row's token's; zeros
      without ``target_hidden``.

    The candidate ids are discrete (no gradient); their unary scores (logits of the trunk's hidden state), the
    hidden projection and the codebooks get one."""
    sel, k = drafter.candidate_selector, drafter.config.selector_top_k

    def per_slot(h, y, x, ht):
        raw = drafter.head_logits(h, target)
        logits = drafter.scale_logits(raw)
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        ids = jax.lax.top_k(jax.lax.stop_gradient(raw), k)[1].astype(jnp.int32)
        hit = ids == y[..., None]
        found = hit.any(-1)
        ids = ids.at[..., -1].set(jnp.where(found, ids[..., -1], y))  # the label in, where it was missing
        at = jnp.where(found, jnp.argmax(hit, -1), k - 1)
        unary = drafter.scale_logits(jnp.take_along_axis(raw, ids, axis=-1))
        scores = sel.candidate_scores(ids, unary, h, x)
        log_q = jax.nn.log_softmax(scores, axis=-1)
        sel_ce = -jnp.take_along_axis(log_q, at[..., None], axis=-1)[..., 0]
        teacher_ce = jnp.zeros_like(sel_ce)
        if ht is not None:
            p_t = jax.nn.softmax(jax.lax.stop_gradient(jnp.take_along_axis(target.logits(ht), ids, axis=-1)), -1)
            teacher_ce = -(p_t * log_q).sum(-1)
        return ce, jnp.argmax(logits, -1) == y, sel_ce, found & (jnp.argmax(scores, -1) == at), found, teacher_ce

    if target_hidden is None:
        return map_slots(lambda h, y, x: per_slot(h, y, x, None), (hidden, labels, prev), labels.shape, chunk_rows)
    return map_slots(per_slot, (hidden, labels, prev, target_hidden), labels.shape, chunk_rows)


def dflash2_loss(drafter: DFlash2Drafter, target: TargetModel, batch: dict, *, weights: jax.Array,
                 features: jax.Array | None = None, ce_chunk_rows: int | None = None,
                 selector_weight: float = DFLASH2_SELECTOR_WEIGHT, selector_teacher: float = 0.0
                 ) -> tuple[jax.Array, dict]:
    """``CE + selector_weight · selector CE``, both weighted by slot as DFlash's (``dflash2_slot_terms``): the
    trunk (with its convolutions) learns DFlash's objective on the same blocks, and the selector learns to pick
    the label among the top-K given the true previous token (the anchor for the first draft): teacher-forced,
    as DSpark's Markov head. ``selector_teacher`` λ > 0 makes the selector's term ``(1 − λ) · CE against the
    label + λ · CE against the target's distribution over the candidates`` (the target's final hidden states come
    from the forward that gives the features, as DSpark's ``p_t``): a sampled row's token is one draw, the
    target's distribution ranks every candidate, and greedy verification accepts its argmax.

    Metrics: ``loss``, its parts ``ce`` and ``selector`` (and ``selector_teacher``, the distribution's CE, when
    λ > 0); ``acc`` and ``tau`` of the selector's drafts (its leading-correct count is greedy decoding's, as the
    walk's previous choice is the true token while every draft is right); ``unary_acc`` and ``unary_tau`` of the
    trunk's argmax (DFlash's drafts); ``recall``, the fraction of labels among the top-K, and ``recall_tau``, the
    τ of a selector that always found the label among them: the most these candidates let the selector reach.
    """
    if drafter.d2t is not None:  # labels and candidates live in the target vocabulary
        raise NotImplementedError("training a DFlash2 drafter with a reduced draft vocabulary is not supported")
    block_size = weights.shape[0] + 1
    target_hidden = None
    if selector_teacher > 0:
        hidden_t, features = target_states(target, batch["tokens"], drafter.config.target_layer_ids)
        # The target's logits at position p + k − 1 are its distribution for slot k's token p + k.
        target_hidden = _at_positions(hidden_t, batch["anchors"][..., None] + jnp.arange(block_size - 1))
    block_ids, labels, label_ok, hidden = forward_blocks(drafter, target, batch, block_size, features)
    prev = jnp.concatenate([block_ids[..., :1], labels[..., :-1]], axis=-1)  # the anchor, then the labels
    ce, top1, sel_ce, sel_top1, found, teacher_ce = dflash2_slot_terms(
        drafter, target, hidden[:, :, 1:], labels, prev, ce_chunk_rows, target_hidden)
    w = weights[None, None, :] * label_ok
    w_sum = jnp.maximum(w.sum(), 1e-6)
    mean = lambda x: (x * w).sum() / w_sum  # noqa: E731
    parts = {"ce": mean(ce), "selector": (1 - selector_teacher) * mean(sel_ce) + selector_teacher * mean(teacher_ce)}
    if selector_teacher > 0:
        parts["selector_teacher"] = mean(teacher_ce)
    loss = parts["ce"] + selector_weight * parts["selector"]
    n_ok = jnp.maximum(label_ok.sum(), 1)
    anchors_ok = batch["valid"]
    n_anchors = jnp.maximum(anchors_ok.sum(), 1)
    tau = lambda correct: ((_leading(correct & label_ok) + 1) * anchors_ok).sum() / n_anchors  # noqa: E731
    return loss, {"loss": loss, **parts,
                  "acc": (sel_top1 & label_ok).sum() / n_ok, "tau": tau(sel_top1),
                  "unary_acc": (top1 & label_ok).sum() / n_ok, "unary_tau": tau(top1),
                  "recall": (found & label_ok).sum() / n_ok, "recall_tau": tau(found)}


def _greedy(row, key):
    return jnp.argmax(row, -1).astype(jnp.int32), None


def dflash2_acceptance(drafter: DFlash2Drafter, target: TargetModel, batch: dict, block_size: int
                       ) -> tuple[Int[Array, "Bs A"], Float[Array, "Bs A G"]]:
    """``anchor_acceptance`` for DFlash2, drafting as decoding does (the kind's own top-K and greedy walk over
    each block, not teacher-forced), plus each draft's confidence as a logit, ``log c − log(1 − c)`` of the
    walk's probability c of its choice before any STS temperatures (what STS fits and the calibration report
    reads; the kind's confidences carry the temperatures, undone here)."""
    block_ids, labels, label_ok, hidden = forward_blocks(drafter, target, batch, block_size)
    bs, a, l, d = hidden.shape
    drafts, _, conf = drafters.kind_of(drafter).draft(target, hidden[:, :, 1:].reshape(bs * a, l - 1, d),
                                                      block_ids[..., 0].reshape(-1), _greedy, None)
    c = jnp.clip(conf.reshape(bs, a, l - 1), 1e-6, 1 - 1e-6)
    temps = jnp.asarray(drafter.config.confidence_temperatures or (1.0,) * (l - 1), jnp.float32)[: l - 1]
    return (_leading((drafts.reshape(bs, a, l - 1) == labels) & label_ok) + 1,
            (jnp.log(c) - jnp.log1p(-c)) * temps)


# --------------------------------------------------------------------------------------------------
# The objective of each drafter kind
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Objective:
    """How one drafter kind trains. ``loss(drafter, target, batch, *, weights, ce_chunk_rows)`` → (loss,
    metrics); ``acceptance(drafter, target, batch, block_size)`` → [Bs, A] (``anchor_acceptance``);
    ``replay(drafter, target, batch, verify_width)`` → (acceptance [Bs, A], confidence logits [Bs, A, G] or
    None), what held-out replay and calibration read; ``check(cfg)`` raises for a drafter it cannot train;
    ``warm_start(drafter, spec)`` builds a drafter of this kind on the trunk of ``drafter``, one of another
    kind (``spec``: the run's ``training.drafter`` section), where the kind can start so; ``calibrates``:
    the pipeline fits STS temperatures on held-out cycles after training (from ``replay``'s logits);
    ``options(settings)``: the kind's own keyword arguments to ``loss`` from the run's ``TrainSettings``."""

    loss: Callable
    acceptance: Callable
    replay: Callable
    check: Callable[[DrafterConfig], None] | None = None
    warm_start: Callable[[Drafter, Any], Drafter] | None = None
    calibrates: bool = False  # STS temperatures are fitted after training (the kind applies them: DSpark, DFlash2)
    options: Callable[[Any], dict] = lambda settings: {}


OBJECTIVES: dict[str, Objective] = {}


def objective_for(kind: str) -> Objective:
    """The training objective of drafter kind ``kind``."""
    if kind not in OBJECTIVES:
        raise ConfigError(f"drafter kind {kind!r} has no training objective (known: {tuple(OBJECTIVES)})")
    return OBJECTIVES[kind]


def _dflash_replay(drafter, target, batch, verify_width):
    return dflash_acceptance(drafter, target, batch, verify_width), None


def _dspark_acceptance(drafter, target, batch, num_drafts):
    return dspark_acceptance(drafter, target, batch, num_drafts)[0]


def _dspark_replay(drafter, target, batch, verify_width):
    return dspark_acceptance(drafter, target, batch, verify_width - 1)


def _dspark_check(cfg: DrafterConfig) -> None:
    if cfg.draft_vocab_size is not None:
        raise ConfigError("training a DSpark drafter with a reduced draft vocabulary is not supported")


def _dspark_warm_start(drafter: Drafter, spec) -> Drafter:
    return dspark_from_dflash(drafter, spec.block_size, spec.markov_rank, seed=spec.seed)


def _dflash2_acceptance(drafter, target, batch, block_size):
    return dflash2_acceptance(drafter, target, batch, block_size)[0]


def _dflash2_check(cfg: DrafterConfig) -> None:
    if cfg.draft_vocab_size is not None:
        raise ConfigError("training a DFlash2 drafter with a reduced draft vocabulary is not supported")


def _dflash2_warm_start(drafter: Drafter, spec) -> Drafter:
    return dflash2_from_dflash(drafter, spec.block_size, conv_kernel_size=spec.conv_kernel_size,
                               conv_group_size=spec.conv_group_size, selector_top_k=spec.selector_top_k,
                               selector_rank=spec.selector_rank, seed=spec.seed)


OBJECTIVES["dflash"] = Objective(loss=dflash_loss, acceptance=dflash_acceptance, replay=_dflash_replay)
OBJECTIVES["dspark"] = Objective(loss=dspark_loss, acceptance=_dspark_acceptance, replay=_dspark_replay,
                                 check=_dspark_check, warm_start=_dspark_warm_start, calibrates=True)
OBJECTIVES["dflash2"] = Objective(loss=dflash2_loss, acceptance=_dflash2_acceptance, replay=dflash2_acceptance,
                                  check=_dflash2_check, warm_start=_dflash2_warm_start, calibrates=True,
                                  options=lambda settings: {"selector_teacher": settings.selector_teacher})


def cosine_with_warmup(peak_lr: float, total_steps: int, warmup_frac: float = 0.04):
    import optax

    warmup = max(1, int(math.ceil(warmup_frac * total_steps)))
    return optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(total_steps, warmup + 1), end_value=0.0)
