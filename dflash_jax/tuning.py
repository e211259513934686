"""Run-time tuning: every knob that changes what a decode program traces or how it compiles, as frozen values.

There are no module-level switches in the library: a knob lives here, reaches the code that reads it as an
argument (the loop's static spec carries :class:`Tuning`; model and kernel calls carry :class:`Kernels`), and is
therefore part of the program cache's key. Tests and benchmarks change a knob by passing a different value
(``speculative_generate(..., tuning=Tuning(kernels=KernelTuning(packed_kernel=False)))``), never by assigning a
module attribute.

This module is a leaf: it imports nothing from :mod:`dflash_jax`, so every layer can take these values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


def _frozen_options(options: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    return None if options is None else tuple(sorted(options.items()))


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Knobs read where a model or kernel is traced (attention, packed verify, cache writes, MoE, delta rule,
    quantized matmuls, top-K)."""

    # Kernels that may be turned off one by one (A/B runs): the packed-verify attention kernel, the pending-KV
    # cache-write kernel and the pending-KV placement kernel (GPU).
    packed_kernel: bool = True
    write_kernel: bool = True
    place_kernel: bool = True
    # The short-block gated-delta-rule kernel of the hybrid targets' linear attention (GPU).
    delta_rule_kernel: bool = True
    # Packed verify: windows of at most this many query tokens run the short-query kernel tile (None: never).
    packed_short_q_len: int | None = 4
    # Packed verify on the XLA path: a step whose every window is whole runs the dense whole-block attention.
    dense_whole_blocks: bool = True
    # Bucket lookups compare every value against every edge up to this many comparisons (else a binary search).
    compare_all_max: int = 1 << 22
    # On the CPU, reads of the cache right after a write are tied to the write (XLA otherwise copies the cache).
    tie_cpu_cache_reads: bool = True
    # Backends whose one-row matmuls are padded to two rows (a faster GEMV path on GPUs).
    pad_single_row_on: tuple[str, ...] = ("gpu",)
    # MoE: the grouped-expert kernel on these backends for calls of at most ``moe_kernel_max_tokens`` tokens;
    # the grouped (sorted) XLA form on the backends of ``moe_grouped_on`` beyond that, else dense experts.
    moe_kernels_on: tuple[str, ...] = ("gpu", "tpu")
    moe_kernel_max_tokens: int = 64
    moe_grouped_on: tuple[str, ...] = ()
    # Quantized experts past the kernel (a wide verify, a prefill) run every expert, this many bytes of converted
    # weights at a time (kernels/moe.py, experts_dense_quantized; 0: one expert a step). One expert a step ran
    # the Qwen3-30B-A3B shape's 16-row block-fp8 cycle at 177 ms (H200; benchmarks/README.md, "Quantized targets").
    moe_dense_quantized_step_bytes: int = 256 << 20
    # Instead, such calls through the sorted grouped-expert GPU kernels (cuda/moe.py: each routed expert read once
    # for all its pairs, any token count). Off until timed on a GPU.
    moe_quantized_sorted: bool = False
    # Quantized linear layers: the fused dequantize-and-multiply kernel (TPU; GPU where ``quant_kernel_impls`` says)
    # for calls of at most ``quant_kernel_max_tokens`` tokens (more: the XLA reference, e.g. verify and prefill,
    # where XLA fuses the conversion into its GEMM; docs/usage.md, "Quantized targets"). The TPU kernel is untimed.
    quant_kernel: bool = True
    quant_kernel_max_tokens: int = 1
    # The implementations whose dense quantized kernel runs by default ("cuda": GPU, "pallas": TPU). Not the GPU's:
    # there XLA fuses the int8 / fp8 → bf16 conversion into its own GEMM (it reads the quantized bytes) and its
    # one-token step was the faster (benchmarks/README.md, "Quantized targets"). ("cuda", "pallas") runs it on
    # GPUs too.
    quant_kernel_impls: tuple[str, ...] = ("pallas",)
    # Kernels of several row blocks (group-wise int8, HF's 128 × 128 FP8 blocks) through the GPU kernel for calls
    # of ``quant_kernel_blocked_min_tokens`` to ``quant_kernel_blocked_max_tokens`` tokens, whatever
    # ``quant_kernel_impls`` says (max 0: as any other kernel). XLA has no fused form for them: the reference writes
    # a temporary beside the weights (partial products or scaled activations: kernels/quantized.py), where the
    # kernel reads the quantized bytes once and scales each 128-row step's product in registers. The bounds are
    # where it was timed the faster on the 8B shape's block fp8 (16 and 64 rows; benchmarks/README.md, "Quantized
    # targets"): from 3 tokens, where the reference leaves its partial products for the scaled activations (one
    # row, padded to two on GPUs, was faster through the partial products), to 64.
    quant_kernel_blocked_min_tokens: int = 3
    quant_kernel_blocked_max_tokens: int = 64
    # float8 weights through that kernel too (off: they take the XLA reference, int8 still the kernel). Its float8
    # tiles match the reference in the GPU tests (tests/test_quantized_kernels.py, test_moe_kernels.py, run on a
    # GPU); the TPU kernel's in interpret mode only. Both switches also govern quantized MoE experts in the
    # grouped-expert GPU kernel (cuda/moe.py), whose token limit is its own (at most as many (token, expert) pairs
    # as experts).
    quant_kernel_float8: bool = True
    # Quantized kernels that share their input (a layer's q / k / v, an MLP's gate / up) in one launch of that GPU
    # kernel (op "quantized_projections") instead of one each; under the same limits as a kernel alone. Off: it
    # made the one-token step slower than one launch a matrix (benchmarks/README.md, "Quantized targets").
    quant_group_kernel: bool = False
    # The top-K over a vocabulary (op "top_k": a DFlash2 drafter's candidates, K per block position) on GPUs as
    # the exact two-stage form (dflash_jax/cuda/top_k.py: the top-K of each chunk of about ``top_k_chunk``
    # columns, then the top-K of their candidates) instead of XLA's TopK over whole rows, which gives few rows
    # little parallelism. Off: lax.top_k everywhere. Only where the logits have at most ``top_k_chunked_max_rows``
    # rows (0: any): inside the LM head's program XLA's own TopK is the faster at many rows (benchmarks/README.md).
    top_k_chunked: bool = False
    top_k_chunk: int = 8192
    top_k_chunked_max_rows: int = 16
    # The LM head and that top-K in one GPU kernel (op "head_top_k", dflash_jax/cuda/head_top_k.py: each program
    # keeps its vocabulary tile's K best, the [N, V] logits are never written) for at most ``head_top_k_max_rows``
    # rows (0: any; the head is read once per 64 rows, so more rows only where measured) over tiles of
    # ``head_top_k_block_v`` columns. At 1 and 960 rows (a DFlash2 cycle at batch 1 and 64) it was faster than
    # XLA's head + TopK, or as fast (benchmarks/README.md, "Drafter kinds"); 1,024 rows cover a 64-row batch's
    # block of 16.
    head_top_k_kernel: bool = True
    head_top_k_max_rows: int = 1024
    head_top_k_block_v: int = 128
    # GPU kernels' split-KV concurrency target (programs per SM; 0 = the kernel's own default).
    programs_per_sm: int = 0
    # Delta rule (linear attention): prefill chunk length.
    delta_rule_chunk: int = 64
    # Run GPU-only kernels in Pallas interpret mode on any backend (tests on the CPU).
    interpret: bool = False


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What a model or kernel call is told about kernels: the attention implementation every op honours
    (``"xla"``, ``"pallas"`` for TPU, ``"cuda"`` for GPU; already resolved from ``"auto"``) and the knobs."""

    impl: str = "xla"
    tuning: KernelTuning = KernelTuning()


def _env_ratio() -> float:
    return float(os.environ.get("DFLASH_JAX_AUTO_COMPACT_RATIO", 1.35))


def _env_fallback() -> bool:
    """$DFLASH_JAX_AR_FALLBACK: "0" turns the fallback off (the test suite's default outside its own tests)."""
    return os.environ.get("DFLASH_JAX_AR_FALLBACK", "1") != "0"


def _env_compiler_options() -> tuple[tuple[str, Any], ...] | None:
    """$DFLASH_JAX_COMPILER_OPTIONS: a JSON object of XLA options (unset or empty: XLA's defaults)."""
    raw = os.environ.get("DFLASH_JAX_COMPILER_OPTIONS", "").strip()
    if not raw:
        return None
    options = json.loads(raw)
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"$DFLASH_JAX_COMPILER_OPTIONS must be a JSON object of XLA options, got {raw!r}")
    return _frozen_options(options)


