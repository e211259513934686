r"""What a quantized target's decode step costs on a real-size shape: weight bytes, the autoregressive step and the
static speculative cycle at τ = 1, per batch, against the bytes floor; and (``--sweep``) the quantized matmul alone.

A Qwen3-8B-shaped target (``--shape 8b``) or a Qwen3-30B-A3B-shaped MoE target (``--shape moe``), random bf16 weights
(``common.random_target``), quantized on the device per ``--quantizations`` (``bf16``: none; ``int8`` / ``fp8``:
per output channel; ``fp8-block``: 128 × 128 blocks, the HF FP8 checkpoints' layout); every linear layer, the LM
head and a MoE layer's routed experts quantized, embeddings, norms and routers in bf16 (as ``load_target(...,
quantization=...)`` leaves them). A random bf16 DFlash drafter of the target's shape (``--drafter-layers``). Every
row's caches hold ``--context`` tokens. Per quantization and batch B (``--batches``):

* ``AR step``: the target over each row's anchor + LM head + argmax + commit (``generate``'s step);
* ``static cycle``: ``loop.cycle`` with the static LoopSpec (draft, verify a block of L, accept, commit, the
  drafter's cache writes); random weights accept nothing past the bonus token, so this is the cycle at τ = 1;

each ``--steps`` steps in one ``lax.while_loop`` (``benchmarks/tools/step_parts.py``'s programs), median of
``--repeats`` calls. Floors: the bytes a step must read (the target's stored weights a step touches — of a MoE
layer's experts the share B uniformly routed tokens touch — plus the K/V at that context) ÷ the device's HBM
bandwidth (``step_parts.DEVICES``, or ``--hbm-gbps``). ``--quant-kernel default``: the library's defaults (on a
GPU the dense quantized layers through XLA's own fused conversion and GEMM, kernels of several row blocks
(``fp8-block``) through the GPU kernel from 3 to 64 tokens, MoE experts through the grouped-expert kernel); ``off``: the quantized layers and MoE experts run the XLA references (A/B); ``on`` (and its older name
``float8``): int8 and float8 weights through the fused kernels, the dense layers' GPU kernel included
(``quant_kernel_impls``); ``grouped``: ``on``, and a layer's q / k / v and an MLP's gate / up in one launch each
(``quant_group_kernel``); ``blocked``: the defaults, and kernels of several row blocks through the GPU kernel at
every size up to 64 tokens, one token included (``quant_kernel_blocked_min_tokens=1``); ``xla-blocked``: the
defaults, and kernels of several row blocks through the XLA reference at every size (the A/B of the default);
``moe-sorted``: the defaults, and quantized experts past E (token, expert) pairs (a wide verify, a prefill) through
the sorted grouped-expert GPU kernels instead of every expert a few at a time (``moe_quantized_sorted``).

``--sweep``: the quantized matmul alone on the shape's linear layers (Qwen3-8B: 4096 × 4096, 4096 × 1024,
4096 × 12288, 12288 × 4096, 4096 × 151936) at T = 1, 16, 64 tokens (``--sweep-tokens``; schemes
``--sweep-schemes``): bf16 ``x @ w`` (XLA), the XLA reference on int8 / fp8, the kernel at its defaults (and, on
int8, at a few other block choices), each against its bytes floor.

    # GPU (one call per quantization keeps a call under ~8 minutes on an H100)
    python benchmarks/bench_quantized_step.py --quantizations bf16 --out $OUT/qstep_8b_bf16.json
    python benchmarks/bench_quantized_step.py --quantizations int8 --out $OUT/qstep_8b_int8.json
    python benchmarks/bench_quantized_step.py --quantizations fp8,fp8-block --out $OUT/qstep_8b_fp8.json
    python benchmarks/bench_quantized_step.py --sweep --out $OUT/qstep_sweep.json
    python benchmarks/bench_quantized_step.py --quantizations int8 --batches 1,16 --quant-kernel grouped \
        --out $OUT/qstep_8b_int8_grouped.json
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/bench_quantized_step.py --shape moe \
        --quantizations bf16,fp8-block --batches 1,16 --out $OUT/qstep_moe.json  # bf16: 61 GB of weights, past
        # the 75 % of an 80 GB GPU that JAX takes by default
    python benchmarks/bench_quantized_step.py --shape moe --quantizations int8,fp8-block --batches 1,16 \
        --quant-kernel float8 --out $OUT/qstep_moe_kernel.json  # quantized experts through the MoE kernel
    # CPU smoke test (a tiny shape; its times mean nothing)
    python benchmarks/bench_quantized_step.py --small --batches 1,2 --steps 2 --repeats 1 --out /tmp/qstep.json
    python benchmarks/bench_quantized_step.py --small --sweep --repeats 1 --out /tmp/qsweep.json

The JSON is rewritten after each quantization, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (dflash_jax)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (common, bench_compact_scaled)
sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))  # step_parts

from bench_compact_scaled import CPU_FAST_COMPILE, SHAPES  # noqa: E402
from common import (SCHEMES, device_profile, print_profile, quantize_model, quantize_on_device,  # noqa: E402
                    random_target, source_commit)
from step_parts import device_rates, parts, program, timed  # noqa: E402
from dflash_jax import random_drafter  # noqa: E402
from dflash_jax.cuda import quantized as cuda_quantized  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.kernels.quantized import reference as quantized_reference  # noqa: E402
from dflash_jax.quant import param_bytes  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402

LAYERS_8B = ((4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096), (4096, 151936))
SWEEP = ({}, dict(block_e=128), dict(block_e=32), dict(block_e=16), dict(block_d=256), dict(block_d=512),
         dict(num_warps=8), dict(num_stages=3), dict(num_splits=1), dict(programs_per_sm=2), dict(programs_per_sm=8),
         dict(programs_per_sm=16), dict(gemv=False),
         # no D split (no XLA sum of partials: one launch) over narrower column blocks, so that E alone gives the
         # GPU enough programs; deeper steps keep bytes in flight
         dict(block_e=32, num_splits=1), dict(block_e=32, block_d=256, num_splits=1),
         dict(block_e=16, block_d=512, num_splits=1), dict(block_e=128, block_d=64),
         dict(block_e=32, block_d=256, programs_per_sm=2),
         # wide column blocks over few D rows a step: each weight row's segment is 256-512 contiguous bytes (a
         # [D, E] int8 kernel's 64-column segment is 64 bytes, a row's stride apart), the accumulator still small
         dict(block_e=256, block_d=32), dict(block_e=256, block_d=64, num_warps=8),
         dict(block_e=512, block_d=16, num_warps=8), dict(block_e=256, block_d=32, programs_per_sm=8))
SWEEP_BYTES = 320e6  # the copies of a swept matrix together: well past an H100's / H200's 50 MB L2


def step_bytes(model, tokens: int) -> float:
    """Bytes of stored weights that ``tokens`` tokens' step reads: the layers, final norm and LM head (the
    embedding table when tied), a MoE layer's experts as the share ``tokens`` uniformly routed tokens touch."""
    cfg = model.config
    total = param_bytes(model, lambda p: p[0] != "embed_tokens" or model.lm_head is None)
    experts = param_bytes(model, lambda p: "experts" in p)
    if experts:
        k_of_e = cfg.num_experts_per_tok / cfg.num_experts
        total -= experts * (1.0 - k_of_e) ** tokens
    return float(total)


