"""Qwen3-MoE sparse MLP block: a top-k router over E SwiGLU experts whose weights are stacked.

Dimension letters: N tokens (the block flattens B·T), D model dim, E experts, F expert hidden, K experts per
token. Expert weights are stacked ``gate_proj``/``up_proj`` ``[E, D, F]`` and ``down_proj`` ``[E, F, D]`` so an
expert is an index on axis 0 and tensor parallelism can split F like the dense MLP's hidden.

Three equivalent expert computations in jnp (XLA-compiled), the references of the kernels:

* :func:`experts_gathered` takes only the routed experts' weights per token: what a decode or verify step
  wants (a few tokens: reading K weight sets per token beats reading all E);
* :func:`experts_dense` runs every expert on every token, unrouted ones weighted zero: E/K times the
  arithmetic, but each expert's weights are read once, in plain batched matmuls (prefill);
* :func:`experts_grouped` sorts the (token, expert) pairs by expert and runs ``lax.ragged_dot``: no wasted
  arithmetic, but XLA's ragged_dot was the slowest of the three for many tokens on the CPU and GPU.

Grouped Pallas kernels (:mod:`dflash_jax.cuda.moe` on GPUs, :mod:`dflash_jax.pallas.moe` on TPUs; same
signature) read each routed expert's weights once and never touch an unrouted one, from the pairs grouped by
:func:`group_pairs` (on GPUs a single token's pairs, distinct experts, run ungrouped:
``cuda.moe.pair_experts``). On the H200 XLA's paths were far from that: one token, ragged_dot 334 µs and the
gathered einsum 217 µs against a 13.9 µs bandwidth floor (issue 20).

:func:`experts_auto` runs the kernel on ``KERNELS_ON`` backends for calls of at most ``KERNEL_MAX_TOKENS``
tokens; otherwise it gathers while a call gathers no more weight sets than there are experts, and runs all
experts (or the grouped form on the backends of ``GROUPED_ON``) beyond that.

All of them take gpt-oss's variations as keywords: ``biases`` (per-expert gate, up and down biases) and ``act``
(the gated activation of the gate and up projections; Qwen3-MoE's SwiGLU by default).
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections import defaultdict
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.attention import compile_probe
from dflash_jax.config import CheckpointError, ModelConfig
from dflash_jax.models.layers import MLP, Dense, _normal, matmul


def route(x: Float[Array, "N D"], router: Float[Array, "D E"], k: int, normalize: bool
          ) -> tuple[Float[Array, "N K"], Int[Array, "N K"]]:
    """Top-k experts per token and their weights (in ``x``'s dtype).

    Logits in the model dtype, softmax in float32, top-k of the probabilities, renormalised to sum to one
    when ``normalize`` (``norm_topk_prob``): the order transformers uses, so bf16 routing matches too.
    """
    probs = jax.nn.softmax(matmul(x, router).astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), idx


def _swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    return jax.nn.silu(g) * u


# Per-expert biases (gpt-oss): gate [E, F], up [E, F], down [E, D].
Biases = tuple[Float[Array, "E F"], Float[Array, "E F"], Float[Array, "E D"]]


def _combine(y: Float[Array, "N K D"], weights: Float[Array, "N K"]) -> Float[Array, "N D"]:
    """Weight each expert's output, then sum over the K experts (weights applied after down_proj)."""
    return jnp.sum(y * weights[..., None], axis=1)


def experts_gathered(x: Float[Array, "N D"], weights: Float[Array, "N K"], idx: Int[Array, "N K"],
                     gate: Float[Array, "E D F"], up: Float[Array, "E D F"], down: Float[Array, "E F D"],
                     *, biases: Biases | None = None, act: Callable = _swiglu) -> Float[Array, "N D"]:
    """Gather the K routed experts' weights per token (``[N, K, D, F]``) and apply them: N·K weight sets."""
    g = jnp.einsum("nd,nkdf->nkf", x, jnp.take(gate, idx, axis=0))
    u = jnp.einsum("nd,nkdf->nkf", x, jnp.take(up, idx, axis=0))
    if biases is not None:
        g, u = g + jnp.take(biases[0], idx, axis=0), u + jnp.take(biases[1], idx, axis=0)
    y = jnp.einsum("nkf,nkfd->nkd", act(g, u), jnp.take(down, idx, axis=0))
    if biases is not None:
        y = y + jnp.take(biases[2], idx, axis=0)
    return _combine(y, weights)


def experts_grouped(x: Float[Array, "N D"], weights: Float[Array, "N K"], idx: Int[Array, "N K"],
                    gate: Float[Array, "E D F"], up: Float[Array, "E D F"], down: Float[Array, "E F D"],
                    *, biases: Biases | None = None, act: Callable = _swiglu) -> Float[Array, "N D"]:
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
    return _combine(y.reshape(n, k, -1), weights)


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
                  *, biases: Biases | None = None, act: Callable = _swiglu) -> Float[Array, "N D"]:
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


