"""Reduced draft vocabularies: rank a target's tokens by how often answers use them, and keep the top N.

A DFlash drafter scores every draft position against the target's whole vocabulary: one read of the
``[V, D]`` LM head per drafted step (113 MB for SmolLM2's 49,152 × 576 in float32), whatever the number of
drafts verified. On a CPU that read is a sizeable part of each speculative step, and most of the vocabulary is
never drafted usefully: the 16,384 most frequent tokens of ShareGPT's answers cover 97 % of them for SmolLM2.
:func:`dflash_jax.loading.restrict_draft_vocab` makes the drafter propose among such a set only (decoding stays
exactly lossless; τ falls a little where answers use rarer tokens). A pair config names a ranking and the size
to keep per backend (``draft_vocab`` in :mod:`dflash_jax.pairs`); ``dflash-jax draft-vocab`` writes a ranking
(counting :func:`dflash_jax.train.data.sharegpt_answers`).

Ranking file (``.npz``): ``ids`` [N] int32, token ids by decreasing count; ``counts`` [N] int64; ``vocab_size``
(the tokenizer's, checked against the target); ``source`` (what was counted).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Iterable

import numpy as np

from dflash_jax.config import ConfigError

ASSETS = Path(__file__).parent / "assets" / "token_rankings"


def token_ranking(tokenizer, texts: Iterable[str], *, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts): every token id seen in ``texts`` (encoded without a chat template), most frequent first
    (ties by id)."""
    counts: collections.Counter = collections.Counter()
    if progress:
        from tqdm import tqdm

        texts = tqdm(texts, desc="counting tokens", unit=" texts")
    for text in texts:
        counts.update(tokenizer.encode(text, chat=False))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return np.array([i for i, _ in ranked], np.int32), np.array([c for _, c in ranked], np.int64)


def save_ranking(path: str | Path, ids: np.ndarray, counts: np.ndarray, vocab_size: int, source: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, ids=ids.astype(np.int32), counts=counts.astype(np.int64),
                        vocab_size=np.int64(vocab_size), source=np.str_(source))
    return path


def resolve_ranking(ref: str, relative_to: str | Path | None = None) -> Path:
    """``embedded:<name>`` (``dflash_jax/assets/token_rankings/<name>.npz``) or a path (relative paths from the
    folder of ``relative_to``, a pair config)."""
    if ref.startswith("embedded:"):
        return ASSETS / f"{ref.partition(':')[2]}.npz"
    path = Path(ref).expanduser()
    if not path.is_absolute() and relative_to is not None:
        path = Path(relative_to).parent / path
    return path


def top_ids(path: str | Path, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` most frequent token ids of the ranking at ``path``, for a target of ``vocab_size``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"token ranking {path} does not exist (write one with `dflash-jax draft-vocab`)")
    with np.load(path) as f:
        ids, ranked_vocab = f["ids"], int(f["vocab_size"])
    if ranked_vocab != vocab_size:
        raise ConfigError(f"token ranking {path} counts a {ranked_vocab}-token vocabulary; the target has "
                          f"{vocab_size}")
    if not 0 < size <= len(ids):
        raise ConfigError(f"draft vocabulary size {size}: the ranking {path} holds {len(ids)} tokens")
    return ids[:size]


def coverage(path: str | Path, sizes: Iterable[int]) -> dict[int, float]:
    """Share of the counted tokens that the top ``n`` ids cover, for each ``n``."""
    with np.load(path) as f:
        counts = f["counts"]
    total = counts.sum()
    return {int(n): float(counts[:n].sum() / total) for n in sizes}