def kv_bytes(cfg, rows: int, keys: int) -> float:
    return float(cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * rows * keys)  # bf16 caches


def run_steps(args, name, cfg, tuning, hbm, results: dict, out: Path | None) -> None:
    l, c = args.block_size, args.context
    for qname in args.quantizations.split(","):
        scheme = SCHEMES[qname]
        t0 = time.perf_counter()
        # quantized layer by layer as drawn: the MoE shape's 61 GB of bf16 weights never sit on the GPU at once
        target = random_target(cfg, jnp.bfloat16,
                               after_layer=None if scheme is None else functools.partial(quantize_model, scheme=scheme))
        if scheme is not None:
            quantize_model(target.model, scheme)  # the LM head
        jax.block_until_ready(jax.tree.leaves(target.model))
        drafter = random_drafter(target, num_layers=args.drafter_layers, block_size=l)
        if args.drafter_quantization and scheme is not None:  # the drafter's linear layers in the target's scheme
            quantize_model(drafter.model, scheme)
        row = dict(scheme=str(scheme) if scheme else "bf16", weight_bytes=target.weight_bytes,
                   drafter_quantized=bool(args.drafter_quantization and scheme is not None),
                   build_s=time.perf_counter() - t0, batches={})
        print(f"{qname}: weights {target.weight_bytes / 1e9:.3f} GB (built in {row['build_s']:.0f} s)",
              file=sys.stderr, flush=True)
        for b in (int(v) for v in args.batches.split(",")):
            ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, c)).tolist()
            job = jobs.make(target, drafter, ids, 4 * l, block_size=l, stop_token_ids=[], verify_mode="static",
                            tuning=tuning, decode=False)
            state, _ = job.programs.prefill(*job.pre_args)
            steps = parts(job)
            ms, prof = {}, {}
            for part in ("AR step", "static cycle"):
                step, x = steps[part]
                x = jax.tree.map(jnp.copy, x)
                fn = program(job, step, state, x)
                ms[part], state = timed(fn, job.params, state, x, args.steps, args.repeats)
                if args.profile and part == "AR step":
                    x = jax.tree.map(jnp.copy, steps[part][1])  # timed's calls donated the last one
                    state, x = profile_step(fn, job.params, state, x, args.steps, f"{qname} B {b} {part}", prof)
            ar_bytes = step_bytes(target.model, b) + kv_bytes(cfg, b, c + 1)
            floor = ar_bytes / hbm * 1e3 if hbm else None
            row["batches"][b] = dict(ar_step_ms=ms["AR step"], static_cycle_ms=ms["static cycle"],
                                     cycle_over_ar=ms["static cycle"] / ms["AR step"], ar_step_bytes=ar_bytes,
                                     ar_bytes_floor_ms=floor,
                                     ar_over_floor=ms["AR step"] / floor if floor else None, **prof)
            print(f"  B {b:3d}: AR step {ms['AR step']:8.3f} ms (floor {floor if floor else float('nan'):.3f}), "
                  f"static cycle {ms['static cycle']:8.3f} ms", file=sys.stderr, flush=True)
            del job, state
        results["quantizations"][qname] = row
        del target, drafter
        _write(results, out)