# Backends where calls of many tokens use experts_grouped rather than experts_dense. Measured (JAX 0.11,
# H200, E=128 K=8 D=2048 F=768 bf16, per call): 1024 tokens 13.1 ms grouped vs 2.4 ms dense, 64 tokens
# 0.97 vs 0.83 ms; the CPU showed the same order. TPUs lower ragged_dot natively and may do better there
# (unmeasured). Read at trace time.
GROUPED_ON: tuple[str, ...] = ()


# Backends whose decode-sized calls run the grouped kernels (cuda.moe on "gpu", pallas.moe on "tpu"), up to
# KERNEL_MAX_TOKENS tokens: they read each routed expert once, like experts_dense but without the unrouted
# ones; prefill keeps the XLA paths (the kernels' per-call layout costs grow with N·E there, and they are not
# tuned for compute-bound sizes). Float32 on a GPU keeps the XLA paths, as attention does, until measured.
# Read at trace time.
KERNELS_ON: tuple[str, ...] = ("gpu", "tpu")
KERNEL_MAX_TOKENS = 64

log = logging.getLogger("dflash_jax")


@functools.cache
def _log_once(level: int, message: str) -> None:
    log.log(level, message)


# Under a (dp, tp) mesh the kernels run per device (shard_map): token rows over dp, the experts' hidden F over
# tp (sharding.py's placement of the expert weights), per-device partial outputs summed over tp. The mesh axis
# of each dimension of x, weights, idx, gate, up, down and the three biases:
_LAYOUTS = (("dp", None), ("dp", None), ("dp", None), (None, None, "tp"), (None, None, "tp"), (None, "tp", None),
            (None, "tp"), (None, "tp"), (None, None))


