r"""What a user gets with the defaults, at every batch: ``speculative_generate`` (verify mode ``auto``, with its
fallback to autoregressive steps) against ``generate`` on an embedded pair, whole calls, the project's own mixed
prompts (``data/latency_prompts.json``: HumanEval, MT-Bench and general chat, cycled to fill the batch).

Batch 1 runs the set's first ``--single-prompts`` prompts (8), one call each, as one round (a single prompt's τ is
one text's); larger batches one call. Per batch: one untimed round of each, then ``--rounds`` rounds that time AR
and speculative back to back (the fastest of the rounds is kept for each: this is how the issue's table was taken,
and a shared machine's noise only ever adds time). Records tokens/s of both, their ratio, and of the fastest
speculative call τ, the verify mode auto ran, the steps that fell back (and every call's seconds and segment log; a
round that compiled is rerun), and whether the tokens equal AR's (bf16 on a GPU: a verify of several tokens may
round differently from one step, so a few rows can differ; float32 is token-identical, tests/test_switching.py).

    # GPU (bf16), both pairs
    python benchmarks/bench_defaults.py --pair smollm2-135m --batches 1,16,64,128 --dtype bfloat16 --out $OUT/dflash.json
    python benchmarks/bench_defaults.py --pair smollm2-135m-dspark --batches 1,16,64,128 --dtype bfloat16 \
        --out $OUT/dspark.json
    # CPU (float32), the 64-row figure of the benchmarks page
    python benchmarks/bench_defaults.py --batches 64 --max-new 64 --out /tmp/cpu64.json

The JSON is rewritten after each batch, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import source_commit  # noqa: E402
from dflash_jax import costs, generate, load_pair, speculative_generate  # noqa: E402
from dflash_jax.engine import programs  # noqa: E402

PROMPTS = Path(__file__).parent / "data" / "latency_prompts.json"


def _merged(outs: list) -> dict:
    """One round's speculative calls (a batch, or batch 1's prompts one call each) as one: τ weighted by cycles,
    the steps, switches and segments of every call (None where no call reports them)."""
    def summed(key, empty):
        parts = [o.stats.get(key) for o in outs]
        return None if all(v is None for v in parts) else sum((v or empty for v in parts), empty)

    cycles = [o.stats["cycles"] for o in outs]
    return dict(tau=sum(o.tau * c for o, c in zip(outs, cycles)) / max(1, sum(cycles)),
                verify_mode="/".join(sorted({o.stats["verify_mode"] for o in outs})),
                ar_fallback_steps=summed("ar_fallback_steps", 0), fallback_switches=summed("fallback_switches", 0),
                cycles=sum(cycles), fallback_log=summed("fallback_log", []))


def batch_case(target, drafter, batches: list[list[list[int]]], max_new: int, rounds: int,
               stop: bool = True) -> dict:
    """The fastest of ``rounds`` timed rounds of each — a round runs ``batches`` one call each (one batch, or batch
    1's prompts one at a time) — and the stats of that fastest speculative round (whether it drafted, probed or
    fell back); every round's seconds and segment log too, since which call held a probe moves the ratio. A round
    whose speculative calls compiled a program (the fallback's, first needed after the untimed round) does not
    count, and another round is run in its place (at most two more). ``stop`` off: no row ends at an end-of-text
    token (``stop_token_ids=[]``), so every row of both sides makes ``max_new`` tokens."""
    kw = dict(max_new_tokens=max_new, **({} if stop else dict(stop_token_ids=[])))
    for prompts in batches:  # compiles; its time is not counted
        generate(target, prompts, **kw)
        speculative_generate(target, drafter, prompts, **kw)
    ar_calls, sp_calls, compiled = [], [], []
    while len(ar_calls) - sum(compiled) < rounds and len(ar_calls) < rounds + 2:
        t0 = time.perf_counter()
        ar = [generate(target, prompts, **kw) for prompts in batches]
        t1 = time.perf_counter()
        before = programs.compile_count()
        sp = [speculative_generate(target, drafter, prompts, **kw) for prompts in batches]
        t2 = time.perf_counter()
        compiled.append(programs.compile_count() != before)
        ar_calls.append((t1 - t0, ar))
        sp_calls.append((t2 - t1, sp))
    counted = [i for i, c in enumerate(compiled) if not c] or list(range(len(compiled)))
    best_ar, ar = min((ar_calls[i] for i in counted), key=lambda c: c[0])
    best_sp, sp = min((sp_calls[i] for i in counted), key=lambda c: c[0])
    ar_rows = [r for o in ar for r in o.token_ids]
    sp_rows = [r for o in sp for r in o.token_ids]
    n_ar, n_sp = sum(map(len, ar_rows)), sum(map(len, sp_rows))
    same = sum(a == b for a, b in zip(ar_rows, sp_rows)) / len(ar_rows)
    merged = [_merged(c[1]) for c in sp_calls]
    return dict(ar_tokens_per_s=n_ar / best_ar, speculative_tokens_per_s=n_sp / best_sp,
                ratio=(n_sp / best_sp) / (n_ar / best_ar), ar_s=best_ar, speculative_s=best_sp,
                calls_per_round=len(batches), **_merged(sp),
                rows_identical_to_ar=same, ar_calls_s=[c[0] for c in ar_calls],
                speculative_calls_s=[c[0] for c in sp_calls],
                speculative_calls_fallback_steps=[m["ar_fallback_steps"] for m in merged],
                speculative_calls_compiled=compiled,
                speculative_calls_fallback_logs=[m["fallback_log"] for m in merged])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="the pair's compute dtype (default: the pair's own)")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N prompts of the set")
    ap.add_argument("--single-prompts", type=int, default=8,
                    help="batch 1 runs the set's first N prompts, one call each, per round (a single prompt's τ "
                         "is one text's)")
    ap.add_argument("--no-stop", action="store_true",
                    help="no row ends at an end-of-text token: every row makes --max-new tokens on both sides, so "
                         "pairs compare on equal lengths (bf16 rows leave generate's text and stop elsewhere)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    target, drafter = load_pair(args.pair, **({"dtype": args.dtype} if args.dtype else {}))
    ids = [p["ids"] for p in json.loads(PROMPTS.read_text())][: args.limit]
    commit = source_commit()
    table = costs.resolve(None, jax.default_backend(), drafter.cost_tables)  # what auto schedules with
    result = dict(command=" ".join(sys.argv), date=datetime.date.today().isoformat(), commit=commit,
                  device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                  host=platform.node(), pair=args.pair, max_new=args.max_new, prompts=len(ids),
                  cost_table=dict(pair=table.pair, device=table.device, created=table.created,
                                  batches=sorted(table.step_ms)), batches={})
    for b in (int(x) for x in args.batches.split(",")):
        batches = ([[p] for p in ids[: args.single_prompts]] if b == 1 else
                   [[ids[i % len(ids)] for i in range(b)]])
        case = batch_case(target, drafter, batches, args.max_new, args.rounds, stop=not args.no_stop)
        result["batches"][str(b)] = case
        args.out.write_text(json.dumps(result, indent=1))
        fell_back = ("fallback not armed" if case["ar_fallback_steps"] is None else
                     f"{case['ar_fallback_steps']} of {case['cycles']} steps fallen back")
        print(f"batch {b:4d}  AR {case['ar_tokens_per_s']:9.1f} tok/s  speculative {case['speculative_tokens_per_s']:9.1f}"
              f"  ratio {case['ratio']:.3f}  τ {case['tau']:.2f}  {case['verify_mode']}, {fell_back}, "
              f"{case['rows_identical_to_ar']:.0%} rows identical", flush=True)
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
