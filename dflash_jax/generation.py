"""Public generation API: :func:`speculative_generate` and the autoregressive baseline :func:`generate`.

A thin client of the engine: the arguments become one :class:`~dflash_jax.settings.DecodeSettings` (every one
validated there), the prompts are tokenized, and :mod:`dflash_jax.engine` prepares, runs and collects the batch
(or, with more prompts than ``batch_size``, runs them through a continuous pool).
"""

from __future__ import annotations

from typing import Sequence, Unpack

from dflash_jax.engine import job as jobs
from dflash_jax.engine import pool
from dflash_jax.engine.job import GenerationOutput
from dflash_jax.engine.programs import compile_count
from dflash_jax.loading import Drafter, Target, as_drafter, as_target
from dflash_jax.settings import DecodeOptions, DecodeSettings, Prompt, SpeculativeOptions, check_prompts

__all__ = ["GenerationOutput", "Prompt", "compile_count", "decode", "generate", "speculative_generate"]


def decode(target: Target, drafter: Drafter | None, prompts: Sequence[Prompt], max_new_tokens,
           **options) -> GenerationOutput:
    """Validate, tokenize, and decode ``prompts`` in one batch or (more prompts than ``batch_size``) a pool."""
    if drafter is not None:
        drafter.config.check_target(target.config)
    prompts = check_prompts(prompts)
    settings = DecodeSettings.build(target, drafter, len(prompts), max_new_tokens, **options)
    ids = jobs.tokenize(target, prompts, settings.chat_template)
    if settings.batch_size is not None and len(ids) > settings.batch_size:
        return pool.run(target, drafter, ids, settings)
    return jobs.run(jobs.prepare(target, drafter, ids, settings))


def speculative_generate(target: Target, drafter: Drafter, prompts: Sequence[Prompt], max_new_tokens: int = 256,
                         **options: Unpack[SpeculativeOptions]) -> GenerationOutput:
    """Lossless DFlash speculative decoding: greedy output identical to :func:`generate`, sampled output with
    exactly the target's distribution — with fewer target calls.

    ``prompts``: strings (tokenized with the target's chat template), chat message lists, or token-id lists.
    ``max_new_tokens``: one value, or one per prompt. ``options``: :class:`dflash_jax.settings.SpeculativeOptions`
    — ``block_size``, ``stop_token_ids``, ``chat_template``, ``attention_impl``, ``temperature`` / ``top_k`` /
    ``top_p``, ``seed``, ``draft_sampling``, ``verify_mode``, ``cost_table``, ``batch_size`` (continuous
    batching) and ``tuning``. :func:`dflash_jax.speculative_stream` takes the same arguments and yields the
    output as it is made.
    """
    return decode(as_target(target), as_drafter(drafter), prompts, max_new_tokens, **options)


def generate(target: Target, prompts: Sequence[Prompt], max_new_tokens: int = 256,
             **options: Unpack[DecodeOptions]) -> GenerationOutput:
    """Plain autoregressive decoding with the same target code (the speed and correctness baseline);
    greedy by default. ``options``: :class:`dflash_jax.settings.DecodeOptions` (sampling, ``batch_size``, …
    as in :func:`speculative_generate`); :func:`dflash_jax.stream_generate` streams it."""
    return decode(as_target(target), None, prompts, max_new_tokens, **options)
