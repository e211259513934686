"""GPU gated delta rule over a short block (Pallas → Triton): a Gated DeltaNet layer's decode step, verify block
or short prompt in one launch, instead of XLA's ~15 small kernels per layer.

Same math as :func:`dflash_jax.kernels.delta_rule.delta_rule_block` and :func:`~dflash_jax.kernels.
delta_rule.state_after` (read their docstrings). Letters: B rows, T tokens (≤ :data:`MAX_T`), Hk key heads,
Hv value heads (r = Hv / Hk per key head; value head h reads key head h // r), Dk key width, Dv value width, BV
the value columns a program owns. Per value head the state ``S [Dk, Dv]`` (float32) takes, token by token::

    S ← exp(g_t)·S;   δ_t = β_t·(v_t − Sᵀk_t);   S ← S + k_t δ_tᵀ;   o_t = Sᵀq_t

with q, k L2-normalised (``x·rsqrt(Σx² + 1e-6)``, float32) and q scaled by Dk^-½.

Why: at decode sizes the block form (cumsum, decay matrix, a cuBLAS ``trsm`` with its pointer set-up kernels and
copies when T > 1, several batched dots) plus the l2norm / repeat of the key heads before it is ~15 XLA kernels
of a few µs each, per linear layer (24 of them in Qwen3.5-9B), on data of a few MiB: launch-bound, not
bandwidth-bound. Here the whole recurrence is one kernel.

Design:

* **A program owns (row b, value head h, value tile j)**, grid ``(B, Hv, Dv / BV)``: the state columns
  ``S[:, j·BV : (j+1)·BV]`` as one ``[Dk, BV]`` float32 tile in registers for the whole block (Dk 128 × BV 32 is
  16 KiB: 32 registers a thread at 4 warps). The recurrence never mixes value columns (``Sᵀk`` and ``Sᵀq``
  reduce over Dk only), so tiles are independent: no communication, the state read once and (advance mode)
  written once. At batch 1 Qwen3.5-9B's shape is 32 heads × 4 tiles = 128 programs, about one per SM.
* **Tokens unrolled at trace time** (a Python loop, T ≤ :data:`MAX_T`): each token's loads (q and k of its key
  head, its v columns, g, β) depend on nothing the recurrence computes, so the compiler can issue them all up
  front and the sequential part is register arithmetic. No ``scf.for`` carries the tile.
* **No tensor cores:** per token ``Sᵀk`` and ``Sᵀq`` are matrix-vector products: an elementwise multiply of the
  tile by a broadcast column and a sum over axis 0 (Dk); the update is a broadcast outer product. Nothing here
  would fill a ``tl.dot`` tile (16 rows), and everything stays IEEE float32 whatever the matmul precision (the
  XLA path's batched dots follow it: TF32 by default on GPUs).
* **The prologue absorbed:** q and k are read per *key* head straight from the layer's conv output (packed
  per key head as ``[q | k | r·v]``: :func:`packed_delta_rule_block`) and normalised and scaled in float32 in
  the program, so neither the normalised copies nor their repeat to value heads exist in memory. The r·Dv/BV
  programs of a key head each redo its normalisation: Dk multiply-adds and one reduction per token, small next
  to the tile's three passes.
* **Two modes** (static ``advance``):

  - *record* (a deferred verify): writes ``out``, ``cum`` (cumulative g, by the tile-0 programs), ``v_new = δ``
    and the normalised k per key head (by value head kh·r's tile-0 programs) — what
    :func:`~dflash_jax.kernels.delta_rule.state_after` needs to form the state after any prefix, once the
    accepted length is known (it takes k per key head as well as per value head);
  - *advance* (a decode step, a short prompt): writes ``out`` and the state after ``lengths[b]`` tokens (all T
    when None), so no ``state_after`` einsum follows. Tokens at or past a row's length are identity updates
    (decay 1, δ = 0): the final tile *is* the state, stored once; those tokens' outputs read it (padding
    positions, which nothing reads; the chunked prefill gives them the same meaning). Their inputs are
    multiplied by 0, so they must be finite (they are: the padding tokens' conv outputs).

Preconditions (:func:`unsupported_reason`): T ≤ :data:`MAX_T`; Dk and Dv powers of two, BV a power of two
dividing Dv, the tile ``Dk·BV`` ≤ :data:`MAX_TILE` values; Hk divides Hv; q/k/v float (any width: they are
upcast), g/β/state float32; ``0 ≤ lengths[b]`` (lengths past T count as T). Outputs are float32.

Tuning: ``block_v`` (BV, default :data:`DEFAULT_BLOCK_V` or Dv if smaller) and ``num_warps`` (default 4);
``benchmarks/bench_delta_rule.py --sweep`` times alternatives. The defaults are reasoned, not tuned.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from dflash_jax.kernels.common import log_once, mesh_sizes, native
from dflash_jax.tuning import Kernels

__all__ = ["MAX_T", "delta_rule_block", "packed_delta_rule_block", "packed_unsupported_reason", "unsupported_reason"]

MAX_T = 16  # tokens per block (unrolled in the kernel): decode steps and verify blocks; longer ones stay on XLA
MAX_TILE = 8192  # Dk·BV float32 state values a program keeps in registers (64 a thread at 4 warps)
DEFAULT_BLOCK_V = 32
EPS = 1e-6  # kernels.delta_rule.l2norm's
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static kernel configuration (hashable: it parameterises the traced kernel)."""

    t: int  # tokens
    dk: int
    dv: int
    bv: int  # value columns per program
    rep: int  # value heads per key head
    q_off: int  # channel offsets of q, k and value head kh·r's v in the q / k / v refs' last axis
    k_off: int
    v_off: int
    advance: bool
    has_lengths: bool
    num_warps: int


