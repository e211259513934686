"""Quantized checkpoints: HF fine-grained FP8 read as stored, and any checkpoint's linear layers quantized on
load — both in the checkpoint's own domain (numpy tensors by HF name, ``[out, in]`` weights), before a model is
built from them.

HF fine-grained FP8 (``quantization_config: {quant_method: fp8, weight_block_size: [bo, bi],
activation_scheme: dynamic}``; transformers' ``FineGrainedFP8Config``): a quantized linear layer's ``weight`` is
``float8_e4m3fn`` ``[out, in]`` with a float32 ``weight_scale_inv`` ``[ceil(out / bo), ceil(in / bi)]``, and
``weight[i, j] · weight_scale_inv[i // bo, j // bi]`` is the float weight (blocks at the edges are partial).
Without ``weight_block_size`` one scale covers the whole tensor. Tensors the checkpoint keeps unquantized
(embeddings, norms, routers, often ``lm_head``) are plain floats there. Stacked or fused expert tensors
(``…_proj`` with ``…_proj_scale_inv``) follow the same rule over their last two axes.

Reading one goes in two steps around the family's checkpoint map (:data:`dflash_jax.families.registry.CheckpointMap`):
:func:`read_fp8` checks every FP8 tensor by its stored name and spreads its scales to one row per weight row, so
that the map renames, stacks, splits or regroups a weight's rows and does the same to its scales (a scale is
always ``weight name + "_scale_inv"``) without knowing the blocks; :func:`settle_fp8` then, in the model's names,
folds the rows back into blocks (or keeps one scale per row where the map moved rows across blocks) or dequantizes.

Activations are not quantized: a linear layer multiplies the compute-dtype activations by its int8 / fp8
weight and scales (weight-only; serving engines running these checkpoints with FP8 activations round those
as well, which we do not).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import ml_dtypes
import numpy as np
from flax import nnx

from dflash_jax import quant
from dflash_jax.config import CheckpointError
from dflash_jax.checkpoints.safetensors_io import hf_name
from dflash_jax.models.layers import quantizable
from dflash_jax.models.moe import PROJECTIONS, quantizable_experts
from dflash_jax.quant import Scheme

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
# A routed expert's weight: per expert (Qwen3-MoE's save_pretrained) or stacked / fused (transformers 5).
_EXPERT_WEIGHT = re.compile(r"^.*\.experts\.(\d+\.(gate|up|down)_proj\.weight|(gate_up|gate|up|down)_proj)$")
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def scale_name(weight: str) -> str:
    """The name of a quantized tensor's scales (``x.weight`` → ``x.weight_scale_inv``)."""
    return weight + quant.SCALE_SUFFIX


def fp8_blocks(hf_cfg: Mapping[str, Any], where: str) -> tuple[int, int] | None | bool:
    """The ``weight_block_size`` ``(rows of out, columns of in)`` of an HF fine-grained FP8 checkpoint's config,
    ``None`` for one scale per tensor; ``False`` when the checkpoint is not FP8. CheckpointError for an FP8
    config this reader cannot take (static activation scales, a malformed block size)."""
    qc = hf_cfg.get("quantization_config") or (hf_cfg.get("text_config") or {}).get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "fp8":
        return False
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}: FP8 activation_scheme {qc.get('activation_scheme')!r} is not supported "
                              f"(only 'dynamic': weights are read with their scales, activations stay unquantized)")
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size must be two positive integers, "
                              f"got {block!r}")
    return int(block[0]), int(block[1])


def linear_names(model: nnx.Module, prefix: str) -> dict[str, tuple[str, ...]]:
    """The checkpoint weight name of each linear layer quantization converts → its module path."""
    return {hf_name(path + ("kernel",), prefix)[0]: path for path, _ in quantizable(model)}


