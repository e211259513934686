"""Public generation API: :func:`speculative_generate` and the autoregressive baseline :func:`generate`.

Host side only: validate and tokenize prompts, pick shape buckets, fetch (or compile once) the prefill and
decode programs, run them, and turn the final :class:`DecodeState` into Python lists. All device work is in
:mod:`dflash_jax.decode.loop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import attention
from dflash_jax.decode import loop
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.decode.state import LoopSpec
from dflash_jax.loading import Drafter, Target, as_drafter, as_target
from dflash_jax.tokenizer import TokenizerMissingError

Prompt = str | Sequence[int] | Sequence[dict]


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[list[int]]  # new tokens per prompt (a stop token is included when hit)
    texts: list[str | None]  # decoded new text (None when the target has no tokenizer)
    acceptance_lengths: list[list[int]]  # a+1 per cycle per prompt (all 1 for autoregressive decoding)
    tau: float  # mean acceptance length over all cycles of all prompts
    stats: dict[str, float]  # prefill_s, decode_s, compile_s, new_tokens, tokens_per_s, decode_tokens_per_s
    prompt_token_ids: list[list[int]]
    finish_reasons: list[str]  # "stop" (stop token) or "length" (max_new_tokens)


# --------------------------------------------------------------------------------------------------
# Compilation cache: one executable per (program, static settings, model graphs, argument shapes).
# --------------------------------------------------------------------------------------------------

_EXECUTABLES: dict[Any, Any] = {}
_COMPILE_COUNT = 0


def compile_count() -> int:
    """How many programs this process has compiled (tests use it to prove there are no recompiles)."""
    return _COMPILE_COUNT


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


def _executable(fn, static: dict, graphdefs, args: tuple, donate: tuple[int, ...] = (), mesh=None):
    global _COMPILE_COUNT
    # The default matmul precision is read at trace time (float32 dots: TF32 vs IEEE), so it keys programs too.
    key = (fn.__name__, tuple(sorted(static.items())), graphdefs, _signature(args),
           jax.config.jax_default_matmul_precision)
    exe = _EXECUTABLES.get(key)
    if exe is None:
        jitted = jax.jit(functools.partial(fn, **static), static_argnums=0,
                         donate_argnums=tuple(d + 1 for d in donate))
        # Trace under our (auto-axes) mesh, whatever mesh context the caller is in (e.g. an explicit one).
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            exe = jitted.lower(graphdefs, *args).compile()
        _EXECUTABLES[key] = exe
        _COMPILE_COUNT += 1
    return exe


# --------------------------------------------------------------------------------------------------
# Buckets and validation
# --------------------------------------------------------------------------------------------------

# Prompts longer than this are prefilled in chunks of this many positions (prompt buckets above 1024 are
# multiples of 1024, so it always divides them): bounds prefill attention memory for long contexts.
PREFILL_CHUNK = 1024


def bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two (≥ minimum) below 1024, to a multiple of 1024 above."""
    if n <= 1024:
        return max(minimum, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


def _tokenize(target: Target, prompts: Sequence[Prompt], chat: bool) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts (strings, token-id lists or chat message lists)")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    vocab = target.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) or (isinstance(p, Sequence) and p and isinstance(p[0], dict)):
            if target.tokenizer is None:
                raise TokenizerMissingError(
                    f"prompt {i} is text but target {target.name!r} was loaded without tokenizer files; "
                    "pass token ids instead")
            if isinstance(p, str) and not p:
                raise ValueError(f"prompt {i} is empty")
            ids = target.tokenizer.encode(p, chat=chat)
        else:
            ids = [int(t) for t in np.asarray(p).reshape(-1)]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        out.append(ids)
    return out


def check_max_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def _per_row(value, n: int, name: str, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full((n,), arr)
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a number or one value per prompt ({n}), got shape {arr.shape}")
    return arr.astype(dtype)


def sampling_params(n: int, temperature, top_k, top_p) -> SamplingParams:
    """Validated per-row sampling settings (HF meanings: temperature 0 = greedy, top_k 0 / top_p 1 = off),
    as host arrays: they reach the device once, padded to the batch's compiled shape (see ``prepare``)."""
    t = _per_row(temperature, n, "temperature", np.float32)
    k = _per_row(top_k, n, "top_k", np.float64)
    p = _per_row(top_p, n, "top_p", np.float32)
    if (t < 0).any() or not np.isfinite(t).all():
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t[(t < 0) | ~np.isfinite(t)][0]}")
    if (k < 0).any() or (k != np.round(k)).any():
        raise ValueError(f"top_k must be a non-negative integer (0 = off), got {k[(k < 0) | (k != np.round(k))][0]}")
    if ((p <= 0) | (p > 1) | ~np.isfinite(p)).any():
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p[(p <= 0) | (p > 1) | ~np.isfinite(p)][0]}")
    return SamplingParams(t, k.astype(np.int32), p)