def _l2norm(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x) + EPS)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, *refs, c: _Config):
    # q_ref / k_ref [B, T, Hk, ·] (Dk wide at q_off / k_off), v_ref [B, T, Hk, ·] (value head kh·r + i's Dv at
    # v_off + i·Dv), g / beta [B, T, Hv] f32, s [B, Hv, Dk, Dv] f32, [lengths [B] int32]; outputs out [B, T, Hv, Dv]
    # f32, then advance: state [B, Hv, Dk, Dv]; record: cum [B, T, Hv], v_new [B, T, Hv, Dv], k [B, T, Hk, Dk].
    if c.has_lengths:
        len_ref, *refs = refs
    out_ref, *refs = refs
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh, sub = lax.div(h, c.rep), lax.rem(h, c.rep)
    d0 = j * c.bv
    v0 = c.v_off + sub * c.dv + d0
    s = plgpu.load(s_ref.at[b, h, :, pl.ds(d0, c.bv)])  # [Dk, BV] f32: this program's columns of the state
    n = jnp.clip(len_ref[b], 0, c.t) if c.has_lengths else None
    cum = jnp.float32(0.0)
    scale = c.dk ** -0.5
    if not c.advance:
        cum_ref, vnew_ref, kout_ref = refs
    for step in range(c.t):  # unrolled: the loads of every token are independent of the recurrence
        t = jnp.int32(step)  # (a Python int index does not lower in interpret mode)
        q = _l2norm(plgpu.load(q_ref.at[b, t, kh, pl.ds(c.q_off, c.dk)]).astype(jnp.float32)) * scale
        k = _l2norm(plgpu.load(k_ref.at[b, t, kh, pl.ds(c.k_off, c.dk)]).astype(jnp.float32))
        v = plgpu.load(v_ref.at[b, t, kh, pl.ds(v0, c.bv)]).astype(jnp.float32)
        g, beta = g_ref[b, t, h], beta_ref[b, t, h]
        decay = jnp.exp(g)
        if n is not None:  # tokens at or past the row's length: identity updates
            live = step < n
            decay, beta = jnp.where(live, decay, 1.0), jnp.where(live, beta, 0.0)
        s = s * decay
        delta = (v - jnp.sum(s * k[:, None], axis=0)) * beta  # [BV]
        s = s + k[:, None] * delta[None, :]
        plgpu.store(out_ref.at[b, t, h, pl.ds(d0, c.bv)], jnp.sum(s * q[:, None], axis=0))
        if not c.advance:
            cum = cum + g
            plgpu.store(cum_ref.at[b, t, h], cum, mask=j == 0)
            plgpu.store(vnew_ref.at[b, t, h, pl.ds(d0, c.bv)], delta)
            first = jnp.broadcast_to((sub == 0) & (j == 0), (c.dk,))
            plgpu.store(kout_ref.at[b, t, kh, pl.ds(0, c.dk)], k, mask=first)
    if c.advance:
        (s_out_ref,) = refs
        plgpu.store(s_out_ref.at[b, h, :, pl.ds(d0, c.bv)], s)


def _block_v(block_v: int | None, dv: int) -> int:
    return min(block_v or DEFAULT_BLOCK_V, dv)


