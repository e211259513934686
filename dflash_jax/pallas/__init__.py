"""TPU (Mosaic) Pallas kernels, one leaf module per operation: :mod:`dflash_jax.pallas.attention` (the decode
loop's draft and ragged verify attention), :mod:`dflash_jax.pallas.moe` (the grouped-expert MLP),
:mod:`dflash_jax.pallas.quantized` (the dequantize-and-multiply of int8 / fp8 kernels), and
:mod:`dflash_jax.pallas.common` (what they share).

On CPU run them with ``interpret=jax.experimental.pallas.tpu.InterpretParams()``. Model code never imports
these: the operations of :mod:`dflash_jax.kernels` reach them through its ``(op, implementation)`` dispatch.
"""
