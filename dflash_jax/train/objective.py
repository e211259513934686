"""The DFlash training objective (SPEC §6), written to match inference exactly.

For each sequence we pick anchors ``p`` (positions where ``p`` and ``p+1`` are response tokens). Anchor ``a``'s
block is ``[token_p, MASK × (L-1)]`` at positions ``p … p+L-1``. Its queries see

* the projected target features of positions **strictly before p** (the injected context — at inference the
  anchor is the last committed token and its own features are not known yet), and
* every token of their own block (bidirectional), and never another block.

Slot ``k = 1 … L-1`` predicts ``token_{p+k}`` (same-position labels: the anchor slot has no loss) with weight
``exp(-(k-1)/γ)``. Worked example, L = 4, anchor p = 5: queries at positions 5,6,7,8 attend to context
positions 0…4 and block keys 5…8; labels are tokens 6, 7, 8 with weights 1, e^{-1/γ}, e^{-2/γ}.

Shapes: Bs sequences of length T, A anchors per sequence, block length L.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dflash_jax.attention import NEG_INF
from dflash_jax.models.drafter import DFlashDrafter
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
                 valid: Bool[Array, "Bs A"], block_size: int, mask_token_id: int):
    """Block token ids / positions, labels and label validity for every anchor."""
    k = jnp.arange(block_size)
    positions = anchors[..., None] + k  # [Bs, A, L]
    t = tokens.shape[1]
    gathered = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(positions, t - 1), axis=2)
    block_ids = jnp.where(k == 0, gathered, mask_token_id)
    labels = gathered[..., 1:]  # slot k predicts token p+k
    label_ok = valid[..., None] & (positions[..., 1:] < lengths[:, None, None])
    return block_ids, positions, labels, label_ok


def _multi_block_attention(q, ctx_k, ctx_v, blk_k, blk_v, anchors, valid_ctx_len=None):
    """q/blk_k/blk_v [Bs, A, L, ·, H]; ctx_k/ctx_v [Bs, T, K, H]; context visible iff position < anchor."""
    bs, a, l, n, h = q.shape
    kh = ctx_k.shape[2]
    qg = q.reshape(bs, a, l, kh, n // kh, h)
    scale = h ** -0.5
    s_ctx = jnp.einsum("balkgh,btkh->bkgalt", qg, ctx_k, preferred_element_type=jnp.float32) * scale
    s_blk = jnp.einsum("balkgh,bamkh->bkgalm", qg, blk_k, preferred_element_type=jnp.float32) * scale
    t = ctx_k.shape[1]
    ctx_mask = jnp.arange(t)[None, None, :] < anchors[:, :, None]  # [Bs, A, T]
    s_ctx = jnp.where(ctx_mask[:, None, None, :, None, :], s_ctx, NEG_INF)
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
                           anchors: Int[Array, "Bs A"]) -> Float[Array, "Bs A L D"]:
    """All blocks of all sequences in one pass (the inference drafter forward, batched over anchors)."""
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
        x_hat = layer.input_layernorm(x)
        ctx_k, ctx_v = att.kv(ctx, ctx_cos, ctx_sin)
        q = apply_rope(att.q_norm(att.q_proj(x_hat).reshape(bs, a * l, att.n, att.h)), cos, sin)
        blk_k, blk_v = att.kv(x_hat, cos, sin)
        o = _multi_block_attention(q.reshape(bs, a, l, att.n, att.h), ctx_k, ctx_v,
                                   blk_k.reshape(bs, a, l, att.k, att.h), blk_v.reshape(bs, a, l, att.k, att.h),
                                   anchors)
        x = x + att.o_proj(o.reshape(bs, a * l, att.n * att.h))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).reshape(bs, a, l, -1)


def target_features(target: TargetModel, tokens: Int[Array, "Bs T"], capture: tuple[int, ...]) -> jax.Array:
    """Frozen target features of every position (no cache is kept)."""
    bs, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bs, t))
    _, feats, _ = target(tokens, positions, None, capture=capture, prefill=True)
    return jax.lax.stop_gradient(feats)


def _leading(correct: Bool[Array, "Bs A L1"]) -> Int[Array, "Bs A"]:
    """Leading correct slots of each block: the drafts a greedy verify would accept."""
    return jnp.cumprod(correct.astype(jnp.int32), axis=-1).sum(-1)


def anchor_acceptance(drafter: DFlashDrafter, target: TargetModel, batch: dict,
                      block_size: int) -> Int[Array, "Bs A"]:
    """For each anchor of ``batch``: the tokens a greedy decoding cycle anchored there would commit
    (1 + leading correct drafts), labels being the row's own tokens. Inference gives exactly these numbers
    at the anchors it visits (tests/test_lossless_smollm2.py checks this on the real pair)."""
    cfg = drafter.config
    features = target_features(target, batch["tokens"], cfg.target_layer_ids)
    block_ids, positions, labels, label_ok = block_inputs(batch["tokens"], batch["lengths"], batch["anchors"],
                                                          batch["valid"], block_size, cfg.mask_token_id)
    hidden = drafter_forward_blocks(drafter, target, features, block_ids, positions, batch["anchors"])
    guess = jnp.argmax(drafter.draft_logits(hidden[:, :, 1:], target), -1)
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


def slot_cross_entropy(drafter: DFlashDrafter, target: TargetModel, hidden: Float[Array, "Bs A L1 D"],
                       labels: Int[Array, "Bs A L1"], chunk_rows: int | None = None
                       ) -> tuple[Float[Array, "Bs A L1"], Bool[Array, "Bs A L1"]]:
    """Cross-entropy of each draft slot's logits against its label, and whether its top-1 is the label.

    ``chunk_rows`` None materializes every slot's float32 logits at once, [Bs, A, L-1, V] (12 GB for the
    SmolLM2 recipe's 32 × 128 anchors × 15 slots × 49,152 words), and the backward pass keeps them. With
    ``chunk_rows``, slots go through the lm_head that many at a time under ``jax.checkpoint``: only one
    chunk's logits exist at once, and the backward pass recomputes them (one more lm_head matmul per chunk).
    Same numbers either way, up to summation order."""

    def per_slot(h, y):
        logits = drafter.draft_logits(h, target)
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return ce, jnp.argmax(logits, -1) == y

    if chunk_rows is None:
        return per_slot(hidden, labels)
    n = labels.size
    chunks = -(-n // chunk_rows)
    pad = chunks * chunk_rows - n
    h = jnp.pad(hidden.reshape(n, hidden.shape[-1]), ((0, pad), (0, 0))).reshape(chunks, chunk_rows, -1)
    y = jnp.pad(labels.reshape(n), (0, pad)).reshape(chunks, chunk_rows)
    ce, correct = jax.lax.map(jax.checkpoint(lambda hy: per_slot(*hy)), (h, y))
    return ce.reshape(-1)[:n].reshape(labels.shape), correct.reshape(-1)[:n].reshape(labels.shape)


def dflash_loss(drafter: DFlashDrafter, target: TargetModel, batch: dict, *, weights: jax.Array,
                features: jax.Array | None = None, ce_chunk_rows: int | None = None) -> tuple[jax.Array, dict]:
    """Weighted cross-entropy over block slots 1…L-1, plus accuracy metrics.

    ``batch``: tokens [Bs, T], lengths [Bs], anchors [Bs, A], valid [Bs, A]. ``weights``: [L-1].
    ``ce_chunk_rows``: see ``slot_cross_entropy``.
    Metrics: ``acc`` (top-1 per labelled slot) and ``tau`` — the acceptance length greedy decoding would get
    on these blocks, 1 + the number of leading correct slots, averaged over anchors.
    """
    cfg = drafter.config
    l = weights.shape[0] + 1
    if features is None:
        features = target_features(target, batch["tokens"], cfg.target_layer_ids)
    block_ids, positions, labels, label_ok = block_inputs(batch["tokens"], batch["lengths"], batch["anchors"],
                                                          batch["valid"], l, cfg.mask_token_id)
    hidden = drafter_forward_blocks(drafter, target, features, block_ids, positions, batch["anchors"])
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


def cosine_with_warmup(peak_lr: float, total_steps: int, warmup_frac: float = 0.04):
    import optax

    warmup = max(1, int(math.ceil(warmup_frac * total_steps)))
    return optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(total_steps, warmup + 1), end_value=0.0)
