"""Hugging Face safetensors checkpoints ↔ NNX modules.

Only safetensors (and GGUF, see :mod:`gguf_io`) are ever read: never pickle, never remote code.
Our modules use HF names one-to-one, except that ``Dense.kernel`` is ``[in, out]`` (PyTorch ``weight`` is
``[out, in]``) and embedding tables are ``….embedding`` (HF ``….weight``, e.g. ``embed_tokens.weight``).
Stacked MoE experts (``mlp.experts.{gate,up,down}_proj``) are likewise ``[E, out, in]`` in checkpoints and
``[E, in, out]`` in the modules; :func:`stack_experts` brings HF's per-expert or fused tensors to that form.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from dflash_jax.config import CheckpointError  # noqa: F401 — defined at the bottom layer, raised here too
from dflash_jax.models.moe import stack_experts  # noqa: F401 — kept importable from here
from dflash_jax.quant import QuantParam

# safetensors dtypes that its numpy reader does not know (FP8 checkpoints): read from the file's bytes here.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: ``model.safetensors`` or the shards its index lists."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"corrupt safetensors index {index}: {e}") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory} (only safetensors and GGUF are read)")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"missing safetensors shard {f}")
    return files


def read_safetensors(files: Iterable[Path]) -> dict[str, np.ndarray]:
    """Every tensor of ``files`` as numpy arrays (FP8 ones as ``ml_dtypes`` float8 arrays)."""
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            raw = _raw_tensors(f)
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    tensors[name] = raw[name] if name in raw else st.get_tensor(name)
        except Exception as e:  # safetensors raises several error types for truncated/corrupt files
            raise CheckpointError(f"corrupt safetensors file {f}: {e}") from None
    return tensors


def _raw_tensors(f: Path) -> dict[str, np.ndarray]:
    """The tensors of ``f`` in :data:`RAW_DTYPES`, read from the bytes the header points at."""
    with open(f, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(size))
    out = {}
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] in RAW_DTYPES:
            start, end = info["data_offsets"]
            data = np.fromfile(f, np.uint8, count=end - start, offset=8 + size + start)
            out[name] = data.view(RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def hf_name(path: tuple, prefix: str) -> tuple[str, bool]:
    """Module parameter path → (HF tensor name, needs transpose)."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    base = ".".join(parts[:-1])
    if leaf == "embedding":
        return prefix + base + ".weight", False
    if parts[0] == "lm_head":
        prefix = ""
    if leaf == "kernel":
        return prefix + base + ".weight", True
    if leaf == "scale" and parts[-2] != "experts":  # a quantized Dense's scales: HF FP8's name and layout
        return prefix + base + ".weight_scale_inv", True
    if parts[-2] == "experts" and leaf.endswith("_proj_scale"):  # quantized stacked experts' [E, nbo, nbi]
        return prefix + base + "." + leaf + "_inv", True
    return prefix + base + "." + leaf, parts[-2] == "experts" and not leaf.endswith("_bias")  # [E, in, out]


def _to_module(arr: np.ndarray) -> np.ndarray:
    """``[..., out, in]`` (PyTorch) → ``[..., in, out]`` (ours), and back: swap the last two axes."""
    return np.swapaxes(arr, -1, -2)


def param_leaves(model: nnx.Module) -> list[tuple[tuple, nnx.Variable]]:
    return [(tuple(path), var) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def load_into(
    model: nnx.Module,
    tensors: Mapping[str, np.ndarray],
    *,
    prefix: str,
    source: str,
    dtype,
    ignore: Callable[[str], bool] = lambda name: False,
    place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
) -> None:
    """Fill every parameter of ``model`` (possibly abstract, from ``nnx.eval_shape``) from ``tensors``.

    Parameters are cast to ``dtype``, except quantized values and scales (:class:`~dflash_jax.quant.QuantParam`),
    which keep the model's dtype for them. Raises :class:`CheckpointError` naming missing tensors, unexpected
    tensors and shape mismatches.
    """
    place = place or (lambda path, arr: jnp.asarray(arr))
    used: set[str] = set()
    missing, mismatched = [], []
    for path, var in param_leaves(model):
        name, transpose = hf_name(path, prefix)
        if name not in tensors:
            missing.append(name)
            continue
        arr = tensors[name]
        arr = _to_module(arr) if transpose else arr
        if tuple(arr.shape) != tuple(var.shape):
            shape = tuple(var.shape)
            mismatched.append(f"{name}: checkpoint {tuple(tensors[name].shape)} vs model "
                              f"{shape[:-2] + (shape[-1], shape[-2]) if transpose else shape}")
            continue
        used.add(name)
        var.set_value(place(path, np.asarray(arr).astype(var.dtype if isinstance(var, QuantParam) else dtype,
                                                                copy=False)))
    unexpected = sorted(n for n in tensors if n not in used and n not in missing and not ignore(n)
                        and not any(n == m.split(":")[0] for m in mismatched))
    problems = []
    if mismatched:
        problems.append("shape mismatch (is this checkpoint for another model shape?): " + "; ".join(mismatched[:6]))
    if missing:
        problems.append(f"missing tensors: {missing[:8]}{' …' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}")
    if problems:
        raise CheckpointError(f"{source}: " + " | ".join(problems))


def state_to_hf(model: nnx.Module, *, prefix: str, dtype=np.float32) -> dict[str, np.ndarray]:
    """Module parameters → HF-named numpy tensors (``[out, in]`` linear weights). Quantized layers are refused
    (their values alone are not the weights)."""
    out = {}
    for path, var in param_leaves(model):
        if isinstance(var, QuantParam):
            raise CheckpointError(f"{'.'.join(map(str, path))} is quantized: export the model before quantizing it")
        name, transpose = hf_name(path, prefix)
        arr = np.asarray(jax.device_get(var[...])).astype(dtype)
        out[name] = np.ascontiguousarray(_to_module(arr) if transpose else arr)
    return out


def save_safetensors(tensors: Mapping[str, np.ndarray], path: Path) -> None:
    save_file(dict(tensors), str(path), metadata={"format": "pt"})
