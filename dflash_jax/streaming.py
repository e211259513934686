"""Streaming: :func:`speculative_stream` and :func:`stream_generate` yield the output while it is made.

The device runs the same prefill and decode programs as a whole call (:mod:`dflash_jax.engine.job`), the decode
loop in segments of a few cycles (its ``max_cycles`` is a runtime argument, so streamed and whole calls commit
identical tokens, greedy or sampled). A worker thread dispatches the segments back to back and hands each
segment's packed view over with its device-to-host copy already started; the caller's thread fetches the
:class:`DecodeView` and turns new token ids into text. On a GPU a decode call returns only when its while loop
is done, which is why dispatching lives on its own thread: the device never waits for the host's text work.

The worker stays at most two segments ahead of the reader, so a caller that stops reading (``break``,
``close()``, or dropping the iterator) stops the device work within two segments.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
import weakref
from typing import Any, Sequence, Unpack

import jax
import numpy as np

from dflash_jax.engine import job as jobs
from dflash_jax.engine.job import GenerationOutput, Job
from dflash_jax.loading import Drafter, Target, as_drafter, as_target
from dflash_jax.settings import DecodeOptions, Prompt, SpeculativeOptions
from dflash_jax.tokenizer import IncrementalDetokenizer

# Cycles per segment (see _Pacer): one for an early first chunk, then `segment_cycles` each, or, by default, as
# many as take about SEGMENT_S. Each device call has a fixed cost (a millisecond or two for a small model's
# few hundred parameter buffers), so a stream's cost is its segment count.
SEGMENT_S = 0.1
_MAX_SEGMENT_CYCLES = 1024


@dataclasses.dataclass
class StreamChunk:
    """What one segment added, per prompt."""

    token_ids: list[list[int]]  # new ids since the previous chunk
    texts: list[str | None]  # new text since the previous chunk (None without a tokenizer)
    finished: list[bool]  # the prompt's generation has ended (in this chunk or before)
    finish_reasons: list[str | None]  # "stop" / "length" once finished, else None


_END = object()


class TokenStream:
    """Iterator of :class:`StreamChunk`. ``output`` is the :class:`GenerationOutput` once the stream ended
    (identical to the non-streamed call's, plus ``stats['time_to_first_token_s']``); ``close()`` (or leaving a
    ``with`` block, or dropping the iterator) stops the device work."""

    def __init__(self, job: Job, segment_cycles: int | None = None):
        if segment_cycles is not None and (isinstance(segment_cycles, bool) or not isinstance(
                segment_cycles, (int, np.integer)) or segment_cycles < 1):
            raise ValueError(f"segment_cycles must be a positive integer or None (adaptive), got {segment_cycles!r}")
        self.output: GenerationOutput | None = None
        self._job = job
        n = len(job.ids)
        tok = job.target.tokenizer
        self._seen = np.zeros(n, np.int64)  # tokens already yielded, per prompt
        self._finished = np.zeros(n, bool)
        self._text = [IncrementalDetokenizer(tok) if tok else None for _ in range(n)]
        self._channel = _Channel(capacity=1)
        self._t0 = time.perf_counter()
        self._first_token_s: float | None = None
        self._segments = [0]  # decode segments dispatched (the worker counts)
        self._worker = threading.Thread(target=_dispatch_segments, name="dflash-stream", daemon=True,
                                        args=(job, segment_cycles and int(segment_cycles), self._channel,
                                              self._segments))
        self._worker.start()
        # Dropping the iterator stops the worker (it holds no reference to this object).
        self._finalizer = weakref.finalize(self, _stop_worker, self._channel, self._worker)

    def __iter__(self) -> "TokenStream":
        return self

    @property
    def segments(self) -> int:
        """Decode segments dispatched so far."""
        return self._segments[0]

    def __next__(self) -> StreamChunk:
        while True:
            if self.output is not None or self._channel.closed:
                raise StopIteration
            item = self._channel.get()
            if item is _END:
                self.close()
                raise StopIteration
            if isinstance(item, BaseException):
                self.close()
                raise item
            chunk = self._chunk(jobs.fetch_view(self._job, item))
            if chunk is not None:
                return chunk

    def _chunk(self, view) -> StreamChunk | None:
        """New tokens and text of every prompt since the previous chunk; None when nothing happened."""
        n = len(self._job.ids)
        tokens, num_new, done = view.tokens, view.num_new[:n], view.done[:n]
        ids = [tokens[i, self._seen[i]: num_new[i]].tolist() for i in range(n)]
        newly_done = done & ~self._finished
        if not any(ids) and not newly_done.any():
            return None
        if self._first_token_s is None:
            self._first_token_s = time.perf_counter() - self._t0
        texts = [d.push(new, final=bool(f)) if d is not None else None
                 for d, new, f in zip(self._text, ids, done)]
        self._seen = np.asarray(num_new, np.int64)
        self._finished = np.asarray(done, bool)
        reasons = jobs.finish_reasons([tokens[i, num_new[i] - 1: num_new[i]].tolist() for i in range(n)],
                                      self._job.stops)
        if self._finished.all():
            self._finish(view)
        return StreamChunk(ids, texts, self._finished.tolist(),
                           [r if f else None for r, f in zip(reasons, self._finished)])

    def _finish(self, view) -> None:
        wall = time.perf_counter() - self._t0
        out = jobs.collect(self._job, view)
        total, b = out.stats["new_tokens"], len(self._job.ids)
        prefill_s = self._first_token_s or 0.0
        out.stats.update(time_to_first_token_s=self._first_token_s, wall_s=wall, prefill_s=prefill_s,
                         decode_s=wall - prefill_s, tokens_per_s=total / max(wall, 1e-9),
                         decode_tokens_per_s=(total - b) / max(wall - prefill_s, 1e-9), segments=self.segments)
        self.output = out
        self._channel.close()  # the worker ends by itself (it may be in one last, empty segment)

    def close(self) -> None:
        """Stop the device work (at most one segment still runs) and release the stream's state."""
        self._finalizer()

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Channel:
    """A bounded hand-over from the worker to the reader that ``close()`` empties and wakes at once (a
    ``queue.Queue`` can only be left by polling with timeouts, which cost a stream up to a poll period)."""

    def __init__(self, capacity: int):
        self.items: collections.deque = collections.deque()
        self.capacity = capacity
        self.closed = False
        self.cv = threading.Condition()

    def put(self, item: Any) -> bool:
        """False once closed (the worker then stops)."""
        with self.cv:
            while len(self.items) >= self.capacity and not self.closed:
                self.cv.wait()
            if self.closed:
                return False
            self.items.append(item)
            self.cv.notify_all()
            return True

    def get(self) -> Any:
        with self.cv:
            while not self.items and not self.closed:
                self.cv.wait()
            if not self.items:
                return _END
            item = self.items.popleft()
            self.cv.notify_all()
            return item

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.items.clear()
            self.cv.notify_all()


