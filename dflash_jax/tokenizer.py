"""Tokenizer and chat template (from transformers), with a clear error when a checkpoint has none."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("dflash_jax")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _auto(directory: Path, **kw):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False, **kw)


def cache_dir() -> Path:
    """Where converted tokenizers (and, from the CLI, compiled programs) are kept: ``$DFLASH_JAX_CACHE`` or
    ``~/.cache/dflash_jax``."""
    return Path(os.environ.get("DFLASH_JAX_CACHE") or Path.home() / ".cache" / "dflash_jax")


def _from_gguf(path: Path):
    """transformers builds a GGUF's tokenizer by parsing the whole file (~5 s for SmolLM2's 49k-token
    vocabulary). The result is saved once as ordinary tokenizer files, keyed by the file's name, size and
    mtime, and later loads read those (~0.3 s). If the cache cannot be written, loading still works."""
    st = path.stat()
    cached = cache_dir() / "tokenizers" / f"{path.name}-{st.st_size}-{st.st_mtime_ns}"
    if (cached / "tokenizer.json").is_file():
        try:
            return _auto(cached)
        except Exception as e:
            log.info("ignoring the unreadable tokenizer cache %s (%s)", cached, e)
    hf = _auto(path.parent, gguf_file=path.name)
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        hf.save_pretrained(str(tmp))
        os.replace(tmp, cached)  # atomic: a concurrent load sees the whole directory or none
    except OSError as e:  # read-only home, a full disk, or another process cached it first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("could not cache the tokenizer of %s in %s (%s)", path, cached, e)
    return hf


class TokenizerMissingError(ValueError):
    """A string prompt was given for a model loaded without tokenizer files."""


class Tokenizer:
    """Thin wrapper: chat-templated encoding of prompts and decoding of generated ids."""

    def __init__(self, hf_tokenizer, chat_template_kwargs: dict[str, Any] | None = None):
        self.hf = hf_tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @staticmethod
    def from_dir(directory: Path, gguf_file: str | None = None, **chat_kwargs) -> "Tokenizer | None":
        if gguf_file is None and not any((directory / f).is_file() for f in _TOKENIZER_FILES):
            return None
        try:
            hf = _from_gguf(directory / gguf_file) if gguf_file else _auto(directory)
        except Exception as e:  # a broken tokenizer should not make the weights unusable
            log.warning("could not load a tokenizer from %s (%s); only token-id prompts will work", directory, e)
            return None
        return Tokenizer(hf, chat_kwargs)

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-turn ids: the tokenizer's eos plus the chat end markers of the families we serve."""
        vocab = self.hf.get_vocab()
        markers = ("<|im_end|>", "<|eot_id|>", "<|return|>", "<|call|>")  # gpt-oss (harmony): answer, tool call
        ids = [self.hf.eos_token_id] + [vocab.get(t) for t in markers]
        return sorted({int(i) for i in ids if i is not None})

    def encode(self, prompt: str | Sequence[dict], *, chat: bool = True) -> list[int]:
        """A user message (or a whole chat) → ids, with the chat template when the tokenizer has one."""
        if isinstance(prompt, str) and not (chat and self.hf.chat_template):
            return list(self.hf.encode(prompt))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          **self.chat_template_kwargs)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def user_turn_prefix(self) -> list[int]:
        """The chat template's ids up to where a user message's text begins (system turn, user header): what
        a model continues with a user message of its own when asked to write one (self-synthesised prompts)."""
        if not self.hf.chat_template:
            raise ValueError("the tokenizer has no chat template: there is no user turn to begin")
        marker = "\u2063USER-TEXT\u2063"
        text = self.hf.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False,
                                           tokenize=False, **self.chat_template_kwargs)
        return list(self.hf.encode(text[: text.index(marker)], add_special_tokens=False))


class IncrementalDetokenizer:
    """Text of a growing id sequence, piece by piece: the pieces concatenated equal ``decode(all ids)``.

    Each push decodes the ids so far and hands out what was not handed out yet, holding back a trailing
    incomplete character (U+FFFD: its bytes span tokens still to come) and trailing whitespace (a tokenizer
    that cleans up spaces, " ." → ".", may still drop it). ``final=True`` hands out the rest.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: len(text.rstrip())]
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""  # nothing new (or an earlier piece would change: wait for more ids)
        piece = text[len(self.emitted):]
        self.emitted = text
        return piece