# A compact tier of n tokens a row drafts 2n positions by default for a drafter trained at narrower widths:
# the anchor and n drafts alone would leave the scheduler no choice of window within the tier.
TRAINED_WIDTHS_SPAN = 2


@dataclasses.dataclass(frozen=True)
class SwitchTuning:
    """When verify mode ``"auto"`` falls back to autoregressive steps and returns to drafting
    (:class:`dflash_jax.engine.switching.SwitchPolicy`; host-side only: no program depends on it)."""

    # Armed only where the cheapest drafted step costs more than this many autoregressive steps. Below it drafting
    # loses only on text the drafter cannot draft at all (under 1.3 tokens a step: a trained drafter's τ is 2–7),
    # while the segments' returns to the host cost a few percent of every run where steps are short (a large model
    # at batch 1 on a GPU: docs/verify-modes.md).
    arm_breakeven: float = 1.3
    # Leave drafting once it is estimated this much slower than autoregressive steps (return as soon as it is not
    # slower): a margin against the table's noise, so that a batch near break-even does not switch back and forth.
    leave_margin: float = 0.05
    # Drafting is left only if it loses with the τs read this many standard errors up (τ̂ / √(row steps seen)).
    leave_optimism: float = 1.5
    # Weight of the newest drafted segment in the running acceptance estimate (and of the newest timing).
    smoothing: float = 0.5
    # A probe costs at most this share of the fallback's time between two probes (times the backoff, which doubles
    # up to max_backoff while probes keep losing). At most the 2 % by which a call may trail ``generate``: a call
    # that holds a probe runs the speculative path throughout (benchmarks/README.md, "Large batches").
    probe_share: float = 0.02
    max_backoff: int = 8
    # A probe (and the first drafted segment) runs ``Tuning.probe_cycles`` cycles, fewer where the batch gives this
    # many row steps in fewer: τ̂'s standard error is read from the row steps seen, and at large batches a drafted
    # step costs several autoregressive ones (3.1× at 128 rows on a 2-core CPU), so a second cycle there buys
    # little. (Drafted segments while it is not yet clear that drafting pays keep ``probe_cycles``: each ends with
    # a return to the host.)
    probe_row_steps: int = 32
    # While drafting clearly pays, a drafted segment that would leave the rows' budgets needing at most this many
    # segments' cycles more (at the batch's running τ) runs until they are spent instead: each segment ends with a
    # return to the host (a few ms on a GPU, where a call's last segment was often a few steps:
    # benchmarks/README.md, "Large batches"), and the loop returns anyway once every row is done. Not in a pool
    # (its rows are refilled).
    finish_within: float = 0.5
    # A row's own τ counts against the batch's as if the batch's had been seen over this many of its steps.
    row_prior_steps: int = 16
    # Where drafting seems to pay less than this many times over by the cost table, one short fallback segment of
    # ar_check_steps steps times an autoregressive step on this machine: a table timed on another machine can be
    # off by more than that (a CPU of another make), and the drafted segments are timed anyway.
    ar_check: float = 2.0
    ar_check_steps: int = 8
    # The timed ratio of the two steps' costs replaces the table's only where they differ by more than this
    # factor: short drafted segments carry their return to the host, which the table's steps do not, and a table
    # timed on this machine should keep deciding.
    timing_trust: float = 1.25


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Every run-time knob; the decode settings carry one, and it is part of every program's cache key."""

    kernels: KernelTuning = KernelTuning()
    # Verify mode "auto" without the static step in the cost table: compact where the whole-block step costs at
    # least this many times the one-token step ($DFLASH_JAX_AUTO_COMPACT_RATIO; "inf": auto is always static).
    auto_compact_ratio: float = dataclasses.field(default_factory=_env_ratio)
    # Verify mode "auto": fall back to plain autoregressive steps while the acceptance observed says drafting does
    # not pay (dflash_jax.engine.switching; default: $DFLASH_JAX_AR_FALLBACK, on unless "0"), in segments: drafted
    # ones of probe_cycles, doubling up to drafted_segment_cycles while drafting clearly pays; autoregressive ones
    # of fallback_steps (rounded up to a multiple of the block size). Probes are shorter where the batch observes
    # enough rows in fewer cycles; when to switch: ``switching``.
    ar_fallback: bool = dataclasses.field(default_factory=_env_fallback)
    drafted_segment_cycles: int = 128
    probe_cycles: int = 2
    fallback_steps: int = 32
    switching: SwitchTuning = SwitchTuning()
    # ... and a later run of the same batch shape with the same drafter starts from the acceptance the earlier ones
    # observed (their running τ, mode and probe countdown) instead of a drafted probe.
    remember_acceptance: bool = True
    # On a GPU, a compact loop that plans its steps ahead switches tiers from the host instead of a CUDA-graph
    # conditional node.
    host_tier_switch: bool = True
    # A sequential (DSpark) drafter's compact steps draft only this many positions (None: all).
    sequential_draft_cap: int | None = None
    # Compact's compiled tiers, in tokens per row (None: 1, 2, 4 … L; sizes above L are dropped).
    tiers_per_row: tuple[int, ...] | None = None
    # Compact steps of a parallel drafter whose windows are chosen before drafting: a tier of n tokens per row runs
    # the drafter's trunk over min(L, tier_draft_span · n) positions (rounded up to a width the drafter was trained
    # at) and caps each row's window at one less. At large batches the trunk is a quarter of a step, but its
    # non-causal pass over fewer positions drafts differently (lossless, yet a drafter trained on whole blocks
    # accepts far less there: docs/verify-modes.md). None: the drafter's (``TRAINED_WIDTHS_SPAN`` for a drafter
    # trained at narrower widths, ``DrafterConfig.trained_widths``; else whole blocks); 0: whole blocks always.
    tier_draft_span: int | None = None
    # Compact's admission weighs a row's tokens by (its remaining budget ÷ the batch's mean)^finish_together, so
    # that rows behind get longer windows and a batch (which ends with its slowest row) ends in fewer steps
    # (decode.schedule.finish_weights). A continuous run, whose finished rows take new prompts, weighs all alike.
    finish_together: float = 2.0
    # The scheduler ranks candidate windows by comparing all pairs up to this many rows × drafts.
    rank_compare_all_max: int = 2048
    # Prompts longer than this are prefilled in chunks of this many positions.
    prefill_chunk: int = 1024
    # XLA compile options for the prefill and decode programs (sorted (name, value) pairs; None: XLA's defaults;
    # default: $DFLASH_JAX_COMPILER_OPTIONS, a JSON object, e.g. the test suite's fast CPU compiles).
    compiler_options: tuple[tuple[str, Any], ...] | None = dataclasses.field(default_factory=_env_compiler_options)

    def draft_span(self, trained_widths: tuple[int, ...] | None) -> int | None:
        """The ``tier_draft_span`` in effect for a drafter trained at ``trained_widths`` (None: whole blocks)."""
        if self.tier_draft_span is None:
            return TRAINED_WIDTHS_SPAN if trained_widths else None
        return self.tier_draft_span or None

    def with_compiler_options(self, options: dict[str, Any] | None) -> "Tuning":
        return dataclasses.replace(self, compiler_options=_frozen_options(options))

    def compiler_options_dict(self) -> dict[str, Any] | None:
        return None if self.compiler_options is None else dict(self.compiler_options)

    def replace(self, **changes) -> "Tuning":
        """A copy with ``changes``; kernel knobs may be given by name too (``packed_kernel=False``)."""
        kernel_fields = {f.name for f in dataclasses.fields(KernelTuning)}
        kern = {k: changes.pop(k) for k in list(changes) if k in kernel_fields}
        out = dataclasses.replace(self, **changes)
        return dataclasses.replace(out, kernels=dataclasses.replace(out.kernels, **kern)) if kern else out
