"""Helpers shared by the TPU (Mosaic) kernels: tile arithmetic and the interpret-mode argument."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

LANES = 128
Interpret = bool | pltpu.InterpretParams | None


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return -(-x // m) * m


def sublanes(dtype: Any) -> int:
    """Rows of one (sublanes, 128) VMEM tile: 8 for 32-bit, 16 for 16-bit dtypes."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def interpret_arg(interpret: Interpret) -> Any:
    """``pallas_call``'s ``interpret`` for an :data:`Interpret` (True: TPU interpret mode's default parameters)."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False
