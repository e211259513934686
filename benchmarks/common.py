"""Helpers shared by the benchmark scripts: model shapes, random targets built on the device, device
bandwidth probes and warm-up, switches that turn compact's GPU kernels off for A/B runs."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax import families
from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.loading import Target
from dflash_jax.models.layers import quantizable
from dflash_jax.models.moe import PROJECTIONS, quantizable_experts
from dflash_jax.quant import Scheme

QWEN3_8B = ModelConfig(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope=RopeConfig(theta=1_000_000.0), max_position_embeddings=40960)
SMOLLM2_135M = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                           rope=RopeConfig(theta=100000.0), max_position_embeddings=8192,
                           tie_word_embeddings=True)
# Qwen/Qwen3-30B-A3B config.json (the fields the parser reads; dflash_jax.config.model_config_from_hf parses it).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_scaling": None,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False, "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def source_commit() -> str:
    """The commit a result was produced at, for its JSON: ``$BENCH_COMMIT`` when set (set it on a machine whose
    git metadata may be older than the files that run there, e.g. the remote GPU copy), else HEAD's short hash in
    this repository, with "+changes" when tracked files differ from HEAD (files only untracked while kept off a
    device call, ``tools/remote_gpu/stash.sh``, are still on disk and do not count); "unknown" when git fails or is
    absent."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=root, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [line for line in status if not (line.startswith("D  ") and (root / line[3:]).exists())]
    return (head + ("+changes" if changed else "")) if head else "unknown"


# The quantized schemes of the shaped benchmarks, by their command-line names (bf16: none)
SCHEMES = {"bf16": None, "int8": Scheme("int8"), "fp8": Scheme("fp8"), "fp8-block": Scheme("fp8", (128, 128))}


@functools.partial(jax.jit, static_argnums=(1,))
def quantize_on_device(w: jax.Array, scheme: Scheme) -> tuple[jax.Array, jax.Array]:
    """``w [..., in, out]`` → (values, float32 scales ``[..., nbi, nbo]``): :func:`dflash_jax.quant.quantize`'s
    rule (symmetric, each block's largest magnitude to the format's largest value), on the device."""
    d_in, d_out = w.shape[-2:]
    (bi, bo), (nbi, nbo) = scheme.blocks(d_in, d_out), scheme.scale_shape(d_in, d_out)
    lead = w.shape[:-2]
    pad = [(0, 0)] * len(lead) + [(0, nbi * bi - d_in), (0, nbo * bo - d_out)]
    blocks = jnp.pad(w.astype(jnp.float32), pad).reshape(*lead, nbi, bi, nbo, bo)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / scheme.qmax, 1.0)
    x = jnp.clip(blocks / scale[..., :, None, :, None], -scheme.qmax, scheme.qmax)
    x = jnp.rint(x) if scheme.kind == "int8" else x
    q = x.astype(scheme.dtype).reshape(*lead, nbi * bi, nbo * bo)[..., :d_in, :d_out]
    return q, scale


def quantize_model(model, scheme: Scheme) -> None:
    """Every linear layer (the LM head included) and the routed experts of ``model`` (a model or one of its layers)
    quantized in place; those already quantized are left as they are."""
    for _, dense in quantizable(model):
        if dense.quant is None:
            q, s = quantize_on_device(dense.kernel[...], scheme)
            dense.set_quantized(scheme, q, s)
    for _, experts in quantizable_experts(model):
        if experts.quant is None:
            experts.set_quantized(scheme, {p: quantize_on_device(getattr(experts, p)[...], scheme)
                                           for p in PROJECTIONS})


