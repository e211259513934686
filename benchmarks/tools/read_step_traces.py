"""Read the Perfetto traces that ``profile_gpu_step.py --keep-traces DIR`` keeps (a folder, or a ``.tgz`` of it):
for each case, per step, what the host did (CUDA-graph launches, device-to-host copies), how many conditional
nodes the graph evaluated, and the device's kernels with their time; with ``--base CASE``, every other case's
kernel time against that case's, grouped (the Pallas kernels by name, GEMMs, copies, the rest by fusion kind).

The profiler's own step times are not read: under CUPTI a step of a graph with conditional nodes is traced at
several times its untraced wall time (benchmarks/journal/RESULTS.md, session 26), so only the kernels'
durations are used.

    python benchmarks/tools/read_step_traces.py traces.tgz --base b64_plain_ar_step --top 15
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tarfile
from pathlib import Path


def load(path: Path) -> dict[str, list]:
    """Case name → the trace's events: a trace's path below the top folder, less ``.json.gz``
    (``traces/b64_plain_ar_step.json.gz`` → ``b64_plain_ar_step``, ``traces/short4/b64_….json.gz`` →
    ``short4/b64_…``)."""
    out = {}
    if path.is_dir():
        for f in sorted(path.rglob("*.json.gz")):
            out[str(f.relative_to(path))[:-len(".json.gz")]] = json.load(gzip.open(f))["traceEvents"]
    else:
        with tarfile.open(path) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if m.name.endswith(".json.gz"):
                    name = str(Path(*Path(m.name).parts[1:]))[:-len(".json.gz")]
                    out[name] = json.load(gzip.open(tar.extractfile(m)))["traceEvents"]
    return out


def group(kernel: str) -> str:
    """A kernel's group for the comparison: Pallas kernels by name, GEMMs, copies, fusions by kind."""
    if kernel.startswith("dflash_"):
        return re.sub(r"_+\d+$", "", kernel)
    if kernel.startswith(("gemm", "nvjet", "cutlass")) or "gemm" in kernel:
        return "GEMMs"
    if "memcpy" in kernel.lower() or "memset" in kernel.lower():
        return "copies"
    return re.sub(r"[._]\d+$", "", kernel)


def summarize(events: list, default_steps: int) -> dict:
    """Per-step host counts and per-kernel (calls, µs) of one trace."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    host = [e for e in spans if "host" in procs.get(e["pid"], "").lower()]
    device = [e for e in spans if "host" not in procs.get(e["pid"], "").lower()]
    launches = sum(e["name"].startswith("cuGraphLaunch") for e in host)
    steps = launches or default_steps
    kernels: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in device:
        kernels[e["name"]][0] += 1
        kernels[e["name"]][1] += float(e.get("dur", 0.0))
    return dict(steps=steps, graph_launches=launches / steps,
                d2h_copies=sum(e["name"] == "MemcpyD2H" for e in host) / steps,
                conditional_nodes=kernels["set_case_condition"][0] / steps if "set_case_condition" in kernels else 0,
                kernels={k: (c / steps, us / steps) for k, (c, us) in kernels.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", type=Path, help="the --keep-traces folder, or a .tgz of it")
    ap.add_argument("--base", help="a case to compare the others with, by kernel group")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per case")
    ap.add_argument("--steps", type=int, default=32, help="steps a trace holds where it shows no graph launches")
    args = ap.parse_args()
    cases = {name: summarize(events, args.steps) for name, events in load(args.traces).items()}
    if not cases:
        print(f"no traces in {args.traces}", file=sys.stderr)
        return 2
    for name, c in cases.items():
        total = sum(us for _, us in c["kernels"].values())
        calls = sum(n for n, _ in c["kernels"].values())
        print(f"== {name}: {c['steps']} steps; a step: {total:.1f} µs in {calls:.0f} kernels, "
              f"{c['graph_launches']:.1f} graph launches, {c['d2h_copies']:.1f} device-to-host copies, "
              f"{c['conditional_nodes']:.1f} conditional nodes")
        for kernel, (n, us) in sorted(c["kernels"].items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"    {us:8.1f} µs  {n:5.1f}×  {kernel[:70]}")
    if args.base:
        base = cases[args.base]
        for name, c in cases.items():
            if name == args.base:
                continue
            mine, theirs = collections.defaultdict(float), collections.defaultdict(float)
            for kernel, (_, us) in c["kernels"].items():
                mine[group(kernel)] += us
            for kernel, (_, us) in base["kernels"].items():
                theirs[group(kernel)] += us
            print(f"\n{name} against {args.base}, µs a step by group (largest differences first):")
            rows = sorted(set(mine) | set(theirs), key=lambda g: -abs(mine[g] - theirs[g]))
            for g in rows[:args.top]:
                print(f"    {theirs[g]:8.1f} → {mine[g]:8.1f}  ({mine[g] - theirs[g]:+8.1f})  {g}")
            print(f"    total {sum(theirs.values()):.1f} → {sum(mine.values()):.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
