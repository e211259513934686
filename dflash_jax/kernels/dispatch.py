"""The one (op, implementation) dispatch of every kernel.

Every operation of :mod:`dflash_jax.kernels` is a leaf module holding its pure-jnp reference (which is also its
fallback) and asking this table for a kernel: ``kernel(op, kernels)`` gives the kernel registered for
``(op, kernels.impl)`` or None, and the op runs its reference on None — and also when the kernel itself returns
None (it cannot take these shapes, logged once). The implementation is the attention implementation the caller
resolved once (:func:`resolve_impl`: ``"auto"`` → ``"pallas"`` on TPUs, ``"cuda"`` on GPUs, ``"xla"``
elsewhere) and it is honoured by every op alike: ``"xla"`` runs every reference, ``"cuda"`` every GPU kernel,
``"pallas"`` every TPU kernel. A kernel asked for on another backend runs in Pallas interpret mode where the op
allows it (tests on the CPU); kernel knobs (:class:`dflash_jax.tuning.KernelTuning`) reach the kernel in
``kernels.tuning``, and the knobs named in :data:`SWITCHES` turn a kernel off (its op runs the reference).

A registered kernel is a function ``entry(*args, kernels=kernels, **keywords)`` of its op's arguments (the op's
module documents them) that returns the op's result, or None when the reference must run. Entries are
registered by ``"module:function"`` path and imported on first use, so importing this table (and every model)
loads no Triton or Mosaic module. Adding a kernel: one leaf module (under :mod:`dflash_jax.cuda` or
:mod:`dflash_jax.pallas`) with its entry, and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax.kernels.common import KERNEL_FOR_BACKEND, log_once
from dflash_jax.tuning import Kernels

IMPLS = ("auto", "xla", "pallas", "cuda")

# Every op, with what its kernel entry is called with (the op's module: its reference and the dispatch).
OPS = {
    "cache_attention": "dflash_jax.kernels.attention.cache_attention (verify / AR step over the cache)",
    "prefill_attention": "dflash_jax.kernels.attention.prefill_attention (a prompt over its own keys)",
    "draft_attention": "dflash_jax.kernels.attention.draft_attention (drafter blocks over the context cache)",
    "packed_verify_attention": "dflash_jax.kernels.packed.packed_verify_attention (compact mode's windows)",
    "cache_write": "dflash_jax.kernels.cache_write.write_pending (compact mode's deferred K/V write)",
    "cache_place": "dflash_jax.kernels.cache_write.place_pending (a tier's K/V slots in the largest tier's)",
    "moe_experts": "dflash_jax.kernels.moe.experts_auto (the routed experts' MLP)",
    "delta_rule": "dflash_jax.kernels.delta_rule.kernel_block (the gated delta rule of a short block)",
    "quantized_matmul": "dflash_jax.kernels.quantized.quantized_matmul (x @ an int8 / fp8 kernel with its scales)",
    "quantized_projections": "dflash_jax.kernels.quantized.quantized_projections (several int8 / fp8 kernels "
                             "over one input)",
    "top_k": "dflash_jax.kernels.top_k.top_k (the K largest of each row: DFlash2's candidates over the vocabulary)",
    "head_top_k": "dflash_jax.kernels.top_k.head_top_k (the LM head, then the K largest logits of each row)",
}

# (op, impl) → "module:function" of the kernel entry. An op without an entry for an implementation runs its
# reference under it ("xla" has none: it is the references).
REGISTRY: dict[tuple[str, str], str] = {
    ("cache_attention", "pallas"): "dflash_jax.pallas.attention:cache_attention_kernel",
    ("cache_attention", "cuda"): "dflash_jax.cuda.attention:cache_attention_kernel",
    ("draft_attention", "pallas"): "dflash_jax.pallas.attention:draft_attention_kernel",
    ("draft_attention", "cuda"): "dflash_jax.cuda.attention:draft_attention_kernel",
    ("prefill_attention", "cuda"): "dflash_jax.cuda.attention:prefill_attention_kernel",
    ("packed_verify_attention", "cuda"): "dflash_jax.cuda.attention:packed_verify_kernel",
    ("cache_write", "cuda"): "dflash_jax.cuda.cache_write:write_pending_kernel",
    ("cache_place", "cuda"): "dflash_jax.cuda.cache_write:place_pending_kernel",
    ("moe_experts", "cuda"): "dflash_jax.cuda.moe:experts_kernel",
    ("moe_experts", "pallas"): "dflash_jax.pallas.moe:experts_kernel",
    ("delta_rule", "cuda"): "dflash_jax.cuda.delta_rule:kernel_block",
    ("quantized_matmul", "cuda"): "dflash_jax.cuda.quantized:quantized_matmul_kernel",
    ("quantized_matmul", "pallas"): "dflash_jax.pallas.quantized:quantized_matmul_kernel",
    ("quantized_projections", "cuda"): "dflash_jax.cuda.quantized:quantized_projections_kernel",
    ("top_k", "cuda"): "dflash_jax.cuda.top_k:chunked_top_k_kernel",
    ("head_top_k", "cuda"): "dflash_jax.cuda.head_top_k:head_top_k_kernel",
}

# Ops whose kernel a KernelTuning field turns off (A/B runs): op → field name. ``top_k_chunked`` is off by default
# (lax.top_k runs where the fused head + top-K does not).
SWITCHES = {"packed_verify_attention": "packed_kernel", "cache_write": "write_kernel", "cache_place": "place_kernel",
            "delta_rule": "delta_rule_kernel", "quantized_matmul": "quant_kernel",
            "quantized_projections": "quant_group_kernel", "top_k": "top_k_chunked", "head_top_k": "head_top_k_kernel"}


def resolve_impl(impl: str, dtype=None) -> str:
    """``"auto"`` → the kernel implementation for the default backend (``"xla"`` where there is none).

    ``dtype``: the model's compute dtype. On a GPU, ``"auto"`` keeps float32 models on the XLA reference: the
    kernels' float32 path (TF32 dots, as XLA's) is only faster at short contexts and batch 1, and slower at 16k
    positions; it runs when asked for by name (``"cuda"``). bfloat16, the serving dtype, is where the kernels
    win (1.5–2.7× at ≥ 4k positions).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    chosen = KERNEL_FOR_BACKEND.get(jax.default_backend(), "xla")
    if chosen == "cuda" and dtype is not None and jnp.dtype(dtype) == jnp.float32:
        log_once("attention_impl='auto': float32 on GPU uses the XLA reference (the cuda kernels are tuned "
                 "for bfloat16; pass attention_impl='cuda' to use them anyway)")
        return "xla"
    return chosen


def registered(op: str, impl: str) -> str | None:
    """The ``"module:function"`` path of ``op``'s kernel under ``impl`` (None: the reference runs). Raises
    ValueError, naming what is known, for an unknown op or an implementation that is not a resolved one."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; the ops are {tuple(OPS)}")
    if impl not in IMPLS[1:]:
        raise ValueError(f"unknown kernel implementation {impl!r} for op {op!r}; one of {IMPLS[1:]} "
                         f"(resolve 'auto' first: dflash_jax.kernels.resolve_impl)")
    return REGISTRY.get((op, impl))


def kernel(op: str, kernels: Kernels) -> Callable | None:
    """The kernel entry of ``op`` under ``kernels.impl``, or None when the reference runs (none registered, or
    turned off by its :data:`SWITCHES` knob)."""
    path = registered(op, kernels.impl)
    if path is None or not getattr(kernels.tuning, SWITCHES.get(op, ""), True):
        return None
    return load(path)


def load(path: str) -> Callable:
    """The function at ``"module:function"`` (looked up at every call, after the module's first import)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
