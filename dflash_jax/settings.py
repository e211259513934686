"""Decode settings: every argument of a public decode call, validated once, as one frozen, hashable value.

The public functions (:func:`dflash_jax.speculative_generate`, :func:`dflash_jax.generate`, the streams, the
batch command, chat) share their keyword arguments: they are declared once here (:class:`DecodeOptions` and
:class:`SpeculativeOptions`, with :data:`DEFAULTS`) and checked once by :meth:`DecodeSettings.build`, each with
an error naming it. The engine (:mod:`dflash_jax.engine`) then takes the settings alone: they yield the decode
loop's static spec (:meth:`DecodeSettings.loop_spec`), which is the settings' part of every program's cache key.

Per-prompt values (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p`` given one per prompt) are runtime
inputs, not compiled: they ride along as host arrays (:class:`RowValues`) outside the hash. What they decide
for the programs — which sampling branches are compiled — is in the hashed :class:`SamplingFlags`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TypedDict

import numpy as np

from dflash_jax.costs import CostTable
from dflash_jax.decode import verify_modes
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.decode.state import LoopSpec
from dflash_jax.kernels import IMPLS, resolve_impl
from dflash_jax.tuning import SwitchTuning, Tuning

if TYPE_CHECKING:
    from dflash_jax.loading import Drafter, Target
    from dflash_jax.sharding import Plan

Prompt = str | Sequence[int] | Sequence[dict]

# Chat message roles a prompt's messages may have (what chat templates know).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class DecodeOptions(TypedDict, total=False):
    """Keyword arguments every public decode function takes (defaults in :data:`DEFAULTS`).

    ``stop_token_ids``: ids that end a prompt's generation (default: the target's end-of-turn ids; ``[]``: never
    stop early). ``chat_template``: text prompts go through the target's chat template (default True).
    ``attention_impl``: ``"auto"`` (the backend's kernels where they pay), ``"xla"``, ``"pallas"`` (TPU) or
    ``"cuda"`` (GPU). ``temperature`` / ``top_k`` / ``top_p``: HF meanings, one value for all prompts or one per
    prompt (temperature 0 = greedy; ``None`` = off). ``seed``: sampled runs are reproducible. ``batch_size``:
    decode at most this many prompts at once, a finished row taking the next prompt (continuous batching;
    default: all at once). ``tuning``: run-time knobs (:class:`dflash_jax.tuning.Tuning`; default: ``Tuning()``).
    """

    stop_token_ids: Sequence[int] | None
    chat_template: bool
    attention_impl: str
    temperature: float | Sequence[float] | None
    top_k: int | Sequence[int] | None
    top_p: float | Sequence[float] | None
    seed: int
    batch_size: int | None
    tuning: Tuning | None


class SpeculativeOptions(DecodeOptions, total=False):
    """:class:`DecodeOptions` and those of speculative decoding.

    ``block_size``: tokens one cycle verifies (default: the drafter's trained verify width; any value in
    ``2 … trained``). ``draft_sampling``: draw drafts from the drafter's distribution (accepted with min(1, p/q))
    instead of taking its argmax. ``verify_mode``: ``"auto"`` (compact where the cost table says trimming pays,
    else static), ``"static"``, ``"compact"`` or ``"cap-accept"`` (docs/verify-modes.md). ``cost_table``: the
    scheduler's step costs (a :class:`dflash_jax.costs.CostTable` or a ``.costs.json`` path; default: the pair's,
    else the one shipped for this backend).
    """

    block_size: int | None
    draft_sampling: bool
    verify_mode: str
    cost_table: CostTable | str | os.PathLike | None


DEFAULTS: dict[str, Any] = dict(stop_token_ids=None, chat_template=True, attention_impl="auto", temperature=0.0,
                                top_k=0, top_p=1.0, seed=0, batch_size=None, tuning=None, block_size=None,
                                draft_sampling=False, verify_mode="auto", cost_table=None)
SPECULATIVE_ONLY = frozenset(SpeculativeOptions.__annotations__) - frozenset(DecodeOptions.__annotations__)


# --------------------------------------------------------------------------------------------------
# Per-prompt values
# --------------------------------------------------------------------------------------------------

def _integer(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_max_new_tokens(max_new_tokens) -> None:
    if not _integer(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def check_batch_size(batch_size) -> None:
    if not _integer(batch_size) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def _per_row(value, n: int, name: str, default: float, valid, expected: str) -> np.ndarray:
    """One setting per row from a number, ``None`` (= ``default``, as HF and vLLM callers pass it) or one value
    per prompt; an error names the value that was given."""
    items = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(items) != n:
        raise ValueError(f"{name} must be a number or one value per prompt ({n} prompts), got {len(items)} "
                         f"values: {value!r}")
    out = np.empty(n, np.float64)
    for i, v in enumerate(items):
        v = default if v is None else v
        number = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        if not (number and np.isfinite(v) and valid(v)):
            raise ValueError(f"{name} must be {expected}, got {v!r}")
        out[i] = v
    return out


def sampling_params(n: int, temperature=None, top_k=None, top_p=None) -> SamplingParams:
    """Validated per-row sampling settings (HF meanings: temperature 0 = greedy, top_k 0 / top_p 1 = off;
    ``None`` = off), as host arrays: they reach the device once, padded to the batch's compiled shape."""
    t = _per_row(temperature, n, "temperature", 0.0, lambda v: v >= 0, ">= 0 (0 or None = greedy)")
    k = _per_row(top_k, n, "top_k", 0, lambda v: v >= 0 and v == int(v), "a non-negative integer (0 or None = off)")
    p = _per_row(top_p, n, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1] (1 or None = off)")
    return SamplingParams(t.astype(np.float32), k.astype(np.int32), p.astype(np.float32))


