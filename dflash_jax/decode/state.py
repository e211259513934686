"""Decode-loop state (a pytree carried through ``lax.while_loop``) and its static settings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.sharding import Plan
from dflash_jax.models.target import KVCache


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Static settings: one compiled program per distinct value (plus array shapes)."""

    block_size: int  # L: tokens verified per cycle (1 = plain autoregressive decoding)
    new_capacity: int  # bucketed upper bound of max_new_tokens: sizes the token and acceptance buffers
    capture: tuple[int, ...]  # target layers whose outputs feed the drafter (() without a drafter)
    impl: str = "xla"  # attention implementation, see dflash_jax.attention
    sampling: bool = False  # some row has temperature > 0 (else the exact greedy path)
    draft_sampling: bool = False  # drafts drawn from the drafter's distribution (else its argmax)
    top_k: bool = False  # some row uses top-k
    top_p: bool = False  # some row uses top-p
    plan: Plan | None = None  # mesh placement of the state (None: one device)
    prefill_chunk: int | None = None  # longer prompts are prefilled this many positions at a time


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything one cycle reads and writes. Row ``b`` is one prompt; rows never interact.

    Invariant between cycles: the target cache holds positions ``< anchor_pos`` (committed tokens minus the
    anchor), the drafter's context cache holds the projected features of the same positions, and ``anchor``
    (the last committed token) is the first token of the next block.
    """

    tokens: Int[Array, "B O"]  # new tokens; valid in [0, num_new); O = new_capacity + L
    num_new: Int[Array, "B"]
    max_new: Int[Array, "B"]  # per-row budget (≤ new_capacity)
    anchor: Int[Array, "B"]
    anchor_pos: Int[Array, "B"]  # = prompt_len + num_new - 1
    done: Bool[Array, "B"]
    acc_lens: Int[Array, "B C"]  # a+1 of each cycle the row was active in; C = new_capacity
    num_cycles: Int[Array, "B"]
    stop_ids: Int[Array, "Z"]  # padded with -1
    target_cache: KVCache
    draft_cache: KVCache | None
    rng: jax.Array | None = None  # one PRNG key per row (sampling only)
    sampling: SamplingParams | None = None
    survival_sum: Float[Array, "B G"] | None = None  # DSpark: Σ over cycles of each draft's predicted survival


@dataclasses.dataclass(frozen=True)
class DecodeView:
    """What the host reads of a state (numpy arrays). The programs return it packed into one int32 array
    beside the state (:meth:`pack`): one device-to-host copy per call or stream segment, and the state itself
    can be donated to the next segment while the host reads the copy."""

    tokens: np.ndarray  # [B, O]
    acc_lens: np.ndarray  # [B, C]
    num_new: np.ndarray  # [B]
    done: np.ndarray  # [B] bool
    num_cycles: np.ndarray  # [B]
    survival_sum: np.ndarray  # [B, G] float32 (G = 0 without a confidence head)

    @staticmethod
    def pack(state: DecodeState) -> Int[Array, "B O+C+G+3"]:
        i32 = lambda x: x.astype(jnp.int32)[:, None]  # noqa: E731
        survival = () if state.survival_sum is None else (
            jax.lax.bitcast_convert_type(state.survival_sum, jnp.int32),)
        return jnp.concatenate([state.tokens, state.acc_lens, *survival, i32(state.num_new), i32(state.done),
                                i32(state.num_cycles)], axis=1)

    @staticmethod
    def unpack(packed: np.ndarray, token_capacity: int, survival_width: int = 0) -> "DecodeView":
        """``token_capacity``: O, the tokens buffer's width; ``survival_width``: G (0 without survival)."""
        o, g = token_capacity, survival_width
        survival = packed[:, packed.shape[1] - 3 - g: packed.shape[1] - 3].view(np.float32)
        return DecodeView(packed[:, :o], packed[:, o:packed.shape[1] - 3 - g], packed[:, -3],
                          packed[:, -2].astype(bool), packed[:, -1], survival)
