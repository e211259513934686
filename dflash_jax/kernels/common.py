"""What the kernel operations share: logging once, the float32 precision JAX asks for, the per-shard run of a
kernel under a mesh with its fallback to the reference, the compile probe of the TPU kernels, and the loop-free
bucket search.

A leaf of the kernel layer: imports nothing from :mod:`dflash_jax` but :mod:`dflash_jax.tuning`.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from dflash_jax.tuning import KernelTuning

NEG_INF = -1e30  # the references' mask value; finite so that fully masked rows stay NaN-free
KERNEL_FOR_BACKEND = {"tpu": "pallas", "gpu": "cuda"}
log = logging.getLogger("dflash_jax")


@functools.cache
def log_once(message: str, level: int = logging.INFO) -> None:
    """``message`` at ``level``, once per process."""
    log.log(level, message)


def warn_once(message: str) -> None:
    """``message`` as a warning, once per process."""
    log_once(message, logging.WARNING)


def native(impl: str) -> bool:
    """Whether ``impl``'s kernels compile for the default backend (else they run in Pallas interpret mode)."""
    return KERNEL_FOR_BACKEND.get(jax.default_backend()) == impl


def highest_precision_requested() -> bool:
    """Whether JAX's default matmul precision (read at trace time) asks for full float32."""
    p = jax.config.jax_default_matmul_precision
    return str(p).lower() in ("highest", "float32") or "F32_F32_F32" in str(p).upper()


def mesh_sizes() -> dict[str, int]:
    """The axis sizes of the mesh being traced under ({} when none, or one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty or mesh.size == 1 else dict(zip(mesh.axis_names, mesh.axis_sizes))


_PROBED: dict[tuple, str | None] = {}


def compile_probe(key: tuple, local: Callable, shapes: tuple) -> str | None:
    """Compile ``local`` alone for these (per-device) shapes once; the error's first line if it fails.

    The kernels' shape rules cannot foresee every compiler limit — the TPU kernels have never met a real
    TPU compiler here — and a kernel that fails to compile must not take the whole decode program down
    with it: the op falls back to the reference instead, with the reason logged. The TPU kernels are probed
    (a probe costs a compile per shape bucket); the GPU ones are compiled and tested on GPUs.
    """
    key = key + tuple((s.shape, str(s.dtype)) for s in shapes)
    if key not in _PROBED:
        try:
            jax.jit(local).lower(*shapes).compile()
            _PROBED[key] = None
        except Exception as e:  # noqa: BLE001 — any compiler error means "use the reference"
            first = (str(e).strip().splitlines() or [""])[0][:300]
            _PROBED[key] = f"the kernel failed to compile: {type(e).__name__}: {first}"
    return _PROBED[key]


# How a kernel argument is laid out under a (dp, tp) mesh: the mesh axis of each of its dimensions.
HEADS = ("dp", None, "tp", None)  # [B, ·, heads, H]: rows over dp, heads over tp
HEAD_VECTOR = ("tp",)  # [N]: per query head (attention sinks)


def rows(ndim: int) -> tuple:
    """[B, …]: rows over dp."""
    return ("dp",) + (None,) * (ndim - 1)


def unsharded(*args) -> tuple[tuple, ...]:
    """Layouts of arguments that are never split (kernels that run on one device only)."""
    return tuple((None,) * a.ndim for a in args)


def run_kernel(impl: str, op: str, key: tuple, local: Callable, reason_of: Callable, args: tuple,
               layouts: tuple[tuple, ...], once: bool = False, probe: bool = False) -> jax.Array | None:
    """``local(*args)`` through the kernel, per shard when traced under a mesh; None (after a log line) when
    the kernel cannot take these shapes (its own rules, or a failed compile) and the caller must use the
    reference. ``layouts``: per argument, the mesh axis of each dimension (:data:`HEADS`, :func:`rows` …); the
    result is laid out like the first argument. ``once``: the fallback's line once per process (an op
    traced in every branch of a ``lax.switch``), not at every trace. ``probe``: compile the kernel alone first
    (:func:`compile_probe`; the TPU kernels on a TPU).

    Under a ``(dp, tp)`` mesh (see :mod:`dflash_jax.sharding`) attention is independent per row and per KV
    head, so each device runs the kernel on its own rows and heads (``shard_map``): nothing is gathered.
    That needs the KV heads split like the query heads (K divisible by tp); otherwise the reference runs.
    """
    sizes = mesh_sizes()
    n_dp, n_tp = sizes.get("dp", 1), sizes.get("tp", 1)
    if set(sizes) - {"dp", "tp"}:
        why = f"mesh axes {tuple(sizes)} (kernels shard over 'dp' and 'tp' only)"
    elif any(d % sizes.get(axis, 1) for a, layout in zip(args, layouts) for d, axis in zip(a.shape, layout)
             if axis is not None):
        why = (f"arguments of shapes {[tuple(a.shape) for a in args]} do not split over tp={n_tp}, dp={n_dp} "
               f"(rows over dp, heads over tp)")
    else:
        shapes = tuple(jax.ShapeDtypeStruct(tuple(d // sizes.get(axis, 1) if axis else d
                                                  for d, axis in zip(a.shape, layout)), a.dtype)
                       for a, layout in zip(args, layouts))
        why = reason_of(*shapes)
        if why is None and probe:
            why = compile_probe((impl, op) + key, local, shapes)
    if why is not None:
        message = f"attention_impl={impl!r}: {op} uses the XLA reference for this shape ({why})"
        if once:
            warn_once(message)
        else:
            log.warning(message)
        return None
    if not sizes:
        return local(*args)
    specs = tuple(P(*(axis if axis in sizes else None for axis in layout)) for layout in layouts)
    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=specs[0],
                         check_vma=False)(*args)


def find_bucket(edges: Int[Array, "E"], values: Int[Array, "*n"], side: str = "left",
                tuning: KernelTuning = KernelTuning()) -> Int[Array, "*n"]:
    """``jnp.searchsorted(edges, values, side)`` without a loop.

    Searches inside a decode step avoid jnp.searchsorted's default, a binary search compiled as a loop: on a GPU
    each iteration is kernel launches, every step (~60 launches of a compact step at batch 64, which is
    launch-bound). One fused comparison of every value with every edge is cheapest while that is small
    (``tuning.compare_all_max`` comparisons); a sort (a few kernels, no loop) beyond (e.g. sampling tests'
    batches of thousands of rows)."""
    method = "compare_all" if edges.shape[-1] * values.size <= tuning.compare_all_max else "sort"
    return jnp.searchsorted(edges, values, side=side, method=method)
