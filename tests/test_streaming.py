"""Streaming (speculative_stream / stream_generate), the chat command, and per-call API behaviour: the chunks
concatenate to exactly the non-streamed output, breaking out stops the device work, no recompiles, ``None``
sampling arguments, error messages that name the value given."""

from __future__ import annotations

import gc

import pytest

from conftest import oracle_drafter, random_prompts, tiny_target
from dflash_jax import (compile_count, generate, speculative_generate, speculative_stream,
                        stream_generate)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target("qwen3", seed=11)
    prompts = random_prompts(3, [4, 13, 9], target.config.vocab_size, seed=12)
    ref = generate(target, prompts, max_new_tokens=48, stop_token_ids=[])
    # Drafts right most of the time: acceptance lengths vary, so segments end at different places per row.
    drafter = oracle_drafter(target, prompts, ref.token_ids, block_size=4, corrupt=0.3)
    return target, drafter, prompts


def concatenated(stream) -> tuple[list[list[int]], list[list[str]], list]:
    ids, finished = None, []
    for chunk in stream:
        ids = ids or [[] for _ in chunk.token_ids]
        for row, new in zip(ids, chunk.token_ids):
            row.extend(new)
        finished.append(list(zip(chunk.finished, chunk.finish_reasons)))
    return ids, finished


@pytest.mark.parametrize("sampled", [False, True])
def test_stream_equals_whole_call(tiny, sampled):
    """Several prompts that finish at different cycles (a stop token for some, the budget for others), greedy
    and sampled with the same seed: the chunks concatenate to the whole call's tokens, and ``output`` is the
    whole call's output. Streaming runs the whole call's programs: nothing compiles."""
    target, drafter, prompts = tiny
    kw = dict(max_new_tokens=40, stop_token_ids=[7, 21], temperature=1.0 if sampled else 0.0, seed=5)
    whole = speculative_generate(target, drafter, prompts, **kw)
    ar = generate(target, prompts, **kw)
    assert len({len(t) for t in whole.token_ids}) > 1  # rows end at different places
    before = compile_count()
    for cycles in (1, 3, 8):
        stream = speculative_stream(target, drafter, prompts, segment_cycles=cycles, **kw)
        ids, finished = concatenated(stream)
        assert ids == whole.token_ids
        assert stream.output.token_ids == whole.token_ids
        assert stream.output.acceptance_lengths == whole.acceptance_lengths
        assert stream.output.finish_reasons == whole.finish_reasons
        # A row's finish reason appears with the chunk that ends it and stays.
        assert finished[-1] == [(True, r) for r in whole.finish_reasons]
        for earlier, later in zip(finished, finished[1:]):
            assert all(not f or lf == (f, r) for (f, r), lf in zip(earlier, later))
        assert stream.output.stats["time_to_first_token_s"] > 0
    ar_ids, _ = concatenated(stream_generate(target, prompts, segment_cycles=2, **kw))
    assert ar_ids == ar.token_ids
    if not sampled:
        assert ar_ids == whole.token_ids
    assert compile_count() == before


def test_breaking_out_stops_the_device_work(tiny):
    target, drafter, prompts = tiny
    kw = dict(max_new_tokens=900, stop_token_ids=[], segment_cycles=1)  # ~300 segments if left to run
    stream = speculative_stream(target, drafter, prompts, **kw)
    for _ in stream:
        break
    stream.close()
    assert not stream._worker.is_alive()
    assert stream.segments <= 3  # the reader stopped after the first chunk; the worker runs ≤ 2 ahead
    assert list(stream) == [] and stream.output is None
    # Dropping an iterator without closing it stops it too.
    stream = speculative_stream(target, drafter, prompts, **kw)
    next(stream)
    worker = stream._worker
    del stream
    gc.collect()
    worker.join(timeout=30)
    assert not worker.is_alive()
    # `with` closes.
    with speculative_stream(target, drafter, prompts, **kw) as stream:
        next(stream)
    assert not stream._worker.is_alive()


def test_none_sampling_arguments_and_named_errors(tiny):
    target, drafter, prompts = tiny
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    greedy = speculative_generate(target, drafter, prompts, **kw)
    none = speculative_generate(target, drafter, prompts, temperature=None, top_k=None, top_p=None, **kw)
    assert none.token_ids == greedy.token_ids
    per_row = generate(target, prompts, temperature=[None, 0, None], top_k=[None, 5, 0], **kw)
    assert per_row.token_ids == greedy.token_ids
    for bad, shown in [(dict(top_k=-1), "-1"), (dict(top_k=2.5), "2.5"), (dict(top_k="5"), "'5'"),
                       (dict(top_p=1.5), "1.5"), (dict(top_p=0), "got 0"), (dict(temperature=float("nan")), "nan"),
                       (dict(temperature=-0.5), "-0.5"), (dict(temperature=[1.0, 2.0]), "[1.0, 2.0]"),
                       (dict(block_size=99), "99"), (dict(max_new_tokens=0), "got 0")]:
        with pytest.raises(ValueError, match=f"{bad and list(bad)[0]}.*{shown}".replace("[", r"\[").replace(
                "(", r"\(")):
            speculative_generate(target, drafter, prompts, **{**kw, **bad})
    with pytest.raises(ValueError, match="segment_cycles.*0"):
        speculative_stream(target, drafter, prompts, segment_cycles=0, **kw)


def test_weights_changed_in_place_are_seen(tiny):
    """The handle keeps its model split between calls; setting a weight invalidates it."""
    from flax import nnx

    target = tiny_target("qwen3", seed=13)
    prompts = tiny[2]
    first = generate(target, prompts, max_new_tokens=8, stop_token_ids=[])
    split = target.split()
    assert target.split() is split
    other = tiny_target("qwen3", seed=14)
    nnx.update(target.model, nnx.state(other.model))
    assert target.split() is not split
    assert generate(target, prompts, max_new_tokens=8, stop_token_ids=[]).token_ids == \
        generate(other, prompts, max_new_tokens=8, stop_token_ids=[]).token_ids != first.token_ids
