"""DFlash2 (z-lab ``DFlash2DraftModel``): the DFlash trunk with grouped dynamic convolutions around its
sublayers, then a candidate selector — each draft position proposes its top-K tokens and a walk over the
pairwise edge scores between adjacent positions picks one per position, left to right. The module is
:class:`dflash_jax.models.drafter.DFlash2Drafter`; docs/drafters.md pins the format and the equations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dflash_jax.config import ConfigError, DrafterConfig, DrafterSchema, ModelConfig
from dflash_jax.drafters.base import DrafterKind, Pick, register
from dflash_jax.models.drafter import DFlash2Drafter
from dflash_jax.tuning import Kernels

# dflash_config keys the public implementations require (each sizes a module or the walk).
REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")


def _detect(cfg, value) -> bool:
    """A DFlash2 architecture, ``projector_type: "dflash2"``, or a config carrying the selector's keys."""
    archs = " ".join(cfg.get("architectures") or []).lower()
    projector = str(value("projector_type", "") or "").lower()
    return "dflash2" in archs or projector == "dflash2" or value("selector_top_k") is not None


def _fields(value, layers: ModelConfig) -> dict:
    missing = [k for k in REQUIRED if value(k) is None]
    if missing:
        raise ConfigError(f"a DFlash2 drafter config needs dflash_config.{', dflash_config.'.join(missing)}")
    temps = value("confidence_temperatures")  # this project's STS fit (absent from the public checkpoints)
    return {**{k: int(value(k)) for k in REQUIRED},
            "confidence_temperatures": tuple(float(t) for t in temps) if temps else None}


def _check(c: DrafterConfig) -> None:
    d, vocab = c.layers.hidden_size, c.draft_vocab
    if c.conv_kernel_size < 1:
        raise ConfigError(f"DFlash2 conv_kernel_size must be >= 1, got {c.conv_kernel_size}")
    if c.conv_group_size < 1 or d % c.conv_group_size:
        raise ConfigError(f"DFlash2 conv_group_size {c.conv_group_size} must divide hidden_size {d}")
    if not 1 <= c.selector_top_k <= vocab:
        raise ConfigError(f"DFlash2 selector_top_k {c.selector_top_k} must be in [1, vocabulary size {vocab}]")
    if c.selector_rank < 1:
        raise ConfigError(f"DFlash2 selector_rank must be >= 1, got {c.selector_rank}")
    temps = c.confidence_temperatures
    if temps is not None and (len(temps) != c.verify_width - 1 or any(not t > 0 for t in temps)):
        raise ConfigError(f"DFlash2 confidence_temperatures must be {c.verify_width - 1} positive numbers (one per "
                          f"draft position), got {list(temps)}")


def _to_hf(c: DrafterConfig, out: dict) -> None:
    """The published layout: the DFlash2 keys and ``block_size`` in ``dflash_config``; the scales where set."""
    dc = out["dflash_config"]
    dc.update(block_size=c.block_size, **{k: getattr(c, k) for k in REQUIRED})
    if c.input_embedding_scale != 1.0:
        dc["input_embedding_scale"] = c.input_embedding_scale
    if c.output_multiplier != 1.0:
        dc["output_multiplier"] = c.output_multiplier
    if c.final_logit_softcapping:
        dc["final_logit_softcapping"] = c.final_logit_softcapping
    if c.confidence_temperatures is not None:
        dc["confidence_temperatures"] = list(c.confidence_temperatures)
    out["is_causal"] = c.causal_sliding  # the published checkpoint: non-causal sliding-window layers
    if "sliding_attention" in c.layer_types:
        out["use_sliding_window"] = True


