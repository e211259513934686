"""Decode-loop state (a pytree carried through ``lax.while_loop``) and its static settings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dflash_jax.decode import verify_modes
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.decode.schedule import AcceptanceCounts
from dflash_jax.decode.verify_modes import VerifyMode
from dflash_jax.sharding import Plan
from dflash_jax.models.target import KVCache
from dflash_jax.tuning import Kernels, Tuning


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Static settings: one compiled program per distinct value (plus array shapes)."""

    block_size: int  # L: tokens verified per cycle (1 = plain autoregressive decoding)
    new_capacity: int  # bucketed upper bound of max_new_tokens: sizes the token and acceptance buffers
    capture: tuple[int, ...]  # target layers whose outputs feed the drafter (() without a drafter)
    impl: str = "xla"  # attention implementation, see dflash_jax.kernels
    sampling: bool = False  # some row has temperature > 0 (else the exact greedy path)
    draft_sampling: bool = False  # drafts drawn from the drafter's distribution (else its argmax)
    top_k: bool = False  # some row uses top-k
    top_p: bool = False  # some row uses top-p
    plan: Plan | None = None  # mesh placement of the state (None: one device)
    # How much of each block is verified (dflash_jax.decode.verify_modes; a registered name is accepted too)
    verify_mode: VerifyMode = verify_modes.STATIC
    tiers: tuple[int, ...] = ()  # compiled packed-verify sizes (scheduled modes; the last is B·L)
    ar_step: bool = False  # compact: the scheduler may also pick a plain autoregressive step (tier index K)
    tuning: Tuning = Tuning()  # every run-time knob (dflash_jax.tuning): part of the program's key

    def __post_init__(self):
        object.__setattr__(self, "verify_mode", verify_modes.mode(self.verify_mode))

    @property
    def prefill_chunk(self) -> int:
        """Longer prompts are prefilled this many positions at a time (:attr:`Tuning.prefill_chunk`)."""
        return self.tuning.prefill_chunk

    @property
    def kernels(self) -> Kernels:
        """What the models' and kernels' calls are told: the attention implementation and the kernel knobs."""
        return Kernels(self.impl, self.tuning.kernels)

    @property
    def scheduled(self) -> bool:
        """The confidence scheduler picks windows (the verify mode uses it, and there are drafts to schedule)."""
        return self.verify_mode.scheduled and self.block_size > 1

    @property
    def packed_groups(self) -> int:
        """Groups of rows a packed verify packs apart (:meth:`VerifyMode.packed_groups`: compact, one per dp
        shard — each device packs, verifies and writes its own rows' windows)."""
        return self.verify_mode.packed_groups(self.plan)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScheduleState:
    """The confidence scheduler's inputs and its statistics (scheduled verify modes only)."""

    step_cost: Float[Array, "K"]  # ms of a step at each tier (draft + verify), from the cost table; with
    #                               LoopSpec.ar_step one more: an autoregressive step's
    counts: AcceptanceCounts | None  # running acceptance counts (drafters without a confidence head)
    verify_tokens: Int[Array, "B"]  # Σ over the row's active cycles of its verified tokens (window + anchor)
    untrimmed: Int[Array, "B"]  # cap-accept: Σ of a + 1 had the whole block been committable
    tier_steps: Int[Array, "B K"]  # steps run at each tier, then AR steps if offered (the same in every row)
    # Compact, planned ahead (:func:`dflash_jax.decode.loop.plans_ahead`): the next step's windows and tier,
    # chosen at the end of the step before; for a drafter with a confidence head also its drafts (block
    # [anchor, d_1 … d_G]) and their confidences. None otherwise.
    window: Int[Array, "B"] | None = None
    tier: Int[Array, ""] | None = None
    block: Int[Array, "B L"] | None = None
    conf: Float[Array, "B G"] | None = None


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
    survival_sum: Float[Array, "B G"] | None = None  # confidences: Σ over cycles of each draft's predicted survival
    schedule: ScheduleState | None = None
    return_at_done: Int[Array, ""] | None = None  # the loop returns once this many rows are done (None: all);
    #                                               continuous batching then hands their rows to new prompts

    def replace_rows(self, new: "DecodeState", rows: Int[Array, "R"]) -> "DecodeState":
        """This state with rows ``rows`` replaced by the rows of ``new`` (a state of R rows made by the same
        program settings; indices past the batch are dropped). Batch-wide fields stay: the stop ids, the cost
        table, the tier histogram (the same in every row: it keeps counting the pool's steps), and the plan for
        the next step (stale: the caller plans again, :func:`dflash_jax.decode.loop.refill_fn`)."""
        put = lambda old, x: old.at[rows].set(x, mode="drop")  # noqa: E731
        per_row = lambda old, x: None if old is None else jax.tree.map(put, old, x)  # noqa: E731
        fields = ("tokens", "num_new", "max_new", "anchor", "anchor_pos", "done", "acc_lens", "num_cycles",
                  "target_cache", "draft_cache", "rng", "sampling", "survival_sum")
        out = dataclasses.replace(self, **{f: per_row(getattr(self, f), getattr(new, f)) for f in fields})
        if self.schedule is not None:
            old, fresh = self.schedule, new.schedule
            out = dataclasses.replace(out, schedule=dataclasses.replace(
                old, counts=per_row(old.counts, fresh.counts), untrimmed=put(old.untrimmed, fresh.untrimmed),
                verify_tokens=put(old.verify_tokens, fresh.verify_tokens)))
        return out


