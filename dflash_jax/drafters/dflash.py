"""DFlash (z-lab): one trunk forward drafts the whole block in parallel, every position read through the
target's LM head at once (SPEC §2). The module is :class:`dflash_jax.models.drafter.DFlashDrafter`."""

from __future__ import annotations

from dflash_jax.config import DrafterSchema
from dflash_jax.drafters.base import DrafterKind, register
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.tuning import Kernels


@register
class DFlash(DrafterKind):
    """``[anchor, MASK × (L-1)]`` in, the drafts are the picks of positions 1 … L-1; no confidences."""

    name = "dflash"
    # No ``detect``: the kind of every drafter config no other kind claims.
    schema = DrafterSchema(kind="dflash", architecture="DFlashDraftModel")
    module_class = DFlashDrafter

    def draft(self, target, hidden, anchor, pick, key, cap=None, kernels=Kernels()):
        ids, q = pick(self.draft_logits(hidden, target, kernels), key)
        return self.to_target_ids(ids), (self.to_target_probs(q) if q is not None else None), None
