"""Qwen3-MoE sparse MLP block: a top-k router over E SwiGLU experts whose weights are stacked.

Dimension letters: N tokens (the block flattens B·T), D model dim, E experts, F expert hidden, K experts per
token. Expert weights are stacked ``gate_proj``/``up_proj`` ``[E, D, F]`` and ``down_proj`` ``[E, F, D]`` so an
expert is an index on axis 0 and tensor parallelism can split F like the dense MLP's hidden. The experts' MLP
itself (its jnp forms and the grouped kernels) is :mod:`dflash_jax.kernels.moe`'s.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.config import CheckpointError, ModelConfig
from dflash_jax.kernels.moe import ExpertScales, experts_auto
from dflash_jax.models.layers import MLP, Dense, normal_init, matmul
from dflash_jax.quant import SCALE_SUFFIX, QuantParam, Scheme
from dflash_jax.tuning import Kernels


def route(x: Float[Array, "N D"], router: Float[Array, "D E"], k: int, normalize: bool,
          kernels: Kernels = Kernels()) -> tuple[Float[Array, "N K"], Int[Array, "N K"]]:
    """Top-k experts per token and their weights (in ``x``'s dtype).

    Logits in the model dtype, softmax in float32, top-k of the probabilities, renormalised to sum to one
    when ``normalize`` (``norm_topk_prob``): the order transformers uses, so bf16 routing matches too.
    """
    probs = jax.nn.softmax(matmul(x, router, kernels).astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), idx


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nnx.Module):
    """E SwiGLU experts, stacked: ``gate_proj``/``up_proj`` ``[E, D, F]``, ``down_proj`` ``[E, F, D]``.

    Quantized (:meth:`set_quantized`, ``quant`` a :class:`~dflash_jax.quant.Scheme`): each projection holds int8
    / fp8 values and ``{name}_scale`` ``[E, nbi, nbo]`` float32, every expert's ``[in, out]`` matrix scaled in the
    scheme's blocks as a quantized :class:`~dflash_jax.models.layers.Dense` kernel is."""

    def __init__(self, e: int, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(normal_init(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.up_proj = nnx.Param(normal_init(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.down_proj = nnx.Param(normal_init(rngs, (e, f, d), 1.0 / math.sqrt(f), dtype))
        self.quant: Scheme | None = None  # static: part of the graph (and the programs' key)
        self.gate_proj_scale = self.up_proj_scale = self.down_proj_scale = nnx.data(None)

    def set_quantized(self, scheme: Scheme, tensors: dict[str, tuple[jax.Array, jax.Array]]) -> None:
        """Hold each projection's (values ``[E, in, out]``, scales ``[E, nbi, nbo]``) of ``tensors`` (by name: all
        three) in place of its float weights (abstract arrays too)."""
        for name in PROJECTIONS:
            values, scale = tensors[name]
            shape = tuple(getattr(self, name).shape)
            want = shape[:1] + scheme.scale_shape(*shape[1:])
            if tuple(values.shape) != shape or tuple(scale.shape) != want:
                raise ValueError(f"{scheme} of experts {shape} takes values {shape} and scales {want}, got "
                                 f"{tuple(values.shape)} and {tuple(scale.shape)}")
            setattr(self, name, QuantParam(values.astype(scheme.dtype)))
            setattr(self, name + "_scale", QuantParam(scale.astype(jnp.float32)))
        self.quant = scheme

    def scales(self) -> ExpertScales | None:
        """The scales the expert kernels take (None: float experts)."""
        if self.quant is None:
            return None
        return ExpertScales(self.gate_proj_scale[...], self.up_proj_scale[...], self.down_proj_scale[...],
                            self.quant.blocks(*self.gate_proj.shape[1:]), self.quant.blocks(*self.down_proj.shape[1:]))


def quantizable_experts(model: nnx.Module) -> list[tuple[tuple[str, ...], Experts]]:
    """The stacked experts of ``model`` (a MoE target's routed experts) with their paths."""
    return [(tuple(str(p) for p in path), m) for path, m in nnx.iter_graph(model) if isinstance(m, Experts)]


class SparseMoE(nnx.Module):
    """Qwen3-MoE's sparse block: ``gate`` (the router, ``[D, E]``, no bias) and ``experts``.

    Qwen3.5-MoE / Qwen3-Next add a dense ``shared_expert`` (SwiGLU of width ``shared_expert_intermediate_size``) that
    every token runs, scaled by ``sigmoid(shared_expert_gate(x))`` (a ``[D, 1]`` projection, no bias).
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.gate = Dense(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg.hidden_size, shared, bias=False, dtype=dtype, rngs=rngs) if shared else None
        self.shared_expert_gate = Dense(cfg.hidden_size, 1, bias=False, dtype=dtype, rngs=rngs) if shared else None

    def __call__(self, x: Float[Array, "*b D"], kernels: Kernels = Kernels()) -> Float[Array, "*b D"]:
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = route(flat, self.gate.kernel[...], self.top_k, self.normalize, kernels)
        e = self.experts
        out = experts_auto(flat, weights, idx, e.gate_proj[...], e.up_proj[...], e.down_proj[...], kernels=kernels,
                           quant=e.scales())
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(flat, kernels)) * self.shared_expert(flat, kernels)
        return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF MoE expert tensors → one ``{base}.experts.{gate,up,down}_proj`` ``[E, out, in]`` each (in place).

    Accepts the per-expert ``experts.{e}.{gate,up,down}_proj.weight`` of the public Qwen3-MoE checkpoints
    (what ``save_pretrained`` writes too) and the fused ``experts.gate_up_proj`` ``[E, 2F, D]`` (gate rows
    first) / ``experts.down_proj`` ``[E, D, F]`` of transformers 5's in-memory layout; others are left alone.
    FP8 experts' scales (``….weight_scale_inv`` per expert, ``experts.gate_up_proj_scale_inv``; one row per weight
    row while a checkpoint map runs, :func:`dflash_jax.checkpoints.quantized.read_fp8`, so the gate / up halves
    split at any block height) are stacked likewise, as ``{base}.experts.{gate,up,down}_proj_scale_inv``.
    """
    groups: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for name in list(tensors):
        m = _EXPERT.match(name)
        if m:
            groups[m[1], m[3] + (m[4] or "")][int(m[2])] = name
        elif name.endswith(".experts.gate_up_proj") or name.endswith(".experts.gate_up_proj" + SCALE_SUFFIX):
            gate_up = tensors.pop(name)
            f = gate_up.shape[1] // 2
            if 2 * f != gate_up.shape[1]:
                raise CheckpointError(f"{name}: {tuple(gate_up.shape)} does not split into gate and up halves")
            base, suffix = name.split(".experts.gate_up_proj")
            base += ".experts."
            tensors[base + "gate_proj" + suffix], tensors[base + "up_proj" + suffix] = gate_up[:, :f], gate_up[:, f:]
    for (base, proj), names in groups.items():
        if sorted(names) != list(range(len(names))):
            raise CheckpointError(f"{base}.{proj}: experts {sorted(names)} are not numbered 0..{len(names) - 1}")
        tensors[f"{base}.{proj}"] = np.stack([tensors.pop(names[e]) for e in range(len(names))])
    return tensors
