"""Batch offline generation (`dflash-jax generate`) and pair configs."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ZLAB, tiny_subprocess_env
from dflash_jax import CheckpointError, ConfigError, generate, load_drafter, load_pair, speculative_generate
from dflash_jax.batch import BadInputError, finished_ids, read_rows, run_batch
from dflash_jax.loading import shipped_drafter_dir
from dflash_jax.pairs import all_pair_configs, load_pair_config, parse_pair


@pytest.fixture(scope="module")
def pair(zlab_target):
    return zlab_target, load_drafter(ZLAB / "drafter_fitted", zlab_target)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def token_rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "token_ids": rng.integers(0, 255, int(rng.integers(2, 30))).tolist()} for i in range(n)]


def read_out(path: Path) -> dict[str, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in recs}


# Every run here decodes batches of 4 rows with at most 16 new tokens (the same compiled programs, whatever the
# test), except where a test is about compiling.
def test_batch_outputs_equal_direct_generation(pair, tmp_path):
    target, drafter = pair
    rows = token_rows(11)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=16, batch_size=4,
                        progress=False, speedup_estimate=True)
    out = read_out(tmp_path / "out.jsonl")
    assert set(out) == {r["id"] for r in rows}
    ref = generate(target, [r["token_ids"] for r in rows], max_new_tokens=16)
    spec = speculative_generate(target, drafter, [r["token_ids"] for r in rows], max_new_tokens=16)
    for r, toks, acc in zip(rows, ref.token_ids, spec.acceptance_lengths):
        rec = out[r["id"]]
        assert rec["token_ids"] == toks and rec["num_tokens"] == len(toks)
        assert rec["acceptance"]["cycles"] == len(acc)
    assert summary["prompts"] == 11 and summary["batches"] == 3 and summary["tau"] > 1.0
    assert summary["new_tokens"] == sum(len(t) for t in ref.token_ids)
    assert 0.0 <= summary["device_idle_fraction"] < 1.0
    assert sum(summary["acceptance_histogram"]) == sum(len(a) for a in spec.acceptance_lengths)
    est = summary["speedup_estimate"]  # the middle full batch (rows 4-7 by length), re-run both ways
    assert est["rows"] == 4 and est["tau"] > 1.0
    assert est["speedup"] == pytest.approx(est["speculative_decode_tokens_per_s"]
                                           / est["autoregressive_decode_tokens_per_s"])
    assert json.loads((tmp_path / "out.jsonl.summary.json").read_text())["speedup_estimate"] == est
    assert (tmp_path / "out.jsonl.acceptance.png").stat().st_size > 1000
    # Autoregressive mode (no drafter) writes the same tokens.
    run_batch(target, None, inp, tmp_path / "ar.jsonl", max_new_tokens=16, batch_size=4, progress=False)
    ar = read_out(tmp_path / "ar.jsonl")
    assert all(ar[k]["token_ids"] == out[k]["token_ids"] for k in out)


def test_continuous_batch_writes_each_prompt_as_it_finishes_and_resumes(pair, tmp_path):
    """One pool of 4 rows over 11 prompts: the same tokens as direct generation, each id once; records of a
    return to the host are written together; a resumed run decodes only what is missing."""
    target, drafter = pair
    rows = token_rows(11)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=16, batch_size=4,
                        progress=False, continuous_batching=True)
    out = read_out(tmp_path / "out.jsonl")
    ref = generate(target, [r["token_ids"] for r in rows], max_new_tokens=16)
    assert all(out[r["id"]]["token_ids"] == toks for r, toks in zip(rows, ref.token_ids))
    pool = summary["continuous"]
    assert summary["prompts"] == 11 and pool["refills"] >= 7 and summary["tau"] > 1.0
    assert len({rec["batch"] for rec in out.values()}) == pool["segments"]
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    (tmp_path / "out.jsonl").write_text("\n".join(lines[:5]) + "\n")  # as if killed after 5 records
    again = run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=16, batch_size=4,
                      progress=False, continuous_batching=True, resume=True)
    assert again["prompts"] == 6 and read_out(tmp_path / "out.jsonl").keys() == out.keys()


def test_every_program_is_compiled_before_the_first_batch(pair, tmp_path, monkeypatch):
    """Compiles between batches would idle the device: all of them happen before the first dispatch, XLA's
    small eager programs included (a partial last batch once compiled its padding there: ~0.2 s idle)."""
    import jax

    from dflash_jax import batch
    from dflash_jax.engine import job as jobs
    from dflash_jax.engine import programs

    jax.clear_caches()  # eager-op programs too, whatever earlier tests built
    monkeypatch.setattr(programs.CACHE, "programs", {})
    counts, late_xla_compiles = [], []
    real_launch = jobs.launch
    monkeypatch.setattr(jobs, "launch", lambda job: (counts.append(programs.compile_count()), real_launch(job))[1])

    def on_compile(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and counts:
            late_xla_compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    before = programs.compile_count()
    # batches of four: one in the 16-token prompt bucket, two in the 64-token one, the last of them padded
    rng = np.random.default_rng(1)
    rows = [{"id": f"r{i}", "token_ids": rng.integers(0, 255, n).tolist()}
            for i, n in enumerate([5] * 4 + [40] * 4 + [36] * 3)]
    try:
        summary = batch.run_batch(*pair, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl",
                                  max_new_tokens=8, batch_size=4, progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert len(counts) == 3 and len(set(counts)) == 1  # no compile of ours once dispatching started
    assert counts[0] - before == 4  # prefill + decode for each bucket
    assert late_xla_compiles == []
    assert summary["compile_s"] > 0
    assert [b for b, _ in summary["batch_timeline_s"]] == sorted(b for b, _ in summary["batch_timeline_s"])


def test_host_writes_do_not_hold_back_dispatch_when_launch_is_synchronous(pair, tmp_path, monkeypatch):
    """On a GPU the decode program's call returns only when its while loop is done. Simulate that (a launch
    that blocks, slower than the host's fetch-and-write of a batch): the next batch must be dispatched as soon
    as the previous one returns, never after the host has written a result in between."""
    import jax

    from dflash_jax import batch
    from dflash_jax.engine import job as jobs

    events = []
    real_launch, real_collect = jobs.launch, jobs.collect

    def blocking_launch(job):
        events.append(("dispatch_start", id(job)))
        state = jax.block_until_ready(real_launch(job))
        time.sleep(0.3)
        events.append(("dispatch_end", id(job)))
        return state

    def slow_collect(job, state, *a, **kw):
        out = real_collect(job, state, *a, **kw)
        time.sleep(0.1)  # detokenizing and writing a big batch
        events.append(("collected", id(job)))
        return out

    monkeypatch.setattr(jobs, "launch", blocking_launch)
    monkeypatch.setattr(jobs, "collect", slow_collect)
    rows = token_rows(20, seed=4)
    summary = batch.run_batch(*pair, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl",
                              max_new_tokens=8, batch_size=4, progress=False)
    assert set(read_out(tmp_path / "out.jsonl")) == {r["id"] for r in rows}
    kinds = [k for k, _ in events]
    assert kinds.count("dispatch_start") == summary["batches"] == 5
    # Between one dispatch's end and the next one's start there is never a host-side collect.
    starts = [i for i, k in enumerate(kinds) if k == "dispatch_start"]
    ends = [i for i, k in enumerate(kinds) if k == "dispatch_end"]
    assert all(nxt == end + 1 for end, nxt in zip(ends, starts[1:])), kinds


def test_bad_rows_are_reported_with_line_numbers(pair, tmp_path):
    target, drafter = pair
    lines = [{"id": "a", "token_ids": [1, 2, 3]}, "{not json", {"token_ids": [4]}, {"id": "e", "prompt": ""},
             {"id": "f", "token_ids": [5, 6]}, {"id": "g", "token_ids": list(range(200)) * 3},
             {"id": "h", "prompt": "text needs a tokenizer"}, {"id": "i", "token_ids": [1, 999]}]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(BadInputError) as err:
        run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=16, batch_size=4, progress=False)
    msg = str(err.value)
    for fragment in ("line 2: invalid JSON", "line 3: missing 'id'", "line 4: 'prompt' must be a non-empty",
                     "line 6: prompt of 600 tokens", "line 7: text prompt", "line 8: token ids outside"):
        assert fragment in msg
    assert not (tmp_path / "out.jsonl").exists()  # nothing was started
    run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=16, batch_size=4, skip_bad=True,
              progress=False)
    assert set(read_out(tmp_path / "out.jsonl")) == {"a", "f"}
    errors = [json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == [2, 3, 4, 6, 7, 8]


def test_duplicate_ids_fail_before_any_work(pair, tmp_path):
    target, drafter = pair
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "token_ids": [1]}, {"id": "y", "token_ids": [2]},
                                               {"id": "x", "token_ids": [3]}])
    with pytest.raises(BadInputError, match="duplicate ids.*'x' on lines 1 and 3"):
        run_batch(target, drafter, inp, tmp_path / "out.jsonl", skip_bad=True, progress=False)
    assert not (tmp_path / "out.jsonl").exists()


def test_text_input_limit_and_existing_output(pair, tmp_path):
    target, drafter = pair
    rows, bad = read_rows(write_jsonl(tmp_path / "p.txt", ["first prompt", "", "second"]))
    assert [(r.id, r.line, r.prompt) for r in rows] == [("1", 1, "first prompt"), ("3", 3, "second")]
    inp = write_jsonl(tmp_path / "in.jsonl", token_rows(9))
    run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=8, batch_size=4, limit=5, progress=False)
    assert set(read_out(tmp_path / "out.jsonl")) == {f"r{i}" for i in range(5)}
    with pytest.raises(FileExistsError, match="--resume"):
        run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=8, batch_size=4, progress=False)
    run_batch(target, drafter, inp, tmp_path / "out.jsonl", max_new_tokens=8, batch_size=4, resume=True,
              progress=False)
    assert set(read_out(tmp_path / "out.jsonl")) == {f"r{i}" for i in range(9)}


def test_torn_last_line_is_repaired(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "x": 1}\n{"id": "b", "x"')
    assert finished_ids(out) == {"a"}
    assert out.read_text() == '{"id": "a", "x": 1}\n'


def cached_programs(cache: Path) -> list[str]:
    """The compiled programs the CLI keeps in $DFLASH_JAX_CACHE/xla."""
    return sorted(p.name for p in (cache / "xla").glob("*-cache"))


def test_sigkill_at_random_moments_then_resume(tmp_path):
    """A real `dflash-jax generate` process killed at random points, resumed each time: every id once. The
    processes after the first load its compiled programs from the CLI's on-disk cache and add none."""
    rows = token_rows(64, seed=3)  # 16 batches: decoding lasts a few seconds after the up-front compiles
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dflash_jax.cli", "generate", "--target", str(ZLAB / "target"), "--drafter",
           str(ZLAB / "drafter_fitted"), "--input", str(inp), "--output", str(out), "--batch-size", "4",
           "--max-new-tokens", "48", "--no-progress", "--no-speedup-estimate"]  # (run_batch's tests cover it)
    # Each process after the first loads the compiled programs from its own on-disk cache (as the CLI does by
    # default), whatever ~/.cache holds and however fast they compiled.
    env = tiny_subprocess_env(DFLASH_JAX_CACHE=str(tmp_path / "cache"),
                              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    rnd = random.Random(0)
    kills = 0
    for attempt in range(8):
        proc = subprocess.Popen(cmd + (["--resume"] if out.exists() else []), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if kills < 2:  # (each process costs ~10 s of start-up here)
            before = len(out.read_text().splitlines()) if out.exists() else 0
            # Kill once this process has written 1–3 batches, a random few milliseconds later (mid-batch,
            # mid-write or mid-fsync: the moment is not aligned with anything).
            target_lines = before + 4 * rnd.randint(1, 3)
            deadline = time.time() + 120
            while time.time() < deadline and proc.poll() is None:
                now = len(out.read_text().splitlines()) if out.exists() else 0
                if now >= target_lines:
                    break
                time.sleep(0.005)
            time.sleep(rnd.uniform(0.0, 0.05))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait()
            if attempt == 0:  # every program is compiled (and kept) before the first batch is written
                programs = cached_programs(tmp_path / "cache")
                assert any(p.startswith("jit_decode") for p in programs), programs
            continue
        assert proc.wait(timeout=300) == 0
        break
    assert kills == 2
    assert cached_programs(tmp_path / "cache") == programs  # all found: none added
    got = read_out(out)
    assert set(got) == {r["id"] for r in rows}
    ref = generate(__import__("dflash_jax").load_target(ZLAB / "target"), [r["token_ids"] for r in rows],
                   max_new_tokens=48)
    for r, toks in zip(rows, ref.token_ids):
        assert got[r["id"]]["token_ids"] == toks


def test_cli_keeps_compiled_programs_on_disk(tmp_path):
    """The CLI writes compiled programs to $DFLASH_JAX_CACHE/xla (later processes load them: the SIGKILL test
    above); --no-compile-cache writes none; JAX's own JAX_COMPILATION_CACHE_DIR takes precedence."""
    inp = write_jsonl(tmp_path / "in.jsonl", token_rows(4, seed=5))
    # Tiny programs compile in well under JAX's 1 s threshold for keeping them: keep everything here.
    base = tiny_subprocess_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    base.pop("JAX_COMPILATION_CACHE_DIR", None)

    def generate_cli(name: str, cache: Path, *extra: str, **env: str):
        """Starts the CLI; the returned function waits for it and reads its output."""
        out = tmp_path / f"{name}.jsonl"
        proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli", "generate", "--target",
                                 str(ZLAB / "target"), "--drafter", str(ZLAB / "drafter_fitted"), "--input", str(inp),
                                 "--output", str(out), "--max-new-tokens", "8", "--no-progress",
                                 "--no-speedup-estimate", *extra], env={**base, "DFLASH_JAX_CACHE": str(cache), **env},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def result() -> dict:
            assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()[-3000:]
            return {i: r["token_ids"] for i, r in read_out(out).items()}
        return result

    # All three at once: none depends on another's cache.
    runs = [generate_cli("first", tmp_path / "a"), generate_cli("off", tmp_path / "b", "--no-compile-cache"),
            generate_cli("jax", tmp_path / "c", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "own"))]
    first, off, own = (run() for run in runs)
    assert any(e.startswith("jit_decode") for e in cached_programs(tmp_path / "a"))
    assert off == first and not (tmp_path / "b" / "xla").exists()
    assert own == first and len(first) == 4
    assert not (tmp_path / "c" / "xla").exists() and list((tmp_path / "own").glob("*-cache"))


