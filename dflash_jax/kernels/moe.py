"""The routed experts' MLP of a sparse MoE block: its jnp forms (the references) and the dispatch to the grouped
kernels.

Dimension letters: N tokens, D model dim, E experts, F expert hidden, K experts per token. Expert weights are
stacked ``gate``/``up`` ``[E, D, F]`` and ``down`` ``[E, F, D]``.

Three equivalent expert computations in jnp (XLA-compiled), the references of the kernels:

* :func:`experts_gathered` takes only the routed experts' weights per token: what a decode or verify step
  wants (a few tokens: reading K weight sets per token beats reading all E);
* :func:`experts_dense` runs every expert on every token, unrouted ones weighted zero: E/K times the
  arithmetic, but each expert's weights are read once, in plain batched matmuls (prefill);
* :func:`experts_grouped` sorts the (token, expert) pairs by expert and runs ``lax.ragged_dot``: no wasted
  arithmetic, but XLA's ragged_dot was the slowest of the three for many tokens on the CPU and GPU.

Grouped Pallas kernels (op ``"moe_experts"`` of :mod:`dflash_jax.kernels.dispatch`: :mod:`dflash_jax.cuda.moe`
under ``impl="cuda"``, :mod:`dflash_jax.pallas.moe` under ``"pallas"``; same signature) read each routed
expert's weights once and never touch an unrouted one, from the pairs grouped by :func:`group_pairs`. On a
GPU XLA's paths were far from that: at one token ragged_dot took ~24× and the gathered einsum ~16× the time
the routed weights' bytes take to stream.

:func:`experts_auto` runs the kernel of ``kernels.impl`` on the backends of ``kernels.tuning.moe_kernels_on``
(or any, with ``kernels.tuning.interpret``) for calls of at most ``moe_kernel_max_tokens`` tokens; otherwise
it gathers while a call gathers no more weight sets than there are experts, and runs all experts (or the
grouped form on the backends of ``moe_grouped_on``) beyond that.

All of them take gpt-oss's variations as keywords: ``biases`` (per-expert gate, up and down biases) and ``act``
(the gated activation of the gate and up projections; Qwen3-MoE's SwiGLU by default).

Quantized experts (``quant``, :class:`ExpertScales`): ``gate``/``up``/``down`` hold int8 / fp8 values, each expert
with its own float32 block scales (``[E, nbi, nbo]``, the layout of :mod:`dflash_jax.quant.scheme` per expert).
:func:`experts_gathered` gathers the routed experts' quantized values (1 byte a weight) and scales the partial
products as :func:`dflash_jax.kernels.quantized.reference` does; beyond decode sizes :func:`experts_auto` runs
every expert, a few at a time (:func:`experts_dense_quantized`: at most ``moe_dense_quantized_step_bytes`` of
converted values at a time, never the whole float stack). The GPU kernel (:mod:`dflash_jax.cuda.moe`) takes
quantized experts at decode sizes, and larger calls with ``moe_quantized_sorted``; the TPU kernel declines them
(the references run).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from dflash_jax.kernels.common import log_once, mesh_sizes
from dflash_jax.kernels.dispatch import kernel
from dflash_jax.kernels.quantized import reference as quantized_reference
from dflash_jax.tuning import Kernels


def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """Qwen3-MoE's gated activation: ``silu(gate) · up``."""
    return jax.nn.silu(g) * u


# Per-expert biases (gpt-oss): gate [E, F], up [E, F], down [E, D].
Biases = tuple[Float[Array, "E F"], Float[Array, "E F"], Float[Array, "E D"]]


