"""The drafter interface the decode loop calls ("drafts, and confidences if any") and the registry of kinds.

A drafter module (:mod:`dflash_jax.models.drafter`) runs a trunk over ``[anchor, MASK, …]`` with the target's
features injected as context K/V; the loop runs that trunk (its attention and caches are the loop's business)
and hands the hidden states that predict the drafts to the kind, which turns them into drafts: a parallel kind
reads every position's logits at once, a sequential one goes left to right. A kind also says whether it scores
its drafts (confidences, which the confidence scheduler then uses instead of running acceptance counts).

Shapes: B rows, G drafts per block, D model dim, Vd draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from dflash_jax.config import DrafterSchema, register_drafter_schema
from dflash_jax.models.drafter import MODULE_CLASSES, DFlashDrafter
from dflash_jax.tuning import Kernels

# (logits [B, *, Vd], per-row PRNG keys [B] or None) → (draft-vocabulary ids [B, *], the distribution they were
# drawn from [B, *, Vd] or None): an argmax without keys, else a draw from the filtered distribution. The loop
# builds it from the sampling settings; a kind calls it wherever it picks drafts.
Pick = Callable[[jax.Array, jax.Array | None], tuple[jax.Array, jax.Array | None]]

KINDS: dict[str, type["DrafterKind"]] = {}


def register(cls: type["DrafterKind"]) -> type["DrafterKind"]:
    """Register a kind under ``cls.name`` (the drafter config's ``kind``): its decoding side here, its config
    side (``cls.schema``) with :mod:`dflash_jax.config`, its module class (``cls.module_class``) with
    :data:`dflash_jax.models.drafter.MODULE_CLASSES`, so that parsing, validation, loading and export know it
    without naming it."""
    if cls.schema.kind != cls.name:
        raise ValueError(f"drafter kind {cls.name!r} registers a schema named {cls.schema.kind!r}")
    register_drafter_schema(cls.schema)
    MODULE_CLASSES[cls.name] = cls.module_class
    KINDS[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    return tuple(KINDS)


def kind_of(module) -> "DrafterKind":
    """The kind of a drafter module (from its config's ``kind``), wrapping it."""
    name = module.config.kind
    if name not in KINDS:
        raise ValueError(f"drafter kind {name!r} has no implementation (registered: {', '.join(KINDS)})")
    return KINDS[name](module)


class DrafterKind:
    """How one kind of drafter drafts. Wraps a drafter module; created where the loop traces (cheap)."""

    name: ClassVar[str]
    schema: ClassVar[DrafterSchema]  # the config side: parsing, validation, export, verify width
    module_class: ClassVar[type[DFlashDrafter]] = DFlashDrafter  # the drafter module (weights, checkpoint names)

    def __init__(self, module):
        self.module = module

    @property
    def config(self):
        return self.module.config

    @property
    def sequential(self) -> bool:
        """Drafts left to right (each draft conditioned on the one before): a compact step then drafts the
        whole block before its tier switch. A parallel kind's per-position logits can instead be read over the
        verified windows only (:meth:`draft_logits`, inside the tier's branch)."""
        return self.schema.sequential

    @property
    def has_confidence(self) -> bool:
        """The kind scores each draft (:meth:`draft` returns confidences)."""
        return False

    def trunk_width(self, block_size: int) -> int:
        """Inputs ``[anchor, MASK…]`` the trunk runs over for a verify width of ``block_size`` (= G + 1); its
        last G hidden states predict the G drafts."""
        return block_size

    def draft(self, target, hidden: Float[Array, "B G D"], anchor: Int[Array, "B"], pick: Pick,
              key: jax.Array | None, cap: int | None = None, kernels: Kernels = Kernels()
              ) -> tuple[Int[Array, "B G"], Float[Array, "B G V"] | None, Float[Array, "B G"] | None]:
        """(drafts as target ids, their distribution q over the target vocabulary when sampled, confidences or
        None) from the trunk's hidden states at the draft positions. ``key``: one PRNG key per row (sampled
        drafts) or None (argmax). ``cap``: draft only this many positions where the kind can save by it (the
        rest are drafts 0 with confidence 0, which no window reaches; None: all). ``kernels``: the kernel ops'
        implementation and knobs (the loop's), for a kind whose drafting runs a kernel op (DFlash2's top-K)."""
        raise NotImplementedError

    # -- the pieces every kind shares (the module's) ------------------------------------------------------

    def draft_logits(self, hidden: Float[Array, "*b D"], target, kernels: Kernels = Kernels()
                     ) -> Float[Array, "*b Vd"]:
        """Per-position draft logits over the draft vocabulary (a parallel kind's drafts are their picks)."""
        return self.module.draft_logits(hidden, target, kernels)

    def to_target_ids(self, ids: Int[Array, "*b"]) -> Int[Array, "*b"]:
        return self.module.to_target_ids(ids)

    def to_target_probs(self, q: Float[Array, "*b Vd"]) -> Float[Array, "*b V"]:
        return self.module.to_target_probs(q)


def survival_stats(survival_sum: np.ndarray, acc_lens: list[list[int]]) -> dict[str, Any]:
    """A scoring drafter's calibration, over every cycle of every row: ``predicted_survival[j]`` the mean
    predicted probability that draft j is accepted (Π of the confidences up to it) next to
    ``realized_survival[j]`` the fraction of cycles that accepted it; ``predicted_tau`` vs the realised τ."""
    cycles = sum(len(a) for a in acc_lens)
    if not cycles:
        return {}
    g = survival_sum.shape[1]
    accepted = np.asarray([a - 1 for row in acc_lens for a in row])
    predicted = survival_sum.sum(0) / cycles
    return {"predicted_survival": predicted.round(4).tolist(),
            "realized_survival": [float((accepted > j).mean().round(4)) for j in range(g)],
            "predicted_tau": float(1 + predicted.sum())}