def random_target(cfg: ModelConfig, dtype, seed: int = 0, after_layer=None) -> Target:
    """Random weights generated on the device, one jitted draw per parameter (no host round trip). The model is
    the family's (``families.of(cfg).model``: MoE layers for a ``qwen3_moe`` config); kernels are scaled by
    their fan-in (stacked experts ``[E, in, out]`` by ``in``). ``after_layer(layer)``: called on each decoder
    layer once its weights are drawn (e.g. to quantize it, so that the whole model never sits in ``dtype``)."""
    model = nnx.eval_shape(lambda: families.of(cfg).model(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    draw = jax.jit(lambda key, shape, scale: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
                   static_argnums=(1,))
    key = jax.random.key(seed)
    layer = None  # the decoder layer whose weights are being drawn (parameters come layer by layer)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        current = path[1] if path[0] == "layers" else None
        if after_layer is not None and layer is not None and current != layer:
            after_layer(model.layers[layer])
        layer = current
        scale = 1.0 if path[-1] == "weight" else 1.0 / np.sqrt(var.shape[-2] if len(var.shape) >= 3 else var.shape[0])
        value = draw(jax.random.fold_in(key, i), tuple(var.shape), scale)
        if path[-1] == "weight":  # norms: around 1
            value = (1.0 + 0.1 * value).astype(dtype)
        var.set_value(value)
    if after_layer is not None and layer is not None:
        after_layer(model.layers[layer])
    return Target(model, None, f"random {cfg.family} {cfg.num_layers}L d{cfg.hidden_size}", ())


def param_bytes(model) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def warm_up(f, *args, seconds: float = 0.5) -> None:
    """Compile, then run for a while: GPU clocks are low after idle host-side work."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready(f(*args))


def per_call_seconds(chain, args: tuple, iters: int, reps: int, warm_s: float) -> float:
    """Seconds per call of a program ``chain(*args)`` that makes ``iters`` dependent calls: median over ``reps``
    runs after compiling and warming up."""
    jax.block_until_ready(chain(*args))
    warm_up(chain, *args, seconds=warm_s)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(chain(*args))
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


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


def device_profile(fn, trace_dir: str, per: int = 1, top: int = 25) -> dict:
    """Run ``fn()`` once under the JAX profiler and sum the device's kernel time by name (Perfetto JSON the
    profiler writes itself; no TensorBoard needed). Device timelines only (process names without "host"),
    summed per timeline (thread) so lanes that repeat the same kernels are not added together. Times are µs
    ÷ ``per`` (e.g. the decode's steps, for per-step figures)."""
    import collections
    import glob
    import gzip
    import json

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        fn()
    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]  # noqa
                         for e in events if e.get("ph") == "M" and e.get("name") == kind}
    procs, threads = meta("process_name"), meta("thread_name")
    lanes: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        proc = procs.get(e.get("pid"), "")
        if e.get("ph") != "X" or "host" in proc.lower():
            continue
        lane = f"{proc} / {threads.get((e['pid'], e.get('tid')), e.get('tid'))}"
        acc = lanes[lane][e["name"]]
        acc[0] += 1
        acc[1] += float(e.get("dur", 0.0))
    out = {}
    for lane, names in lanes.items():
        ranked = sorted(names.items(), key=lambda kv: -kv[1][1])
        out[lane] = dict(total_us=sum(v[1] for v in names.values()) / per,
                         calls=sum(v[0] for v in names.values()) / per,
                         top=[dict(name=n[:120], calls=c / per, us=t / per) for n, (c, t) in ranked[:top]])
    return out


def print_profile(profile: dict, label: str) -> None:
    """The lanes of :func:`device_profile` that ran kernels, each with its top kernels."""
    for lane, p in profile.items():
        if not p["total_us"]:  # copy-only streams
            continue
        print(f"{label} — {lane}: {p['total_us']:.1f} µs in {p['calls']:.1f} kernels", flush=True)
        for k in p["top"]:
            print(f"    {k['us']:9.1f} µs  {k['calls']:6.1f}×  {k['name']}", flush=True)