def run_sweep(args, cfg, hbm, results: dict, out: Path | None) -> None:
    """The quantized matmul alone (module docstring). Each candidate is timed as a model runs it: one program
    applies it to ``n`` distinct copies of the weights in turn (together more than the GPU's L2 cache, so every
    call reads its weights from HBM) and the time is split over the ``n`` calls; a one-call program would time
    the host's dispatch instead (tens of µs against a 4096 × 1024 int8 matrix's ~2 µs floor)."""
    shapes = LAYERS_8B if not args.small else ((cfg.hidden_size, cfg.intermediate_size),
                                              (cfg.intermediate_size, cfg.hidden_size))
    interpret = jax.default_backend() != "gpu"
    rows = []
    for d, e in shapes:
        w = jax.random.normal(jax.random.key(d + e), (d, e), jnp.float32).astype(jnp.bfloat16) / np.sqrt(d)
        n = 2 if args.small else int(np.clip(np.ceil(SWEEP_BYTES / (d * e)), 2, 16))
        ws = [jnp.roll(w, i, axis=0) for i in range(n)]
        for qname in args.sweep_schemes.split(","):
            scheme = SCHEMES[qname]
            qs, ss = zip(*(quantize_on_device(wi, scheme) for wi in ws))
            block = scheme.blocks(d, e)
            nbytes = qs[0].size * qs[0].dtype.itemsize + ss[0].size * 4
            for t in map(int, args.sweep_tokens.split(",")):
                x = jax.random.normal(jax.random.key(t), (t, d), jnp.float32).astype(jnp.bfloat16)
                cands = {"xla bf16": (lambda x, w: x @ w, (ws,), d * e * 2),
                         "xla reference": (lambda x, q, s, b=block: quantized_reference(x, q, s, b, x.dtype),
                                           (qs, ss), nbytes)}
                # the block choices on int8 (the same tiles for every weight dtype); fp8 at the defaults
                for kw in SWEEP[:2] if args.small else SWEEP if qname == "int8" else SWEEP[:1]:
                    label = "kernel " + (",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
                    cands[label] = (lambda x, q, s, b=block, kw=kw: cuda_quantized.quantized_matmul(
                        x, q, s, b, interpret=interpret, **kw), (qs, ss), nbytes)
                for label, (fn, weights, nb) in cands.items():
                    try:
                        us = _time_us(_over_copies(fn), (x, *weights), args.repeats) / n
                    except Exception as ex:  # noqa: BLE001 — a block choice Triton refuses: recorded, not fatal
                        rows.append(dict(layer=f"{d}x{e}", scheme=qname, t=t, impl=label,
                                         error=f"{type(ex).__name__}: {str(ex)[:200]}"))
                        continue
                    floor = nb / hbm * 1e6 if hbm else None
                    rows.append(dict(layer=f"{d}x{e}", scheme=qname, t=t, impl=label, us=us, bytes=nb, copies=n,
                                     floor_us=floor, over_floor=us / floor if floor else None))
                    print(f"  {d}x{e} {qname:9s} T {t:2d} {label:40s} {us:9.1f} µs"
                          + (f"  ({us / floor:.2f}× floor)" if floor else ""), file=sys.stderr, flush=True)
            results["sweep"] = rows
            _write(results, out)
            del qs, ss


def profile_step(fn, params, state, x, steps: int, label: str, into: dict):
    """One more call of ``fn`` under the JAX profiler: the device's kernel µs and kernel count per step and its
    top kernels (``common.device_profile``; ``--profile``), printed and stored in ``into["ar_profile"]``; wall −
    kernel time is the GPU waiting between kernels. Returns (state, x) after the call."""
    out = {}

    def call():
        out["sx"] = jax.block_until_ready(fn(params, state, x, np.int32(steps)))

    with tempfile.TemporaryDirectory() as d:
        prof = device_profile(call, d, per=steps, top=15)
    print_profile(prof, label)
    into["ar_profile"] = prof
    return out["sx"]


def _over_copies(fn):
    """A program applying ``fn(x, *weights_i)`` to each copy i of the weights (tuples of arrays), the outputs
    summed in float32 so that no call is dead code."""
    @jax.jit
    def run(x, *weights):
        total = None
        for parts in zip(*weights):
            y = fn(x, *parts).astype(jnp.float32)
            total = y if total is None else total + y
        return total
    return run


def _time_us(fn, args, repeats: int) -> float:
    """Median µs of ``repeats`` timed rounds of 5 calls, after compiling and a warm-up round."""
    jax.block_until_ready(fn(*args))
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        for _ in range(5):
            y = fn(*args)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - t0) / 5)
    return float(np.median(times) * 1e6)


