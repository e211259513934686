"""What a quantized kernel is: :class:`Scheme` (storage dtype and scale blocks), the names users pass
(``quantization="int8" | "fp8"``) and the parameter type that holds quantized values and their scales.

Layout: a kernel ``[in, out]`` (as :class:`dflash_jax.models.layers.Dense` stores it) is cut into blocks of
``block = (rows, columns)``; each block has one float32 scale, and ``kernel ≈ values · scale`` elementwise with
the scale of its block. ``rows = None`` spans every input row: one scale per block of output columns, per output
channel when ``columns = 1``. The HF fine-grained FP8 format's ``weight_block_size [bo, bi]`` over
``[out, in]`` weights is ``block = (bi, bo)`` here, its ``weight_scale_inv`` the transposed ``scale``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import ConfigError

# HF fine-grained FP8's name for a weight's scales: ``x.weight`` → ``x.weight_scale_inv`` (fused experts:
# ``experts.gate_up_proj`` → ``experts.gate_up_proj_scale_inv``).
SCALE_SUFFIX = "_scale_inv"
KINDS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # storage dtype, largest magnitude


@dataclasses.dataclass(frozen=True)
class Scheme:
    """Weight-only symmetric quantization: ``kind`` ``"int8"`` or ``"fp8"`` (e4m3), one float32 scale per
    ``block`` of the ``[in, out]`` kernel (module docstring). Hashable: a quantized layer keeps it as a static
    attribute, so it is part of the compiled programs' key."""

    kind: str
    block: tuple[int | None, int] = (None, 1)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"quantization kind must be one of {tuple(KINDS)}, got {self.kind!r}")
        rows, cols = self.block
        if (rows is not None and (not isinstance(rows, int) or rows < 1)) or not isinstance(cols, int) or cols < 1:
            raise ConfigError(f"a quantization block is (rows or None, columns) of positive integers, got {self.block}")

    @property
    def dtype(self):
        """The values' storage dtype."""
        return jnp.dtype(KINDS[self.kind][0])

    @property
    def qmax(self) -> float:
        return KINDS[self.kind][1]

    def blocks(self, d_in: int, d_out: int) -> tuple[int, int]:
        """The block of a ``[d_in, d_out]`` kernel in rows and columns (``None`` rows resolved to ``d_in``)."""
        return (d_in if self.block[0] is None else self.block[0]), self.block[1]

    def scale_shape(self, d_in: int, d_out: int) -> tuple[int, int]:
        bi, bo = self.blocks(d_in, d_out)
        return math.ceil(d_in / bi), math.ceil(d_out / bo)

    def __str__(self) -> str:
        rows, cols = self.block
        if rows is None and cols == 1:
            return f"{self.kind} per output channel"
        return f"{self.kind} in {'all' if rows is None else rows}×{cols} blocks"


INT8 = Scheme("int8")  # per output channel
FP8 = Scheme("fp8")  # per output channel (an FP8 checkpoint keeps its own blocks)
NAMES = {"int8": INT8, "fp8": FP8}


def parse(quantization) -> Scheme | None:
    """``None`` or ``"none"`` (weights as the checkpoint stores them), ``"int8"``, ``"fp8"`` or a :class:`Scheme`."""
    if quantization is None or isinstance(quantization, Scheme):
        return quantization
    if isinstance(quantization, str) and quantization.lower() == "none":
        return None
    if isinstance(quantization, str) and quantization.lower() in NAMES:
        return NAMES[quantization.lower()]
    raise ConfigError(f"quantization must be None, 'int8' or 'fp8' (or a dflash_jax.quant.Scheme), "
                      f"got {quantization!r}")


class QuantParam(nnx.Param):
    """A quantized kernel's values or its scales: a parameter that keeps its own dtype (int8, float8, float32)
    where a loader casts the others to the model's compute dtype."""


def param_bytes(module: nnx.Module, where=lambda path: True) -> int:
    """Bytes of the parameters of ``module`` whose path (a tuple of names) ``where`` accepts: what is stored,
    scales included (a sharded array counts once, whole)."""
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        value = var.get_value() if hasattr(var, "get_value") else var[...]
        if where(tuple(str(p) for p in path)) and isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            total += math.prod(value.shape) * jnp.dtype(value.dtype).itemsize
    return total
