"""gpt-oss (``model_type: "gpt_oss"``): the parts that differ from the LLaMA/Qwen layers (:class:`GptOssTargetModel`
puts them together), and its checkpoints.

Attention is :class:`dflash_jax.models.target.Attention` with two things the config turns on: a learned logit
per query head (``self_attn.sinks``) that joins every softmax denominator and takes no value (a query can
"attend to nothing"), and a sliding window of ``sliding_window`` keys on the layers in ``sliding_layers``
(every other layer in the released models). Both live in :func:`dflash_jax.kernels.attention.cache_attention`, and
the verify kernels (``attention_impl`` "pallas" / "cuda") take both.

The MLP of every layer is a routed MoE (:class:`GptOssMoE`): a router with a bias whose top-k *logits* are
softmaxed (not top-k of a softmax over all experts), and experts with biases and a clamped SwiGLU,
``(clip(u, ±limit) + 1) · g' · σ(alpha · g')`` with ``g' = min(g, limit)``. The expert computation is
:mod:`dflash_jax.models.moe`'s (gathered / dense / grouped), given the biases and this activation.

Dimension letters: N tokens, D model dim, E experts, F expert hidden, K experts per token, R rows of a
quantized matrix (its output features), G blocks of 32 values along its input features (G·32 = its input dim).

Checkpoints store the experts as ``experts.gate_up_proj`` ``[E, D, 2F]`` (already ``[in, out]``; gate and up
*interleaved* along 2F: gate = columns 0, 2, 4 …) and ``experts.down_proj`` ``[E, F, D]``, with biases
``gate_up_proj_bias`` ``[E, 2F]`` and ``down_proj_bias`` ``[E, D]`` — or, in the released checkpoints, the two
matrices in MXFP4 (``*_blocks`` + ``*_scales``, see :func:`dequantize_mxfp4`). :func:`checkpoint_tensors`
turns either into this package's stacked-expert names and ``[E, out, in]`` layout, gate and up apart.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.config import CheckpointError, ModelConfig
from dflash_jax.kernels.moe import experts_auto
from dflash_jax.models.layers import Dense, normal_init, matmul
from dflash_jax.models.target import DecoderLayer, TargetModel
from dflash_jax.tuning import Kernels


class RMSNorm(nnx.Module):
    """gpt-oss's RMSNorm: the weight multiplies in float32 before the cast back (LLaMA's multiplies after; the
    two differ in bfloat16). transformers also keeps these weights in float32; bf16 checkpoints lose nothing."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * x32).astype(x.dtype)


def route(x: Float[Array, "N D"], router: Float[Array, "D E"], bias: Float[Array, "E"], k: int,
          kernels: Kernels = Kernels()) -> tuple[Float[Array, "N K"], Int[Array, "N K"]]:
    """Top-k of the router logits (model dtype, with bias), softmax over those k only (float32, cast back)."""
    top, idx = jax.lax.top_k(matmul(x, router, kernels) + bias, k)
    return jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x.dtype), idx