class ExpertScales(NamedTuple):
    """The scales of quantized experts: ``gate``/``up`` ``[E, nbi, nbo]`` over each expert's ``[D, F]`` values in
    blocks of ``gate_up_block`` (rows, columns: integers), ``down`` over ``[F, D]`` in blocks of ``down_block``."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_up_block: tuple[int, int]
    down_block: tuple[int, int]


def scaled_expert_dot(h: Float[Array, "N K I"], w: jax.Array, s: Float[Array, "N K nbi nbo"],
                      block: tuple[int, int]) -> Float[Array, "N K O"]:
    """``h @ dequantize(w, s)`` per (token, slot) for the gathered values ``w [N, K, I, O]`` (int8 / fp8) and their
    scales: the values converted to ``h``'s dtype as a dot operand, products in float32 scaled per output column
    (and per row block, summed, when the scales have several), in ``h``'s dtype."""
    n, k, i = h.shape
    o = w.shape[-1]
    bi, bo = block
    nbi = s.shape[-2]
    cols = jnp.repeat(s.astype(jnp.float32), bo, axis=-1)[..., :o] if bo > 1 else s.astype(jnp.float32)
    wv = w.astype(h.dtype)
    if nbi == 1:
        y = jnp.einsum("nki,nkio->nko", h, wv, preferred_element_type=jnp.float32) * cols[:, :, 0]
        return y.astype(h.dtype)
    pad = nbi * bi - i
    hb = jnp.pad(h, ((0, 0), (0, 0), (0, pad))).reshape(n, k, nbi, bi)
    wb = jnp.pad(wv, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(n, k, nbi, bi, o)
    partial = jnp.einsum("nkbi,nkbio->nkbo", hb, wb, preferred_element_type=jnp.float32)
    return jnp.sum(partial * cols, axis=2).astype(h.dtype)


def combine(y: Float[Array, "N K D"], weights: Float[Array, "N K"]) -> Float[Array, "N D"]:
    """Weight each expert's output, then sum over the K experts (weights applied after down_proj)."""
    return jnp.sum(y * weights[..., None], axis=1)


def experts_gathered(x: Float[Array, "N D"], weights: Float[Array, "N K"], idx: Int[Array, "N K"],
                     gate: Float[Array, "E D F"], up: Float[Array, "E D F"], down: Float[Array, "E F D"],
                     *, biases: Biases | None = None, act: Callable = swiglu, quant: ExpertScales | None = None
                     ) -> Float[Array, "N D"]:
    """Gather the K routed experts' weights per token (``[N, K, D, F]``) and apply them: N·K weight sets
    (quantized: their int8 / fp8 values and scales, module docstring)."""
    if quant is None:
        g = jnp.einsum("nd,nkdf->nkf", x, jnp.take(gate, idx, axis=0))
        u = jnp.einsum("nd,nkdf->nkf", x, jnp.take(up, idx, axis=0))
    else:
        xk = jnp.broadcast_to(x[:, None], (*idx.shape, x.shape[-1]))
        g = scaled_expert_dot(xk, jnp.take(gate, idx, axis=0), jnp.take(quant.gate, idx, axis=0), quant.gate_up_block)
        u = scaled_expert_dot(xk, jnp.take(up, idx, axis=0), jnp.take(quant.up, idx, axis=0), quant.gate_up_block)
    if biases is not None:
        g, u = g + jnp.take(biases[0], idx, axis=0), u + jnp.take(biases[1], idx, axis=0)
    if quant is None:
        y = jnp.einsum("nkf,nkfd->nkd", act(g, u), jnp.take(down, idx, axis=0))
    else:
        y = scaled_expert_dot(act(g, u), jnp.take(down, idx, axis=0), jnp.take(quant.down, idx, axis=0),
                              quant.down_block)
    if biases is not None:
        y = y + jnp.take(biases[2], idx, axis=0)
    return combine(y, weights)


def experts_grouped(x: Float[Array, "N D"], weights: Float[Array, "N K"], idx: Int[Array, "N K"],
                    gate: Float[Array, "E D F"], up: Float[Array, "E D F"], down: Float[Array, "E F D"],
                    *, biases: Biases | None = None, act: Callable = swiglu) -> Float[Array, "N D"]:
    """Sort the N·K (token, expert) pairs by expert and run one ragged matmul per projection."""
    n, k = idx.shape
    flat = idx.reshape(n * k)
    order = jnp.argsort(flat, stable=True)  # pair positions grouped by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # [E] pairs per expert
    xs = jnp.take(x, order // k, axis=0)  # [N·K, D] each pair's token
    g, u = jax.lax.ragged_dot(xs, gate, sizes), jax.lax.ragged_dot(xs, up, sizes)
    if biases is not None:
        expert = flat[order]  # [N·K] each sorted pair's expert
        g, u = g + jnp.take(biases[0], expert, axis=0), u + jnp.take(biases[1], expert, axis=0)
    ys = jax.lax.ragged_dot(act(g, u), down, sizes)  # [N·K, D] in expert order
    if biases is not None:
        ys = ys + jnp.take(biases[2], expert, axis=0)
    y = jnp.zeros_like(ys).at[order].set(ys)  # back to (token, slot) order
    return combine(y.reshape(n, k, -1), weights)


class PairGroups(NamedTuple):
    """The P = N·K (token, expert) pairs grouped by expert, for the grouped kernels; G = min(E, P) groups (a
    static bound on the routed experts), one per routed expert in ascending expert order."""

    pos: jax.Array  # [P] pair p's row in the expert-sorted order (stable: tokens ascending within an expert)
    rank: jax.Array  # [P] pair p's index among its expert's pairs (< N: a token routes an expert once)
    group: jax.Array  # [P] pair p's group
    expert: jax.Array  # [G] group g's expert; groups g >= n_active repeat the last routed expert
    start: jax.Array  # [G] group g's first sorted row
    count: jax.Array  # [G] group g's pairs (0 for g >= n_active)
    n_active: jax.Array  # [] int32: routed experts (>= 1)


# Up to this many pairs the stable sort rank is a [P, P] comparison (one fused reduction, no sort kernel:
# decode and verify steps); above it an argsort.
_PAIRWISE_MAX = 1024


def group_pairs(idx: Int[Array, "N K"], num_experts: int, *, pairwise_max: int = _PAIRWISE_MAX) -> PairGroups:
    """Group the (token, expert) pairs of ``idx`` (pair p = token p // K, slot p % K) by expert."""
    p = math.prod(idx.shape)
    flat = idx.reshape(p).astype(jnp.int32)
    counts = jnp.sum(flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)
    offsets = jnp.cumsum(counts) - counts  # [E] first sorted row of each expert
    if p <= pairwise_max:  # earlier pairs of the same expert
        q = jnp.arange(p)
        rank = jnp.sum((flat[None, :] == flat[:, None]) & (q[None, :] < q[:, None]), axis=1, dtype=jnp.int32)
        pos = offsets[flat] + rank
    else:
        pos = jnp.zeros(p, jnp.int32).at[jnp.argsort(flat, stable=True)].set(jnp.arange(p, dtype=jnp.int32))
        rank = pos - offsets[flat]
    routed = counts > 0
    gid = jnp.cumsum(routed, dtype=jnp.int32) - 1  # [E] each routed expert's group
    g = min(num_experts, p)
    n_active = gid[-1] + 1
    expert = jnp.zeros(g, jnp.int32).at[jnp.where(routed, gid, g)].set(
        jnp.arange(num_experts, dtype=jnp.int32), mode="drop")
    live = jnp.arange(g) < n_active
    expert = jnp.where(live, expert, expert[n_active - 1])  # idle groups point at blocks already fetched
    return PairGroups(pos=pos, rank=rank, group=gid[flat], expert=expert, start=offsets[expert],
                      count=jnp.where(live, counts[expert], 0), n_active=n_active)


def experts_dense(x: Float[Array, "N D"], weights: Float[Array, "N K"], idx: Int[Array, "N K"],
                  gate: Float[Array, "E D F"], up: Float[Array, "E D F"], down: Float[Array, "E F D"],
                  *, biases: Biases | None = None, act: Callable = swiglu) -> Float[Array, "N D"]:
    """Every expert on every token, unrouted experts weighted zero (E/K times the arithmetic).

    The routing weights scale the hidden ``[N, E, F]`` before down_proj (the same sum by linearity), so no
    ``[N, E, D]`` tensor is ever made; the down biases enter as ``dense_w @ down_bias`` likewise.
    """
    dense_w = jnp.sum(jax.nn.one_hot(idx, gate.shape[0], dtype=x.dtype) * weights[..., None], axis=1)  # [N, E]
    g, u = jnp.einsum("nd,edf->nef", x, gate), jnp.einsum("nd,edf->nef", x, up)
    if biases is not None:
        g, u = g + biases[0], u + biases[1]
    out = jnp.einsum("nef,efd->nd", act(g, u) * dense_w[..., None], down)
    return out if biases is None else out + jnp.einsum("ne,ed->nd", dense_w, biases[2])


def experts_dense_quantized(x: Float[Array, "N D"], weights: Float[Array, "N K"], idx: Int[Array, "N K"],
                            gate: jax.Array, up: jax.Array, down: jax.Array, *, quant: ExpertScales,
                            biases: Biases | None = None, act: Callable = swiglu,
                            step_bytes: int = 0) -> Float[Array, "N D"]:
    """Every expert on every token, unrouted ones weighted zero, for quantized experts: G experts at a time (a
    scan over E / G steps, the G experts of a step batched), each product :func:`dflash_jax.kernels.quantized.
    reference` of an expert's values and scales, so at most G experts' values are ever converted; the weighted
    outputs summed in float32. G is the largest divisor of E whose experts' converted weights fit ``step_bytes``
    (at least 1; 0: one expert a step). One expert a step made a 16-row verify of the Qwen3-30B-A3B shape 6,144
    loop iterations of small dots (benchmarks/README.md, "Quantized targets")."""
    e = gate.shape[0]
    dense_w = jnp.sum(jax.nn.one_hot(idx, e, dtype=x.dtype) * weights[..., None], axis=1)  # [N, E]
    bias = biases if biases is not None else (jnp.zeros(gate.shape[::2], x.dtype),) * 2 + (
        jnp.zeros((e, x.shape[-1]), x.dtype),)
    per_expert = (2 * math.prod(gate.shape[1:]) + math.prod(down.shape[1:])) * jnp.dtype(x.dtype).itemsize
    g_n = max([g for g in range(1, e + 1) if e % g == 0 and g * per_expert <= step_bytes] or [1])

    def expert(g_e, u_e, d_e, sg, su, sd, bg, bu, bd, w_e):
        g = quantized_reference(x, g_e, sg, quant.gate_up_block, x.dtype) + bg
        u = quantized_reference(x, u_e, su, quant.gate_up_block, x.dtype) + bu
        y = quantized_reference(act(g, u), d_e, sd, quant.down_block, x.dtype) + bd
        return y.astype(jnp.float32) * w_e[:, None].astype(jnp.float32)

    def step(acc, xs):
        return acc + jnp.sum(jax.vmap(expert)(*xs), axis=0), None

    xs = (gate, up, down, quant.gate, quant.up, quant.down, *bias, dense_w.T)
    xs = tuple(a.reshape(e // g_n, g_n, *a.shape[1:]) for a in xs)  # [E / G, G, ...]
    out, _ = jax.lax.scan(step, jnp.zeros(x.shape, jnp.float32), xs)
    return out.astype(x.dtype)


# Under a (dp, tp) mesh the kernels run per device (shard_map): token rows over dp, the experts' hidden F over
# tp (sharding.py's placement of the expert weights), per-device partial outputs summed over tp. The mesh axis
# of each dimension of x, weights, idx, gate, up, down and the three biases:
LAYOUTS = (("dp", None), ("dp", None), ("dp", None), (None, None, "tp"), (None, None, "tp"), (None, "tp", None),
            (None, "tp"), (None, "tp"), (None, None))


def per_device(args: tuple, sizes: dict[str, int]) -> tuple[tuple, str | None]:
    """Each argument's per-device shape under the mesh (``LAYOUTS``), or why the arguments do not split."""
    if set(sizes) - {"dp", "tp"}:
        return (), f"mesh axes {tuple(sizes)} (the kernels split over 'dp' and 'tp' only)"
    if any(d % sizes.get(axis, 1) for a, layout in zip(args, LAYOUTS) for d, axis in zip(a.shape, layout) if axis):
        return (), (f"{args[0].shape[0]} tokens / expert width {args[3].shape[-1]} do not split over "
                    f"dp={sizes.get('dp', 1)} / tp={sizes.get('tp', 1)}")
    return tuple(jax.ShapeDtypeStruct(tuple(d // sizes.get(axis, 1) if axis else d for d, axis in zip(a.shape, layout)),
                                      a.dtype) for a, layout in zip(args, LAYOUTS)), None


def argument_reason(x, weights, idx, gate, up, down, biases: Biases | None, dtypes: tuple) -> str | None:
    """Why these arrays (or ShapeDtypeStructs) are not a grouped-experts call any kernel takes (None when they
    are): the shape and dtype rules the GPU and TPU kernels share."""
    if x.ndim != 2 or idx.ndim != 2 or gate.ndim != 3:
        return "expected x [N, D], idx [N, K], gate [E, D, F]"
    (n, d), (e, _, f) = x.shape, gate.shape
    if gate.shape != (e, d, f) or up.shape != gate.shape or down.shape != (e, f, d) or weights.shape != idx.shape:
        return "expert / routing shapes do not match x"
    if idx.shape[0] != n or n < 1 or not 1 <= idx.shape[1] <= e:
        return f"idx {idx.shape} does not route N={n} tokens to at most E={e} experts"
    if jnp.dtype(x.dtype) not in dtypes:
        return f"dtype {jnp.dtype(x.dtype)} is not one of {', '.join(str(t) for t in dtypes)}"
    if any(jnp.dtype(a.dtype) != jnp.dtype(x.dtype) for a in (gate, up, down)):
        return "x and expert weight dtypes differ"
    if biases is not None and (biases[0].shape != (e, f) or biases[1].shape != (e, f) or biases[2].shape != (e, d)):
        return "bias shapes do not match the experts"
    return None


def act_key(act: Callable) -> tuple:
    if isinstance(act, functools.partial):
        return (act_key(act.func), act.args, tuple(sorted(act.keywords.items())))
    return (getattr(act, "__module__", None), getattr(act, "__qualname__", repr(act)))


def per_shard(fn: Callable, args: tuple, sizes: dict[str, int]) -> jax.Array:
    """``fn`` on each device's rows and slice of the experts' hidden, the slices' outputs summed over tp (in
    float32; the down-projection bias added by one tp shard only)."""
    tp = sizes.get("tp", 1)

    def local(x, *rest):
        if tp > 1 and len(rest) == 8:  # biases: the down bias once, not once per shard
            rest = (*rest[:7], jnp.where(jax.lax.axis_index("tp") == 0, rest[7], jnp.zeros_like(rest[7])))
        y = fn(x, *rest)
        return jax.lax.psum(y.astype(jnp.float32), "tp").astype(y.dtype) if tp > 1 else y

    specs = tuple(P(*(axis if axis in sizes else None for axis in layout)) for layout in LAYOUTS[:len(args)])
    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=specs[0],
                         check_vma=False)(*args)


def kernel_unsupported_reason(kernels: Kernels, x, weights, idx, gate, up, down, *, biases: Biases | None = None,
                              quantized: bool = False) -> str | None:
    """Why :func:`experts_auto` does not hand these arguments to a kernel at all under ``kernels`` (None: the
    kernel of ``kernels.impl`` is asked, which may still decline: its own rules, a mesh the arguments do not
    split over, a failed compile). Arrays or ShapeDtypeStructs."""
    backend, tuning = jax.default_backend(), kernels.tuning
    if kernel("moe_experts", kernels) is None:
        return f"no MoE kernel for attention_impl={kernels.impl!r}"
    if backend not in tuning.moe_kernels_on and not tuning.interpret:
        return f"backend {backend!r} not in moe_kernels_on = {tuning.moe_kernels_on}"
    if x.shape[0] > tuning.moe_kernel_max_tokens and not (quantized and tuning.moe_quantized_sorted):
        return f"{x.shape[0]} tokens > moe_kernel_max_tokens = {tuning.moe_kernel_max_tokens}"
    return None


def run_grouped(impl: str, grouped: Callable, reason: Callable, x, weights, idx, gate, up, down, *,
                biases: Biases | None, act: Callable, probe: Callable | None = None) -> jax.Array | None:
    """A grouped kernel's run for the kernel entries (:mod:`dflash_jax.cuda.moe`, :mod:`dflash_jax.pallas.moe`):
    ``grouped(x, weights, idx, gate, up, down, biases=, act=)`` per device under a mesh, or None (its line
    logged once) where ``reason(*per-device shapes)`` or the mesh says no, or where ``probe(key, fn, shapes)``
    (a compile probe) fails."""
    args = (x, weights, idx, gate, up, down, *(biases or ()))
    sizes = mesh_sizes()
    local, why = per_device(args, sizes)
    if why is None:
        why = reason(*local[:6], biases=tuple(local[6:]) or None)
    fn = lambda x, w, i, g, u, d, *b: grouped(x, w, i, g, u, d, biases=tuple(b) or None, act=act)  # noqa: E731
    if why is None and probe is not None:
        why = probe(("moe", act_key(act)), fn, local)
    if why is not None:
        log_once(f"MoE experts: XLA path instead of the {impl} kernel ({why})",
                 logging.WARNING if "compile" in why else logging.INFO)
        return None
    return per_shard(fn, args, sizes) if sizes else fn(*args)


def experts_auto(x, weights, idx, gate, up, down, *, kernels: Kernels = Kernels(), **kw) -> jax.Array:
    """The grouped kernel where it applies (module docstring), else gathered while N·K ≤ E (it then reads at
    most as many weight sets as exist), else all experts. ``kw``: ``biases``, ``act``, ``quant`` (quantized
    experts' scales: a kernel that does not take them declines; all experts then run one at a time).

    Shapes are static, so the choice is made at trace time: decode/verify steps of small batches gather,
    prefill and wide verify batches run every expert (on a GPU: at 1 token gathering takes a twelfth of the
    dense time, at 16 tokens still ~13 % less).
    """
    if kernel_unsupported_reason(kernels, x, weights, idx, gate, up, down, biases=kw.get("biases"),
                                 quantized=kw.get("quant") is not None) is None:
        out = kernel("moe_experts", kernels)(x, weights, idx, gate, up, down, kernels=kernels, **kw)
        if out is not None:
            return out
    if math.prod(idx.shape) <= gate.shape[0]:
        return experts_gathered(x, weights, idx, gate, up, down, **kw)
    if kw.get("quant") is not None:
        return experts_dense_quantized(x, weights, idx, gate, up, down,
                                       step_bytes=kernels.tuning.moe_dense_quantized_step_bytes, **kw)
    kw.pop("quant", None)
    grouped = jax.default_backend() in kernels.tuning.moe_grouped_on
    return (experts_grouped if grouped else experts_dense)(x, weights, idx, gate, up, down, **kw)
