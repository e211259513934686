"""Helpers shared by the benchmark scripts: device bandwidth probes and warm-up."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def warm_up(f, *args, seconds: float = 0.5) -> None:
    """Compile, then run for a while: GPU clocks are low after idle host-side work."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready(f(*args))


def _median_seconds(f, x, reps: int) -> float:
    warm_up(f, x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read + bytes written (median of ``reps``)."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    # a * (1 + ε): a real read + write (a plain copy could be elided)
    return 2 * nbytes / _median_seconds(jax.jit(lambda a: a * 1.0000001), x, reps)


def read_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device read bandwidth in bytes/s (a large reduction; median of ``reps``)."""
    x = jax.random.normal(jax.random.key(1), (nbytes // 4,), jnp.float32)
    return nbytes / _median_seconds(jax.jit(jnp.sum), x, reps)
