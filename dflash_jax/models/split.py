"""A module split once for the jitted programs, and merged back inside them.

``nnx.split`` walks the whole module graph (tens of milliseconds for a 30-layer model), and flattening an
``nnx.State`` runs a Python callback per Variable; a call of the public API should do neither. So a loaded
model is split once (:class:`dflash_jax.Target` keeps the split) and its parameters cross the jit boundary as
a flat list of arrays.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """A module split once for the jitted programs: ``static`` = (graph definition, tree structure of its
    state) and ``leaves``, the parameter arrays as a flat list (a list crosses the jit boundary without the
    per-Variable Python callbacks that flattening an ``nnx.State`` runs on every call).

    ``structure`` is a small integer shared by every split with the same graph and the same parameter shapes,
    dtypes and placements, so compiled programs are looked up without hashing a graph per call.
    """

    static: tuple
    leaves: list
    structure: int
    variables: tuple  # the module's Variables and, below, the arrays they held when split
    values: tuple

    def is_current(self) -> bool:
        """True while every Variable still holds the array it held at the split (no weights were set since).
        One attribute read per Variable: ~0.1 ms for a 36-layer model, against ~30-70 ms for a new split."""
        return all(map(operator.is_, map(_raw_value, self.variables), self.values))


_raw_value = operator.methodcaller("get_raw_value")
_STRUCTURES: dict[Any, int] = {}
_STRUCTURES_LOCK = threading.Lock()


def split_model(model: nnx.Module) -> SplitModel:
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    variables = tuple(v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable))
    signature = (graphdef, treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves))
    with _STRUCTURES_LOCK:
        structure = _STRUCTURES.setdefault(signature, len(_STRUCTURES))
    return SplitModel((graphdef, treedef), leaves, structure, variables, tuple(v.get_raw_value() for v in variables))


def merge_model(static: tuple, leaves: list) -> nnx.Module:
    """Inverse of :func:`split_model` (inside the jitted programs)."""
    graphdef, treedef = static
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
