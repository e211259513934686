"""Compact vs static verify on a measured GPU cost table, simulated on this machine's CPU.

The confidence scheduler's choices depend only on the drafts, the acceptance so far and the cost table; the
committed tokens depend only on the models. So the steps a GPU sweep runs can be replayed here: each mode decodes
the same batches as ``bench_schedule.py``'s sweep (the evaluation prompts, HumanEval + MT-Bench, in consecutive
batches of each size), compact scheduling with the GPU's table, and each step is charged what the table says
that step costs on the GPU — compact's steps by their tier (and its steps without drafting at the AR column),
static's whole-block steps at the static column. A static batch steps until its slowest row is done, so its
steps are the most cycles any of its rows needs (rows are independent: one static pass gives every row's
cycles). Prefill, host work and the table's own error are not in the simulated times; ``--measured`` puts a
sweep's measured ratio beside them. No ratio to plain autoregressive decoding: the table's AR column is compact's
step without drafting (its conditionals included), dearer than a plain autoregressive step
(benchmarks/journal/RESULTS.md), so only the autoregressive steps a batch needs are counted.

What this is for: trying scheduler and tier changes against the GPU's costs while no GPU is lent. It runs the
models in float32 (a CPU's bf16 is slow), so acceptance can differ a little from the GPU's bf16 runs.

    python benchmarks/tools/sim_schedule.py --drafter smollm2-135m-dspark \\
        --measured benchmarks/results/2026-12-05_s22_schedule_dspark_unrolled_b64_128_h200.json --out sim.json
    (``--measured``'s sweep supplies the table it scheduled with; ``--cost-table`` gives another.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, bench_schedule
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_schedule import DEFAULT_PROMPTS, evaluation_ids, sweep_prompts  # noqa: E402
from common import source_commit  # noqa: E402
from dflash_jax import costs, load_drafter, load_target, speculative_generate  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402
from dflash_jax.loading import shipped_drafter_dir  # noqa: E402


def sweep_batches(prompts: list[list[int]], b: int) -> list[list[list[int]]]:
    """The batches ``bench_schedule.sweep`` decodes at batch ``b`` ≥ 16."""
    chosen = sweep_prompts(prompts, b, max_prompts=0)
    return [chosen[i: i + b] for i in range(0, len(chosen), b)]


def static_rows(target, drafter, prompts: list[list[int]], max_new: int, chunk: int) -> tuple[list, list]:
    """(cycles, token ids) of every prompt under the static verify (each row's own: rows never interact)."""
    cycles, ids = [], []
    for i in range(0, len(prompts), chunk):
        out = speculative_generate(target, drafter, prompts[i: i + chunk], max_new_tokens=max_new,
                                   verify_mode="static")
        cycles += [len(a) for a in out.acceptance_lengths]
        ids += out.token_ids
        print(f"  static: {min(i + chunk, len(prompts))}/{len(prompts)} prompts", flush=True)
    return cycles, ids


def compact_batch(target, drafter, batch: list[list[int]], table, max_new: int, tuning: Tuning) -> dict:
    """One batch in compact mode, scheduled with ``table``: its token ids and its steps' simulated GPU time."""
    mode, tiers, step_cost, ar_offered = jobs.resolve_verify_mode(
        "compact", drafter, len(batch), drafter.config.verify_width, table, tuning=tuning)
    out = speculative_generate(target, drafter, batch, max_new_tokens=max_new, verify_mode="compact",
                               cost_table=table, tuning=tuning)
    if mode.name == "static":  # the table says no tier saves on static's step: compact runs static's program
        steps = {"static": out.stats["cycles"]}
        ms = out.stats["cycles"] * table.static_cost(len(batch))
    else:
        cost = dict(zip(tiers, step_cost[: len(tiers)].tolist()))
        steps = dict(out.stats.get("tier_steps", {}))
        ms = sum(n * cost[t] for t, n in steps.items())
        if ar_offered:
            steps["ar"] = out.stats.get("ar_steps", 0)
            ms += steps["ar"] * float(step_cost[-1])
    return dict(ids=out.token_ids, ms=ms, steps=steps, tiers=list(tiers), new_tokens=out.stats["new_tokens"])


def simulate(target, drafter, prompts, table, batch_sizes, max_new: int, chunk: int, earlier: dict | None,
             tuning: Tuning = Tuning()) -> dict:
    """``earlier``: an earlier run's results over the same prompts and drafter, whose static steps to reuse (the
    static pass is the slow part; a scheduler variant changes compact's steps only). Its outputs are then not
    checked against static's."""
    if earlier is None:
        longest = max(sum(map(len, sweep_batches(prompts, b))) for b in batch_sizes)
        t0 = time.perf_counter()
        cycles, static_ids = static_rows(target, drafter, prompts[:longest], max_new, chunk)
        print(f"static pass: {time.perf_counter() - t0:.0f} s", flush=True)
    results = {}
    for b in batch_sizes:
        batches = sweep_batches(prompts, b)
        static_ms = table.static_cost(b)
        if static_ms is None:
            raise SystemExit(f"the cost table has no static step at batch {b}")
        res = dict(static_steps=0, ar_steps=0, compact_ms=0.0, compact_steps={}, tokens=0,
                   identical=None if earlier else True)
        t0 = time.perf_counter()
        for k, batch in enumerate(batches):
            c = compact_batch(target, drafter, batch, table, max_new, tuning)
            res["compact_ms"] += c["ms"]
            res["tokens"] += c["new_tokens"]
            res["tiers"] = c["tiers"]
            for t, n in c["steps"].items():
                res["compact_steps"][str(t)] = res["compact_steps"].get(str(t), 0) + n
            if earlier is None:
                rows = slice(k * b, k * b + len(batch))
                res["static_steps"] += max(cycles[rows])
                res["ar_steps"] += max(len(t) for t in static_ids[rows]) - 1  # the prefill gives the first token
                res["identical"] &= c["ids"] == static_ids[rows]
        if earlier is not None:
            res["static_steps"], res["ar_steps"] = earlier[str(b)]["static_steps"], earlier[str(b)]["ar_steps"]
        res["static_ms"] = res["static_steps"] * static_ms
        res["compact_vs_static"] = res["static_ms"] / res["compact_ms"]
        results[str(b)] = res
        print(f"batch {b}: simulated compact ÷ static {res['compact_vs_static']:.3f}; steps {res['compact_steps']}"
              f" ({res['compact_ms']:.0f} ms), static {res['static_steps']} ({res['static_ms']:.0f} ms), AR "
              f"{res['ar_steps']}; outputs identical to static's: {res['identical']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


def measured_ratios(path: Path, batch_sizes) -> dict:
    """compact ÷ static in tokens/s from a ``bench_schedule.py`` sweep (prefill and host included), and
    compact's measured tier histogram."""
    sweep = json.loads(path.read_text()).get("sweep", {})
    return {str(b): dict(compact_vs_static=sweep[str(b)]["compact"]["tokens_per_s"]
                         / sweep[str(b)]["static"]["tokens_per_s"],
                         compact_steps=sweep[str(b)]["compact"].get("tier_steps"))
            for b in batch_sizes if str(b) in sweep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="smollm2-135m-dflash", help="a shipped drafter (assets/) or a folder")
    ap.add_argument("--cost-table", type=Path, help="a costs file with a GPU table (default: --measured's table)")
    ap.add_argument("--backend", default="gpu", help="which of the file's tables to schedule with")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk", type=int, default=64, help="rows per call of the static pass")
    ap.add_argument("--measured", type=Path, help="a bench_schedule.py sweep JSON to compare with")
    ap.add_argument("--static-from", type=Path,
                    help="reuse the static steps of an earlier --out (same drafter, prompts and batches)")
    ap.add_argument("--tiers-per-row", help="compile these tokens-per-row tiers instead of 1, 2, 4 … L (e.g. "
                    "1,2,3,4,6,8,12,16): their costs interpolated from the table")
    ap.add_argument("--tier-scale", type=float, default=1.0,
                    help="what if compact's drafted steps cost this times the table's (static and AR unchanged)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batches.split(",")]
    tuning = Tuning(tiers_per_row=tuple(int(n) for n in args.tiers_per_row.split(",")) if args.tiers_per_row
                    else None)
    if args.cost_table:
        table = costs.load_tables(args.cost_table)[args.backend]
    elif args.measured:  # the table the sweep scheduled with
        table = costs.CostTable.from_json(json.loads(args.measured.read_text())["cost_table"], str(args.measured))
    else:
        raise SystemExit("give --cost-table or --measured")
    if args.tier_scale != 1.0:
        table = dataclasses.replace(table, step_ms={b: {n: ms * args.tier_scale for n, ms in row.items()}
                                                    for b, row in table.step_ms.items()})
    target = load_target("smollm2-135m", dtype=args.dtype)
    drafter_dir = Path(args.drafter) if Path(args.drafter).is_dir() else shipped_drafter_dir(f"embedded:{args.drafter}")
    drafter = load_drafter(drafter_dir, target)
    prompts = evaluation_ids(json.loads(args.prompts.read_text()))
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), drafter=args.drafter, cost_table=table.to_json(),
                  dtype=args.dtype, max_new=args.max_new,
                  commit=source_commit(),
                  tiers_per_row=args.tiers_per_row, tier_scale=args.tier_scale,
                  simulated=simulate(target, drafter, prompts, table, batch_sizes, args.max_new, args.chunk,
                                     json.loads(args.static_from.read_text())["simulated"]
                                     if args.static_from else None, tuning))
    if args.measured:
        result["measured"] = measured_ratios(args.measured, batch_sizes)
        for b, m in result["measured"].items():
            if b not in result["simulated"]:
                continue
            s = result["simulated"][b]
            print(f"batch {b}: compact ÷ static simulated {s['compact_vs_static']:.3f}, measured "
                  f"{m['compact_vs_static']:.3f}; compact's steps simulated {s['compact_steps']}, measured "
                  f"{m['compact_steps']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
