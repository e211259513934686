"""Target models: LLaMA-3, Qwen3 and Qwen3-MoE decoder-only transformers in Flax NNX (the base the other
families' models subclass: :mod:`dflash_jax.models.gpt_oss`, :mod:`dflash_jax.models.hybrid`).

The KV cache lives outside the module (:class:`KVCache`, a pytree of per-layer arrays indexed by absolute
position) and is returned updated, so the decode loop can carry and donate it. A forward can capture the
outputs of any set of decoder layers: those are the DFlash context features (SPEC §2.1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.config import ModelConfig
from dflash_jax.kernels.attention import cache_attention, prefill_attention, read_after
from dflash_jax.kernels.cache_write import place_pending, write_pending, write_rows
from dflash_jax.kernels.packed import PackedLayout, gather_windows, packed_verify
from dflash_jax.models.layers import MLP, Dense, Embed, RMSNorm, Rope, apply_rope, project_together
from dflash_jax.models.linear_attention import pad_record
from dflash_jax.models.moe import SparseMoE
from dflash_jax.quant import dequantize_columns
from dflash_jax.sharding import Plan, constrain
from dflash_jax.tuning import Kernels


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values, each ``[B, S, K, H]``, slot ``j`` holding absolute position ``j``."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @staticmethod
    def zeros(num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, capacity, kv_heads, head_dim)
        return KVCache(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                       tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def constrained(self, plan: Plan, sharded_heads: bool) -> "KVCache":
        """Pinned to its mesh placement: rows over dp, and KV heads over tp when ``sharded_heads``."""
        s = plan.cache(sharded_heads)
        return dataclasses.replace(self, k=tuple(constrain(k, s) for k in self.k),
                                   v=tuple(constrain(v, s) for v in self.v))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingKV:
    """A packed verify's new K/V, every layer's stacked and still packed (``[T, NL, 2, K, H]``: slot t's token,
    the layers inside it), to be written row by row: row r's window (``lens[r]`` tokens from slot ``slots[r]``)
    at its anchor position ``starts[r]``, then zeros up to ``width`` tokens — the static verify's row-window
    writes (what lies past a window, past the row's length, is masked and overwritten before it is read; zeros
    keep NaN in padding slots out). A compiled tier (a branch of a ``lax.switch``) only reads the caches and
    returns these; :meth:`write` stores them after the conditional, in place. Stacked, a branch returns one
    array rather than two per layer (on a GPU each is a kernel launch and a copy out of the conditional, every
    step); packed, it writes only its T slots' K/V (unpacking them into ``[B, L]`` blocks inside the branch was
    one select fusion writing the whole batch's blocks, a few percent of the step at 64 rows). A hybrid
    target's linear layers add their deferred ``records``
    (:mod:`dflash_jax.models.hybrid`), which :meth:`write` leaves in the cache for ``settle``."""

    starts: Int[Array, "B"]
    slots: Int[Array, "B"]  # each row's first packed slot
    lens: Int[Array, "B"]
    kv: Float[Array, "T NL 2 K H"]  # keys, values
    records: tuple = ()
    width: int = dataclasses.field(default=1, metadata=dict(static=True))  # tokens written a row
    groups: int = dataclasses.field(default=1, metadata=dict(static=True))  # as PackedLayout's

    @staticmethod
    def of(layout: PackedLayout, kv: tuple, records: tuple = ()) -> "PendingKV":
        """``kv``: per layer ``[T, 2, K, H]``; ``records``: per linear layer, over ``layout.block`` tokens."""
        return PendingKV(layout.anchors, layout.starts, layout.lens, jnp.stack(kv, axis=1), records, layout.block,
                         layout.groups)

    def widened(self, block: int, size: int, kernels: Kernels = Kernels()) -> "PendingKV":
        """The same writes over ``block`` ≥ width tokens a row from ``size`` ≥ T slots (each group's slots
        padded at their end), so that every tier, whose windows fit blocks of different widths packed into
        different sizes, returns one shape. What lies past the T slots is never read (the writes and
        :meth:`rows` mask past each window): :func:`dflash_jax.kernels.cache_write.place_pending` (a kernel
        that leaves them unwritten under ``kernels``, where one applies; else zeros)."""
        g, t = self.groups, self.kv.shape[0]
        kv = place_pending(self.kv, size, g, kernels=kernels)
        grow = (size - t) // g
        slots = self.slots + (jnp.arange(self.slots.shape[0]) // (self.slots.shape[0] // g)) * grow
        return PendingKV(self.starts, slots.astype(jnp.int32), self.lens, kv,
                         tuple(pad_record(r, block) for r in self.records), block, g)

    def rows(self) -> Float[Array, "B W NL 2 K H"]:
        """Each row's ``width`` tokens: its window, then zeros (each group gathers from its own slots)."""
        return gather_windows(self.kv, self.slots, self.lens, self.width, self.groups)

    def write(self, cache: KVCache, kernels: Kernels = Kernels()) -> KVCache:
        """The rows written into every layer's caches (:func:`dflash_jax.kernels.cache_write.write_pending`: one
        GPU kernel for every layer under ``kernels.impl="cuda"`` where it applies, else two scatters a layer)."""
        done = write_pending(self.kv, self.slots, self.lens, self.starts, cache.k, cache.v, width=self.width,
                             groups=self.groups, kernels=kernels)
        return dataclasses.replace(cache, k=done[0], v=done[1], **({"pending": self.records} if self.records else {}))