def is_expert(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a routed expert's weight (per expert or stacked / fused)."""
    return bool(_EXPERT_WEIGHT.match(name))


def read_fp8(tensors: dict[str, np.ndarray], blocks: tuple[int, int] | None, where: str) -> dict[str, np.ndarray]:
    """An FP8 checkpoint's tensors checked by their stored names: every FP8 tensor has float scales of the shape
    its blocks give (CheckpointError naming the tensor otherwise). Returns the tensors with each scale spread to
    one row per weight row (``[..., out, ceil(in / bi)]`` float32), so that the family's checkpoint map can
    reorder, split or stack a weight's rows and do the same to its scales whatever the block height
    (:func:`settle_fp8` then folds them back into blocks where the rows allow)."""
    out = dict(tensors)
    for name, w in tensors.items():
        if name.endswith("_scale_inv"):
            base = name[: -len("_scale_inv")]
            if base not in tensors or tensors[base].dtype != FP8_DTYPE:
                raise CheckpointError(f"{where}: scale {name} belongs to no FP8 tensor {base} in the checkpoint")
            continue
        if w.dtype == np.dtype(ml_dtypes.float8_e5m2):
            raise CheckpointError(f"{where}: tensor {name} is float8_e5m2; FP8 checkpoints are read in "
                                  f"float8_e4m3fn only")
        if w.dtype != FP8_DTYPE:
            continue
        sname = scale_name(name)
        if sname not in tensors:
            raise CheckpointError(f"{where}: FP8 tensor {name} {tuple(w.shape)} has no scale tensor {sname}")
        s, (bo, _) = _checked_scale(name, w, tensors[sname], blocks, where)
        out[sname] = _row_scales(s, bo, w.shape[-2])
    return out


def settle_fp8(tensors: Mapping[str, np.ndarray], blocks: tuple[int, int] | None, linears: Mapping[str, tuple],
               *, keep: bool, dtype, where: str, experts: bool = False, ignore=lambda name: False
               ) -> tuple[dict[str, np.ndarray], dict[str, Scheme]]:
    """The FP8 tensors in the model's names (after the family's checkpoint map, their row scales beside them:
    :func:`read_fp8`). Returns (tensors, kept): with ``keep``, the FP8 weights of ``linears`` (and, with
    ``experts``, the routed experts' weights, when ``blocks`` are given) stay FP8 beside their scales, folded
    into the checkpoint's blocks where every block's rows share a scale (rows the map moved by whole blocks;
    else one scale per row), and ``kept`` gives each one's scheme; every other FP8 tensor is dequantized
    (float32 for a linear layer or expert, to be quantized again; ``dtype`` for the rest), except those the map's
    ``ignore`` lists."""
    out = dict(tensors)
    kept: dict[str, Scheme] = {}
    for name, w in tensors.items():
        sname = scale_name(name)
        if name.endswith("_scale_inv"):
            if name[: -len("_scale_inv")] not in tensors and not ignore(name):
                raise CheckpointError(f"{where}: scale {name} has no FP8 tensor beside it after the checkpoint map")
            continue
        if w.dtype != FP8_DTYPE or ignore(name):
            continue
        if sname not in tensors:
            raise CheckpointError(f"{where}: FP8 tensor {name} {tuple(w.shape)} has no scales {sname} after the "
                                  f"checkpoint map")
        rows = tensors[sname]
        out_dim, in_dim = w.shape[-2:]
        bi = blocks[1] if blocks else in_dim
        expert = experts and is_expert(name)
        if keep and ((name in linears and w.ndim == 2) or (expert and blocks is not None)):
            bo = blocks[0] if blocks else out_dim
            folded = rows[..., ::bo, :]
            if not np.array_equal(_row_scales(folded, bo, out_dim), rows):
                bo, folded = 1, rows
            out[sname] = folded
            kept[name] = Scheme("fp8", (bi, bo))  # [out, in] blocks → the [in, out] kernel's
        else:
            out[name] = quant.dequantize(np.swapaxes(w, -1, -2), np.swapaxes(rows, -1, -2), (bi, 1),
                                         np.float32 if name in linears or expert else dtype).swapaxes(-1, -2)
            del out[sname]
    return out, kept


def _checked_scale(name: str, w: np.ndarray, s: np.ndarray, blocks: tuple[int, int] | None, where: str
                   ) -> tuple[np.ndarray, tuple[int, int]]:
    """The scales of FP8 tensor ``name`` as float32 ``[..., nbo, nbi]`` and the block they cover (one scale per
    tensor: a block spanning it)."""
    out_dim, in_dim = w.shape[-2:] if w.ndim >= 2 else (0, 0)
    if blocks is None:
        block = (max(out_dim, 1), max(in_dim, 1))
        want = w.shape[:-2] + (1, 1)
        ok = s.size == math.prod(want)
    else:
        block = blocks
        want = w.shape[:-2] + (-(-out_dim // blocks[0]), -(-in_dim // blocks[1]))
        ok = tuple(s.shape) == want
    if w.ndim < 2 or not ok or s.dtype not in SCALE_DTYPES:
        raise CheckpointError(
            f"{where}: the scales {scale_name(name)} of FP8 tensor {name} {tuple(w.shape)} are {s.dtype} "
            f"{tuple(s.shape)}; weight_block_size {list(blocks) if blocks else None} needs float scales of shape "
            f"{want}")
    s = np.asarray(s, np.float32).reshape(want)
    if not np.all(np.isfinite(s)):
        raise CheckpointError(f"{where}: the scales {scale_name(name)} of FP8 tensor {name} are not all finite")
    return s, block


def _row_scales(s: np.ndarray, bo: int, out_dim: int) -> np.ndarray:
    """Block scales ``[..., nbo, nbi]`` spread to one row per weight row ``[..., out, nbi]``."""
    return np.repeat(s, bo, axis=-2)[..., :out_dim, :]


def quantize_linears(tensors: Mapping[str, np.ndarray], linears: Mapping[str, tuple], kept: Mapping[str, Scheme],
                     scheme: Scheme | None) -> tuple[dict[str, np.ndarray], dict[tuple, Scheme]]:
    """The weights of ``linears`` quantized to ``scheme`` (those in ``kept`` stay as stored). Returns the tensors
    (a quantized weight ``[out, in]`` in the scheme's dtype, its scales under :func:`scale_name`, transposed
    like the weight) and the scheme of each quantized layer by module path."""
    out = dict(tensors)
    plan: dict[tuple, Scheme] = {}
    for name, path in linears.items():
        if name in kept:
            plan[path] = kept[name]
        elif scheme is not None and name in out:
            q, s = quant.quantize(np.asarray(out[name], np.float32).T, scheme)
            out[name], out[scale_name(name)] = q.T, s.T
            plan[path] = scheme
    return out, plan


def expert_names(model: nnx.Module, prefix: str) -> dict[tuple[str, ...], dict[str, str]]:
    """Each stacked-experts module path → its projections' checkpoint names (after stacking)."""
    return {path: {p: hf_name(path + (p,), prefix)[0] for p in PROJECTIONS} for path, _ in quantizable_experts(model)}


def quantize_experts(tensors: Mapping[str, np.ndarray], experts: Mapping[tuple, Mapping[str, str]],
                     kept: Mapping[str, Scheme], scheme: Scheme | None
                     ) -> tuple[dict[str, np.ndarray], dict[tuple, Scheme]]:
    """The stacked experts (``[E, out, in]`` after :func:`dflash_jax.models.moe.stack_experts`) as stored when
    :func:`settle_fp8` kept them FP8 (one scheme for the three projections: one scale per row for all three
    where one of them could not fold its rows into blocks), else quantized to ``scheme`` expert by expert
    (None: left as they are). Returns the tensors and each quantized experts module's scheme by path."""
    out = dict(tensors)
    plan: dict[tuple, Scheme] = {}
    for path, names in experts.items():
        if any(n not in out for n in names.values()):
            continue  # missing tensors: the loader names them
        if all(n in kept for n in names.values()):
            schemes = {kept[n] for n in names.values()}
            if len(schemes) > 1:
                for n in names.values():
                    out[scale_name(n)] = _row_scales(out[scale_name(n)], kept[n].block[1], out[n].shape[-2])
                schemes = {Scheme("fp8", (kept[n].block[0], 1))}
            plan[path] = schemes.pop()
        elif scheme is not None:
            for n in names.values():
                pairs = [quant.quantize(np.asarray(w, np.float32).T, scheme) for w in out[n]]
                out[n] = np.stack([q.T for q, _ in pairs])
                out[scale_name(n)] = np.stack([s.T for _, s in pairs])
            plan[path] = scheme
    return out, plan
