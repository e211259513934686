"""Tensor and data parallelism with ``jax.sharding`` meshes: every partition rule lives here.

Mesh axes: ``dp`` (batch rows) and ``tp`` (Megatron-style tensor parallelism). Parameters get *logical*
axis names from their path (a family's own rules, registered in :mod:`dflash_jax.families`, then ``RULES``, the
shared layers'), and logical names map to mesh axes (``logical_to_mesh``):

* attention heads (q_proj columns, o_proj rows) and the MLP hidden (gate/up columns, down rows) over ``tp``:
  two all-reduces per layer (after o_proj and after down_proj); MoE experts likewise, each expert's hidden F
  split over ``tp`` (every device holds a slice of every expert, so routing needs no communication; the
  router is replicated);
* KV projections and KV caches over ``tp`` by KV head — replicated when the model has fewer KV heads than
  ``tp`` (each device then holds every KV head its query heads need);
* embeddings and lm_head over the vocabulary;
* hybrid targets' Gated DeltaNet layers over ``tp`` by key head (each device holds whole key heads with their
  value heads: the q/k/v projection columns and conv channels, which the layer groups by key head, z/β/g
  projections, decay parameters, recurrent states and conv histories), ``out_proj`` by rows: one all-reduce
  per layer, like attention — replicated when ``tp`` does not divide the key heads; MoE layers' shared
  expert like the MLP;
* batch rows (prompts, caches, tokens) over ``dp``; the drafter's context cache like the target's;
* a quantized layer's scales (``….scale``, one per block of its kernel) like its kernel, each dimension whose
  blocks the mesh axis does not divide replicated (a per-output-channel scale ``[1, out]`` of a row-split
  ``o_proj`` / ``down_proj``, a 128-column block grid narrower than ``tp``); quantized experts' scales
  (``….experts.{gate,up,down}_proj_scale``, ``[E, nbi, nbo]``) likewise by their experts' rule.

Unsupported splits (``tp`` not dividing the query heads, the MLP width or the vocabulary; KV heads neither
divisible by ``tp`` nor dividing it) raise :class:`ShardingError` naming the numbers.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.config import ModelConfig


class ShardingError(ValueError):
    """The requested mesh cannot split this model."""


# (path regex, logical axes of the array's dimensions) of the shared layers; a family's own rules are tried first;
# first match wins, no match = replicated.
RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.embedding$", ("vocab", "embed")),
    (r"lm_head\.kernel$", ("embed", "vocab")),
    (r"self_attn\.q_proj\.kernel$", ("embed", "q_heads")),
    (r"self_attn\.q_proj\.bias$", ("q_heads",)),
    (r"self_attn\.[kv]_proj\.kernel$", ("embed", "kv_heads")),
    (r"self_attn\.[kv]_proj\.bias$", ("kv_heads",)),
    (r"self_attn\.o_proj\.kernel$", ("q_heads", "embed")),
    (r"mlp\.(gate|up)_proj\.kernel$", ("embed", "mlp")),
    (r"mlp\.(gate|up)_proj\.bias$", ("mlp",)),
    (r"mlp\.down_proj\.kernel$", ("mlp", "embed")),
)


def make_mesh(tp: int = 1, dp: int = 1, *, devices: Sequence[jax.Device] | None = None,
              explicit: bool = False) -> Mesh:
    """A ``(dp, tp)`` mesh over the first ``dp·tp`` devices (auto axes by default; ``explicit=True`` for
    JAX's explicit-sharding axes)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or dp < 1:
        raise ShardingError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    if tp * dp > len(devices):
        raise ShardingError(f"a mesh of tp={tp} × dp={dp} needs {tp * dp} devices, {len(devices)} available")
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(kind, kind), devices=devices[: tp * dp])


def parse_mesh(spec: str) -> dict[str, int]:
    """``"tp=2,dp=4"`` → ``{"tp": 2, "dp": 4}`` (for command lines)."""
    out = {"tp": 1, "dp": 1}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key not in out or not value.isdigit() or int(value) < 1:
            raise ShardingError(f"bad mesh spec {spec!r}: expected e.g. 'tp=2,dp=4'")
        out[key] = int(value)
    return out


def mesh_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])


def check_splittable(cfg: ModelConfig, tp: int, what: str = "model") -> None:
    """Raise ShardingError unless ``tp`` splits this model's heads, MLP and vocabulary."""
    if tp == 1:
        return
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.intermediate_size % tp:
        problems.append(f"MLP width {cfg.intermediate_size}")
    if cfg.vocab_size % tp:
        problems.append(f"vocabulary {cfg.vocab_size}")
    if cfg.moe and cfg.moe_intermediate_size % tp:
        problems.append(f"expert MLP width {cfg.moe_intermediate_size}")
    if cfg.moe and cfg.shared_expert_intermediate_size % tp:
        problems.append(f"shared expert width {cfg.shared_expert_intermediate_size}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither a multiple nor a divisor of tp)")
    if problems:
        raise ShardingError(f"tp={tp} cannot split this {what}: it does not divide its " + ", ".join(problems))


