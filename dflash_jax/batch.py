"""``dflash-jax generate``: batch offline generation over a prompt file, overlapped and crash-safe.

* Input: JSONL, one object per line with ``id`` and one of ``prompt`` (text; chat template applied),
  ``messages`` (a chat list) or ``token_ids``; or a plain text file, one prompt per line (id = line number).
  Every row is validated before any work; bad rows are reported with their line numbers.
* Output: JSONL, one record per prompt, appended and flushed (fsync) after every finished batch. ``resume``
  skips ids already in the output (a torn last line from a kill is cut off first), so a run killed at any
  moment and resumed yields every input id exactly once.
* Overlap: prompts are tokenized (and checked) up front and sorted by length into batches of one shape
  bucket; every bucket's programs are compiled before the first dispatch; batch ``i+1`` is handed to the
  dispatch thread before the results of batch ``i`` are fetched and written, so the device always has the
  next batch queued. Dispatch runs on its own thread because it is not always asynchronous: on a GPU the
  decode loop's ``while`` reads its condition on the host every iteration, so the dispatching call returns
  only when the loop is done. A watcher thread timestamps when each batch is ready; the summary reports the
  device's idle fraction between batches (from dispatch start of ``i+1`` back to ready of ``i``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from dflash_jax import generation
from dflash_jax.engine import job as jobs
from dflash_jax.engine import pool
from dflash_jax.loading import Drafter, Target, as_drafter, as_target
from dflash_jax.settings import DecodeSettings, check_prompt
from dflash_jax.tuning import Tuning

log = logging.getLogger("dflash_jax")


class BadInputError(ValueError):
    """The input file has rows that cannot be run (the message lists them with line numbers)."""


@dataclasses.dataclass
class Row:
    id: str
    line: int
    prompt: Any  # str | list[dict] | list[int]
    ids: list[int] | None = None


def read_rows(path: str | Path) -> tuple[list[Row], list[dict]]:
    """Parse the input; returns (good rows, bad rows as {"line", "id", "error"}). Duplicate ids are fatal."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    rows, bad = [], []
    jsonl = path.suffix in (".jsonl", ".json")
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        if not jsonl:
            rows.append(Row(str(n), n, raw))
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            bad.append({"line": n, "id": None, "error": f"invalid JSON: {e.msg}"})
            continue
        if not isinstance(obj, dict):
            bad.append({"line": n, "id": None, "error": "expected a JSON object"})
            continue
        rid = obj.get("id")
        if rid is None or (isinstance(rid, str) and not rid.strip()):
            bad.append({"line": n, "id": None, "error": "missing 'id'"})
            continue
        rid = str(rid)
        fields = [k for k in ("prompt", "messages", "token_ids") if k in obj]
        if len(fields) != 1:
            bad.append({"line": n, "id": rid, "error": "needs exactly one of 'prompt', 'messages', 'token_ids'"})
            continue
        value = obj[fields[0]]
        problem = _check_value(fields[0], value)
        if problem:
            bad.append({"line": n, "id": rid, "error": problem})
            continue
        rows.append(Row(rid, n, value))
    seen: dict[str, int] = {}
    dups = []
    for r in rows:
        if r.id in seen:
            dups.append(f"id {r.id!r} on lines {seen[r.id]} and {r.line}")
        seen.setdefault(r.id, r.line)
    if dups:
        raise BadInputError(f"{path}: duplicate ids ({len(dups)}): " + "; ".join(dups[:10]))
    return rows, bad


def _check_value(field: str, value) -> str | None:
    if field == "prompt":
        return None if isinstance(value, str) and value.strip() else "'prompt' must be a non-empty string"
    if field == "messages":
        ok = (isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                        and "role" in m for m in value))
        if not ok:
            return "'messages' must be a non-empty list of {role, content}"
        try:
            check_prompt(value, 0)
        except ValueError as e:
            return f"'messages': {str(e).removeprefix('prompt 0: ')}"
        return None
    ok = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    return None if ok else "'token_ids' must be a non-empty list of integers"


def finished_ids(output: Path) -> set[str]:
    """Ids already in ``output``; a torn last line (killed mid-write) is cut off so appending stays valid."""
    if not output.is_file():
        return set()
    data = output.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with output.open("r+b") as f:
            f.truncate(end)
        log.warning("%s: removed a partial last record left by an interrupted run", output)
    done = set()
    for line in data[:end].decode("utf-8").splitlines():
        if line.strip():
            done.add(str(json.loads(line)["id"]))
    return done