def clamped_swiglu(g: jax.Array, u: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """``(clip(u, -limit, limit) + 1) · g' · σ(alpha · g')``, ``g' = min(g, limit)`` (gate clamped above only)."""
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return (u + 1) * (g * jax.nn.sigmoid(alpha * g))


class Experts(nnx.Module):
    """E experts, stacked as in :class:`dflash_jax.models.moe.Experts` (gate/up ``[E, D, F]``, down
    ``[E, F, D]``) plus biases."""

    def __init__(self, e: int, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(normal_init(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.up_proj = nnx.Param(normal_init(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.down_proj = nnx.Param(normal_init(rngs, (e, f, d), 1.0 / math.sqrt(f), dtype))
        self.gate_proj_bias = nnx.Param(jnp.zeros((e, f), dtype))
        self.up_proj_bias = nnx.Param(jnp.zeros((e, f), dtype))
        self.down_proj_bias = nnx.Param(jnp.zeros((e, d), dtype))


class GptOssMoE(nnx.Module):
    """gpt-oss's MLP: ``router`` (``[D, E]`` + bias) and ``experts`` (HF names ``mlp.router`` / ``mlp.experts``)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.router = Dense(cfg.hidden_size, cfg.num_experts, bias=True, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.top_k, self.alpha, self.limit = cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit

    def __call__(self, x: Float[Array, "*b D"], kernels: Kernels = Kernels()) -> Float[Array, "*b D"]:
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = route(flat, self.router.kernel[...], self.router.bias[...], self.top_k, kernels)
        e = self.experts
        out = experts_auto(flat, weights, idx, e.gate_proj[...], e.up_proj[...], e.down_proj[...], kernels=kernels,
                           biases=(e.gate_proj_bias[...], e.up_proj_bias[...], e.down_proj_bias[...]),
                           act=functools.partial(clamped_swiglu, alpha=self.alpha, limit=self.limit))
        return out.reshape(x.shape)


class GptOssDecoderLayer(DecoderLayer):
    """The shared decoder layer (its attention takes sinks and, on sliding layers, a window from ``cfg``) with
    gpt-oss's norms and routed experts in every layer."""

    norm_class = RMSNorm

    def make_mlp(self, cfg: ModelConfig, idx: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return GptOssMoE(cfg, dtype=dtype, rngs=rngs)


class GptOssTargetModel(TargetModel):
    """A gpt-oss causal LM: :class:`~dflash_jax.models.target.TargetModel` with :class:`GptOssDecoderLayer` layers
    and gpt-oss's final norm."""

    layer_class = GptOssDecoderLayer
    norm_class = RMSNorm


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------

# FP4 E2M1 by code: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal (0, 0.5).
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """MXFP4 ``blocks`` ``[..., R, G, 16]`` and ``scales`` ``[..., R, G]`` (uint8) → ``[..., R, G·32]`` in ``dtype``.

    Each byte holds two FP4 (E2M1) codes, the low nibble first; each block of 32 values shares one E8M0 scale
    ``2^(scale - 127)``. Every result is an FP4 value times a power of two, exact in float32 and bfloat16.
    """
    if blocks.shape[:-1] != scales.shape and blocks.size == scales.size * 16:  # bytes flattened: [..., R, G·16]
        blocks = blocks.reshape(*scales.shape, 16)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise CheckpointError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match "
                              f"([..., R, G, 16] and [..., R, G])")
    blocks = np.asarray(blocks, np.uint8)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # [..., R, G, 32]
    values = FP4_E2M1[codes] * np.exp2(scales.astype(np.float32) - 127.0)[..., None]
    return values.reshape(*blocks.shape[:-2], -1).astype(dtype)


class _LazyTensors(Mapping):
    """Checkpoint tensors where some entries are made on first access (dequantized expert matrices): the
    loader places each on the device before asking for the next, so the host never holds them all at once."""

    def __init__(self, tensors: dict[str, np.ndarray], makers: dict[str, Callable[[], np.ndarray]]):
        self._tensors, self._makers = tensors, makers

    def __getitem__(self, name: str) -> np.ndarray:
        return self._makers[name]() if name in self._makers else self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        yield from self._makers

    def __len__(self) -> int:
        return len(self._tensors) + len(self._makers)

    def __contains__(self, name) -> bool:
        return name in self._makers or name in self._tensors


def _split_mxfp4(blocks: np.ndarray, scales: np.ndarray, rows: slice, dtype) -> Callable[[], np.ndarray]:
    """A maker of ``[E, R', G·32]`` for the selected rows (output features), one expert at a time."""
    def make() -> np.ndarray:
        b, s = blocks[:, rows], scales[:, rows]
        out = np.empty((*s.shape[:2], s.shape[2] * 32), dtype)
        for e in range(b.shape[0]):
            out[e] = dequantize_mxfp4(b[e], s[e], dtype)
        return out
    return make


def checkpoint_tensors(tensors: dict[str, np.ndarray], dtype=np.float32) -> Mapping[str, np.ndarray]:
    """gpt-oss expert tensors → ``experts.{gate,up,down}_proj`` ``[E, out, in]`` and
    ``experts.{gate,up,down}_proj_bias`` (the names and layout :func:`safetensors_io.load_into` reads); other
    tensors pass through.

    Takes the plain ``gate_up_proj`` ``[E, D, 2F]`` / ``down_proj`` ``[E, F, D]`` that ``save_pretrained`` writes
    and the released checkpoints' MXFP4 ``*_blocks`` / ``*_scales``, dequantized into ``dtype`` when read.
    """
    dtype = np.dtype(dtype)
    out, makers = dict(tensors), {}
    bases = sorted({n[: n.index(".experts.") + len(".experts.")] for n in tensors if ".experts." in n})
    for base in bases:
        gate_up, down = base + "gate_up_proj", base + "down_proj"
        if gate_up + "_blocks" in out:
            for name in (gate_up, down):
                if name + "_scales" not in out or name + "_blocks" not in out:
                    raise CheckpointError(f"{name}: MXFP4 needs both {name}_blocks and {name}_scales")
            gb, gs = out.pop(gate_up + "_blocks"), out.pop(gate_up + "_scales")  # rows = 2F, interleaved
            db, ds = out.pop(down + "_blocks"), out.pop(down + "_scales")
            makers[base + "gate_proj"] = _split_mxfp4(gb, gs, slice(0, None, 2), dtype)
            makers[base + "up_proj"] = _split_mxfp4(gb, gs, slice(1, None, 2), dtype)
            makers[base + "down_proj"] = _split_mxfp4(db, ds, slice(None), dtype)
        elif gate_up in out:
            w = out.pop(gate_up)  # [E, D, 2F]: [in, out], gate and up interleaved
            out[base + "gate_proj"] = np.swapaxes(w[..., 0::2], 1, 2)
            out[base + "up_proj"] = np.swapaxes(w[..., 1::2], 1, 2)
            out[down] = np.swapaxes(out[down], 1, 2)  # [E, F, D] → [E, D, F]
        if gate_up + "_bias" in out:
            b = out.pop(gate_up + "_bias")  # [E, 2F]
            out[base + "gate_proj_bias"], out[base + "up_proj_bias"] = b[:, 0::2], b[:, 1::2]
    return _LazyTensors(out, makers) if makers else out