# --------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    """One batch prepared on the host: shapes bucketed, programs compiled (or fetched from the cache).

    :func:`launch` dispatches it without waiting (JAX async dispatch), so the host can prepare the next batch
    while the device decodes this one; :func:`collect` fetches the results.
    """

    target: Target
    drafter: Drafter | None
    ids: list[list[int]]  # real rows only
    stops: tuple[int, ...]
    graphdefs: tuple
    params: tuple
    pre_args: tuple
    spec: LoopSpec
    capacity: int
    mask_id: int
    pre_exe: Any = None
    compile_s: float = 0.0


def prepare(target: Target, drafter: Drafter | None, ids: list[list[int]], *, max_new_tokens, block_size: int,
            stop_token_ids=None, attention_impl: str = "auto", temperature=0.0, top_k=0, top_p=1.0, seed: int = 0,
            draft_sampling: bool = False, pad_batch_to: int | None = None) -> Job:
    """Validate and bucket one batch of token-id prompts. ``max_new_tokens``: one value or one per row.

    ``pad_batch_to`` adds finished dummy rows so that every batch of a run has the same compiled shape.
    """
    cfg = target.config
    n = len(ids)
    max_new = _per_row(max_new_tokens, n, "max_new_tokens", np.int64)
    for m in np.unique(max_new):
        check_max_new_tokens(int(m))
    sp = sampling_params(n, temperature, top_k, top_p)
    lens = [len(p) for p in ids]
    worst = int(np.max(np.asarray(lens) + max_new))
    if worst > cfg.max_position_embeddings:
        i = int(np.argmax(np.asarray(lens) + max_new))
        raise ValueError(f"prompt of {lens[i]} tokens + max_new_tokens {int(max_new[i])} exceeds the model's "
                         f"maximum length {cfg.max_position_embeddings}")
    stops = target.stop_token_ids if stop_token_ids is None else tuple(int(s) for s in stop_token_ids)

    from dflash_jax import sharding as shd

    if drafter is not None and drafter.mesh is not target.mesh:
        raise shd.ShardingError("the target and the drafter must be placed on the same mesh (load the drafter "
                                "with the target: load_drafter(..., target=target) inherits its mesh)")
    dp = shd.mesh_size(target.mesh, "dp")
    b = max(n, pad_batch_to or 0)
    b = -(-b // dp) * dp  # batch rows split evenly over dp
    pad = b - n
    p = bucket(max(lens))
    new_cap = bucket(int(max_new.max()))
    capacity = -(-(p + new_cap + block_size) // 16) * 16
    prompt = np.zeros((b, p), np.int32)
    for i, row in enumerate(ids):
        prompt[i, : len(row)] = row
    lens_arr = np.asarray(lens + [1] * pad, np.int32)  # dummy rows: one token, one new token, discarded
    max_arr = np.concatenate([max_new, np.ones(pad, np.int64)]).astype(np.int32)
    stop_arr = np.full((bucket(max(len(stops), 1), 8),), -1, np.int32)
    stop_arr[: len(stops)] = stops
    if pad:  # on the host: eager device ops would compile anew for each partial batch's row count
        sp = SamplingParams(*(np.concatenate([x, np.repeat(x[-1:], pad)]) for x in
                              (sp.temperature, sp.top_k, sp.top_p)))

    impl = attention.resolve_impl(attention_impl, target.model.dtype)
    capture = drafter.config.target_layer_ids if drafter is not None else ()
    sampled = bool((np.asarray(sp.temperature) > 0).any())
    spec = LoopSpec(block_size=block_size, new_capacity=new_cap, capture=tuple(capture), impl=impl,
                    prefill_chunk=PREFILL_CHUNK,
                    sampling=sampled, draft_sampling=sampled and draft_sampling,
                    top_k=sampled and bool((np.asarray(sp.top_k) > 0).any()),
                    top_p=sampled and bool((np.asarray(sp.top_p) < 1).any()),
                    plan=shd.make_plan(target.mesh, cfg, drafter.config.layers if drafter is not None else None))
    with jax.set_mesh(spec.plan.mesh) if spec.plan else contextlib.nullcontext():  # see _executable
        rng = jax.random.split(jax.random.key(seed), b) if sampled else None
        tgd, tparams = nnx.split(target.model)
        if drafter is not None:
            dgd, dparams = nnx.split(drafter.model)
            mask_id = drafter.config.mask_token_id
        else:
            dgd, dparams, mask_id = None, None, 0
        graphdefs, params = (tgd, dgd), (tparams, dparams)
        rows = (lambda x: jax.device_put(x, spec.plan.rows(np.ndim(x)))) if spec.plan else jnp.asarray
        pre_args = (params, rows(prompt), rows(lens_arr), rows(max_arr), jnp.asarray(stop_arr),
                    rows(rng) if rng is not None else None,
                    jax.tree.map(rows, sp) if sampled else None)
    job = Job(target, drafter, ids, stops, graphdefs, params, pre_args, spec, capacity, mask_id)
    t0 = time.perf_counter()
    job.pre_exe = _executable(loop.prefill_fn, {"spec": spec, "capacity": capacity}, graphdefs, pre_args,
                              mesh=spec.plan.mesh if spec.plan else None)
    job.compile_s = time.perf_counter() - t0
    return job


def _decode_exe(job: Job, state):
    t0 = time.perf_counter()
    exe = _executable(loop.decode_fn, {"spec": job.spec, "mask_token_id": job.mask_id}, job.graphdefs,
                      (job.params, state), donate=(1,), mesh=job.spec.plan.mesh if job.spec.plan else None)
    job.compile_s += time.perf_counter() - t0
    return exe


def compile_decode(job: Job) -> None:
    """Compile (or fetch) the decode program of ``job`` now, from the prefill program's output shapes, so
    that ``launch`` finds it ready (callers that must not compile between device work, e.g. the batch
    command, call this first)."""
    _decode_exe(job, job.pre_exe.out_info)


def launch(job: Job):
    """Dispatch prefill + decode; returns the (not yet computed) final DecodeState."""
    state = job.pre_exe(*job.pre_args)
    return _decode_exe(job, state)(job.params, state)


def collect(job: Job, state, stats: dict | None = None) -> GenerationOutput:
    """Fetch a finished batch's results (blocks until the device is done with it)."""
    n = len(job.ids)
    tokens, num_new, acc, cycles = jax.device_get((state.tokens, state.num_new, state.acc_lens, state.num_cycles))
    token_ids = [tokens[i, : num_new[i]].tolist() for i in range(n)]
    acc_lens = [acc[i, : cycles[i]].tolist() for i in range(n)]
    stop_set = set(job.stops)
    finish = ["stop" if t and t[-1] in stop_set else "length" for t in token_ids]
    tok = job.target.tokenizer
    texts = [tok.decode(t) if tok else None for t in token_ids]
    all_acc = [a for row in acc_lens for a in row]
    stats = dict(stats or {})
    stats.setdefault("compile_s", job.compile_s)
    stats["new_tokens"] = int(num_new[:n].sum())
    stats["cycles"] = int(cycles[:n].max(initial=0))
    return GenerationOutput(token_ids, texts, acc_lens, float(np.mean(all_acc)) if all_acc else 0.0, stats,
                            job.ids, finish)