def _mesh_sizes() -> dict[str, int]:
    """The axis sizes of the mesh being traced under ({} when none, or one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty or mesh.size == 1 else dict(zip(mesh.axis_names, mesh.axis_sizes))


def _per_device(args: tuple, sizes: dict[str, int]) -> tuple[tuple, str | None]:
    """Each argument's per-device shape under the mesh (``_LAYOUTS``), or why the arguments do not split."""
    if set(sizes) - {"dp", "tp"}:
        return (), f"mesh axes {tuple(sizes)} (the kernels split over 'dp' and 'tp' only)"
    if any(d % sizes.get(axis, 1) for a, layout in zip(args, _LAYOUTS) for d, axis in zip(a.shape, layout) if axis):
        return (), (f"{args[0].shape[0]} tokens / expert width {args[3].shape[-1]} do not split over "
                    f"dp={sizes.get('dp', 1)} / tp={sizes.get('tp', 1)}")
    return tuple(jax.ShapeDtypeStruct(tuple(d // sizes.get(axis, 1) if axis else d for d, axis in zip(a.shape, layout)),
                                      a.dtype) for a, layout in zip(args, _LAYOUTS)), None


def kernel_unsupported_reason(backend: str, x, weights, idx, gate, up, down, *, biases: Biases | None = None
                              ) -> str | None:
    """Why :func:`experts_auto` keeps the XLA paths for these arguments on ``backend`` (None: the kernel runs,
    per device under a mesh; on a TPU after it compiled on its own). Arrays or ShapeDtypeStructs."""
    if backend not in KERNELS_ON:
        return f"no MoE kernel for backend {backend!r} (KERNELS_ON = {KERNELS_ON})"
    if x.shape[0] > KERNEL_MAX_TOKENS:
        return f"{x.shape[0]} tokens > KERNEL_MAX_TOKENS = {KERNEL_MAX_TOKENS}"
    local, why = _per_device((x, weights, idx, gate, up, down, *(biases or ())), _mesh_sizes())
    if why is not None:
        return why
    if backend == "gpu":
        if jnp.dtype(x.dtype) == jnp.float32:
            return "float32 on GPU (the kernel is measured in bfloat16 only)"
        from dflash_jax.cuda import moe as mod
    elif backend == "tpu":
        from dflash_jax.pallas import moe as mod
    else:
        return f"no MoE kernel for backend {backend!r}"
    return mod.unsupported_reason(*local[:6], biases=tuple(local[6:]) or None)


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


def _act_key(act: Callable) -> tuple:
    if isinstance(act, functools.partial):
        return (_act_key(act.func), act.args, tuple(sorted(act.keywords.items())))
    return (getattr(act, "__module__", None), getattr(act, "__qualname__", repr(act)))


def _experts_kernel(x, weights, idx, gate, up, down, *, biases: Biases | None = None, act: Callable = _swiglu
                    ) -> jax.Array | None:
    """The grouped kernel's result, or None (after a log line where that is news) when the XLA paths must run."""
    backend = jax.default_backend()
    why = kernel_unsupported_reason(backend, x, weights, idx, gate, up, down, biases=biases)
    if why is None:
        if backend == "gpu":
            from dflash_jax.cuda.moe import grouped_experts
        else:
            from dflash_jax.pallas.moe import grouped_experts
        args = (x, weights, idx, gate, up, down, *(biases or ()))
        fn = lambda x, w, i, g, u, d, *b: grouped_experts(x, w, i, g, u, d, biases=tuple(b) or None,  # noqa: E731
                                                           act=act)
        sizes = _mesh_sizes()
        if backend == "tpu":
            # The TPU kernel has never met a real Mosaic compiler: compiled alone first (attention's probe).
            why = compile_probe(("moe", _act_key(act)), fn, _per_device(args, sizes)[0])
        if why is None:
            return _per_shard(fn, args, sizes) if sizes else fn(*args)
    if backend in KERNELS_ON and x.shape[0] <= KERNEL_MAX_TOKENS:
        _log_once(logging.WARNING if "compile" in why else logging.INFO,
                  f"MoE experts: XLA path instead of the {backend} kernel ({why})")
    return None


def _per_shard(fn: Callable, args: tuple, sizes: dict[str, int]) -> jax.Array:
    """``fn`` on each device's rows and slice of the experts' hidden, the slices' outputs summed over tp (in
    float32; the down-projection bias added by one tp shard only)."""
    from jax.sharding import PartitionSpec as P

    tp = sizes.get("tp", 1)

    def local(x, *rest):
        if tp > 1 and len(rest) == 8:  # biases: the down bias once, not once per shard
            rest = (*rest[:7], jnp.where(jax.lax.axis_index("tp") == 0, rest[7], jnp.zeros_like(rest[7])))
        y = fn(x, *rest)
        return jax.lax.psum(y.astype(jnp.float32), "tp").astype(y.dtype) if tp > 1 else y

    specs = tuple(P(*(axis if axis in sizes else None for axis in layout)) for layout in _LAYOUTS[:len(args)])
    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=specs[0],
                         check_vma=False)(*args)


