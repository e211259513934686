"""Interactive use at batch 1: per-call host overhead, time to first token, ms/token, streaming cost.

One call per prompt, programs already compiled (every prompt runs once untimed first). Per call:
host overhead = call wall time − (prefill_s + decode_s), the two programs' times as the call measures them (each
ends with a sync). Cases:

* ``--gguf``: the embedded pair (SmolLM2-135M target from its GGUF + the shipped drafter) on real prompts
  (``--prompts``, token ids made by ``--make-prompts`` here: HumanEval and MT-Bench first turns through the chat
  template). Speculative and autoregressive, whole calls and streams, interleaved per prompt. Reports the
  wall-clock speed-up against the decode-only one, and each stream's tokens/s against the whole call's.
* ``--qwen8b``: a Qwen3-8B-shaped target with random bf16 weights (+ a random 5-layer drafter): per-call
  overhead for a short prompt, and the AR step against the weight-bytes floor at batch 1 (one-row products
  padded to two rows and not) and batch 8.
* ``--depths``: narrow random Qwen3 targets of several depths (per-call overhead vs depth; a CPU check).

    python benchmarks/bench_latency.py --make-prompts benchmarks/data/latency_prompts.json   # here, once
    python benchmarks/bench_latency.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --qwen8b --out latency.json
    python benchmarks/bench_latency.py --depths 4,32,64 --out latency_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_8B, SMOLLM2_135M, copy_bandwidth, param_bytes, random_target, source_commit  # noqa: E402
from dflash_jax import (generate, load_drafter, load_target, random_drafter, speculative_generate,  # noqa: E402
                        speculative_stream, stream_generate)
from dflash_jax import streaming  # noqa: E402
from dflash_jax.config import RopeConfig  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.loading import shipped_drafter_dir  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "latency_prompts.json"


def make_prompts(path: Path, per_set: int) -> None:
    from dflash_jax.train.data import evaluation_prompts

    target = load_target("smollm2-135m")
    sets = evaluation_prompts()
    rows = [{"set": name, "text": text, "ids": target.tokenizer.encode(text)}
            for name in ("humaneval", "mtbench") for text in sets[name][:per_set]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows) + "\n")
    print(f"{len(rows)} prompts → {path}")


def timed_call(fn, prompts) -> dict:
    t0 = time.perf_counter()
    out = fn(prompts)
    wall = time.perf_counter() - t0
    s = out.stats
    return dict(wall=wall, prefill=s["prefill_s"], decode=s["decode_s"], tokens=s["new_tokens"],
                cycles=s["cycles"], overhead=wall - s["prefill_s"] - s["decode_s"], ids=out.token_ids, tau=out.tau)


def timed_stream(make) -> dict:
    t0 = time.perf_counter()
    stream = make()
    first, ids = None, None
    for chunk in stream:
        if first is None and any(chunk.token_ids):
            first = time.perf_counter() - t0
        ids = ids or [[] for _ in chunk.token_ids]
        for row, new in zip(ids, chunk.token_ids):
            row.extend(new)
    wall = time.perf_counter() - t0
    return dict(wall=wall, ttft=first, tokens=sum(map(len, ids)), ids=ids, segments=stream.segments)


def summarise(calls: list[dict]) -> dict:
    wall, tokens = sum(c["wall"] for c in calls), sum(c["tokens"] for c in calls)
    out = dict(calls=len(calls), tokens=tokens, wall_ms_per_token=1e3 * wall / tokens)
    if "overhead" in calls[0]:
        over = sorted(1e3 * c["overhead"] for c in calls)
        decode_tokens = sum(c["tokens"] - 1 for c in calls)
        out.update(overhead_ms_median=statistics.median(over), overhead_ms_p90=over[int(0.9 * (len(over) - 1))],
                   decode_ms_per_token=1e3 * sum(c["decode"] for c in calls) / decode_tokens,
                   prefill_ms_median=1e3 * statistics.median(c["prefill"] for c in calls),
                   tau=sum(c["tokens"] - 1 for c in calls) / max(sum(c["cycles"] for c in calls), 1))
    else:
        out.update(ttft_ms_median=1e3 * statistics.median(c["ttft"] for c in calls),
                   segments=sum(c["segments"] for c in calls))
    return out


def pair_case(gguf: str, prompts_path: Path, dtype: str, max_new: int, repeats: int, limit: int | None,
              profile: bool = False, segment_cycles: int = 8) -> dict:
    target = load_target(gguf, dtype=dtype)
    drafter = load_drafter(shipped_drafter_dir("embedded:smollm2-135m-dflash"), target)
    rows = json.loads(prompts_path.read_text())
    if limit:  # an even share of each set
        rows = [r for i, r in enumerate(rows) if i % max(len(rows) // limit, 1) == 0][:limit]
    prompts = [r["ids"] for r in rows]
    kw = dict(max_new_tokens=max_new)
    skw = dict(kw, segment_cycles=segment_cycles or None)  # 0: adaptive (~100 ms segments)
    runs = {
        "spec": lambda p: timed_call(lambda x: speculative_generate(target, drafter, x, **kw), [p]),
        "ar": lambda p: timed_call(lambda x: generate(target, x, **kw), [p]),
        "spec_stream": lambda p: timed_stream(lambda: speculative_stream(target, drafter, [p], **skw)),
        "ar_stream": lambda p: timed_stream(lambda: stream_generate(target, [p], **skw)),
    }
    t0 = time.perf_counter()
    for p in prompts:  # compile every bucket; warm up
        for run in runs.values():
            run(p)
    print(f"warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    calls = {k: [] for k in runs}
    for _ in range(repeats):
        for p in prompts:
            for k, run in runs.items():
                calls[k].append(run(p))
    res = {k: summarise(v) for k, v in calls.items()}
    spec, ar = res["spec"], res["ar"]
    res["speedup_wall"] = ar["wall_ms_per_token"] / spec["wall_ms_per_token"]
    res["speedup_decode_only"] = ar["decode_ms_per_token"] / spec["decode_ms_per_token"]
    res["wall_over_decode_only"] = res["speedup_wall"] / res["speedup_decode_only"]
    for mode in ("spec", "ar"):
        res[f"{mode}_stream_cost"] = 1 - res[mode]["wall_ms_per_token"] / res[f"{mode}_stream"]["wall_ms_per_token"]
        res[f"{mode}_stream_identical"] = all(a["ids"] == b["ids"] for a, b in zip(calls[mode], calls[f"{mode}_stream"]))
    res["spec_ar_identical_fraction"] = float(np.mean([a["ids"] == b["ids"] for a, b in zip(calls["spec"], calls["ar"])]))
    res["setting"] = dict(dtype=dtype, max_new=max_new, prompts=len(prompts), repeats=repeats,
                          segment_cycles=segment_cycles, switch_interval_s=sys.getswitchinterval())
    if profile:  # where a call's host time goes: the functions with the most own time over 20 calls
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            speculative_generate(target, drafter, [prompts[0]], **kw)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return res


def ar_step(target, batch: int, prompt_len: int, max_new: int, repeats: int, tuning: Tuning = Tuning()) -> float:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, target.config.vocab_size, prompt_len).tolist() for _ in range(batch)]
    kw = dict(max_new_tokens=max_new, stop_token_ids=[], tuning=tuning)
    generate(target, prompts, **kw)
    return statistics.median(r.stats["decode_s"] / r.stats["cycles"]
                             for r in (generate(target, prompts, **kw) for _ in range(repeats)))


def qwen8b_case(repeats: int, steps: bool = True) -> dict:
    target = random_target(QWEN3_8B, jnp.bfloat16)
    drafter = random_drafter(target, block_size=16, num_layers=5)
    bw = copy_bandwidth()
    weights = param_bytes(target.model) - QWEN3_8B.vocab_size * QWEN3_8B.hidden_size * 2  # the embedding: a gather
    res = dict(copy_bandwidth_GBps=bw / 1e9, weight_bytes=weights)
    short = [list(range(1, 17))]
    for name, fn in (("spec", lambda: speculative_generate(target, drafter, short, max_new_tokens=32)),
                     ("ar", lambda: generate(target, short, max_new_tokens=32))):
        fn()
        calls = [timed_call(lambda _: fn(), None) for _ in range(10 * repeats)]
        res[f"{name}_overhead_ms_median"] = 1e3 * statistics.median(c["overhead"] for c in calls)
    if not steps:
        return res
    ctx = 128 + 128
    kv = lambda b: 2 * QWEN3_8B.num_layers * b * ctx * QWEN3_8B.num_kv_heads * QWEN3_8B.head_dim * 2  # noqa: E731
    for padded in (True, False):
        tuning = Tuning().replace(pad_single_row_on=("gpu",) if padded else ())
        for b in ((1,) if not padded else (1, 8)):
            step = ar_step(target, b, 128, 128, repeats, tuning)
            floor = (weights + kv(b)) / bw
            key = f"ar_b{b}" + ("" if padded else "_unpadded")
            res[key] = dict(step_ms=step * 1e3, floor_ms=floor * 1e3, over_floor=step / floor)
            print(key, json.dumps(res[key]), flush=True)
    return res


def segments_case(repeats: int, cycles: int = 8) -> dict:
    """Where a stream's extra time goes, on a SmolLM2-shaped target with random weights and a random drafter
    (every cycle commits one token: 255 cycles per call): one whole decode call, the same decode run in
    segments from this thread (fetching each segment's view), and the stream (worker thread)."""
    target = random_target(SMOLLM2_135M, jnp.bfloat16)
    drafter = random_drafter(target, block_size=16, num_layers=2)
    prompts = [list(range(1, 65))]
    kw = dict(max_new_tokens=256, stop_token_ids=[])

    def whole():
        job = jobs.make(target, drafter, prompts, chat_template=False, block_size=16, **kw)
        state, packed = job.programs.prefill(*job.pre_args)
        packed.block_until_ready()
        t0 = time.perf_counter()
        state, packed = job.programs.decode(job.params, state, jobs.ALL_CYCLES)
        np.asarray(packed)
        return time.perf_counter() - t0, 1

    def segmented():
        job = jobs.make(target, drafter, prompts, chat_template=False, block_size=16, **kw)
        state, packed = job.programs.prefill(*job.pre_args)
        packed.block_until_ready()
        t0, n = time.perf_counter(), 0
        while True:
            state, packed = job.programs.decode(job.params, state, np.int32(cycles))
            n += 1
            if jobs.fetch_view(job, packed).done.all():
                return time.perf_counter() - t0, n

    def stream(segment_cycles=cycles):
        job = jobs.make(target, drafter, prompts, chat_template=False, block_size=16, **kw)
        t0 = time.perf_counter()
        s = streaming.TokenStream(job, segment_cycles)
        for _ in s:
            pass
        return time.perf_counter() - t0 - s.output.stats["time_to_first_token_s"], s.segments

    def empty_calls():  # the decode program's fixed cost: calls whose loop runs no cycle
        job = jobs.make(target, drafter, prompts, chat_template=False, block_size=16, **kw)
        state, packed = job.programs.prefill(*job.pre_args)
        packed.block_until_ready()
        t0 = time.perf_counter()
        for _ in range(20):
            state, packed = job.programs.decode(job.params, state, np.int32(0))
            np.asarray(packed)
        return (time.perf_counter() - t0) / 20, 20

    res = {}
    for name, fn in (("whole", whole), ("segmented", segmented), ("stream", stream),
                     ("stream_adaptive", lambda: stream(None)), ("empty_call", empty_calls)):
        fn()
        runs = [fn() for _ in range(3 * repeats)]
        res[name] = dict(decode_ms=1e3 * statistics.median(r[0] for r in runs), segments=runs[0][1])
        print(name, json.dumps(res[name]), flush=True)
    for name in ("segmented", "stream", "stream_adaptive"):
        res[name]["extra_ms_per_segment"] = (res[name]["decode_ms"] - res["whole"]["decode_ms"]) / res[name]["segments"]
        res[name]["cost_vs_whole"] = res[name]["decode_ms"] / res["whole"]["decode_ms"] - 1
    print(json.dumps(res, indent=1), flush=True)
    return res


def depth_case(depths: list[int], repeats: int) -> dict:
    from dflash_jax.config import ModelConfig
    from dflash_jax.loading import Target
    from dflash_jax.models.target import TargetModel
    from flax import nnx

    res = {}
    for n in depths:
        cfg = ModelConfig(family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=n,
                          num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4),
                          max_position_embeddings=512).validate()
        target = Target(TargetModel(cfg, rngs=nnx.Rngs(0)), None, f"narrow-{n}", ())
        drafter = random_drafter(target, block_size=4, num_layers=1)
        p = [[1, 2, 3, 4, 5]]
        row = {}
        for name, fn in (("spec", lambda: speculative_generate(target, drafter, p, max_new_tokens=4, stop_token_ids=[])),
                         ("ar", lambda: generate(target, p, max_new_tokens=4, stop_token_ids=[]))):
            fn()
            calls = [timed_call(lambda _: fn(), None) for _ in range(20 * repeats)]
            row[f"{name}_overhead_ms_median"] = 1e3 * statistics.median(c["overhead"] for c in calls)
            row[f"{name}_device_ms_median"] = 1e3 * statistics.median(c["prefill"] + c["decode"] for c in calls)
        res[f"layers_{n}"] = row
        print(n, json.dumps(row), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-prompts", type=Path, help="write the prompt file (needs the training extras) and exit")
    ap.add_argument("--per-set", type=int, default=16, help="with --make-prompts: prompts per evaluation set")
    ap.add_argument("--gguf", help="SmolLM2 GGUF: the embedded-pair case")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--limit", type=int, help="only this many prompts (spread over the file)")
    ap.add_argument("--profile", action="store_true", help="print a host-side profile of 20 speculative calls")
    ap.add_argument("--segment-cycles", type=int, default=8, help="the streams' segment_cycles (0: adaptive)")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for this run (threads)")
    ap.add_argument("--qwen8b", action="store_true")
    ap.add_argument("--skip-steps", action="store_true", help="with --qwen8b: per-call overhead only")
    ap.add_argument("--depths", help="e.g. 4,32,64: narrow targets of these depths")
    ap.add_argument("--segments", action="store_true", help="where a stream's extra time goes (random weights)")
    ap.add_argument("--out", default="bench_latency.json")
    ap.add_argument("--commit")
    args = ap.parse_args()
    if args.make_prompts:
        make_prompts(args.make_prompts, args.per_set)
        return 0
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    dev = jax.devices()[0]
    info = dict(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                host=platform.node(), commit=args.commit or source_commit())
    print(json.dumps(info), flush=True)
    results = {"info": info}
    if args.depths:
        results["depths"] = depth_case([int(d) for d in args.depths.split(",")], args.repeats)
    if args.segments:
        results["segments"] = segments_case(args.repeats)
    if args.gguf:
        results["pair"] = pair_case(args.gguf, args.prompts, args.dtype, args.max_new, args.repeats, args.limit,
                                    args.profile, args.segment_cycles)
        print(json.dumps(results["pair"], indent=1), flush=True)
    if args.qwen8b:
        results["qwen8b"] = qwen8b_case(args.repeats, steps=not args.skip_steps)
        print(json.dumps(results["qwen8b"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