def _run(target: Target, drafter: Drafter | None, prompts, *, chat: bool, **kw) -> GenerationOutput:
    """Tokenize, prepare, then run prefill and decode with a sync between them (for the timing stats)."""
    n = len(prompts) if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)) else 0
    sampling_params(max(n, 1), kw.get("temperature", 0.0), kw.get("top_k", 0), kw.get("top_p", 1.0))
    check_max_new_tokens(kw["max_new_tokens"])
    ids = _tokenize(target, prompts, chat)
    job = prepare(target, drafter, ids, **kw)
    t1 = time.perf_counter()
    state = jax.block_until_ready(job.pre_exe(*job.pre_args))
    t2 = time.perf_counter()
    exe = _decode_exe(job, state)
    t3 = time.perf_counter()
    state = jax.block_until_ready(exe(job.params, state))
    t4 = time.perf_counter()
    prefill_s, decode_s = t2 - t1, t4 - t3
    out = collect(job, state, {"prefill_s": prefill_s, "decode_s": decode_s, "compile_s": job.compile_s})
    total, b = out.stats["new_tokens"], len(ids)
    out.stats["tokens_per_s"] = total / max(prefill_s + decode_s, 1e-9)
    out.stats["decode_tokens_per_s"] = (total - b) / max(decode_s, 1e-9)
    return out