def experts_auto(x, weights, idx, gate, up, down, **kw) -> jax.Array:
    """The grouped kernel where it applies (module docstring), else gathered while N·K ≤ E (it then reads at
    most as many weight sets as exist), else all experts.

    Shapes are static, so the choice is made at trace time: decode/verify steps of small batches gather,
    prefill and wide verify batches run every expert (H200, numbers above: 1 token 68 µs gathered vs 0.80 ms
    dense, 16 tokens 0.70 vs 0.80 ms).
    """
    out = _experts_kernel(x, weights, idx, gate, up, down, **kw)
    if out is not None:
        return out
    if math.prod(idx.shape) <= gate.shape[0]:
        return experts_gathered(x, weights, idx, gate, up, down, **kw)
    impl = experts_grouped if jax.default_backend() in GROUPED_ON else experts_dense
    return impl(x, weights, idx, gate, up, down, **kw)


class Experts(nnx.Module):
    """E SwiGLU experts, stacked: ``gate_proj``/``up_proj`` ``[E, D, F]``, ``down_proj`` ``[E, F, D]``."""

    def __init__(self, e: int, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(_normal(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.up_proj = nnx.Param(_normal(rngs, (e, d, f), 1.0 / math.sqrt(d), dtype))
        self.down_proj = nnx.Param(_normal(rngs, (e, f, d), 1.0 / math.sqrt(f), dtype))


class SparseMoE(nnx.Module):
    """Qwen3-MoE's sparse block: ``gate`` (the router, ``[D, E]``, no bias) and ``experts``.

    Qwen3.5-MoE / Qwen3-Next add a dense ``shared_expert`` (SwiGLU of width ``shared_expert_intermediate_size``) that
    every token runs, scaled by ``sigmoid(shared_expert_gate(x))`` (a ``[D, 1]`` projection, no bias).
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.gate = Dense(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg.hidden_size, shared, bias=False, dtype=dtype, rngs=rngs) if shared else None
        self.shared_expert_gate = Dense(cfg.hidden_size, 1, bias=False, dtype=dtype, rngs=rngs) if shared else None

    def __call__(self, x: Float[Array, "*b D"]) -> Float[Array, "*b D"]:
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = route(flat, self.gate.kernel[...], self.top_k, self.normalize)
        e = self.experts
        out = experts_auto(flat, weights, idx, e.gate_proj[...], e.up_proj[...], e.down_proj[...])
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF MoE expert tensors → one ``{base}.experts.{gate,up,down}_proj`` ``[E, out, in]`` each (in place).

    Accepts the per-expert ``experts.{e}.{gate,up,down}_proj.weight`` of the public Qwen3-MoE checkpoints
    (what ``save_pretrained`` writes too) and the fused ``experts.gate_up_proj`` ``[E, 2F, D]`` (gate rows
    first) / ``experts.down_proj`` ``[E, D, F]`` of transformers 5's in-memory layout; others are left alone.
    """
    groups: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for name in list(tensors):
        m = _EXPERT.match(name)
        if m:
            groups[m[1], m[3]][int(m[2])] = name
        elif name.endswith(".experts.gate_up_proj"):
            gate_up = tensors.pop(name)
            f = gate_up.shape[1] // 2
            base = name[: -len("gate_up_proj")]
            tensors[base + "gate_proj"], tensors[base + "up_proj"] = gate_up[:, :f], gate_up[:, f:]
    for (base, proj), names in groups.items():
        if sorted(names) != list(range(len(names))):
            raise CheckpointError(f"{base}.{proj}: experts {sorted(names)} are not numbered 0..{len(names) - 1}")
        tensors[f"{base}.{proj}"] = np.stack([tensors.pop(names[e]) for e in range(len(names))])
    return tensors