def add_kernel_switches(ap: argparse.ArgumentParser) -> None:
    """``--packed-kernel`` / ``--write-kernel`` / ``--place-kernel off``: compact's step without one of its GPU
    kernels (the path before it); ``--host-tier-switch off``: its tier switch as a CUDA-graph conditional node;
    ``--packed-short-tile N``: the packed kernel's second tile for windows of ≤ N tokens (0: off);
    ``--sequential-draft-cap``: how a DSpark drafter's compact steps draft (the switch in
    :mod:`dflash_jax.decode.loop`). For A/B runs; :func:`apply_kernel_switches` applies them."""
    ap.add_argument("--packed-kernel", choices=["on", "off"], default="on",
                    help="off: compact's packed verify unpacks to [B, L] for the block kernel (the path before "
                         "cuda.packed_block_attention)")
    ap.add_argument("--write-kernel", choices=["on", "off"], default="on",
                    help="off: compact's deferred cache write as two XLA scatters a layer (the path before "
                         "cuda.cache_write)")
    ap.add_argument("--place-kernel", choices=["on", "off"], default="on",
                    help="off: each compact tier pads its new K/V to the largest tier's slots with XLA (the path "
                         "before cuda.cache_write.place_pending)")
    ap.add_argument("--packed-short-tile", type=int,
                    help="the packed verify kernel's second tile: windows of at most this many tokens run a tile "
                         "of that many query positions (KernelTuning.packed_short_q_len; 0: one tile)")
    ap.add_argument("--sequential-draft-cap", type=int,
                    help="a sequential (DSpark) drafter's compact steps draft only this many positions")
    ap.add_argument("--host-tier-switch", choices=["on", "off"], default="on",
                    help="off: compact's tier switch stays a CUDA-graph conditional node where the loop plans its "
                         "tiers ahead (Tuning.host_tier_switch)")


def apply_kernel_switches(args: argparse.Namespace, **changes) -> tuple["Tuning", dict]:
    """The :class:`dflash_jax.tuning.Tuning` that :func:`add_kernel_switches`' flags (and ``changes``: more knobs
    by name, e.g. ``programs_per_sm=4``) say — pass it as ``tuning=`` to the library's calls, whose program cache
    keys on it — and the settings, for a result file."""
    from dflash_jax.cuda import graphs
    from dflash_jax.tuning import Tuning

    knobs = dict(packed_kernel=args.packed_kernel == "on", write_kernel=args.write_kernel == "on",
                 place_kernel=args.place_kernel == "on", host_tier_switch=args.host_tier_switch == "on")
    if args.packed_short_tile is not None:
        knobs["packed_short_q_len"] = args.packed_short_tile or None
    if args.sequential_draft_cap:
        knobs["sequential_draft_cap"] = args.sequential_draft_cap
    tuning = Tuning().replace(**knobs, **changes)
    return tuning, dict(packed_kernel=args.packed_kernel, write_kernel=args.write_kernel,
                        place_kernel=args.place_kernel, packed_short_tile=tuning.kernels.packed_short_q_len,
                        sequential_draft_cap=tuning.sequential_draft_cap, host_tier_switch=args.host_tier_switch,
                        # the options a GPU's planned tier switch compiles with
                        tier_switch_options=graphs.without_conditional_nodes() if args.host_tier_switch == "on"
                        else {}, **changes)


def fallback_log_line(log: list[dict] | None) -> str:
    """A run's fallback segments in one line (``stats["fallback_log"]``): each segment's kind and steps (P probe,
    D drafted, C timing check, A autoregressive, G a whole call on ``generate``'s programs), then the policy's
    value after it (drafting's speed ÷ the fallback's, estimated) where it had one, and ``→A`` / ``→D`` where the
    mode it chose changed."""
    if not log:
        return ""
    marks, mode = [], None
    for e in log:
        s = f"{e['segment'][0].upper()}{e['steps']}"
        if e.get("value") is not None:
            s += f"({e['value']:.2f})"
        if e["then"] != mode and mode is not None:
            s += "→" + e["then"][0].upper()
        mode = e["then"]
        marks.append(s)
    return " ".join(marks)

