"""Drafter kinds behind one interface: what the decode loop calls to draft (:class:`DrafterKind`).

Each kind is one module registering its :class:`DrafterKind` (:mod:`.dflash`, :mod:`.dspark`, :mod:`.dflash2`); the loop asks
:func:`kind_of` for the drafter module it was given and never branches on the kind. The drafter modules
themselves (weights, checkpoint key names) stay in :mod:`dflash_jax.models.drafter`. docs/drafters.md
describes how to add a kind.
"""

from dflash_jax.drafters import dflash, dflash2, dspark  # noqa: F401 (registers the kinds)
from dflash_jax.drafters.base import KINDS, DrafterKind, Pick, kind_of, names, register, survival_stats

__all__ = ["KINDS", "DrafterKind", "Pick", "kind_of", "names", "register", "survival_stats"]
