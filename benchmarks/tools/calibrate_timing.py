"""How steadily each way of timing a step reads it (``dflash_jax.engine.calibrate._timed``): calibrate's plain
autoregressive step program on the embedded pair, at ``--batch`` rows with 256 tokens cached, timed as the mean step
of a call of n steps (calibrate before session 47), the slope between calls of n and 2n steps, and the slope
between a call of no step and one of 2n (calibrate since) — each from the medians of three calls, ``--reps`` times:
the mean and spread of each reading, and what a call of no step costs.

    python benchmarks/tools/calibrate_timing.py --batch 1 --reps 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from dflash_jax import load_pair  # noqa: E402
from dflash_jax.engine import calibrate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="n")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    target, drafter = load_pair(args.pair)
    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, (args.batch, 256)).tolist()
    program = {}

    def keep(fn, params, state, index, repeats, clock=None):  # calibrate's program and state, untimed
        program.update(fn=fn, params=params, state=state)
        return 0.0, state

    calibrate._timed, timed = keep, calibrate._timed
    try:
        calibrate._time_fallback_step(target, drafter, ids, drafter.config.verify_width, 2)
    finally:
        calibrate._timed = timed

    def call(n: int) -> float:
        t0 = time.perf_counter()
        program["state"] = jax.block_until_ready(program["fn"](program["params"], program["state"], np.int32(0),
                                                               np.int32(n)))
        return time.perf_counter() - t0

    call(1)
    n = args.steps
    reads = {f"mean of {n}": [], f"slope {n}→{2 * n}": [], f"slope 0→{2 * n}": []}
    empty = []
    for rep in range(args.reps):
        t = {k: 1e3 * float(np.median([call(k) for _ in range(3)])) for k in (0, n, 2 * n)}
        for name, ms in zip(reads, (t[n] / n, (t[2 * n] - t[n]) / n, (t[2 * n] - t[0]) / (2 * n))):
            reads[name].append(ms)
        empty.append(t[0])
        print(f"round {rep}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in reads.items()), flush=True)
    print(f"{args.pair}, batch {args.batch}, {jax.devices()[0].device_kind}: a call of no step {np.mean(empty):.2f} ms")
    for name, v in reads.items():
        print(f"  {name:12s} mean {np.mean(v):7.2f} ms a step, spread (sd) {np.std(v):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
