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
from dflash_jax.kernels.moe import experts_auto
from dflash_jax.models.layers import MLP, Dense, normal_init, matmul
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


class Experts(nnx.Module):
    """E SwiGLU experts, stacked: ``gate_proj``/``up_proj`` ``[E, D, F]``, ``down_proj`` ``[E, F, D]``."""

    def __init__(self, e: int, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(normal_init(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.up_proj = nnx.Param(normal_init(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.down_proj = nnx.Param(normal_init(rngs, (e, f, d), 1.0 / math.sqrt(f), dtype))


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
        out = experts_auto(flat, weights, idx, e.gate_proj[...], e.up_proj[...], e.down_proj[...], kernels=kernels)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(flat, kernels)) * self.shared_expert(flat, kernels)
        return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF MoE expert tensors → one ``{base}.experts.{gate,up,down}_proj`` ``[E, out, in]`` each (in place).

    Accepts the per-expert ``experts.{e}.{gate,up,down}_proj.weight`` of the public Qwen3-MoE checkpoints
    (what ``save_pretrained`` writes too) and the fused ``experts.gate_up_proj`` ``[E, 2F, D]`` (gate rows
    first) / ``experts.down_proj`` ``[E, D, F]`` of transformers 5's in-memory layout; others are left alone.
    """
    groups: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for name in list(tensors):
        m = _EXPERT.match(name)
        if m:
            groups[m[1], m[3]][int(m[2])] = name
        elif name.endswith(".experts.gate_up_proj"):
            gate_up = tensors.pop(name)
            f = gate_up.shape[1] // 2
            base = name[: -len("gate_up_proj")]
            tensors[base + "gate_proj"], tensors[base + "up_proj"] = gate_up[:, :f], gate_up[:, f:]
    for (base, proj), names in groups.items():
        if sorted(names) != list(range(len(names))):
            raise CheckpointError(f"{base}.{proj}: experts {sorted(names)} are not numbered 0..{len(names) - 1}")
        tensors[f"{base}.{proj}"] = np.stack([tensors.pop(names[e]) for e in range(len(names))])
    return tensors
