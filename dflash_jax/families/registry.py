"""The target-family registry: what a family brings, in one record, found by family name or HF ``model_type``.

A family module (one per family, beside this one) builds a :class:`Family` and ``families/__init__.py`` registers
it. Registering also hands the config side (:class:`~dflash_jax.config.FamilySchema`: model types, field parser,
switches the shared layers read) to :mod:`dflash_jax.config`, so that :func:`~dflash_jax.config.model_config_from_hf`
and :class:`~dflash_jax.config.ModelConfig` know it without importing this package.

Everything else reads a family through its record: :mod:`dflash_jax.loading` builds ``family.model`` from the
checkpoint as ``family.checkpoint`` maps it and places it by ``family.sharding_rules``; the decode loop calls the
model's own methods (the forward's ``lengths`` / ``defer``, ``settle``, its cache's ``constrained``), never asking
which family it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from dflash_jax.config import ConfigError, FamilySchema, ModelConfig, register_schema
from dflash_jax.kernels.dispatch import OPS
from dflash_jax.models.moe import stack_experts
from dflash_jax.models.target import TargetModel

# (path regex, logical axes of the array's dimensions), as dflash_jax.sharding.RULES
ShardingRules = tuple[tuple[str, tuple[str | None, ...]], ...]
# (config, tensors by checkpoint name, dtype, source for messages) → (tensors by our names, names to ignore)
CheckpointMap = Callable[[ModelConfig, dict, Any, str], tuple[Mapping[str, np.ndarray], Callable[[str], bool]]]


def no_tensor(name: str) -> bool:
    return False


def hf_checkpoint(cfg: ModelConfig, tensors: dict, dtype, source: str):
    """The LLaMA / Qwen3 names as they are; Qwen-MoE experts stacked into ``[E, out, in]`` per projection."""
    return stack_experts(tensors), no_tensor


@dataclasses.dataclass(frozen=True)
class Family:
    """What a target family brings.

    ``schema``: its config side (model types, field parser, switches). ``model``: the target model class
    (:class:`~dflash_jax.models.target.TargetModel` or a subclass; it builds the layers, ``new_cache`` gives the
    cache kind, and its forward / ``settle`` / cache carry any state beyond K/V). ``checkpoint``: HF tensors →
    the model's names and layout, and which checkpoint tensors to ignore. ``sharding_rules``: partition rules of
    its own parameters, tried before :data:`dflash_jax.sharding.RULES` (the shared layers'). ``kernel_ops``: the
    kernel ops (:data:`dflash_jax.kernels.dispatch.OPS`) its layers call beyond the attention every target runs
    (:data:`ATTENTION_OPS`) — e.g. the routed experts or the delta rule; :attr:`kernels` lists them all."""

    schema: FamilySchema
    model: type[TargetModel] = TargetModel
    checkpoint: CheckpointMap = hf_checkpoint
    sharding_rules: ShardingRules = ()
    kernel_ops: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = [op for op in self.kernel_ops if op not in OPS]
        if unknown:
            raise ConfigError(f"family {self.schema.name!r} needs kernel ops {unknown} that the kernel dispatch does "
                              f"not know (ops: {tuple(OPS)})")

    @property
    def kernels(self) -> tuple[str, ...]:
        """Every kernel op the family's target runs: the attention ops and its own."""
        return ATTENTION_OPS + self.kernel_ops

    @property
    def name(self) -> str:
        return self.schema.name

    @property
    def model_types(self) -> tuple[str, ...]:
        return self.schema.model_types


# The ops every target's attention runs (decode, prefill, compact's packed verify and its deferred cache writes).
ATTENTION_OPS = ("cache_attention", "prefill_attention", "packed_verify_attention", "cache_write", "cache_place")

_BY_NAME: dict[str, Family] = {}
_BY_MODEL_TYPE: dict[str, Family] = {}


def register(*families: Family) -> None:
    """Make ``families`` known by name and by model type (and their schemas to :mod:`dflash_jax.config`)."""
    for f in families:
        register_schema(f.schema)
        _BY_NAME[f.name] = f
        _BY_MODEL_TYPE.update({t: f for t in f.model_types})


def get(key: str) -> Family:
    """The family registered under the name or HF ``model_type`` ``key`` (ConfigError listing them if none)."""
    key = str(key).lower()
    found = _BY_NAME.get(key) or _BY_MODEL_TYPE.get(key)
    if found is None:
        raise ConfigError(f"model family or model_type {key!r} is not supported (families: {names()}; "
                          f"model types: {sorted(_BY_MODEL_TYPE)})")
    return found


def of(cfg: ModelConfig) -> Family:
    """The family of a parsed config."""
    return get(cfg.family)


def names() -> tuple[str, ...]:
    """The registered family names, in registration order."""
    return tuple(_BY_NAME)
