"""Quantized weights: the schemes (:class:`Scheme`: int8 or fp8 e4m3 values with float32 scales per block of
the ``[in, out]`` kernel) and the host-side arithmetic that makes and undoes them (:mod:`.numeric`).

A quantized linear layer stores its kernel in the scheme's storage dtype and a ``scale`` beside it, both as
:class:`QuantParam` (kept in their own dtypes when a checkpoint is loaded); the matmul over them is the kernel op
``quantized_matmul`` (:mod:`dflash_jax.kernels.quantized`), which never builds the dequantized kernel.
"""

from dflash_jax.quant.numeric import dequantize, dequantize_columns, quantize
from dflash_jax.quant.scheme import FP8, INT8, NAMES, SCALE_SUFFIX, QuantParam, Scheme, parse, param_bytes

__all__ = ["FP8", "INT8", "NAMES", "SCALE_SUFFIX", "QuantParam", "Scheme", "dequantize", "dequantize_columns", "param_bytes",
           "parse", "quantize"]
