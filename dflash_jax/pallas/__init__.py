"""Pallas TPU (Mosaic) kernels for the decode loop's attention; see :mod:`dflash_jax.pallas.attention`.

On CPU run them with ``interpret=jax.experimental.pallas.tpu.InterpretParams()``. Use
:func:`unsupported_reason` to decide whether to fall back to the jnp references in :mod:`dflash_jax.attention`.
"""

from dflash_jax.pallas.attention import draft_attention, ragged_verify_attention, unsupported_reason

__all__ = ["draft_attention", "ragged_verify_attention", "unsupported_reason"]