def _reason(b, t, hk, dk, hv, dv, dtypes, g, beta, state, lengths, block_v, interpret) -> str | None:
    if not interpret and jax.default_backend() != "gpu":
        return f"needs a GPU backend (have {jax.default_backend()!r}; interpret=True runs on any backend)"
    if not 1 <= t <= MAX_T:
        return f"{t} tokens (the kernel unrolls at most MAX_T={MAX_T})"
    if hk < 1 or hv % hk:
        return f"Hv={hv} is not a multiple of Hk={hk}"
    if tuple(g.shape) != (b, t, hv) or tuple(beta.shape) != (b, t, hv) or tuple(state.shape) != (b, hv, dk, dv):
        return "g / beta / state shapes do not match q / k / v"
    if lengths is not None and tuple(lengths.shape) != (b,):
        return f"lengths shape {tuple(lengths.shape)} is not (B,) = ({b},)"
    if any(jnp.dtype(d) not in _FLOATS for d in dtypes):
        return f"q/k/v dtypes {[str(jnp.dtype(d)) for d in dtypes]} are not all bfloat16/float16/float32"
    if any(jnp.dtype(x.dtype) != jnp.float32 for x in (g, beta, state)):
        return "g, beta and state must be float32"
    if not (_pow2(dk) and _pow2(dv)):
        return f"Dk={dk} / Dv={dv} are not powers of two"
    bv = _block_v(block_v, dv)
    if not _pow2(bv) or dv % bv:
        return f"block_v={bv} is not a power of two dividing Dv={dv}"
    if dk * bv > MAX_TILE:
        return f"state tile Dk·BV = {dk}·{bv} exceeds MAX_TILE={MAX_TILE} (pass a smaller block_v)"
    return None


def unsupported_reason(q, k, v, g, beta, state, lengths=None, *, block_v: int | None = None,
                       interpret: bool = False, **_: object) -> str | None:
    """Why :func:`delta_rule_block` cannot run these arguments here (None when it can). Arrays or
    ShapeDtypeStructs."""
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        return "expected q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]"
    (b, t, hk, dk), (hv, dv) = q.shape, v.shape[2:]
    return _reason(b, t, hk, dk, hv, dv, (q.dtype, k.dtype, v.dtype), g, beta, state, lengths, block_v, interpret)


def packed_unsupported_reason(qkv, g, beta, state, lengths=None, *, key_dim: int, block_v: int | None = None,
                              interpret: bool = False, **_: object) -> str | None:
    """Why :func:`packed_delta_rule_block` cannot run these arguments here (None when it can)."""
    if qkv.ndim != 4 or state.ndim != 4:
        return "expected qkv [B, T, Hk, 2·Dk + r·Dv] and state [B, Hv, Dk, Dv]"
    (b, t, hk, ch), (hv, dk, dv) = qkv.shape, state.shape[1:]
    if dk != key_dim or hk < 1 or hv % hk or ch != 2 * dk + hv // hk * dv:
        return f"qkv channels {ch} are not 2·Dk + (Hv/Hk)·Dv for Dk={key_dim}, Hk={hk}, state {tuple(state.shape)}"
    return _reason(b, t, hk, dk, hv, dv, (qkv.dtype,), g, beta, state, lengths, block_v, interpret)


def _call(q, k, v, g, beta, state, lengths, *, offsets, hv, dv, advance, block_v, num_warps, interpret):
    """The pallas_call over refs q, k, v laid out ``[B, T, Hk, ·]`` (possibly one array three times)."""
    b, t, hk = q.shape[:3]
    dk = state.shape[2]
    c = _Config(t=t, dk=dk, dv=dv, bv=_block_v(block_v, dv), rep=hv // hk, q_off=offsets[0], k_off=offsets[1],
                v_off=offsets[2], advance=advance, has_lengths=lengths is not None, num_warps=num_warps or 4)
    f32 = jnp.float32
    out = jax.ShapeDtypeStruct((b, t, hv, dv), f32)
    if advance:
        shapes = [out, jax.ShapeDtypeStruct((b, hv, dk, dv), f32)]
    else:
        shapes = [out, jax.ShapeDtypeStruct((b, t, hv), f32), jax.ShapeDtypeStruct((b, t, hv, dv), f32),
                  jax.ShapeDtypeStruct((b, t, hk, dk), f32)]
    extra = [] if lengths is None else [lengths.astype(jnp.int32)]
    res = pl.pallas_call(functools.partial(_kernel, c=c), out_shape=shapes, grid=(b, hv, dv // c.bv),
                         interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=c.num_warps,
                                                                                   num_stages=1),
                         name="dflash_delta_rule_block")(q, k, v, g, beta, state, *extra)
    if advance:
        return res[0], res[1]
    out, cum, v_new, k_norm = res
    return out, (k_norm, cum, v_new)


