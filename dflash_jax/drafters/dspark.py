"""DSpark (SPEC §7): the DFlash trunk plus a sequential (Markov) head that drafts left to right and, in most
checkpoints, a confidence head that scores each draft. The module is
:class:`dflash_jax.models.drafter.DSparkDrafter` (training uses its pieces teacher-forced)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import ConfigError, DrafterConfig, DrafterSchema, ModelConfig
from dflash_jax.drafters.base import DrafterKind, register
from dflash_jax.models.drafter import DSparkDrafter
from dflash_jax.tuning import Kernels


def _detect(cfg, value) -> bool:
    """``dflash_config.projector_type: "dspark"`` or a DSpark architecture."""
    projector = str(value("projector_type", "") or "").lower()
    archs = " ".join(cfg.get("architectures") or []).lower()
    return projector == "dspark" or "dspark" in archs


def _fields(value, layers: ModelConfig) -> dict:
    temps = value("confidence_temperatures")
    draft_vocab = value("draft_vocab_size")
    return dict(
        markov_rank=int(value("markov_rank", 256)),
        draft_vocab_size=int(draft_vocab) if draft_vocab and int(draft_vocab) != layers.vocab_size else None,
        confidence_head=bool(value("use_confidence_head", True)),
        confidence_temperatures=tuple(float(t) for t in temps) if temps else None,
    )


def _check(c: DrafterConfig) -> None:
    if c.markov_rank <= 0:
        raise ConfigError(f"DSpark markov_rank must be positive, got {c.markov_rank}")
    if c.draft_vocab_size is not None and not 0 < c.draft_vocab_size <= c.layers.vocab_size:
        raise ConfigError(f"draft_vocab_size {c.draft_vocab_size} must be in [1, vocab_size "
                          f"{c.layers.vocab_size}]")
    temps = c.confidence_temperatures
    if temps is not None and (len(temps) != c.block_size or any(not t > 0 for t in temps)):
        raise ConfigError(f"confidence_temperatures must be {c.block_size} positive numbers (one per "
                          f"draft position), got {list(temps)}")


def _to_hf(c: DrafterConfig, out: dict) -> None:
    out["dflash_config"].update(projector_type="dspark", markov_rank=c.markov_rank,
                                use_confidence_head=c.confidence_head)
    if c.confidence_temperatures is not None:
        out["dflash_config"]["confidence_temperatures"] = list(c.confidence_temperatures)
    out["draft_vocab_size"] = c.draft_vocab


@register
class DSpark(DrafterKind):
    """The trunk over ``[anchor, MASK × (γ-1)]`` gives per-position base logits ``U_k`` (its output at the anchor
    predicts the first draft); drafting is a scan of G steps, ``x_k = pick(U_k + W2·W1[x_{k-1}])`` with
    ``x_{-1}`` the anchor, each a [B, R] × [R, Vd] product. When drafts are sampled, ``q_k`` is exactly the
    distribution ``x_k`` was drawn from, conditioned on the drafts before it, which keeps the ratio test of
    :func:`dflash_jax.decode.sampling.accept_sampled` exact. Confidences ``c_k = σ(z_k / T_k)``."""

    name = "dspark"
    schema = DrafterSchema(kind="dspark", architecture="DSparkDraftModel", sequential=True, detect=_detect,
                           fields=_fields, check=_check, to_hf=_to_hf)
    module_class = DSparkDrafter

    @property
    def has_confidence(self) -> bool:
        return self.module.confidence_head is not None

    def trunk_width(self, block_size: int) -> int:
        return block_size - 1  # the anchor predicts too: γ = L − 1 inputs give L − 1 drafts

    def draft(self, target, hidden, anchor, pick, key, cap=None, kernels=Kernels()):
        drafter = self.module
        g_all = hidden.shape[1]
        if cap and self.has_confidence:  # the LM head and the left-to-right head are most of the drafting
            hidden = hidden[:, :cap]
        base = drafter.base_logits(hidden, target, kernels).swapaxes(0, 1)  # [G, B, Vd]
        g, b = base.shape[:2]
        if key is not None:
            keys = jax.vmap(lambda k: jax.random.split(k, g))(key).swapaxes(0, 1)  # [G, B]
        else:
            keys = jnp.zeros((g, b), jnp.int32)  # unused
        head = drafter.markov_head

        def step(prev, xs):
            u, k = xs
            e = head.embed(prev)  # [B, R]
            x, q = pick(u + head.bias(e), k if key is not None else None)
            x = drafter.to_target_ids(x)
            return x, (x, e, q)

        # Unrolled: as a loop, each of the G steps launched 7 kernels on a GPU (its outputs' slice updates
        # included); unrolled, 3.4.
        _, (drafts, embeds, q) = jax.lax.scan(step, anchor, (base, keys), unroll=True)
        drafts, embeds = drafts.swapaxes(0, 1), embeds.swapaxes(0, 1)  # [B, G], [B, G, R]
        q = drafter.to_target_probs(q.swapaxes(0, 1)) if key is not None else None
        conf = None
        if self.has_confidence:
            conf = jax.nn.sigmoid(drafter.confidence_head(hidden, embeds) / drafter.temperatures(g))
        if g < g_all:  # past the cap: drafts 0 with confidence 0, which no window reaches
            pad = lambda x: jnp.pad(x, [(0, 0), (0, g_all - g)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
            drafts, conf, q = pad(drafts), pad(conf), (pad(q) if q is not None else None)
        return drafts, q, conf
