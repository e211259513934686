"""Helpers shared by the GPU kernels (Pallas lowered to Triton): integer arithmetic of tilings, the device's SM
count, the dtypes they take and the precision JAX asks for (kept in :mod:`dflash_jax.kernels.common`, which the TPU
kernels read too)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.kernels.common import highest_precision_requested  # noqa: F401 — the GPU kernels import it here

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
DEFAULT_SMS = 132  # Hopper SXM parts; used when the device does not say (interpret mode)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for n ≤ 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def num_sms() -> int:
    """Streaming multiprocessors of the first device (:data:`DEFAULT_SMS` off a GPU)."""
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", 0) or DEFAULT_SMS)
    except Exception:  # noqa: BLE001 — no backend: keep the default
        pass
    return DEFAULT_SMS


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first device where it is a GPU that says (None elsewhere: interpret mode)."""
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            major, _, minor = str(getattr(dev, "compute_capability", "")).partition(".")
            return int(major), int(minor or 0)
    except Exception:  # noqa: BLE001 — no backend, or a device that does not say
        pass
    return None
