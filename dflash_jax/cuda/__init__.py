"""GPU kernels (Pallas lowered to Triton; NVIDIA GPUs, sm80+), one leaf module per operation.

* :mod:`dflash_jax.cuda.attention` — the decode loop's attention (draft, ragged verify, packed verify);
* :mod:`dflash_jax.cuda.cache_write` — compact mode's deferred cache write and slot placement;
* :mod:`dflash_jax.cuda.moe` — the grouped-expert MLP;
* :mod:`dflash_jax.cuda.delta_rule` — the short-block gated delta rule (linear attention);
* :mod:`dflash_jax.cuda.quantized` — the fused dequantize-and-multiply of int8 / fp8 linear layers;
* :mod:`dflash_jax.cuda.top_k` — the exact two-stage (chunked) top-K over a vocabulary (jnp, no Triton);
* :mod:`dflash_jax.cuda.head_top_k` — the LM head and the top-K of its logits in one kernel (DFlash2's candidates);
* :mod:`dflash_jax.cuda.common` — helpers they share; :mod:`dflash_jax.cuda.graphs` — CUDA-graph options.

Model code never imports these: it calls the operations of :mod:`dflash_jax.kernels`, whose dispatch picks a
kernel by ``(op, attention implementation)``. This package imports nothing at import time (Triton's modules
load with the kernel that needs them).
"""
