"""Verify modes across batch sizes: autoregressive vs static vs compact (confidence scheduler), and a mixed batch.

* ``--calibrate``: first measure the step cost table for this machine (:func:`dflash_jax.engine.calibrate.measure`) and
  schedule with it (written to ``--out`` beside the results); otherwise the pair's / the shipped table is used.
* Sweep: for each batch size, the evaluation prompts (HumanEval + MT-Bench first turns, token ids made here by
  ``--make-prompts``) in consecutive batches of that size, one call per batch, each mode on the same batches
  after an untimed pass over them (every shape bucket compiled). Per mode: tokens/s over the whole run (prefill + decode, host included), the
  mean per-row latency per token (a batch's wall time ÷ its mean answer length: what one user waits per token),
  τ, verified tokens per committed token, the tier histogram. Drawn as a throughput–latency spectrum.
  ``--continuous``: every prompt through one pool of the batch's rows instead (:mod:`dflash_jax.engine.pool`: a
  finished row takes the next prompt); latency is then each request's own, per token.
* Mixed batch: code, chat and poetry prompts in one batch, cap-accept (whose commits equal compact's): mean
  window and utilisation (committed ÷ what the whole block would have committed) per kind.

    python benchmarks/bench_schedule.py --make-prompts benchmarks/data/schedule_prompts.json   # here, once
    python benchmarks/bench_schedule.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --calibrate --out sched.json
    python benchmarks/bench_schedule.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --continuous --out pool.json
    python benchmarks/bench_schedule.py --demo --dtype float32 --max-new 96 --out demo_cpu.json   # CPU
    python benchmarks/bench_schedule.py --spectrum-of a.json b.json --out spectrum.png   # several runs' sweeps
    python benchmarks/bench_schedule.py --demo --dtype float32 --max-new 96 --repeats 3 --modes ar,compact \
        --draft-vocab 0,16384 --out demo_vocab.json   # CPU: the whole vocabulary vs a reduced draft vocabulary
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_jax import costs, draft_vocab, generate, load_drafter, load_target, speculative_generate  # noqa: E402
from dflash_jax import pairs  # noqa: E402
from dflash_jax.cuda.attention import PROGRAMS_PER_SM  # noqa: E402
from dflash_jax.engine import calibrate  # noqa: E402
from dflash_jax.engine import pool as pools  # noqa: E402
from dflash_jax.settings import DecodeSettings  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402
from dflash_jax.loading import restrict_draft_vocab, shipped_drafter_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_kernel_switches, apply_kernel_switches, source_commit  # noqa: E402

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "schedule_prompts.json"
# Poetry: free-form text that a drafter predicts worst (seed 002's "poetry" kind).
THEMES = ["the sea at night", "a city waking up", "an old clock", "autumn leaves", "a lighthouse keeper",
          "the first snow", "a train leaving", "a forgotten garden", "the moon over a desert", "a violin",
          "rain on a tin roof", "a letter never sent", "fireflies", "a mountain pass", "the smell of bread",
          "a kite string"]
FORMS = ["a short free-verse poem", "a sonnet", "a haiku sequence of three haiku", "a limerick"]


def make_prompts(path: Path) -> None:
    from dflash_jax.train.data import evaluation_prompts

    target = load_target("smollm2-135m")
    sets = evaluation_prompts()
    rows = [{"set": name, "ids": target.tokenizer.encode(text)} for name in ("humaneval", "mtbench")
            for text in sets[name]]
    poems = [f"Write {FORMS[i % len(FORMS)]} about {theme}." for i, theme in enumerate(THEMES)]
    rows += [{"set": "poetry", "ids": target.tokenizer.encode(text)} for text in poems]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows) + "\n")
    print(f"{len(rows)} prompts → {path}")


def run_mode(mode: str, target, drafter, batches: list[list[list[int]]], max_new: int,
             pool: dict | None = None, warm: bool = False, tuning: Tuning = Tuning()) -> dict:
    """``pool`` (continuous batching): ``batches`` is one list of every prompt, decoded through a pool of
    ``pool["batch_size"]`` rows refilled ``pool["refill_size"]`` at a time; latency is then each request's own
    (its prefill's dispatch to its answer on the host) per token. ``warm``: every shape already run once.
    ``tuning``: the library's knobs (:class:`dflash_jax.tuning.Tuning`) for every call."""
    def call(batch):
        if pool:
            d = None if mode == "ar" else drafter
            spec = {} if d is None else dict(block_size=d.config.verify_width, verify_mode=mode)
            settings = DecodeSettings.build(target, d, len(batch), max_new, batch_size=pool["batch_size"],
                                            tuning=tuning, **spec)
            return pools.run(target, d, batch, settings, refill_size=pool["refill_size"])
        if mode == "ar":
            return generate(target, batch, max_new_tokens=max_new, tuning=tuning)
        return speculative_generate(target, drafter, batch, max_new_tokens=max_new, verify_mode=mode,
                                    tuning=tuning)

    for batch in [] if warm else batches:  # compile every shape bucket first (from the persistent cache when
        call(batch)                          # it has them)
    wall = tokens = cycles = verified = batch_steps = row_slots = 0
    latency, tiers, ar_steps = [], {}, 0
    outs = []
    for batch in batches:
        t0 = time.perf_counter()
        out = call(batch)
        dt = time.perf_counter() - t0
        outs.append(out)
        n = out.stats["new_tokens"]
        wall, tokens = wall + dt, tokens + n
        if pool:
            latency += [1e3 * s / len(t) for s, t in zip(out.stats["request_latency_s"], out.token_ids)]
        else:
            latency.append(1e3 * dt / (n / len(batch)))
        cycles += sum(len(a) for a in out.acceptance_lengths)
        if not pool:  # a static batch steps until its slowest row is done; the others idle meanwhile
            batch_steps += out.stats["cycles"]
            row_slots += out.stats["cycles"] * len(batch)
        verified += out.stats.get("verify_tokens", n)
        for t, c in out.stats.get("tier_steps", {}).items():
            tiers[t] = tiers.get(t, 0) + c
        ar_steps += out.stats.get("ar_steps", 0)  # compact's steps without drafting, where offered
    res = dict(tokens_per_s=tokens / wall, row_ms_per_token=float(np.mean(latency)), tokens=tokens, wall_s=wall,
               tau=(tokens - sum(map(len, batches))) / max(cycles, 1), verified_per_token=verified / tokens)
    if tiers:
        res["tier_steps"] = dict(sorted(tiers.items()))
        res["ar_steps"] = ar_steps
    if pool:
        res.update({k: out.stats[k] for k in ("cycles", "segments", "refills", "refill_size")})
    else:  # steps the batches ran, the wall per step (prefill included), the share of row-steps spent idle
        res.update(batch_steps=batch_steps, wall_ms_per_step=1e3 * wall / max(batch_steps, 1),
                   idle_rows=1 - cycles / max(row_slots, 1))
    return res, outs


def evaluation_ids(rows: list[dict]) -> list[list[int]]:
    """The sweep's prompts: the evaluation sets' (HumanEval, MT-Bench), not the mixed run's poetry."""
    return [r["ids"] for r in rows if r["set"] != "poetry"]


def sweep_prompts(prompts: list[list[int]], b: int, max_prompts: int, whole_batches: bool = True) -> list:
    """The prompts a sweep decodes at batch ``b``: every one from batch 16 on (below, ``max_prompts``), cut to a
    whole number of batches unless ``whole_batches`` is off (continuous batching)."""
    n = min(len(prompts), max(b, max_prompts if b < 16 else len(prompts)))
    return prompts[:n - n % b if whole_batches and n >= b else n]


def sweep(target, drafter, rows: list[dict], batch_sizes: list[int], max_new: int, max_prompts: int,
          save=lambda results: None, refill_size: int | None = None, continuous_batching: bool = False,
          repeats: int = 1, tuning: Tuning = Tuning()) -> dict:
    """Each batch size's prompts in every mode; with ``repeats`` > 1 the modes' timed passes are interleaved that
    many times and each mode reports its median pass (``walls_s``: every pass's wall) — a pass at 64 rows and more
    is well under a second, which one pass measures to only ~2 %."""
    prompts = evaluation_ids(rows)
    results = {}
    for b in batch_sizes:
        chosen = sweep_prompts(prompts, b, max_prompts, whole_batches=not continuous_batching)
        n, pool = len(chosen), None
        if continuous_batching:
            batches, pool = [chosen], dict(batch_size=b, refill_size=refill_size)
        else:
            batches = [chosen[i: i + b] for i in range(0, n, b)]
        res = {}
        ids = {}
        passes = {mode: [] for mode in ("ar", "static", "compact")}
        spent = dict.fromkeys(passes, 0.0)  # seconds a mode took, compiling included
        for i in range(repeats):
            for mode, done in passes.items():
                t0 = time.perf_counter()
                done.append(run_mode(mode, target, drafter, batches, max_new, pool, warm=i > 0, tuning=tuning))
                spent[mode] += time.perf_counter() - t0
        for mode, done in passes.items():
            res[mode], outs = sorted(done, key=lambda run: run[0]["wall_s"])[len(done) // 2]
            if repeats > 1:
                res[mode]["walls_s"] = [run[0]["wall_s"] for run in done]
            ids[mode] = [t for o in outs for t in o.token_ids]
            print(f"batch {b:4d} {mode:8s} {res[mode]['tokens_per_s']:9.1f} tok/s  "
                  f"{res[mode]['row_ms_per_token']:7.2f} ms/token/row  τ {res[mode]['tau']:.2f}  "
                  + (f"{res[mode]['batch_steps']} steps, {res[mode]['wall_ms_per_step']:.2f} ms each, "
                     f"rows idle {res[mode]['idle_rows']:.0%}  " if pool is None else "")
                  + f"({spent[mode]:.0f} s)", flush=True)
        for mode in ("static", "compact"):
            res[f"{mode}_vs_ar"] = res[mode]["tokens_per_s"] / res["ar"]["tokens_per_s"]
            res[f"{mode}_identical_to_ar"] = float(np.mean([a == s for a, s in zip(ids["ar"], ids[mode])]))
        res["compact_vs_static"] = res["compact"]["tokens_per_s"] / res["static"]["tokens_per_s"]
        res["prompts"] = n
        results[b] = res
        save(results)  # a run cut short keeps the batches it finished
    return results


def mixed(target, drafter, rows: list[dict], per_kind: int, max_new: int, tuning: Tuning = Tuning()) -> dict:
    kinds = {"code": "humaneval", "chat": "mtbench", "poetry": "poetry"}
    batch, labels = [], []
    for kind, name in kinds.items():
        chosen = [r["ids"] for r in rows if r["set"] == name][:per_kind]
        batch += chosen
        labels += [kind] * len(chosen)
    out = {}
    for mode in ("cap-accept", "compact"):
        speculative_generate(target, drafter, batch, max_new_tokens=max_new, verify_mode=mode, tuning=tuning)  # compile
        t0 = time.perf_counter()
        res = speculative_generate(target, drafter, batch, max_new_tokens=max_new, verify_mode=mode, tuning=tuning)
        out[f"{mode}_tokens_per_s"] = res.stats["new_tokens"] / (time.perf_counter() - t0)
        if mode == "cap-accept":
            cap = res
    per_kind_stats = {}
    s = cap.stats
    for kind in kinds:
        idx = [i for i, k in enumerate(labels) if k == kind]
        cycles = sum(len(cap.acceptance_lengths[i]) for i in idx)
        committed = sum(sum(cap.acceptance_lengths[i]) for i in idx)
        per_kind_stats[kind] = dict(
            rows=len(idx), tau=committed / max(cycles, 1),
            mean_window=sum(s["row_verify_tokens"][i] for i in idx) / max(cycles, 1),
            utilization=committed / max(sum(s["row_untrimmed"][i] for i in idx), 1),
            untrimmed_tau=sum(s["row_untrimmed"][i] for i in idx) / max(cycles, 1))
    out.update(per_kind=per_kind_stats, utilization=s["utilization"], batch=len(batch),
               tier_steps=s["tier_steps"])
    return out


def demo_case(target, drafters: dict, max_new: int, repeats: int = 1,
              modes=("ar", "static", "compact", "cap-accept"), tuning: Tuning = Tuning()) -> dict:
    """`make demo`'s batch (its three prompts together) in every mode: the decode time of warm calls, the
    modes interleaved ``repeats`` times (this machine's speed drifts by 15-30 % between minutes), medians.
    ``drafters``: label → drafter (e.g. one per draft vocabulary); speculative modes run with each, named
    ``<mode>/<label>`` when there are several."""
    import statistics

    from dflash_jax.cli import DEMO_PROMPTS

    runs = {"ar": None} if "ar" in modes else {}
    for mode in (m for m in modes if m != "ar"):
        runs.update({(f"{mode}/{label}" if len(drafters) > 1 else mode): (mode, d) for label, d in drafters.items()})

    def call(name):
        if runs[name] is None:
            return generate(target, DEMO_PROMPTS, max_new_tokens=max_new, tuning=tuning)
        mode, drafter = runs[name]
        return speculative_generate(target, drafter, DEMO_PROMPTS, max_new_tokens=max_new, verify_mode=mode,
                                    tuning=tuning)

    modes = tuple(runs)
    for mode in modes:  # compile and warm every program first
        call(mode)
    times: dict = {mode: [] for mode in modes}
    res = {}
    for _ in range(repeats):
        for mode in modes:
            out = call(mode)
            s = out.stats
            times[mode].append(s["decode_s"])
            res[mode] = dict(tokens=s["new_tokens"], tau=out.tau, cycles=s["cycles"], mean_window=s.get("mean_window"),
                             utilization=s.get("utilization"), tier_steps=s.get("tier_steps"),
                             ar_steps=s.get("ar_steps"))
    for mode in modes:
        res[mode].update(decode_s=statistics.median(times[mode]), decode_s_all=times[mode])
        if "ar" in res:
            res[mode]["vs_ar"] = res["ar"]["decode_s"] / res[mode]["decode_s"]
            res[mode]["vs_ar_each"] = [a / t for a, t in zip(times["ar"], times[mode])]
        print(mode, res[mode], flush=True)
    return res


def restricted(target, drafter, size: int):
    """``drafter`` drafting over the embedded ranking's ``size`` most frequent tokens (0: unchanged)."""
    if not size:
        return drafter
    ids = draft_vocab.top_ids(draft_vocab.resolve_ranking("embedded:smollm2-135m"), size, target.config.vocab_size)
    return restrict_draft_vocab(drafter, target, ids)


def plot_spectrum(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.6, 4.4))
    for mode, style in (("ar", "s-"), ("static", "o-"), ("compact", "^-")):
        xs = [1e3 / results[b][mode]["row_ms_per_token"] for b in results]
        ys = [results[b][mode]["tokens_per_s"] for b in results]
        ax.plot(xs, ys, style, label={"ar": "autoregressive"}.get(mode, mode))
        for b, x, y in zip(results, xs, ys):
            ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens/s per request (interactivity)")
    ax.set_ylabel("tokens/s in total (throughput)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-prompts", type=Path)
    ap.add_argument("--gguf", help="the SmolLM2 GGUF (default: the embedded one)")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,4,16,32,64,128", help="batch sizes of the sweep (and calibration)")
    ap.add_argument("--cost-table", type=Path, help="a costs file from an earlier --calibrate (instead of calibrating)")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--small-batch-prompts", type=int, default=16, help="prompts per mode below batch 16")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--mixed-per-kind", type=int, default=16)
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--demo", action="store_true", help="only `make demo`'s batch in every mode (a CPU check)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="interleaved timed calls (--demo) or passes (the sweep) per mode; medians reported")
    ap.add_argument("--modes", default="ar,static,compact,cap-accept", help="--demo: the modes to time")
    ap.add_argument("--draft-vocab", default="0",
                    help="DFlash drafts over the N most frequent tokens (the embedded ranking; 0: all); "
                         "--demo takes a list and times each")
    ap.add_argument("--drafter", default="smollm2-135m-dflash",
                    help="a shipped drafter (dflash_jax/assets/<name>: smollm2-135m-dflash, smollm2-135m-dspark) "
                         "or a drafter directory")
    ap.add_argument("--continuous", action="store_true",
                    help="sweep: every prompt through one pool of the batch's rows (continuous batching) instead "
                         "of consecutive static batches")
    ap.add_argument("--refill-size", type=int, help="--continuous: rows refilled at a time (default: the library's)")
    add_kernel_switches(ap)
    ap.add_argument("--programs-per-sm", type=int,
                    help="GPU attention kernels: split each row's cache until this many programs per SM (the "
                         "library's default 3; where rows × KV heads fill the SMs, e.g. batch ≥ 44 here, the "
                         "library keeps one pass on caches < 2k rows whatever this is)")
    ap.add_argument("--spectrum-of", nargs="+", type=Path, metavar="SWEEP_JSON",
                    help="no run: one spectrum (--out, a .png) of the sweeps in these result files, batch by batch")
    ap.add_argument("--out", type=Path, default=Path("schedule.json"))
    args = ap.parse_args()
    tuning, switches = apply_kernel_switches(args, programs_per_sm=args.programs_per_sm or 0)
    if args.make_prompts:
        make_prompts(args.make_prompts)
        return 0
    if args.spectrum_of:
        runs = [json.loads(f.read_text()) for f in args.spectrum_of]
        merged = {b: r for run in runs for b, r in run["sweep"].items()}
        plot_spectrum({b: merged[b] for b in sorted(merged, key=int)}, args.out,
                      f"SmolLM2-135M + {runs[0]['drafter']}, {runs[0]['device']}, {runs[0]['dtype']} "
                      f"({', '.join(sorted({r['commit'] for r in runs}))})")
        return 0
    target = load_target(args.gguf or "smollm2-135m", dtype=args.dtype)
    drafter_dir = (Path(args.drafter) if Path(args.drafter).is_dir()
                   else shipped_drafter_dir(f"embedded:{args.drafter}"))
    drafter = load_drafter(drafter_dir, target)
    kind = "DSpark" if drafter.config.sequential else "DFlash"
    # the pair config this drafter ships in (configs/<pair>.yaml), whose costs file a calibration here can become
    def ships(cfg) -> bool:
        shipped = shipped_drafter_dir(cfg.drafter)
        return shipped is not None and shipped.resolve() == drafter_dir.resolve()
    pair_name = next((cfg.name for cfg in pairs.all_pair_configs() if ships(cfg)), drafter_dir.name)
    vocab_sizes = [int(n) for n in args.draft_vocab.split(",")]
    drafters = {(f"v{n}" if n else "full"): restricted(target, drafter, n) for n in vocab_sizes}
    drafter = next(iter(drafters.values()))
    rows = json.loads(args.prompts.read_text())
    result = dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind, dtype=args.dtype,
                  **{**switches, "programs_per_sm": args.programs_per_sm or PROGRAMS_PER_SM},
                  platform=platform.platform(), max_new=args.max_new, drafter=drafter_dir.name,
                  commit=source_commit())
    if args.calibrate:
        t0 = time.perf_counter()
        table = calibrate.measure(target, drafter, batches=[int(b) for b in args.batches.split(",")],
                                  pair=pair_name, progress=lambda line: print(line, flush=True), tuning=tuning)
        print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
        # With the rows of an earlier calibration already in that file (same settings), their union.
        table = costs.save_table(args.out.with_name(args.out.stem + ".costs.json"), table)
        for d in drafters.values():
            d.cost_tables = {table.backend: table}
        result["cost_table"] = table.to_json()
        costs.plot(table, args.out.with_name(args.out.stem + ".costs.png"))
    elif args.cost_table:
        for d in drafters.values():
            d.cost_tables = costs.load_tables(args.cost_table)
        result["cost_table"] = costs.resolve(None, jax.default_backend(), drafter.cost_tables).to_json()
    if args.demo:
        result["demo"] = demo_case(target, drafters, args.max_new, args.repeats, tuple(args.modes.split(",")),
                                   tuning)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if not args.skip_sweep:
        def save(partial):
            args.out.write_text(json.dumps(dict(result, sweep=partial), indent=1) + "\n")

        result["continuous"] = args.continuous
        result["sweep"] = sweep(target, drafter, rows, [int(b) for b in args.batches.split(",")], args.max_new,
                                args.small_batch_prompts, save, args.refill_size, args.continuous, args.repeats,
                                tuning)
        plot_spectrum(result["sweep"], args.out.with_name(args.out.stem + ".spectrum.png"),
                      f"SmolLM2-135M + {kind} drafter ({drafter_dir.name}), {result['device']}, {args.dtype}")
    if args.mixed_per_kind:
        result["mixed"] = mixed(target, drafter, rows, args.mixed_per_kind, args.max_new, tuning)
        print(json.dumps(result["mixed"], indent=1), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