def selector_walk(scores: Float[Array, "B G K K"], pick: Pick, key: jax.Array | None
                  ) -> tuple[Int[Array, "B G"], Float[Array, "B G K"] | None, Float[Array, "B G"]]:
    """The walk over the edge scores ``[b, k, p, c]``: at position k the row of the candidate chosen at k − 1
    (row 0 at k = 0, where every row is the anchor's) is picked from — its argmax (lowest index on ties)
    without keys, else a draw from the filtered ``softmax(row / T)``. Returns the chosen candidate indices,
    the distribution each was drawn from (over the K candidates; None without keys) and the confidence of each
    position, the row's largest ``softmax(row)`` (the selector's own probability of its best candidate, at
    temperature 1): the greedy choice's probability. It is read from the row, never from a sampled choice: the
    scheduler's windows must not depend on the draft they end at (a window chosen after seeing a sampled draft's
    own probability verifies likely draws more often than q gives them, and rejection sampling is then no
    longer exact); the row depends on the choices before it only."""
    b, g, k = scores.shape[:3]
    # Every row of every position is picked from at once and the walk then only follows the chosen indices:
    # picking inside a sequential walk costs a reduction kernel per position on a GPU, following indices costs
    # gathers that fuse. A row's pick is the walk's pick when the walk reaches it: the same row and, when
    # sampling, the same key (one per position, shared by its K rows, as the walk would draw it).
    if key is None:
        choice, q_all = pick(scores, None)  # [B, G, K]
    else:
        keys = jax.vmap(lambda x: jax.random.split(x, g))(key).swapaxes(0, 1)  # [G, B]
        per_row = jax.vmap(pick, in_axes=(1, None), out_axes=(1, 1))  # the K rows of one position
        choice, q_all = jax.vmap(per_row, in_axes=(1, 0), out_axes=(1, 1))(scores, keys)  # [B, G, K(, K)]
    conf_all = jax.nn.softmax(scores, axis=-1).max(-1)  # [B, G, K]
    picked = [jnp.zeros((b,), jnp.int32)]  # the row the walk reaches at each position: the candidate chosen before
    for pos in range(g):
        picked.append(jnp.take_along_axis(choice[:, pos], picked[-1][:, None], axis=1)[:, 0])
    idx, rows = jnp.stack(picked[1:], axis=1), jnp.stack(picked[:-1], axis=1)  # [B, G] each
    at_row = lambda x: jnp.take_along_axis(x, rows.reshape(b, g, *[1] * (x.ndim - 2)), axis=2)[:, :, 0]  # noqa: E731
    return idx, (at_row(q_all) if key is not None else None), at_row(conf_all)


def scaled_confidence(conf: Float[Array, "B G"], temperatures) -> Float[Array, "B G"]:
    """STS on the selector's probabilities: ``σ(logit(c_k) / T_k)`` (``temperatures`` None: as they are)."""
    if not temperatures:
        return conf
    c = jnp.clip(conf, 1e-6, 1 - 1e-6)
    t = jnp.asarray(temperatures[: conf.shape[1]], jnp.float32)
    return jax.nn.sigmoid((jnp.log(c) - jnp.log1p(-c)) / t)


@register
class DFlash2(DrafterKind):
    """``[anchor, MASK × (L-1)]`` in (as DFlash: verify width L), positions 1 … L-1 give K candidates each, the
    selector's walk picks the drafts. When drafts are sampled, ``q_k`` is the distribution the walk drew draft k
    from — over the K candidates, given the candidate chosen before it, zero elsewhere in the target vocabulary —
    which keeps the ratio test of :func:`dflash_jax.decode.sampling.accept_sampled` exact. Confidences: the
    selector's probability of each row's best candidate (:func:`selector_walk`), scaled by the STS temperatures
    where the config has them (:func:`scaled_confidence`; fitted after training, as DSpark's)."""

    name = "dflash2"
    schema = DrafterSchema(kind="dflash2", architecture="DFlash2DraftModel", detect=_detect, fields=_fields,
                           check=_check, to_hf=_to_hf)
    module_class = DFlash2Drafter

    @property
    def sequential(self) -> bool:
        """The walk goes left to right (each pick given the one before), so a compact step drafts the whole
        block before its tier switch; the trunk's layout and verify width stay DFlash's (``schema.sequential``
        is False: the anchor predicts nothing)."""
        return True

    @property
    def has_confidence(self) -> bool:
        return True

    def draft(self, target, hidden, anchor, pick, key, cap=None, kernels=Kernels()):
        drafter = self.module
        g_all = hidden.shape[1]
        if cap:  # the LM head's top-K and the walk are the drafting's cost
            hidden = hidden[:, :cap]
        ids, unary = drafter.candidates(hidden, target, kernels)  # [B, G, K] target ids, best first
        scores = drafter.candidate_selector.edge_scores(ids, unary, hidden, anchor, kernels)
        idx, q_k, conf = selector_walk(scores, pick, key)
        conf = scaled_confidence(conf, drafter.config.confidence_temperatures)
        drafts = jnp.take_along_axis(ids, idx[..., None], axis=-1)[..., 0]
        q = None
        if q_k is not None:  # onto the target vocabulary: zero outside the K candidates
            b, g, _ = ids.shape
            q = jnp.zeros((b, g, drafter.config.layers.vocab_size), jnp.float32)
            q = q.at[jnp.arange(b)[:, None, None], jnp.arange(g)[None, :, None], ids].set(q_k)
        if g_all > drafts.shape[1]:  # past the cap: drafts 0 with confidence 0, which no window reaches
            pad = lambda x: jnp.pad(x, [(0, 0), (0, g_all - x.shape[1])] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
            drafts, conf, q = pad(drafts), pad(conf), (pad(q) if q is not None else None)
        return drafts, q, conf