@dataclasses.dataclass(frozen=True)
class DecodeView:
    """What the host reads of a state (numpy arrays). The programs return it packed into one int32 array
    beside the state (:meth:`pack`): one device-to-host copy per call or stream segment, and the state itself
    can be donated to the next segment while the host reads the copy. Columns absent from a state (no
    confidence head, static verify) come back with width 0."""

    tokens: np.ndarray  # [B, O]
    acc_lens: np.ndarray  # [B, C]
    survival_sum: np.ndarray  # [B, G] float32 (G = 0 without a confidence head)
    verify_tokens: np.ndarray  # [B, 1] (width 0 for static verify)
    untrimmed: np.ndarray  # [B, 1] (width 0 for static verify)
    tier_steps: np.ndarray  # [B, K] (K = 0 for static verify)
    num_new: np.ndarray  # [B]
    done: np.ndarray  # [B] bool
    num_cycles: np.ndarray  # [B]

    @staticmethod
    def columns(state: DecodeState) -> list[jax.Array]:
        i32 = lambda x: x.astype(jnp.int32).reshape(x.shape[0], -1)  # noqa: E731
        empty = jnp.zeros((state.tokens.shape[0], 0), jnp.int32)
        sch = state.schedule
        return [state.tokens, state.acc_lens,
                empty if state.survival_sum is None else jax.lax.bitcast_convert_type(state.survival_sum,
                                                                                       jnp.int32),
                empty if sch is None else i32(sch.verify_tokens), empty if sch is None else i32(sch.untrimmed),
                empty if sch is None else sch.tier_steps,
                i32(state.num_new), i32(state.done), i32(state.num_cycles)]

    @staticmethod
    def widths(state: DecodeState) -> tuple[int, ...]:
        """The column widths of :meth:`pack` (from the shapes alone; the host unpacks with them)."""
        sch = state.schedule
        return (state.tokens.shape[1], state.acc_lens.shape[1],
                0 if state.survival_sum is None else state.survival_sum.shape[1],
                0 if sch is None else 1, 0 if sch is None else 1, 0 if sch is None else sch.tier_steps.shape[1],
                1, 1, 1)

    @staticmethod
    def pack(state: DecodeState) -> Int[Array, "B W"]:
        return jnp.concatenate(DecodeView.columns(state), axis=1)

    @staticmethod
    def unpack(packed: np.ndarray, widths: tuple[int, ...]) -> "DecodeView":
        parts = np.split(packed, np.cumsum(widths)[:-1], axis=1)
        tokens, acc_lens, survival, verify_tokens, untrimmed, tier_steps, num_new, done, cycles = parts
        return DecodeView(tokens, acc_lens, survival.view(np.float32), verify_tokens, untrimmed, tier_steps,
                          num_new[:, 0], done[:, 0].astype(bool), cycles[:, 0])