def linear_heads_split(cfg: ModelConfig, tp: int) -> bool:
    """Whether a hybrid target's Gated DeltaNet layers split over ``tp`` (by key head), else they are replicated."""
    return cfg.hybrid is not None and cfg.hybrid.key_heads % tp == 0


def logical_to_mesh(cfg: ModelConfig, mesh: Mesh) -> dict[str, str | None]:
    tp = mesh_size(mesh, "tp")
    return {"vocab": "tp", "q_heads": "tp", "mlp": "tp", "embed": None, "experts": None,
            "kv_heads": "tp" if cfg.num_kv_heads % tp == 0 else None,  # fewer KV heads than tp: replicate
            "linear_heads": "tp" if linear_heads_split(cfg, tp) else None,
            "batch": "dp"}


def spec_for(path: str, ndim: int, mapping: dict[str, str | None], rules: Sequence = ()) -> P:
    """The partition spec of parameter ``path``: the first of ``rules`` (a family's), then of ``RULES``, to match."""
    for pattern, axes in (*rules, *RULES):
        if re.search(pattern, path):
            assert len(axes) == ndim, (path, axes, ndim)
            return P(*(mapping[a] if a is not None else None for a in axes))
    return P()


def param_spec(path: str, shape: Sequence[int], mapping: dict[str, str | None], mesh: Mesh, rules: Sequence = ()) -> P:
    """The partition spec of parameter ``path`` of ``shape``: :func:`spec_for`, and for a quantized layer's
    ``scale`` its kernel's, without the axes that do not divide the scale's block counts."""
    if path.endswith(".scale"):
        kernel = path[: -len("scale")] + "kernel"
    elif re.search(r"experts\.\w+_proj_scale$", path):  # quantized stacked experts: [E, nbi, nbo]
        kernel = path[: -len("_scale")]
    else:
        return spec_for(path, len(shape), mapping, rules)
    spec = spec_for(kernel, len(shape), mapping, rules)
    return P(*(a if a is None or n % mesh_size(mesh, a) == 0 else None for a, n in zip(spec, shape)))


def shard_module(module: nnx.Module, cfg: ModelConfig, mesh: Mesh, what: str = "model",
                 rules: Sequence = ()) -> nnx.Module:
    """Place every parameter of ``module`` on ``mesh`` according to ``rules`` (its family's), then ``RULES``
    (in place; returns it)."""
    check_splittable(cfg, mesh_size(mesh, "tp"), what)
    mesh = as_auto(mesh)
    mapping = logical_to_mesh(cfg, mesh)
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name = ".".join(str(p) for p in path)
        value = var[...]
        var.set_value(jax.device_put(value, NamedSharding(mesh, param_spec(name, np.shape(value), mapping, mesh,
                                                                           rules))))
    return module


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the decode loop needs to keep its state sharded (hashable: part of the compiled program's key)."""

    mesh: Mesh
    target_kv: bool  # target KV caches split by KV head over tp
    drafter_kv: bool
    target_linear: bool = False  # hybrid targets: linear-attention states split by head over tp

    def cache(self, sharded_heads: bool) -> NamedSharding:
        return NamedSharding(self.mesh, P("dp", None, "tp" if sharded_heads else None, None))

    def conv_history(self) -> NamedSharding:
        """[B, W-1, C], channels grouped by key head."""
        return NamedSharding(self.mesh, P("dp", None, "tp" if self.target_linear else None))

    def recurrent(self) -> NamedSharding:
        """[B, Hv, Dk, Dv]."""
        return NamedSharding(self.mesh, P("dp", "tp" if self.target_linear else None, None, None))

    def rows(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, P("dp", *([None] * (ndim - 1))))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def make_plan(mesh: Mesh | None, target_cfg: ModelConfig, drafter_cfg: ModelConfig | None) -> Plan | None:
    if mesh is None:
        return None
    mesh = as_auto(mesh)
    tp = mesh_size(mesh, "tp")
    return Plan(mesh, target_cfg.num_kv_heads % tp == 0,
                drafter_cfg is not None and drafter_cfg.num_kv_heads % tp == 0, linear_heads_split(target_cfg, tp))


def as_auto(mesh: Mesh) -> Mesh:
    """The same devices and axes with auto axis types.

    Meshes with JAX's explicit axes are accepted everywhere; the model code runs on the auto-axes twin,
    where the partition rules above are applied as placements and constraints and the compiler inserts the
    collectives (the explicit mode would need an output sharding annotated on every gather and einsum).
    """
    if all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def constrain(x, sharding: NamedSharding | None):
    return jax.lax.with_sharding_constraint(x, sharding) if sharding is not None else x
