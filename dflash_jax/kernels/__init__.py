"""The kernel layer: every compute operation the models hand to a kernel, each a leaf module with its pure-jnp
reference beside the dispatch to its kernels.

* :mod:`~dflash_jax.kernels.attention` — cache (verify / AR step), prefill and draft attention;
* :mod:`~dflash_jax.kernels.packed` — compact mode's packed verify windows and their attention;
* :mod:`~dflash_jax.kernels.cache_write` — writing the pending K/V of a packed verify into the caches;
* :mod:`~dflash_jax.kernels.moe` — the routed experts' MLP;
* :mod:`~dflash_jax.kernels.delta_rule` — the gated delta rule of linear attention;
* :mod:`~dflash_jax.kernels.quantized` — matmuls over int8 / fp8 kernels and their scales;
* :mod:`~dflash_jax.kernels.top_k` — the K largest entries of each row (DFlash2's candidates);
* :mod:`~dflash_jax.kernels.dispatch` — the one ``(op, implementation)`` table they all ask (read its docstring);
* :mod:`~dflash_jax.kernels.common` — what they share.

The kernel bodies live in :mod:`dflash_jax.pallas` (TPU, Mosaic) and :mod:`dflash_jax.cuda` (GPU, Triton).
Nothing here imports model code; every call takes a :class:`dflash_jax.tuning.Kernels` (the resolved attention
implementation and the kernel knobs).
"""

from dflash_jax.kernels.dispatch import IMPLS, OPS, REGISTRY, kernel, registered, resolve_impl

__all__ = ["IMPLS", "OPS", "REGISTRY", "kernel", "registered", "resolve_impl"]
