"""TPU (Mosaic) grouped-expert MLP: the routed experts' SwiGLU for a few tokens, reading only the weights of
experts some token routed to.

Same semantics and signature as :func:`dflash_jax.kernels.moe.experts_gathered` (the jnp reference):
``x [N, D]``, routing ``weights``/``idx [N, K]``, experts ``gate``/``up [E, D, F]``, ``down [E, F, D]``,
optional gpt-oss ``biases`` and any elementwise ``act(g, u)`` (float32 here). P = N·K pairs.

Layout: the pairs are grouped by expert (:func:`dflash_jax.kernels.moe.group_pairs`); group g (one per routed
expert, G = min(E, P) static groups) gets its own tile of ``Mt`` = round_up(N, sublane tile) rows in
``xg [G, Mt, D]`` (a token routes an expert at most once, so N rows always suffice; unused rows are zeros).
A fixed tile per group keeps every block aligned — an expert-sorted packed layout would need tiles that
straddle groups and row masks, as in megablox's grouped matmul — at the cost of G·Mt·D bytes of
activations, small at decode sizes (N ≤ 64) next to the routed weights; prefill keeps the XLA paths.

Kernel: grid ``(G, F / block_f)``, ("parallel", "arbitrary"). The routed expert of each group and the
number of routed experts are scalar-prefetched; step (g, j) gets ``gate[e]``/``up[e]`` column block j
``[D, block_f]`` and ``down[e]`` row block j ``[block_f, D]``, computes ``act(x·gate, x·up)`` (float32) and
adds its ``[Mt, D]`` share of the down projection to a float32 VMEM accumulator; the last j writes the
group's output. So the fused MLP reads each routed expert's three matrices exactly once and the hidden
never leaves VMEM. Idle groups (g ≥ routed experts) skip all compute and their index maps repeat the block
of the last routed group's last step, so the pipeline issues no DMA for them: unrouted experts are never
read. ``block_f``: the largest multiple of 128 dividing F whose double-buffered weight blocks fit 8 MiB
(256 for D=2048 bf16), or F itself when F is not a multiple of 128.

Untested on real TPUs (none available to us): tested in TPU interpret mode and lowered to Mosaic for
platform "tpu" on CPU; performance and VMEM sizing unverified. ``experts_auto`` therefore compiles each
shape on its own first and falls back to the jnp path if Mosaic refuses it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dflash_jax.kernels.common import compile_probe, log_once, native
from dflash_jax.kernels.moe import Biases, argument_reason, combine, group_pairs, run_grouped, swiglu
from dflash_jax.pallas.common import Interpret, interpret_arg, round_up, sublanes
from dflash_jax.tuning import Kernels

__all__ = ["grouped_experts", "unsupported_reason"]

_LANES = 128
_WEIGHT_VMEM_BUDGET = 8 * 2**20  # bytes for the double-buffered gate, up and down blocks
_VMEM_HARD_LIMIT = 48 * 2**20
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _block_f(d: int, f: int, dtype: Any) -> int:
    per_col = 2 * 3 * d * jnp.dtype(dtype).itemsize  # gate + up columns and down rows, double-buffered
    fits = [b for b in range(_LANES, f + 1, _LANES) if f % b == 0 and b * per_col <= _WEIGHT_VMEM_BUDGET]
    return max(fits) if fits else (f if f % _LANES else _LANES)


def _vmem_bytes(mt: int, d: int, bf: int, dtype: Any) -> int:
    isz = jnp.dtype(dtype).itemsize
    weights = 2 * 3 * d * bf * isz
    rows = 2 * 2 * mt * d * isz + mt * d * 4  # x and output blocks (double-buffered), accumulator
    temps = 3 * round_up(mt, 8) * round_up(bf, _LANES) * 4 + round_up(mt, 8) * d * 4
    return weights + rows + temps


def _kernel(expert_ref, active_ref, x_ref, g_ref, u_ref, d_ref, *refs, act: Callable, has_bias: bool, nf: int):
    # Blocks: x (Mt, D); gate/up (D, bf); down (bf, D); [bias_g, bias_u (1, bf); bias_d (1, D)]; out (Mt, D);
    # scratch acc (Mt, D) float32. expert [G], active [1] in SMEM.
    *bias_refs, o_ref, acc_ref = refs
    g, j = pl.program_id(0), pl.program_id(1)

    @pl.when(g < active_ref[0])
    def _():
        x = x_ref[...]
        hg = jnp.dot(x, g_ref[...], preferred_element_type=jnp.float32)
        hu = jnp.dot(x, u_ref[...], preferred_element_type=jnp.float32)
        if has_bias:
            hg, hu = hg + bias_refs[0][...].astype(jnp.float32), hu + bias_refs[1][...].astype(jnp.float32)
        h = act(hg, hu).astype(d_ref.dtype)
        part = jnp.dot(h, d_ref[...], preferred_element_type=jnp.float32)

        @pl.when(j == 0)
        def _():
            acc_ref[...] = part

        @pl.when(j > 0)
        def _():
            acc_ref[...] += part

        @pl.when(j == nf - 1)
        def _():
            out = acc_ref[...]
            if has_bias:
                out = out + bias_refs[2][...].astype(jnp.float32)
            o_ref[...] = out.astype(o_ref.dtype)


def unsupported_reason(x, weights, idx, gate, up, down, *, biases: Biases | None = None, interpret: Interpret = None,
                       block_f: int | None = None, vmem_limit_bytes: int | None = None, **_: object) -> str | None:
    """Why :func:`grouped_experts` cannot run these arguments as a Mosaic kernel here, or None. Arrays or
    ShapeDtypeStructs; Mosaic may still refuse a shape (compile it first, as ``experts_auto`` does)."""
    why = argument_reason(x, weights, idx, gate, up, down, biases, _SUPPORTED_DTYPES)
    if why is not None:
        return why
    (n, d), f = x.shape, gate.shape[2]
    bf = block_f or _block_f(d, f, x.dtype)
    if f % bf or (bf != f and bf % _LANES):
        return f"block_f={bf} must divide F={f} and be a multiple of {_LANES} (or F)"
    if interpret_arg(interpret):
        return None
    need, limit = _vmem_bytes(round_up(n, sublanes(x.dtype)), d, bf, x.dtype), vmem_limit_bytes or _VMEM_HARD_LIMIT
    if need > limit:
        return f"estimated VMEM {need / 2**20:.1f} MiB > {limit / 2**20:.0f} MiB (lower block_f)"
    if jax.default_backend() != "tpu":
        return f"Mosaic kernels need a TPU backend (have {jax.default_backend()!r}; pass interpret=...)"
    return None


def grouped_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                    down: jax.Array, *, biases: Biases | None = None, act: Callable = swiglu,
                    block_f: int | None = None, vmem_limit_bytes: int | None = None,
                    interpret: Interpret = None) -> jax.Array:
    """The routed experts' MLP of :func:`dflash_jax.kernels.moe.experts_gathered` as one Mosaic kernel that reads
    only routed experts' weights (module docstring). Not jitted itself (``act`` may be a fresh closure each
    call): call it inside a jitted program. ``interpret``: ``pltpu.InterpretParams()`` (or True) on CPU."""
    n, k = idx.shape
    e, d, f = gate.shape
    groups = min(e, n * k)
    mt = round_up(n, sublanes(x.dtype))
    bf = block_f or _block_f(d, f, x.dtype)
    nf = f // bf
    grp = group_pairs(idx, e)
    slot = grp.group * mt + grp.rank  # each pair's row in its group's tile
    xg = jnp.zeros((groups * mt, d), x.dtype).at[slot].set(jnp.repeat(x, k, axis=0)).reshape(groups, mt, d)

    # Idle groups (g >= active) repeat the last routed group's last blocks: no DMA is issued for them.
    def rows_map(g, j, expert_ref, active_ref):
        return jnp.minimum(g, active_ref[0] - 1), 0, 0

    def col_block(g, j, active_ref):
        return jnp.where(g < active_ref[0], j, nf - 1)

    def gate_map(g, j, expert_ref, active_ref):
        return expert_ref[g], 0, col_block(g, j, active_ref)

    def down_map(g, j, expert_ref, active_ref):
        return expert_ref[g], col_block(g, j, active_ref), 0

    def expert_map(g, j, expert_ref, active_ref):
        return expert_ref[g], 0, 0

    in_specs = [pl.BlockSpec((None, mt, d), rows_map), pl.BlockSpec((None, d, bf), gate_map),
                pl.BlockSpec((None, d, bf), gate_map), pl.BlockSpec((None, bf, d), down_map)]
    bias_args = []
    if biases is not None:  # [E, 1, ·]: blocks whose last two dims are legal Mosaic tiles
        bias_args = [biases[0][:, None, :], biases[1][:, None, :], biases[2][:, None, :]]
        in_specs += [pl.BlockSpec((None, 1, bf), gate_map), pl.BlockSpec((None, 1, bf), gate_map),
                     pl.BlockSpec((None, 1, d), expert_map)]
    out = pl.pallas_call(
        functools.partial(_kernel, act=act, has_bias=biases is not None, nf=nf),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(groups, nf), in_specs=in_specs,
            # Idle groups write their own (unread) tile, so "parallel" cores never share an output block.
            out_specs=pl.BlockSpec((None, mt, d), lambda g, j, *_: (g, 0, 0)),
            scratch_shapes=[pltpu.VMEM((mt, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((groups, mt, d), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret_arg(interpret),
        name="dflash_moe_experts",
    )(grp.expert, grp.n_active[None], xg, gate, up, down, *bias_args)
    return combine(out.reshape(groups * mt, d)[slot].reshape(n, k, d), weights)


def experts_kernel(x, weights, idx, gate, up, down, *, biases: Biases | None = None, act: Callable = swiglu,
                   kernels: Kernels, quant=None) -> jax.Array | None:
    """The entry of the kernel dispatch (op ``"moe_experts"``): :func:`grouped_experts` (interpret mode off a TPU;
    on a TPU compiled alone first — it has never met a real Mosaic compiler), per device under a mesh, or None
    where the XLA paths must run (quantized experts too: the kernel reads float weights)."""
    if quant is not None:
        log_once("MoE experts: quantized experts take the XLA path (the TPU grouped kernel reads float weights)")
        return None
    interp = None if native("pallas") else pltpu.InterpretParams()
    return run_grouped("pallas", functools.partial(grouped_experts, interpret=interp),
                       functools.partial(unsupported_reason, interpret=interp), x, weights, idx, gate, up, down,
                       biases=biases, act=act, probe=compile_probe if native("pallas") else None)
