r"""What each drafter kind's cycle costs on one backbone: a static-verify cycle (draft → verify → accept → commit,
``loop.cycle``) with a random DFlash, DSpark and DFlash2 drafter of the same trunk (``--drafter-layers`` layers
of the target's width), at each batch, on a Qwen3-8B-shaped target (``--shape 8b``) or the embedded pair's
SmolLM2-135M shape (``--shape smollm2``), random weights. The kinds differ only in what turns the trunk's hidden
states into drafts: DFlash's LM head and argmax per position; DSpark's sequential head (a Markov term per
position) and confidence head; DFlash2's grouped convolutions around every trunk sublayer, the top-K of the LM
head per position and the candidate selector's walk. So the ratio to DFlash is what each kind adds to a cycle.

Each cycle runs ``--steps`` times in one ``lax.while_loop`` with the positions reset after each step (as
``dflash-jax calibrate`` times the cost table; ``benchmarks/tools/step_parts.py`` times the parts the same
way), ``--repeats`` calls after a warm-up, median. Verify widths are equal: DSpark's ``block_size`` counts its
drafts, so it gets L − 1. ``--top-k-impl`` picks DFlash2's top-K over the vocabulary: ``lax.top_k``, the exact
chunked two-stage form (``KernelTuning(top_k_chunked=True)``, chunks of about ``--top-k-chunk``; it runs under the
GPU kernels only, i.e. bf16 on a GPU: elsewhere both are lax.top_k), the LM head and top-K in one kernel
(``KernelTuning(head_top_k_kernel=True)``, ``fused``, the default: at most 16 rows, i.e. batch 1, unless
``--fused-max-rows`` says more; interpret mode off a GPU),
``both`` (``dflash2`` and ``dflash2+chunked``) or ``all`` (the three).

    # GPU: the 8B shape and the embedded pair's shape at batch 1 and 64
    python benchmarks/bench_drafter_kinds.py --shape 8b --batches 1,64 --out $OUT/kinds_8b.json
    python benchmarks/bench_drafter_kinds.py --shape smollm2 --batches 1,64 --out $OUT/kinds_smollm2.json
    # DFlash2 with lax.top_k and with the chunked top-K (KernelTuning.top_k_chunked) in one run
    python benchmarks/bench_drafter_kinds.py --shape 8b --batches 1,64 --kinds dflash,dflash2 --top-k-impl both \
        --out $OUT/kinds_8b_top_k.json
    # CPU smoke test (a tiny shape; its times mean nothing)
    python benchmarks/bench_drafter_kinds.py --small --batches 2 --steps 2 --repeats 1 --out /tmp/kinds.json

The JSON is rewritten after each batch, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (dflash_jax)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (common, bench_compact_scaled)
sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))  # step_parts

from bench_compact_scaled import CPU_FAST_COMPILE, SMALL  # noqa: E402
from common import QWEN3_8B, SMOLLM2_135M, random_target, source_commit  # noqa: E402
from step_parts import program, timed  # noqa: E402
from dflash_jax import random_drafter  # noqa: E402
from dflash_jax.decode import loop  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.tuning import KernelTuning, Tuning  # noqa: E402

SHAPES = {"8b": QWEN3_8B, "smollm2": SMOLLM2_135M}
KINDS = ("dflash", "dspark", "dflash2")


def drafter_of(kind: str, target, layers: int, block: int):
    """A random drafter of ``kind`` whose cycles verify ``block`` tokens (DSpark's block size counts drafts)."""
    if kind == "dspark":
        return random_drafter(target, kind="dspark", num_layers=layers, block_size=block - 1)
    if kind == "dflash2":  # the published checkpoint's selector and convolution sizes
        return random_drafter(target, kind="dflash2", num_layers=layers, block_size=block, selector_top_k=16,
                              selector_rank=256, conv_kernel_size=2, conv_group_size=16)
    return random_drafter(target, num_layers=layers, block_size=block)


def cycle_ms(target, drafter, batch: int, block: int, context: int, steps: int, repeats: int, tuning: Tuning):
    """(median ms of a static cycle of ``batch`` rows, compile seconds)."""
    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, context)).tolist()
    job = jobs.make(target, drafter, ids, 4 * block, block_size=block, stop_token_ids=[], verify_mode="static",
                    tuning=tuning, decode=False)
    state, _ = job.programs.prefill(*job.pre_args)
    mask = job.drafter.config.mask_token_id
    step = lambda t, d, s, x: (loop.cycle(t, d, s, job.spec, mask), x)  # noqa: E731
    x = jnp.zeros((), jnp.int32)
    t0 = time.perf_counter()
    fn = program(job, step, state, x)
    compile_s = time.perf_counter() - t0
    ms, _ = timed(fn, job.params, state, x, steps, repeats)
    return ms, compile_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--small", action="store_true", help="a tiny shape (a CPU smoke test)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=192, help="tokens in every row's caches")
    ap.add_argument("--block-size", type=int, default=16, help="L: tokens a cycle verifies")
    ap.add_argument("--drafter-layers", type=int, help="default: 5 (8b), 3 (smollm2: the embedded drafters')")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top-k-impl", choices=["lax", "chunked", "fused", "both", "all"], default="lax",
                    help="DFlash2's top-K over the vocabulary (both: dflash2 and dflash2+chunked; all: and +fused)")
    ap.add_argument("--top-k-chunk", type=int, default=KernelTuning().top_k_chunk,
                    help="KernelTuning.top_k_chunk for the chunked top-K")
    ap.add_argument("--fused-max-rows", type=int, default=KernelTuning().head_top_k_max_rows,
                    help="head_top_k_max_rows of the +fused runs (0: any; the library's default otherwise)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    layers = args.drafter_layers or (5 if args.shape == "8b" else 3)
    tuning = Tuning()
    cfg = SHAPES[args.shape]
    if args.small:
        cfg = dataclasses.replace(SMALL, vocab_size=512)
        if jax.default_backend() == "cpu":
            tuning = tuning.with_compiler_options(CPU_FAST_COMPILE)
    target = random_target(cfg, jnp.dtype(args.dtype))
    commit = source_commit()
    result = dict(command=" ".join(["python", "benchmarks/bench_drafter_kinds.py",
                                    *(sys.argv[1:] if argv is None else argv)]),
                  date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit,
                  device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  shape=("small-" if args.small else "") + args.shape, drafter_layers=layers,
                  args={k: str(v) for k, v in vars(args).items()}, batches={})
    plain = tuning.replace(head_top_k_kernel=False)  # XLA's head, then lax.top_k
    chunked = plain.replace(top_k_chunked=True, top_k_chunk=args.top_k_chunk)
    fused = tuning.replace(head_top_k_kernel=True, head_top_k_max_rows=args.fused_max_rows)
    top_k = {"lax": [("", plain)], "chunked": [("+chunked", chunked)], "fused": [("+fused", fused)],
             "both": [("", plain), ("+chunked", chunked)],
             "all": [("", plain), ("+fused", fused), ("+chunked", chunked)]}[args.top_k_impl]
    runs = [(kind + suffix, kind, t) for kind in kinds
            for suffix, t in (top_k if kind == "dflash2" else [("", tuning)])]
    for batch in (int(b) for b in args.batches.split(",")):
        row = {}
        for label, kind, run_tuning in runs:
            drafter = drafter_of(kind, target, layers, args.block_size)
            ms, compile_s = cycle_ms(target, drafter, batch, args.block_size, args.context, args.steps,
                                     args.repeats, run_tuning)
            row[label] = dict(cycle_ms=ms, compile_s=compile_s)
            print(f"batch {batch:4d} {label:15s} {ms:9.3f} ms a cycle  (compiled in {compile_s:.1f} s)", flush=True)
        if "dflash" in row:
            for kind in row:
                row[kind]["vs_dflash"] = row[kind]["cycle_ms"] / row["dflash"]["cycle_ms"]
            print(f"batch {batch:4d} " + ", ".join(f"{k} ÷ dflash {v['vs_dflash']:.3f}" for k, v in row.items()),
                  flush=True)
        result["batches"][batch] = row
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
