"""What one small host↔device round trip costs, and which way of making it is cheapest (issue 18: a call's
inputs go over in one copy and its packed result comes back in one; on the H200 VM those two copies were
~1.3 ms of a ~3 ms per-call overhead).

Each case runs a tiny program (a few hundred int32 in, a few hundred out) ``--repeats`` times and reports the
median wall time per call, host to host:

* ``device_put + call + asarray``: today's path (inputs placed explicitly, result fetched with np.asarray);
* ``numpy in + call + asarray``: the compiled program takes the numpy inputs itself;
* ``... + copy_to_host_async``: the result's copy requested right after dispatch;
* ``pinned_host out``: the program writes its result into pinned host memory (``memory_kind``), so fetching it
  is a host-side read.

    python benchmarks/bench_transfer.py --out transfer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def program(x):
    return jnp.cumsum(x.reshape(4, -1), axis=1).astype(jnp.int32) + 1


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--size", type=int, default=512, help="int32 values each way")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = jax.devices()[0]
    host = np.arange(args.size, dtype=np.int32)
    shape = jax.ShapeDtypeStruct(host.shape, jnp.int32)
    compiled = jax.jit(program).lower(shape).compile()
    res = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "size": args.size}

    def put_call_get():
        return np.asarray(compiled(jax.device_put(host, dev)))

    def np_call_get():
        return np.asarray(compiled(host))

    def np_call_async_get():
        out = compiled(host)
        out.copy_to_host_async()
        return np.asarray(out)

    res["device_put + call + asarray"] = timed(put_call_get, args.repeats)
    res["numpy in + call + asarray"] = timed(np_call_get, args.repeats)
    res["numpy in + call + copy_to_host_async + asarray"] = timed(np_call_async_get, args.repeats)
    res["device_put only"] = timed(lambda: jax.device_put(host, dev).block_until_ready(), args.repeats)
    res["call only (inputs on device)"] = timed(lambda: compiled(jax.device_put(host, dev)).block_until_ready(),
                                                args.repeats)
    try:
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        to_host = jax.jit(program, out_shardings=pinned).lower(shape).compile()
        res["numpy in + call (pinned_host out) + asarray"] = timed(lambda: np.asarray(to_host(host)), args.repeats)
        assert np.array_equal(np.asarray(to_host(host)), np.asarray(compiled(host)))
    except Exception as e:  # memory kinds differ per backend
        res["pinned_host out"] = f"unavailable: {type(e).__name__}: {e}"[:300]
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
