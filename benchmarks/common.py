"""Helpers shared by the benchmark scripts: model shapes, random targets built on the device, device
bandwidth probes and warm-up."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.loading import Target
from dflash_jax.models.target import TargetModel

QWEN3_8B = ModelConfig(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope=RopeConfig(theta=1_000_000.0), max_position_embeddings=40960)
SMOLLM2_135M = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                           rope=RopeConfig(theta=100000.0), max_position_embeddings=8192,
                           tie_word_embeddings=True)


def random_target(cfg: ModelConfig, dtype, seed: int = 0) -> Target:
    """Random weights generated on the device, one jitted draw per parameter (no host round trip)."""
    model = nnx.eval_shape(lambda: TargetModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    draw = jax.jit(lambda key, shape, scale: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
                   static_argnums=(1,))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        scale = 1.0 if path[-1] == "weight" else 1.0 / np.sqrt(var.shape[0])
        value = draw(jax.random.fold_in(key, i), tuple(var.shape), scale)
        if path[-1] == "weight":  # norms: around 1
            value = (1.0 + 0.1 * value).astype(dtype)
        var.set_value(value)
    return Target(model, None, f"random {cfg.family} {cfg.num_layers}L d{cfg.hidden_size}", ())


def param_bytes(model) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


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
