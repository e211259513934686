"""Mistral (``mistral``): LLaMA's layers, every layer attending to the last ``sliding_window`` positions only
(none when the config's ``sliding_window`` is null, as in Mistral 7B v0.2 and later).

Everything else is shared: the window is the attention's ``window`` (what gpt-oss's sliding layers use), the
checkpoints carry LLaMA's names, and the partition rules are the shared layers'. The port the walk-through in
``docs/port-a-model.md`` follows as its worked example.
"""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.config import FamilySchema, ModelConfig, required
from dflash_jax.families.registry import Family


def fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    layers = int(required(cfg, "num_hidden_layers", where))
    return dict(sliding_layers=tuple(range(layers)), sliding_window=int(window))


def check(cfg: ModelConfig) -> None:
    cfg.check_windows()


MISTRAL = Family(FamilySchema("mistral", ("mistral",), fields=fields, check=check))

FAMILIES = (MISTRAL,)