class Attention(nnx.Module):
    """``window``: keys older than ``window`` positions are masked (gpt-oss sliding layers); gpt-oss also adds
    per-head attention ``sinks`` to the softmax (see :func:`dflash_jax.kernels.attention.cache_attention`)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, window: int | None = None):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Dense(d, n * h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Dense(d, k * h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Dense(d, k * h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Dense(n * h, d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.n, self.k, self.h = n, k, h
        self.sinks = nnx.Param(jnp.zeros((n,), dtype)) if cfg.attention_sinks else None
        self.window = window

    def project_qkv(self, x: Float[Array, "B T D"], cos, sin, kernels: Kernels = Kernels()):
        b, t, _ = x.shape
        q, k, v = project_together((self.q_proj, self.k_proj, self.v_proj), x, kernels)
        q = q.reshape(b, t, self.n, self.h)
        k, v = k.reshape(b, t, self.k, self.h), v.reshape(b, t, self.k, self.h)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x, positions, cos, sin, k_cache, v_cache, *, prefill: bool, kernels: Kernels,
                 packed: PackedLayout | None = None):
        q, k, v = self.project_qkv(x, cos, sin, kernels)
        extra = dict(sinks=None if self.sinks is None else self.sinks[...], window=self.window)
        if packed is not None:  # x is [1, T, D]: verify windows packed end to end; the cache is only read
            out, new_kv = packed_verify(q, k, v, *read_after(x, k_cache, v_cache, kernels), packed,
                                        kernels=kernels, **extra)
            k_cache = v_cache = new_kv  # the new entries, for PendingKV
        elif prefill:
            # Empty cache: attend over the prompt's own keys (slot j = position j), then store them. Prefill is
            # compute-bound and long: not the decode kernels (cuDNN's fused attention on GPUs, else the reference).
            out = prefill_attention(q, k, v, positions, kernels=kernels, **extra)
            if k_cache is not None:  # None: a cache-free forward (training features)
                k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0))
                v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0))
        else:
            k_cache = write_rows(k_cache, k, positions[:, 0])
            v_cache = write_rows(v_cache, v, positions[:, 0])
            out = cache_attention(q, k_cache, v_cache, positions, kernels=kernels, **extra)
        b, t = x.shape[:2]
        return self.o_proj(out.reshape(b, t, self.n * self.h), kernels), k_cache, v_cache


class DecoderLayer(nnx.Module):
    """Pre-norm attention + MLP; the MLP is Qwen3-MoE's sparse block in the layers ``cfg`` makes sparse. A family
    with other norms or MLPs subclasses it (``norm_class``, :meth:`make_mlp`), as gpt-oss does."""

    norm_class = RMSNorm

    def __init__(self, cfg: ModelConfig, idx: int, *, dtype, rngs: nnx.Rngs):
        norm = self.norm_class
        self.input_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, window=cfg.layer_window(idx))
        self.post_attention_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = self.make_mlp(cfg, idx, dtype=dtype, rngs=rngs)

    def make_mlp(self, cfg: ModelConfig, idx: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if cfg.is_moe_layer(idx):
            return SparseMoE(cfg, dtype=dtype, rngs=rngs)
        return MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cos, sin, k_cache, v_cache, *, prefill: bool, kernels: Kernels, packed=None):
        a, k_cache, v_cache = self.self_attn(self.input_layernorm(x), positions, cos, sin, k_cache, v_cache,
                                             prefill=prefill, kernels=kernels, packed=packed)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x), kernels), k_cache, v_cache


class TargetModel(nnx.Module):
    """A LLaMA-3 / Qwen3 / Qwen3-MoE causal LM. Weights follow HF names (``layers.i.self_attn.q_proj`` …).

    What the decode loop asks of every target, whatever its family: the forward (``lengths`` / ``defer`` are
    for targets with recurrent states and change nothing here: a K/V slot written by a rejected draft is
    overwritten before it is read), :meth:`settle` after acceptance, and its cache's ``constrained``. A family
    subclasses it with its own ``layer_class`` / ``norm_class`` or more (:mod:`dflash_jax.families`)."""

    layer_class = DecoderLayer
    norm_class = RMSNorm

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([self.layer_class(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = self.norm_class(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Dense(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                   dtype=dtype, rngs=rngs)
        self.rope = Rope(cfg)

    @property
    def dtype(self):
        return self.embed_tokens.embedding[...].dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim, self.dtype)

    def embed(self, ids: Int[Array, "*b"]) -> jax.Array:
        return self.embed_tokens(ids)

    def logits(self, h: Float[Array, "*b D"], kernels: Kernels = Kernels()) -> Float[Array, "*b V"]:
        """Float32 logits from final-normed hidden states (tied or separate lm_head, quantized or not); a quantized
        head's product goes through the kernel op under ``kernels``, as every other quantized layer's."""
        head = self.head_weight()
        if head is None:
            return self.lm_head.project(h, kernels, preferred_element_type=jnp.float32)
        w, vocab_major = head
        return jnp.einsum("...d,dv->...v", h, w.T if vocab_major else w, preferred_element_type=jnp.float32)

    def head_weight(self) -> tuple[jax.Array, bool] | None:
        """The weights :meth:`logits` multiplies by, unquantized, and whether they are vocabulary-major (``[V, D]``,
        a tied embedding; else ``[D, V]``): what a kernel that forms the logits itself reads. None for a quantized
        head (its product goes through the quantized kernels)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...], True
        return None if self.lm_head.quant is not None else (self.lm_head.kernel[...], False)

    def head_rows(self, ids: Int[Array, "N"]) -> Float[Array, "N D"]:
        """The lm_head's weights of tokens ``ids``, one row each (what :meth:`logits` multiplies them by),
        dequantized to the compute dtype where the head is quantized."""
        if self.lm_head is None:
            return jnp.take(self.embed_tokens.embedding[...], ids, axis=0)
        head = self.lm_head
        if head.quant is not None:
            return dequantize_columns(head.kernel[...], head.scale[...], head.quant.blocks(*head.kernel.shape), ids,
                                      self.dtype)
        return jnp.take(head.kernel[...], ids, axis=1).T

    def untie(self) -> None:
        """A tied model gets an lm_head of its own holding the embedding (transposed), so that the head can be
        quantized while the embedding stays in the compute dtype (in place; abstract models too)."""
        if self.lm_head is None:
            head = Dense(self.config.hidden_size, self.config.vocab_size, bias=False, dtype=self.dtype,
                         rngs=nnx.Rngs(0))
            head.kernel.set_value(self.embed_tokens.embedding[...].T)
            self.lm_head = nnx.data(head)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache | None,
        *,
        capture: tuple[int, ...] = (),
        prefill: bool = False,
        kernels: Kernels = Kernels(),
        packed: PackedLayout | None = None,
        lengths: Int[Array, "B"] | None = None,
        defer: bool = False,
    ) -> tuple[Float[Array, "B T D"], Float[Array, "B T F"] | None, KVCache]:
        """Run ``tokens`` at ``positions`` (consecutive per row), writing their K/V into ``cache``.

        ``prefill=True`` means the cache is empty and positions are ``0..T-1``; then ``cache`` may be ``None``
        (no K/V are kept). ``packed``: the compact verify's windows packed end to end — then ``tokens`` and
        ``positions`` are ``[1, T]`` (``packed.pack`` of the block and its positions), and the cache is only
        read. Returns the final-normed hidden states, the concatenated outputs of the ``capture`` layers (HF
        ``hidden_states[l+1]``; for the last layer HF reports it after the final norm, and so do we) and the
        updated cache (``packed``: the writes still to make, :class:`PendingKV`). ``lengths`` and ``defer`` (see
        :class:`~dflash_jax.models.hybrid.HybridTargetModel`) have nothing to act on here.
        """
        cos, sin = self.rope(positions)
        x = self.embed(tokens)
        n = self.config.num_layers
        if cache is None and not prefill:
            raise ValueError("a cache is required unless prefill=True")
        ks, vs = (list(cache.k), list(cache.v)) if cache is not None else ([None] * n, [None] * n)
        captured = {}
        for i, layer in enumerate(self.layers):
            x, ks[i], vs[i] = layer(x, positions, cos, sin, ks[i], vs[i], prefill=prefill, kernels=kernels,
                                    packed=packed)
            if i in capture and i != n - 1:
                captured[i] = x
        h = self.norm(x)
        if n - 1 in capture:
            captured[n - 1] = h
        feats = jnp.concatenate([captured[i] for i in capture], axis=-1) if capture else None
        if packed is not None:
            return h, feats, PendingKV.of(packed, tuple(ks))  # each layer's [T, 2, K, H]
        return h, feats, KVCache(tuple(ks), tuple(vs)) if cache is not None else None

    def settle(self, cache: KVCache, n: Int[Array, "B"]) -> KVCache:
        """The cache after a verify forward once each row's ``n[b]`` committed tokens are known: as it is here
        (a target with recurrent states advances them here, :meth:`HybridTargetModel.settle`)."""
        return cache