def _write(results: dict, out: Path | None) -> None:
    if out:
        out.write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="8b: Qwen3-8B; moe: Qwen3-30B-A3B")
    ap.add_argument("--small", action="store_true", help="a tiny version of the shape (a CPU smoke test)")
    ap.add_argument("--quantizations", default="bf16,int8,fp8", help=f"comma-separated, of {sorted(SCHEMES)}")
    ap.add_argument("--batches", default="1,16,64", help="B: rows, comma-separated")
    ap.add_argument("--context", type=int, default=192, help="C: tokens in every row's caches")
    ap.add_argument("--block-size", type=int, default=16, help="L: tokens a cycle verifies")
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed call")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls (median)")
    ap.add_argument("--quant-kernel", choices=("default", "on", "off", "float8", "grouped", "blocked",
                                                   "xla-blocked", "moe-sorted"),
                    default="default",
                    help="default: the library's; off: quantized layers (and MoE experts) run the XLA reference "
                         "(A/B against the fused kernels); on / float8: every fused kernel, the dense layers' GPU "
                         "kernel included (quant_kernel_impls); grouped: on, and a layer's q / k / v and gate / up "
                         "each in one launch (quant_group_kernel); blocked: the defaults, and kernels of several row "
                         "blocks (fp8-block) through the GPU kernel at 1 to 64 tokens; xla-blocked: those through "
                         "the XLA reference at every size; moe-sorted: the defaults, and quantized experts past E "
                         "pairs through the sorted grouped-expert kernels (moe_quantized_sorted)")
    ap.add_argument("--drafter-quantization", action="store_true",
                    help="quantize the drafter's linear layers too, as the target's (load_pair's drafter_quantization)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one call of the AR step: kernel time and count a step, top kernels")
    ap.add_argument("--sweep", action="store_true", help="time the quantized matmul alone instead (docstring)")
    ap.add_argument("--sweep-tokens", default="1,16,64", help="T of the sweep, comma-separated")
    ap.add_argument("--sweep-schemes", default="int8,fp8,fp8-block", help="the sweep's quantizations")
    ap.add_argument("--hbm-gbps", type=float, help="HBM bandwidth in GB/s (default: the device table's)")
    ap.add_argument("--peak-tflops", type=float, help="unused here (step_parts' device table has it)")
    ap.add_argument("--out", type=Path, help="a JSON of every number")
    args = ap.parse_args(argv)
    unknown = (set(args.quantizations.split(",")) | set(args.sweep_schemes.split(","))) - set(SCHEMES)
    if unknown:
        ap.error(f"unknown quantizations {sorted(unknown)}; one of {sorted(SCHEMES)}")
    name, full, small = SHAPES[args.shape]
    cfg = small if args.small else full
    tuning = Tuning()
    if args.quant_kernel == "blocked":
        tuning = tuning.replace(quant_kernel_blocked_min_tokens=1, quant_kernel_blocked_max_tokens=64)
    elif args.quant_kernel == "xla-blocked":
        tuning = tuning.replace(quant_kernel_blocked_max_tokens=0)
    elif args.quant_kernel == "moe-sorted":
        tuning = tuning.replace(moe_quantized_sorted=True)
    elif args.quant_kernel != "default":
        tuning = tuning.replace(quant_kernel=args.quant_kernel != "off", quant_kernel_float8=args.quant_kernel != "off",
                                quant_group_kernel=args.quant_kernel == "grouped",
                                quant_kernel_impls=("cuda", "pallas"))
    if args.small and jax.default_backend() == "cpu":
        tuning = tuning.with_compiler_options(CPU_FAST_COMPILE)
    hbm, _ = device_rates(args)
    kind = jax.devices()[0].device_kind
    commit = source_commit()
    results = dict(command=" ".join(["python", "benchmarks/bench_quantized_step.py",
                                     *(sys.argv[1:] if argv is None else argv)]),
                   date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit, device_kind=kind,
                   jax_version=jax.__version__, shape=f"small-{name}" if args.small else name,
                   args={k: str(v) for k, v in vars(args).items()}, hbm_bytes_per_s=hbm, quantizations={})
    if args.sweep:
        run_sweep(args, cfg, hbm, results, args.out)
    else:
        run_steps(args, name, cfg, tuning, hbm, results, args.out)
        print(f"\n{name}{' (small)' if args.small else ''}, B × {args.batches}, L {args.block_size}, "
              f"C {args.context}, quant kernel {args.quant_kernel}, {kind}\n")
        print("| weights | GB | B | AR step ms | AR floor ms | AR ÷ floor | static cycle ms | cycle ÷ AR |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for q, row in results["quantizations"].items():
            for b, r in row["batches"].items():
                fl = r["ar_bytes_floor_ms"]
                print(f"| {q} | {row['weight_bytes'] / 1e9:.2f} | {b} | {r['ar_step_ms']:.3f} | "
                      f"{'n/a' if fl is None else f'{fl:.3f}'} | "
                      f"{'n/a' if fl is None else format(r['ar_over_floor'], '.2f')} | {r['static_cycle_ms']:.3f} | "
                      f"{r['cycle_over_ar']:.2f} |")
    if args.out:
        print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
