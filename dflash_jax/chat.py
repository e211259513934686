"""``dflash-jax chat``: an interactive terminal chat whose answers stream as they are decoded.

Multi-turn (the whole conversation goes through the target's chat template each turn), ``/reset`` starts
over, ``/exit`` or end of input ends the chat, and Ctrl-C stops the answer being written (the chat goes on;
the part already shown stays in the conversation). After each answer: τ, tokens and tokens/s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from dflash_jax.loading import Drafter, Target
from dflash_jax.streaming import TokenStream, speculative_stream, stream_generate
from dflash_jax.tuning import Tuning

HELP = "/reset clears the conversation · /exit (or Ctrl-D) ends the chat · Ctrl-C stops an answer"


def run_chat(target: Target, drafter: Drafter | None, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
             system: str | None = None, max_new_tokens: int = 512, temperature: float | None = 0.0,
             top_k: int | None = 0, top_p: float | None = 1.0, seed: int = 0, block_size: int | None = None,
             attention_impl: str = "auto", verify_mode: str = "auto", tuning: Tuning | None = None) -> int:
    """The chat loop over ``stdin`` / ``stdout`` (the terminal by default); ``drafter=None`` decodes
    autoregressively; the decode options as :func:`dflash_jax.speculative_generate`'s. Returns the exit
    status."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if target.tokenizer is None:
        raise ValueError(f"target {target.name!r} has no tokenizer: chat needs one")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    mode = f"speculative, drafter {Path(drafter.name).name}" if drafter is not None else "autoregressive"
    print(f"Chat with {target.name} ({mode}). {HELP}", file=stdout, flush=True)
    turn = 0
    while True:
        print("\n> ", end="", file=stdout, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:  # end of input
            print(file=stdout)
            return 0
        if not _interactive(stdin):
            print(line.rstrip("\n"), file=stdout)  # echo piped input, so the transcript reads like a terminal's
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(start)
            print("(conversation cleared)", file=stdout, flush=True)
            continue
        if text.startswith("/"):
            print(f"unknown command {text!r}: {HELP}", file=stdout, flush=True)
            continue
        messages.append({"role": "user", "content": text})
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  seed=seed + turn, attention_impl=attention_impl, tuning=tuning)
        try:
            stream = (speculative_stream(target, drafter, [messages], block_size=block_size,
                                         verify_mode=verify_mode, **kw)
                      if drafter is not None else stream_generate(target, [messages], **kw))
        except ValueError as e:  # e.g. the conversation no longer fits the model's context
            messages.pop()
            print(f"error: {e}\n(/reset starts a new conversation)", file=stdout, flush=True)
            continue
        turn += 1
        reply, stopped = _show_answer(stream, stdout)
        messages.append({"role": "assistant", "content": reply})
        print(f"\n[{_summary(stream, stopped)}]", file=stdout, flush=True)


def _interactive(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _show_answer(stream: TokenStream, stdout: TextIO) -> tuple[str, bool]:
    """Print the answer as it streams; Ctrl-C stops it. Returns (the text shown, whether it was stopped)."""
    pieces = []
    try:
        for chunk in stream:
            pieces.append(chunk.texts[0])
            print(chunk.texts[0], end="", file=stdout, flush=True)
        return "".join(pieces), False
    except KeyboardInterrupt:
        stream.close()
        return "".join(pieces), True


def _summary(stream: TokenStream, stopped: bool) -> str:
    if stopped or stream.output is None:
        return "stopped"
    out = stream.output
    s = out.stats
    parts = [f"τ {out.tau:.2f}", f"{s['new_tokens']} tokens", f"{s['tokens_per_s']:.1f} tokens/s",
             f"first token {s['time_to_first_token_s'] * 1e3:.0f} ms", f"finish: {out.finish_reasons[0]}"]
    if s.get("compile_s", 0) > 0.5:
        parts.append(f"compiled {s['compile_s']:.1f} s first")
    return " · ".join(parts)