def test_every_pair_config_validates():
    configs = {c.name: c for c in all_pair_configs()}
    assert {"smollm2-135m", "qwen3-4b", "qwen3-8b", "llama3.1-8b-instruct"} <= set(configs)
    assert configs["qwen3-8b"].chat_template_kwargs == {"enable_thinking": False}
    assert configs["qwen3-8b"].drafter == "z-lab/Qwen3-8B-DFlash-b16"
    assert configs["smollm2-135m"].drafter == "embedded"
    for c in configs.values():
        assert c.dtype in ("float32", "bfloat16") and c.mesh["tp"] >= 1
    # the pairs whose drafters ship in the package find them there (bench_schedule names a calibration's pair so)
    shipped = {c.name: shipped_drafter_dir(c.drafter) for c in configs.values() if shipped_drafter_dir(c.drafter)}
    assert {n: d.name for n, d in shipped.items()} == {"smollm2-135m": "smollm2-135m-dflash",
                                                      "smollm2-135m-dspark": "smollm2-135m-dspark",
                                                      "smollm2-135m-dflash2": "smollm2-135m-dflash2"}
    assert all((d / "config.json").is_file() for d in shipped.values())
    assert shipped_drafter_dir("z-lab/Qwen3-8B-DFlash-b16") is None
    # the embedded pair's training recipe parses too (every key known, values in range)
    from dflash_jax.train.pipeline import load_run_config

    recipe = load_run_config(Path(__file__).parents[1] / "configs" / "smollm2-135m.yaml")
    assert recipe.data.sampled_responses == 1 and recipe.train.val_rows > 0 and recipe.drafter.block_size == 16


@pytest.mark.parametrize("raw,match", [
    ({"target": "x"}, "'name' must be a non-empty string"),
    ({"name": "a", "target": "x", "dtype": "fp16"}, "dtype must be"),
    ({"name": "a", "target": "x", "block_size": 1}, "block_size must be an integer >= 2"),
    ({"name": "a", "target": "x", "mesh": {"tp": 0}}, "mesh must be"),
    ({"name": "a", "target": "x", "bogus": 1}, "unknown keys"),
])
def test_pair_schema_errors(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_pair(raw, "test.yaml")


def test_hub_pairs_give_a_clear_error_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="Qwen/Qwen3-8B.*not in the huggingface_hub cache"):
        load_pair("qwen3-8b")
    with pytest.raises(ConfigError, match="unknown pair 'nope'"):
        load_pair_config("nope")