def speculative_generate(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 256,
    *,
    block_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    chat_template: bool = True,
    attention_impl: str = "auto",
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int = 0,
    draft_sampling: bool = False,
) -> GenerationOutput:
    """Lossless DFlash speculative decoding: greedy output identical to :func:`generate`, sampled output with
    exactly the target's distribution — with fewer target calls.

    ``prompts``: strings (tokenized with the target's chat template), chat message lists, or token-id lists.
    ``block_size`` (default: the drafter's trained size) may be any value in ``2 … trained size``.
    ``stop_token_ids`` defaults to the target's end-of-turn ids; pass ``[]`` to disable stopping.
    ``temperature`` / ``top_k`` / ``top_p``: HF meanings, a value for all prompts or one per prompt
    (temperature 0 = greedy). ``seed`` makes sampled runs reproducible. ``draft_sampling``: draw drafts
    from the drafter's own distribution (accept with min(1, p/q)) instead of taking its argmax.
    """
    target, drafter = as_target(target), as_drafter(drafter)
    drafter.config.check_target(target.config)
    trained = drafter.config.block_size
    block_size = trained if block_size is None else int(block_size)
    if not 2 <= block_size <= trained:
        raise ValueError(f"block_size must be in [2, {trained}] for this drafter (trained block size "
                         f"{trained}), got {block_size}")
    return _run(target, drafter, prompts, max_new_tokens=max_new_tokens, block_size=block_size,
                stop_token_ids=stop_token_ids, chat=chat_template, attention_impl=attention_impl,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, draft_sampling=draft_sampling)


def generate(
    target: Target,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 256,
    *,
    stop_token_ids: Sequence[int] | None = None,
    chat_template: bool = True,
    attention_impl: str = "auto",
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int = 0,
) -> GenerationOutput:
    """Plain autoregressive decoding with the same target code (the speed and correctness baseline);
    greedy by default, sampling with the same options as :func:`speculative_generate`."""
    return _run(as_target(target), None, prompts, max_new_tokens=max_new_tokens, block_size=1,
                stop_token_ids=stop_token_ids, chat=chat_template, attention_impl=attention_impl,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