def _stop_worker(channel: _Channel, worker: threading.Thread) -> None:
    """Close the channel and wait for the worker, which returns after the device call it is in, if any."""
    channel.close()
    worker.join()


class _Pacer:
    """Cycles per segment: one for an early first chunk, then (once a cycle's time is known from this stream, or
    from the last stream that ran the same programs) as many as take about ``SEGMENT_S``, rounded down to a
    power of two so that the few cycle counts a stream uses stay on the device (no copy per call); doubling until
    then. A fixed ``segment_cycles`` is used as given after the first segment."""

    _CYCLE_S: dict[int, float] = {}  # id(decode program) → seconds per cycle measured by the last stream

    def __init__(self, decode, segment_cycles: int | None):
        self.key, self.fixed = id(decode), segment_cycles
        sharding = decode.input_shardings[0][-1]
        self._on_device = functools.lru_cache(maxsize=None)(lambda c: jax.device_put(np.int32(c), sharding))
        self.cycle_s = self._CYCLE_S.get(self.key)
        self.sizes: list[int] = []  # cycles of each segment dispatched
        self.ends: dict[int, float] = {}  # segment index → when its results were seen to be ready

    def next_cycles(self):
        if not self.sizes:
            c = 1
        elif self.fixed:
            c = self.fixed
        elif self.cycle_s is None:
            c = min(2 * self.sizes[-1], _MAX_SEGMENT_CYCLES)
        else:
            c = 1 << int(np.log2(np.clip(SEGMENT_S / self.cycle_s, 1, _MAX_SEGMENT_CYCLES)))
        self.sizes.append(c)
        return self._on_device(c)

    def ready(self, k: int) -> None:
        """Segment ``k``'s results are ready now: the time since segment ``k - 1``'s were is its duration."""
        self.ends.setdefault(k, time.perf_counter())
        if k - 1 in self.ends:
            self.cycle_s = self._CYCLE_S[self.key] = (self.ends[k] - self.ends[k - 1]) / self.sizes[k]