def max_new_per_row(max_new_tokens, n: int) -> np.ndarray:
    """``max_new_tokens`` (one value, or one per prompt) as [n] int64, each a positive integer."""
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        items = list(max_new_tokens)
        if len(items) != n:
            raise ValueError(f"max_new_tokens must be a number or one value per prompt ({n} prompts), got "
                             f"{len(items)} values")
    else:
        items = [max_new_tokens] * n
    for m in items:
        check_max_new_tokens(m)
    return np.asarray(items, np.int64).reshape(n)


@dataclasses.dataclass(frozen=True, eq=False)
class RowValues:
    """Per-prompt runtime values as host arrays (not part of any program key)."""

    max_new: np.ndarray  # [n] int64
    sampling: SamplingParams  # [n] each

    @staticmethod
    def build(n: int, max_new_tokens, temperature=None, top_k=None, top_p=None) -> "RowValues":
        sp = sampling_params(n, temperature, top_k, top_p)
        return RowValues(max_new_per_row(max_new_tokens, n), sp)

    def __len__(self) -> int:
        return len(self.max_new)

    def take(self, rows) -> "RowValues":
        """The values of prompts ``rows`` (indices)."""
        rows = np.asarray(rows)
        sp = self.sampling
        return RowValues(self.max_new[rows], SamplingParams(sp.temperature[rows], sp.top_k[rows], sp.top_p[rows]))


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Which sampling branches the programs compile (from every prompt of a call)."""

    sampled: bool = False  # some row has temperature > 0 (else the exact greedy path)
    draft_sampling: bool = False  # drafts drawn from the drafter's distribution (sampled runs only)
    top_k: bool = False  # some sampled row uses top-k
    top_p: bool = False  # some sampled row uses top-p

    @staticmethod
    def of(sp: SamplingParams, draft_sampling: bool) -> "SamplingFlags":
        sampled = bool((sp.temperature > 0).any())
        return SamplingFlags(sampled, sampled and bool(draft_sampling), sampled and bool((sp.top_k > 0).any()),
                             sampled and bool((sp.top_p < 1).any()))


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------

def check_prompts(prompts) -> list[Prompt]:
    """The prompts as a list, each a non-empty string, chat message list or token-id list; else one error
    naming the prompt. (Token ids are checked against the vocabulary when tokenized.)"""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts (strings, token-id lists or chat message lists), "
                        f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, p in enumerate(prompts):
        check_prompt(p, i)
    return list(prompts)


def check_prompt(p, i: int) -> None:
    if isinstance(p, str):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        return
    if _integer(p):
        raise TypeError(f"prompt {i} is a bare integer ({p!r}): prompts is a list of prompts, and a token-id "
                        f"prompt is itself a list (e.g. prompts=[[{p}]])")
    if isinstance(p, np.ndarray):
        if p.size and p.dtype.kind not in "iu":
            raise ValueError(f"prompt {i} must be text, a chat message list or token ids, got {p!r:.80}")
        return
    if not isinstance(p, Sequence) or isinstance(p, bytes):
        raise TypeError(f"prompt {i} must be text, a chat message list or a token-id list, got "
                        f"{type(p).__name__}")
    if len(p) and isinstance(p[0], dict):
        for j, m in enumerate(p):
            if not isinstance(m, dict):
                raise ValueError(f"prompt {i}: message {j} is not a {{'role', 'content'}} dict: {m!r:.80}")
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"prompt {i}: message {j} has role {m.get('role')!r}; a chat message's role is "
                                 f"one of {CHAT_ROLES}")
            if not isinstance(m.get("content"), (str, list)):
                raise ValueError(f"prompt {i}: message {j} ({m.get('role')}) has no text 'content'")
        return
    try:  # one vectorised check: a Python loop over every id costs tens of ms on large batches
        kind = np.asarray(p).dtype.kind if len(p) else "i"
    except ValueError:  # ragged nesting
        kind = "O"
    if kind not in "iu" or np.ndim(p) != 1:
        raise ValueError(f"prompt {i} must be text, a chat message list or token ids, got {p!r:.80}")


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------

def cost_table_id(table) -> str | None:
    """A hashable stand-in for a cost table argument: a table by its content's fingerprint, a file by its path
    and modification time (a recalibrated file is another table)."""
    if table is None:
        return None
    if isinstance(table, CostTable):
        return "table:" + hashlib.sha1(json.dumps(table.to_json(), sort_keys=True).encode()).hexdigest()
    if isinstance(table, (str, os.PathLike)):
        path = Path(table)
        return f"file:{path.resolve()}@{path.stat().st_mtime_ns if path.exists() else 'missing'}"
    raise TypeError(f"cost_table must be a dflash_jax.costs.CostTable, a .costs.json path or None, got "
                    f"{type(table).__name__}")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Everything a decode call was asked for, validated (see :class:`SpeculativeOptions`). Hashable: equal
    settings compile the same programs for the same models and shapes."""

    block_size: int = 1  # L: tokens verified per cycle (1: autoregressive)
    verify_mode: verify_modes.VerifyPolicy = verify_modes.STATIC  # as asked: auto is resolved per batch
    attention_impl: str = "xla"  # resolved from "auto" for the target's dtype on this backend
    sampling: SamplingFlags = SamplingFlags()
    draft_vocab: int | None = None  # the drafter's draft vocabulary size (None: the target's whole vocabulary)
    cost_table_id: str | None = None  # :func:`cost_table_id` of ``cost_table``
    stop_token_ids: tuple[int, ...] = ()
    batch_size: int | None = None  # continuous batching's pool rows (None: one batch)
    seed: int = 0
    chat_template: bool = True
    tuning: Tuning = dataclasses.field(default_factory=Tuning)
    cost_table: Any = dataclasses.field(default=None, compare=False, repr=False)  # as given (see cost_table_id)
    rows: RowValues | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def speculative(self) -> bool:
        return self.block_size > 1

    @classmethod
    def build(cls, target: "Target", drafter: "Drafter | None", n: int, max_new_tokens,
              **options) -> "DecodeSettings":
        """Validate ``options`` (:class:`SpeculativeOptions` with a drafter, :class:`DecodeOptions` without) for
        ``n`` prompts and ``max_new_tokens`` (one value or one per prompt) and build the settings."""
        allowed = SpeculativeOptions.__annotations__ if drafter is not None else DecodeOptions.__annotations__
        for name in options:
            if name not in allowed:
                why = " (speculative decoding only: pass a drafter)" if name in SPECULATIVE_ONLY else ""
                raise TypeError(f"unexpected keyword argument {name!r}{why}")
        o = {**DEFAULTS, **options}
        if drafter is not None:
            trained = drafter.config.verify_width
            size = trained if o["block_size"] is None else o["block_size"]
            if not _integer(size) or not 2 <= size <= trained:
                raise ValueError(f"block_size must be in [2, {trained}] for this drafter (an integer; trained "
                                 f"block size {trained}), got {o['block_size']!r}")
        else:
            size = 1
        rows = RowValues.build(n, max_new_tokens, o["temperature"], o["top_k"], o["top_p"])
        seed = o["seed"]
        if not _integer(seed):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        stops = target.stop_token_ids if o["stop_token_ids"] is None else o["stop_token_ids"]
        if isinstance(stops, (str, bytes)) or _integer(stops) or not isinstance(stops, (Sequence, np.ndarray)):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers), got {stops!r}")
        bad = [s for s in stops if not _integer(s) or s < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integer token ids, got {bad[0]!r} in {stops!r}")
        if not isinstance(o["chat_template"], (bool, np.bool_)):
            raise ValueError(f"chat_template must be True or False, got {o['chat_template']!r}")
        if not isinstance(o["draft_sampling"], (bool, np.bool_)):
            raise ValueError(f"draft_sampling must be True or False, got {o['draft_sampling']!r}")
        if not isinstance(o["attention_impl"], str) or o["attention_impl"] not in IMPLS:
            raise ValueError(f"attention_impl must be one of {IMPLS}, got {o['attention_impl']!r}")
        policy = verify_modes.by_name(o["verify_mode"])  # a name or a strategy; else one error naming the choices
        if o["batch_size"] is not None:
            check_batch_size(o["batch_size"])
        tuning = Tuning() if o["tuning"] is None else o["tuning"]
        if not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a dflash_jax.tuning.Tuning, got {type(tuning).__name__}")
        table_id = cost_table_id(o["cost_table"])
        return cls(block_size=int(size), verify_mode=policy if drafter is not None else verify_modes.STATIC,
                   attention_impl=resolve_impl(o["attention_impl"], target.model.dtype),
                   sampling=SamplingFlags.of(rows.sampling, o["draft_sampling"]),
                   draft_vocab=drafter.config.draft_vocab_size if drafter is not None else None,
                   cost_table_id=table_id, stop_token_ids=tuple(int(s) for s in stops),
                   batch_size=None if o["batch_size"] is None else int(o["batch_size"]), seed=int(seed),
                   chat_template=bool(o["chat_template"]), tuning=tuning, cost_table=o["cost_table"], rows=rows)

    def autoregressive(self) -> "DecodeSettings":
        """What :func:`dflash_jax.generate` would have been given for the same call: the same rows, sampling,
        stops, seed and tuning, without the drafter (its programs are ``generate``'s own)."""
        return dataclasses.replace(self, block_size=1, verify_mode=verify_modes.STATIC, draft_vocab=None,
                                   sampling=dataclasses.replace(self.sampling, draft_sampling=False))

    def with_rows(self, rows: RowValues) -> "DecodeSettings":
        """The same settings for other prompts' values (e.g. one batch of a run): the compiled sampling
        branches stay the run's."""
        return dataclasses.replace(self, rows=rows)

    def loop_spec(self, new_capacity: int, capture: tuple[int, ...], plan: "Plan | None",
                  verify_mode: verify_modes.VerifyMode, tiers: tuple[int, ...] = (), ar_step: bool = False) -> LoopSpec:
        """The decode loop's static spec for a batch: these settings plus what the batch fixes (its bucketed
        new-token capacity, the drafter's captured layers, the mesh plan, the verify mode resolved for it)."""
        s = self.sampling
        return LoopSpec(block_size=self.block_size, new_capacity=new_capacity, capture=capture,
                        impl=self.attention_impl, sampling=s.sampled, draft_sampling=s.draft_sampling,
                        top_k=s.top_k, top_p=s.top_p, plan=plan,
                        verify_mode=verify_mode, tiers=tiers, ar_step=ar_step, tuning=traced(self.tuning))


# Knobs the host has used up before a spec is built (the verify mode is resolved with them): the spec carries
# them at a fixed value, so that they do not split the program cache.
_HOST_ONLY = dict(auto_compact_ratio=1.0, ar_fallback=True, drafted_segment_cycles=128, probe_cycles=2,
                  fallback_steps=32, remember_acceptance=True, switching=SwitchTuning())


def traced(tuning: Tuning) -> Tuning:
    """``tuning`` as a loop spec carries it: its host-only knobs (:data:`_HOST_ONLY`) at a fixed value."""
    return dataclasses.replace(tuning, **_HOST_ONLY)