@functools.partial(jax.jit, static_argnames=("advance", "block_v", "num_warps", "interpret"))
def delta_rule_block(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                     lengths: jax.Array | None = None, *, advance: bool = False, block_v: int | None = None,
                     num_warps: int | None = None, interpret: bool = False):
    """The gated delta rule over a block of T ≤ :data:`MAX_T` tokens (module docstring).

    ``q``, ``k`` ``[B, T, Hk, Dk]`` per *key* head and not normalised (the kernel normalises and scales them),
    ``v [B, T, Hv, Dv]``, ``g``, ``beta [B, T, Hv]`` and ``state [B, Hv, Dk, Dv]`` float32.

    ``advance=False`` (record): returns ``(out [B, T, Hv, Dv], (k [B, T, Hk, Dk], cum [B, T, Hv], v_new [B, T,
    Hv, Dv]))`` as :func:`dflash_jax.kernels.delta_rule.delta_rule_block`, except that k is the normalised
    k per key head (``state_after`` takes it as it is). ``advance=True``: ``(out, state after lengths[b]
    tokens)`` (all T when ``lengths`` is None). Tuning (static): ``block_v``, ``num_warps``."""
    b, t, hk = q.shape[:3]
    hv, dv = v.shape[2:]
    v_heads = v.reshape(b, t, hk, hv // hk * dv)  # free: value head kh·r + i is channel block i of key head kh
    return _call(q, k, v_heads, g, beta, state, lengths, offsets=(0, 0, 0), hv=hv, dv=dv, advance=advance,
                 block_v=block_v, num_warps=num_warps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("key_dim", "advance", "block_v", "num_warps", "interpret"))
def packed_delta_rule_block(qkv: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                            lengths: jax.Array | None = None, *, key_dim: int, advance: bool = False,
                            block_v: int | None = None, num_warps: int | None = None, interpret: bool = False):
    """:func:`delta_rule_block` reading q, k and v from the Gated DeltaNet's conv output as it lies: ``qkv [B, T,
    Hk, 2·Dk + r·Dv]``, per key head its q, its k, then its r value heads' v (no slices or copies before the
    kernel). ``key_dim``: Dk. Same returns."""
    hv, dk, dv = state.shape[1:]
    assert dk == key_dim, (dk, key_dim)
    return _call(qkv, qkv, qkv, g, beta, state, lengths, offsets=(0, dk, 2 * dk), hv=hv, dv=dv, advance=advance,
                 block_v=block_v, num_warps=num_warps, interpret=interpret)


def kernel_block(qkv, g, beta, state, lengths, *, key_dim: int, advance: bool, kernels: Kernels):
    """The entry of the kernel dispatch (op ``"delta_rule"``): :func:`packed_delta_rule_block` (interpret mode off
    a GPU), or None (the reason logged once) where it does not take these shapes. Under a ``(dp, tp)`` mesh each
    device runs it on its own rows and heads (``shard_map``; rows and value heads are independent, and a
    device's value heads read its key heads)."""
    interpret = not native("cuda")
    args = (qkv, g, beta, state) + (() if lengths is None else (lengths.astype(jnp.int32),))
    sizes = mesh_sizes()
    rows = "dp" if "dp" in sizes and qkv.shape[0] % sizes["dp"] == 0 else None
    heads = "tp" if "tp" in sizes and qkv.shape[2] % sizes["tp"] == 0 else None
    specs = (P(rows, None, heads, None), P(rows, None, heads), P(rows, None, heads), P(rows, heads, None, None),
             P(rows))[:len(args)]
    split = lambda d, axis: d // sizes[axis] if axis else d  # noqa: E731
    local = tuple(jax.ShapeDtypeStruct(tuple(split(d, axis) for d, axis in zip(a.shape, tuple(spec) + (None,) * 4)),
                                       a.dtype) for a, spec in zip(args, specs))
    why = (f"mesh axes {tuple(sizes)} (it shards over 'dp' and 'tp' only)" if set(sizes) - {"dp", "tp"} else
           packed_unsupported_reason(*local, key_dim=key_dim, interpret=interpret))
    if why is not None:
        log_once(f"Gated DeltaNet: the XLA delta rule instead of the GPU kernel ({why})")
        return None
    fn = functools.partial(packed_delta_rule_block, key_dim=key_dim, advance=advance, interpret=interpret)
    if not sizes:
        return fn(*args)
    values = P(rows, None, heads, None)
    out_specs = (values, P(rows, heads, None, None)) if advance else (values, (values, P(rows, None, heads), values))
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=out_specs,
                         check_vma=False)(*args)