# Batches prepared and queued for dispatch ahead of the one being collected: with one, a short batch (GPU,
# batch 16: ~0.25 s) can finish while the host is still writing the previous one (measured idle 5.4%).
_QUEUE_AHEAD = 2


@dataclasses.dataclass
class _Batch:
    rows: list[Row]
    job: jobs.Job
    dispatched: Any = None  # Future of the dispatch thread; its result is ``state``
    state: Any = None  # the final packed view (jobs.launch)
    launched: float | None = None  # dispatch start
    ready: float | None = None


class _ReadyWatcher(threading.Thread):
    """Blocks on each launched batch in order and records when the device finished it."""

    def __init__(self):
        super().__init__(daemon=True)
        self.queue: list[_Batch] = []
        self.cv = threading.Condition()
        self.stopped = False

    def add(self, batch: _Batch) -> None:
        with self.cv:
            self.queue.append(batch)
            self.cv.notify()

    def run(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stopped:
                    self.cv.wait()
                if not self.queue:
                    return
                batch = self.queue.pop(0)
            jax.block_until_ready(batch.state)  # the batch's packed view
            with self.cv:
                batch.ready = time.perf_counter()
                self.cv.notify_all()

    def wait_ready(self, batch: _Batch) -> None:
        with self.cv:
            while batch.ready is None:
                self.cv.wait()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()


def _batch_settings(settings: DecodeSettings, rows: list[Row], index: int) -> DecodeSettings:
    """Batch ``index``'s settings: the run's, its rows' values, and a seed of its own."""
    values = settings.rows.take(np.zeros(len(rows), int))  # the run's one value for every row
    return dataclasses.replace(settings, seed=settings.seed + index, rows=values)


def _compile_ahead(target: Target, drafter: Drafter | None, batches: list[list[Row]], settings: DecodeSettings,
                   batch_size: int, progress: bool) -> float:
    """Compile the prefill and decode programs of every distinct batch shape; returns the seconds spent.

    Batches of one prompt-length bucket share their programs, so one batch per bucket is prepared (its
    inputs are dropped afterwards) and the run's own ``prepare`` calls then hit the program cache.
    """
    t0 = time.perf_counter()
    first_of_bucket: dict[int, int] = {}
    for i, rows in enumerate(batches):
        first_of_bucket.setdefault(jobs.bucket(max(len(r.ids) for r in rows)), i)
    for i in tqdm(list(first_of_bucket.values()), disable=not progress or len(first_of_bucket) < 2,
                  desc="compile", unit="shape", dynamic_ncols=True):
        job = jobs.prepare(target, drafter, [r.ids for r in batches[i]], _batch_settings(settings, batches[i], i),
                           pad_batch_to=batch_size)  # compiles the bucket's prefill and decode programs
        job.decoder.compile()  # and, where auto may fall back to autoregressive steps, the fallback's
    return time.perf_counter() - t0


def run_batch(
    target: Target,
    drafter: Drafter | None,
    input_path: str | Path,
    output_path: str | Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    block_size: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    limit: int | None = None,
    resume: bool = False,
    skip_bad: bool = False,
    progress: bool = True,
    summary_path: str | Path | None = None,
    histogram_path: str | Path | None = None,
    speedup_estimate: bool = False,
    attention_impl: str = "auto",
    verify_mode: str = "auto",
    continuous_batching: bool = False,
    tuning: Tuning | None = None,
) -> dict:
    """Generate for every prompt of ``input_path`` into ``output_path``; returns the summary dict.
    ``verify_mode``, ``tuning`` and the sampling options: see :func:`dflash_jax.speculative_generate`.
    ``continuous_batching``: one pool of ``batch_size`` rows whose finished rows take the next prompts
    (:mod:`dflash_jax.engine.pool`), records written as prompts finish, instead of consecutive batches.

    ``speedup_estimate``: afterwards, decode one batch of this run again both speculatively and
    autoregressively (synchronously timed) and report the ratio of their decode tokens/s in the summary.
    """
    output = Path(output_path)
    target = as_target(target)
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, attention_impl=attention_impl,
                   tuning=tuning)
    if drafter is not None:
        drafter = as_drafter(drafter)
        drafter.config.check_target(target.config)
        options.update(block_size=block_size, verify_mode=verify_mode)
    settings = DecodeSettings.build(target, drafter, 1, max_new_tokens, batch_size=batch_size,
                                    **options)  # every argument validated before any work
    rows, bad = _read_and_tokenize(target, input_path, limit, max_new_tokens)
    _report_bad_rows(bad, output, skip_bad)
    if output.exists() and not resume:
        raise FileExistsError(f"{output} exists: pass --resume to continue it, or choose another output path")
    done = finished_ids(output) if resume else set()
    todo = [r for r in rows if r.id not in done]
    todo.sort(key=lambda r: len(r.ids))  # one shape bucket per batch, shortest first
    batches = [todo[i: i + batch_size] for i in range(0, len(todo), batch_size)]

    t_start = time.perf_counter()
    acc_hist = np.zeros(settings.block_size + 1, np.int64)  # cycles per acceptance length
    if continuous_batching and todo:
        stats, totals = _decode_continuous(target, drafter, todo, output, settings, acc_hist, progress)
        summary = _summary(input_path, output, None, totals, acc_hist, t_start, stats.pop("compile_s"), len(done),
                           len(bad), 0, batch_size, settings.block_size)
        summary["continuous"] = stats
    else:
        # Every program of the run is compiled before the first batch is dispatched: a compile between two
        # batches would leave the device idle (on a GPU one decode program takes seconds to compile).
        compile_s = _compile_ahead(target, drafter, batches, settings, batch_size, progress)
        launched, totals = _decode_and_write(target, drafter, batches, output, settings, batch_size, acc_hist,
                                             t_start, progress)
        summary = _summary(input_path, output, launched, totals, acc_hist, t_start, compile_s, len(done),
                           len(bad), len(batches), batch_size, settings.block_size)
    if speedup_estimate and drafter is not None and batches:
        full = [b for b in batches if len(b) == batch_size] or batches
        summary["speedup_estimate"] = _speedup_estimate(target, drafter, full[len(full) // 2], max_new_tokens,
                                                        options)
    summary_path = Path(summary_path) if summary_path else output.with_name(output.name + ".summary.json")
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    if acc_hist.sum():
        plot_acceptance(acc_hist, histogram_path or output.with_name(output.name + ".acceptance.png"),
                        title=f"{Path(target.name).name}: acceptance lengths (τ {summary['tau']:.2f})")
    return summary


def _read_and_tokenize(target: Target, input_path, limit: int | None, max_new_tokens: int
                       ) -> tuple[list[Row], list[dict]]:
    """The good rows, tokenized, and the bad ones: over-long and untokenizable prompts are found here,
    before any generation."""
    rows, bad = read_rows(input_path)
    if limit is not None:  # the first `limit` prompt rows of the file, good or bad
        cutoff = _nth_line(rows, bad, limit)
        rows, bad = [r for r in rows if r.line <= cutoff], [b for b in bad if b["line"] <= cutoff]
    for r in rows:
        try:
            r.ids = _tokenize_row(target, r)
            if len(r.ids) + max_new_tokens > target.config.max_position_embeddings:
                raise ValueError(f"prompt of {len(r.ids)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                                 f"model's maximum length {target.config.max_position_embeddings}")
        except ValueError as e:
            bad.append({"line": r.line, "id": r.id, "error": str(e)})
    bad_lines = {b["line"] for b in bad}
    return [r for r in rows if r.line not in bad_lines], bad


def _report_bad_rows(bad: list[dict], output: Path, skip_bad: bool) -> None:
    """Stop with the list of bad rows, or (``skip_bad``) write them to ``<output>.errors.jsonl``."""
    if not bad:
        return
    bad.sort(key=lambda b: b["line"])
    listing = "; ".join(f"line {b['line']}: {b['error']}" for b in bad[:20])
    if not skip_bad:
        raise BadInputError(f"{len(bad)} bad input row(s) — nothing was generated (use --skip-bad to "
                            f"continue without them): {listing}")
    errors_path = output.with_name(output.name + ".errors.jsonl")
    errors_path.write_text("".join(json.dumps(b) + "\n" for b in bad))
    log.warning("%d bad row(s) written to %s", len(bad), errors_path)


def _decode_and_write(target: Target, drafter: Drafter | None, batches: list[list[Row]], output: Path,
                      settings: DecodeSettings, batch_size: int, acc_hist: np.ndarray, t_start: float, progress: bool
                      ) -> tuple[list["_Batch"], dict]:
    """Decode every batch and append its records (fsync'd) in order; ``acc_hist`` is filled in place.

    Batches are prepared here and dispatched in order from their own thread, ``_QUEUE_AHEAD`` queued behind
    the one being collected, so the device does not wait for the host's writing.
    """
    watcher = _ReadyWatcher()
    watcher.start()
    totals = {"prompts": 0, "tokens": 0}
    launched: list[_Batch] = []
    bar = tqdm(total=sum(map(len, batches)), disable=not progress, desc="generate", unit="prompt",
               dynamic_ncols=True)
    dispatcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-dispatch")

    def dispatch(b: _Batch):
        b.launched = time.perf_counter()
        b.state = jobs.launch(b.job)
        watcher.add(b)
        return b.state

    def launch(i: int) -> None:
        """Prepare batch ``i`` here (host work) and queue its dispatch behind the batches already queued."""
        rows_i = batches[i]
        job = jobs.prepare(target, drafter, [r.ids for r in rows_i], _batch_settings(settings, rows_i, i),
                           pad_batch_to=batch_size)
        b = _Batch(rows_i, job)
        b.dispatched = dispatcher.submit(dispatch, b)
        launched.append(b)

    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        with output.open("a", encoding="utf-8") as out:
            for i in range(min(_QUEUE_AHEAD, len(batches))):
                launch(i)
            for i in range(len(batches)):
                if i + _QUEUE_AHEAD < len(batches):
                    launch(i + _QUEUE_AHEAD)  # queued behind batches i … on the dispatch thread
                b = launched[i]
                res = jobs.collect(b.job, b.dispatched.result())
                watcher.wait_ready(b)
                out.write("".join(_records(b, res, i, acc_hist)))
                out.flush()
                os.fsync(out.fileno())
                totals["prompts"] += len(b.rows)
                totals["tokens"] += res.stats["new_tokens"]
                bar.update(len(b.rows))
                bar.set_postfix(tok_s=f"{totals['tokens'] / (time.perf_counter() - t_start):,.0f}",
                                tau=f"{_tau(acc_hist) or 0:.2f}")
    finally:
        dispatcher.shutdown(wait=True, cancel_futures=True)
        watcher.stop()
        bar.close()
    return launched, totals


def _decode_continuous(target: Target, drafter: Drafter | None, rows: list[Row], output: Path,
                       settings: DecodeSettings, acc_hist: np.ndarray, progress: bool) -> tuple[dict, dict]:
    """Every row through one pool (:func:`dflash_jax.engine.pool.run`); the records of the prompts finished at
    each return to the host are appended and fsync'd then ("batch": that return's number). → (the pool's
    statistics, totals)."""
    totals = {"prompts": 0, "tokens": 0}
    bar = tqdm(total=len(rows), disable=not progress, desc="generate", unit="prompt", dynamic_ncols=True)
    t0 = time.perf_counter()
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a", encoding="utf-8") as out:
        segment = [0]

        def write(finished: list[tuple[int, list[int], list[int]]]) -> None:
            lines = []
            for i, toks, acc in finished:
                text = target.tokenizer.decode(toks) if target.tokenizer else None
                fin = jobs.finish_reasons([toks], settings.stop_token_ids)[0]
                lines.append(_record(rows[i], toks, text, acc, fin, segment[0], acc_hist))
                totals["tokens"] += len(toks)
            out.write("".join(lines))
            out.flush()
            os.fsync(out.fileno())
            segment[0] += 1
            totals["prompts"] += len(finished)
            bar.update(len(finished))
            bar.set_postfix(tok_s=f"{totals['tokens'] / (time.perf_counter() - t0):,.0f}",
                            tau=f"{_tau(acc_hist) or 0:.2f}")

        try:
            res = pool.run(target, drafter, [r.ids for r in rows],
                           _batch_settings(settings, rows, 0), on_finish=write)
        finally:
            bar.close()
    stats = {k: res.stats[k] for k in ("segments", "refills", "refill_size", "cycles", "compile_s")}
    return stats, totals


def _records(b: "_Batch", res: jobs.GenerationOutput, index: int, acc_hist: np.ndarray) -> list[str]:
    """One JSON line per row of a finished batch; its acceptance lengths are added to ``acc_hist``."""
    return [_record(r, toks, text, acc, fin, index, acc_hist)
            for r, toks, text, acc, fin in zip(b.rows, res.token_ids, res.texts, res.acceptance_lengths,
                                               res.finish_reasons)]


def _record(row: Row, toks: list[int], text: str | None, acc: list[int], finish: str, index: int,
            acc_hist: np.ndarray) -> str:
    """One JSON line; the row's acceptance lengths are added to ``acc_hist``."""
    acc_hist += np.bincount(acc, minlength=len(acc_hist))[: len(acc_hist)] if acc else 0
    return json.dumps({
        "id": row.id, "text": text, "token_ids": toks, "num_tokens": len(toks), "finish_reason": finish,
        "acceptance": {"cycles": len(acc), "tau": float(np.mean(acc)) if acc else None}, "batch": index}) + "\n"


def _tau(acc_hist: np.ndarray) -> float | None:
    """Tokens committed per cycle (the prefill's first token is not a cycle)."""
    n = acc_hist.sum()
    return float((np.arange(len(acc_hist)) * acc_hist).sum() / n) if n else None


def _summary(input_path, output: Path, launched: list["_Batch"] | None, totals: dict, acc_hist: np.ndarray,
             t_start: float, compile_s: float, skipped: int, bad: int, batches: int, batch_size: int,
             block_size: int) -> dict:
    """``launched``: the static batches (None for a continuous pool, which has none of their figures)."""
    wall = time.perf_counter() - t_start
    out = {
        "input": str(input_path), "output": str(output), "prompts": totals["prompts"],
        "skipped_done": skipped, "bad_rows": bad, "new_tokens": totals["tokens"],
        "wall_s": wall, "tokens_per_s": totals["tokens"] / max(wall, 1e-9),
        "prompts_per_s": totals["prompts"] / max(wall, 1e-9),
        "tau": _tau(acc_hist), "acceptance_histogram": acc_hist.tolist(),
        "batch_size": batch_size, "block_size": block_size, "compile_s": compile_s,
    }
    if launched is None:
        return out
    idle = sum(max(0.0, nxt.launched - prev.ready) for prev, nxt in zip(launched, launched[1:]))
    span = (launched[-1].ready - launched[0].launched) if launched else 0.0
    return out | {
        "batches": batches, "device_idle_fraction": idle / span if span > 0 else 0.0,
        # per batch: [dispatch start, device done] in seconds from the run's start (compile included)
        "batch_timeline_s": [[round(b.launched - t_start, 4), round(b.ready - t_start, 4)] for b in launched],
        "compile_s": compile_s + sum(b.job.compile_s for b in launched),  # the latter ~0: cache hits
    }


def _speedup_estimate(target: Target, drafter: Drafter, rows: list[Row], max_new_tokens: int, options: dict
                      ) -> dict:
    """Speculative vs autoregressive decode tokens/s on one batch of the run (the middle full one: a typical
    prompt length), each timed synchronously after its compile — the run itself overlaps batches, so its
    own timings are not per batch."""
    ids = [r.ids for r in rows]
    common = {k: v for k, v in options.items() if k not in ("block_size", "verify_mode")}
    spec = generation.speculative_generate(target, drafter, ids, max_new_tokens, **options)
    ar = generation.generate(target, ids, max_new_tokens, **common)
    s_tps, a_tps = spec.stats["decode_tokens_per_s"], ar.stats["decode_tokens_per_s"]
    return {"rows": len(ids), "tau": spec.tau, "speculative_decode_tokens_per_s": s_tps,
            "autoregressive_decode_tokens_per_s": a_tps, "speedup": s_tps / max(a_tps, 1e-9)}


def _nth_line(rows: list[Row], bad: list[dict], limit: int) -> int:
    """The input line number of the ``limit``-th prompt row (good or bad)."""
    lines = sorted([r.line for r in rows] + [b["line"] for b in bad])
    return lines[min(limit, len(lines)) - 1] if lines and limit > 0 else 0


def _tokenize_row(target: Target, row: Row) -> list[int]:
    if isinstance(row.prompt, list) and row.prompt and isinstance(row.prompt[0], int):
        bad = [t for t in row.prompt if not 0 <= t < target.config.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary: {bad[:5]}")
        return list(row.prompt)
    if target.tokenizer is None:
        raise ValueError("text prompt, but the target was loaded without a tokenizer")
    return target.tokenizer.encode(row.prompt)


def plot_acceptance(hists: Sequence[int] | dict[str, Sequence[int]], path: str | Path, title: str) -> Path:
    """Bar chart of acceptance lengths (fraction of cycles per length); a dict of named histograms (e.g. one
    per evaluation set) is drawn as grouped bars, each labelled with its τ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = hists if isinstance(hists, dict) else {"": hists}
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    width = 0.8 / len(named)
    for j, (name, hist) in enumerate(named.items()):
        hist = np.asarray(hist, np.float64)
        lengths = np.arange(len(hist))
        tau = (hist * lengths).sum() / max(hist.sum(), 1)
        ax.bar(lengths[1:] + (j - (len(named) - 1) / 2) * width, hist[1:] / max(hist.sum(), 1), width,
               label=f"{name} (τ {tau:.2f})" if name else None)
    if len(named) > 1 or next(iter(named)):
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens committed per cycle (accepted drafts + 1)")
    ax.set_ylabel("fraction of cycles")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