def _dispatch_segments(job: Job, segment_cycles: int | None, out: _Channel, count: list[int]) -> None:
    """Worker thread: prefill, then decode segments back to back until ``out`` closes (the reader closes it once
    every row is done, or when it stops reading).

    Each segment's packed view is handed to the reader (its device-to-host copy started) before the next segment
    is dispatched: the reader fetches and decodes it while the device runs on. On a GPU a decode call returns
    once its while loop is done, so the worker's only gap on the device is the next call's dispatch; on a CPU the
    call returns at once, and the worker waits for the previous segment after dispatching the next, which keeps
    it at most one segment ahead (a reader that stops costs at most that)."""
    try:
        pacer = _Pacer(job.programs.decode, segment_cycles)
        state, _ = job.programs.prefill(*job.pre_args)
        previous = None
        while True:
            state, packed = job.decoder(state, pacer.next_cycles())
            k = count[0]
            count[0] += 1
            if packed.is_ready():  # a GPU: the call returned with its segment done
                pacer.ready(k)
            packed.copy_to_host_async()
            if not out.put(packed):
                break
            if previous is not None:
                previous.block_until_ready()
                pacer.ready(k - 1)
            previous = packed
    except BaseException as e:  # handed to the reader's thread
        out.put(e)


def _stream(target: Target, drafter: Drafter | None, prompts, max_new_tokens, segment_cycles: int | None,
            options: dict) -> TokenStream:
    if options.get("batch_size") is not None:
        raise ValueError("batch_size: a stream decodes its prompts in one batch (continuous batching is for "
                         "whole calls: speculative_generate / generate)")
    if drafter is not None:
        drafter.config.check_target(target.config)
    return TokenStream(jobs.make(target, drafter, prompts, max_new_tokens, **options), segment_cycles)


def speculative_stream(target: Target, drafter: Drafter, prompts: Sequence[Prompt], max_new_tokens: int = 256, *,
                       segment_cycles: int | None = None, **options: Unpack[SpeculativeOptions]) -> TokenStream:
    """:func:`dflash_jax.speculative_generate` as an iterator of :class:`StreamChunk`: concatenated, the chunks'
    ids and texts equal the non-streamed result (greedy, and sampled with the same seed). ``options``: as
    :func:`dflash_jax.speculative_generate`'s (but ``batch_size``). ``segment_cycles``: decode cycles per device
    call once the first few chunks are out; ``None`` (default): as many as take about ``SEGMENT_S`` = 100 ms
    (fewer cycles: more, smaller chunks; more: less overhead).

    ```
    for chunk in speculative_stream(target, drafter, ["Tell me a story."]):
        print(chunk.texts[0], end="", flush=True)
    ```
    """
    return _stream(as_target(target), as_drafter(drafter), prompts, max_new_tokens, segment_cycles, options)


def stream_generate(target: Target, prompts: Sequence[Prompt], max_new_tokens: int = 256, *,
                    segment_cycles: int | None = None, **options: Unpack[DecodeOptions]) -> TokenStream:
    """:func:`dflash_jax.generate` (autoregressive) as an iterator of :class:`StreamChunk`."""
    return _stream(as_target(target), None, prompts, max_new_tokens, segment_cycles, options)
