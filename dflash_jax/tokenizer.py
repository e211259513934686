"""Tokenizer and chat template (from transformers), with a clear error when a checkpoint has none."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("dflash_jax")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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
        from transformers import AutoTokenizer

        kw = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            hf = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False, **kw)
        except Exception as e:  # a broken tokenizer should not make the weights unusable
            log.warning("could not load a tokenizer from %s (%s); only token-id prompts will work", directory, e)
            return None
        return Tokenizer(hf, chat_kwargs)

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-turn ids: the tokenizer's eos plus the chat end markers of the families we serve."""
        vocab = self.hf.get_vocab()
        ids = [self.hf.eos_token_id] + [vocab.get(t) for t in ("<|im_end|>", "<|eot_id|>")]
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
