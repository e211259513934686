"""Why speculative decoding does not pay on a small CPU (issue 21, item 6): where a drafted step's time goes
with the embedded pair, and the ideas measured against it. Parts (``--parts``, default all):

* ``steps``   — the scheduler's step at batch 1 and 3 (``costs.measure``: draft + packed verify of 1…16
  tokens per row, and the AR step), and the drafter's pieces alone at batch 3: trunk over the block, the LM
  head over 1 / 4 / 15 positions per row, the context materialize.
* ``matmul``  — XLA:CPU dense products by row count M: a 30-layer SwiGLU stack of SmolLM2's widths (319 MB of
  float32 weights) as ``x @ W`` against a fused multiply-reduce over weights stored ``[out, in]``.
* ``block``   — a shorter drafter block (the trunk over 4 / 6 / 8 positions instead of 16): static τ on 24
  mixed prompts against the full block's acceptance capped at the same widths.
* ``vocab``   — a reduced draft vocabulary: how much of the target's greedy output (64 evaluation prompts, 128
  tokens) the most frequent tokens of ShareGPT answers + stdlib code cover.
* ``attention`` — the decode attention reference as it is (grouped einsums) against contracting the cache
  as it lies (every query head × every KV head, the diagonal kept): 30 layers alone, and the embedded
  target's batch-1 decode from a 600-token prompt with each.
* ``cache_reads`` — ``make demo``'s batch decoded with the drafted steps' cache reads tied to their layers
  (``attention.read_after``, the default) and untied (``attention.TIE_CPU_CACHE_READS = False``), and
  autoregressively: decode seconds of each run and the medians' ratios to autoregressive.

The forms compared within a part run interleaved, so that a noisy machine moves them alike.

    python benchmarks/bench_cpu_costs.py --out benchmarks/results/<date>_cpu_costs.json [--parts steps,matmul]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_jax import attention, costs, generate, load_pair, speculative_generate  # noqa: E402
from dflash_jax.cli import DEMO_PROMPTS  # noqa: E402
from dflash_jax.train import data  # noqa: E402

PARTS = ("steps", "matmul", "block", "vocab", "attention", "cache_reads")


def interleaved(fns: dict, args_of: dict, reps: int) -> dict[str, float]:
    """Median ms per call of each fn (``args_of[name]``: its arguments), the fns taking turns."""
    for name, f in fns.items():
        jax.block_until_ready(f(*args_of[name]))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args_of[name]))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def part_steps(target, drafter, reps: int) -> dict:
    table = costs.measure(target, drafter, batches=(1, 3), context=64, repeats=reps, progress=print)
    from flax import nnx

    t, d = target.model, drafter.model
    tdef, tstate = nnx.split(t)
    ddef, dstate = nnx.split(d)
    b, l, ctx = 3, drafter.config.block_size, 64
    dcache = d.new_cache(b, 256)
    pos = jnp.broadcast_to(ctx + jnp.arange(l, dtype=jnp.int32), (b, l))
    dim = t.config.hidden_size
    trunk = jax.jit(lambda ds, e, p, c, n: nnx.merge(ddef, ds)(e, p, c, n))
    head = jax.jit(lambda ts, h: jnp.argmax(nnx.merge(tdef, ts).logits(h), -1))
    mat = jax.jit(lambda ds, c, f, p: nnx.merge(ddef, ds).materialize(c, f, p))
    feats = jnp.ones((b, l, drafter.config.num_features * dim), jnp.float32)
    fns = {"trunk": trunk, "head_1": head, "head_4": head, "head_15": head, "materialize": mat}
    args = {"trunk": (dstate, jnp.ones((b, l, dim)), pos, dcache, jnp.full((b,), ctx, jnp.int32)),
            "head_1": (tstate, jnp.ones((b, 1, dim))), "head_4": (tstate, jnp.ones((b, 4, dim))),
            "head_15": (tstate, jnp.ones((b, 15, dim))), "materialize": (dstate, dcache, feats, pos)}
    pieces = interleaved(fns, args, reps)
    print("drafter pieces at batch 3 (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in pieces.items()), flush=True)
    return dict(step_ms={str(k): v for k, v in table.step_ms.items()}, ar_ms=table.ar_ms, drafter_pieces_ms=pieces)


def part_matmul(reps: int) -> dict:
    rng = np.random.default_rng(0)
    layers, d, i = 30, 576, 1536
    gate_up = [jnp.asarray(rng.standard_normal((d, 2 * i), np.float32) * 0.02) for _ in range(layers)]
    down = [jnp.asarray(rng.standard_normal((i, d), np.float32) * 0.02) for _ in range(layers)]
    gate_up_t = [w.T.copy() for w in gate_up]  # [out, in], materialised
    down_t = [w.T.copy() for w in down]

    def stack(product):
        def run(x, a, b):
            for wa, wb in zip(a, b):
                h = product(x, wa)
                x = x + product(jax.nn.silu(h[:, :i]) * h[:, i:], wb)
            return x
        return jax.jit(run)

    fns = {"dot": stack(lambda x, w: x @ w),
           "multiply_reduce": stack(lambda x, wt: (wt[:, None, :] * x[None, :, :]).sum(-1).T)}
    mb = sum(w.size for w in gate_up + down) * 4 / 1e6
    floor_ms = mb / copy_bandwidth_gbs()  # MB / (GB/s) = ms
    rows = []
    for m in (1, 2, 3, 4, 8, 12, 16, 48):
        x = jnp.asarray(rng.standard_normal((m, d), np.float32))
        ms = interleaved(fns, {"dot": (x, gate_up, down), "multiply_reduce": (x, gate_up_t, down_t)}, reps)
        rows.append(dict(rows=m, **{f"{k}_ms": v for k, v in ms.items()}))
        print(f"M={m:3d}: x @ W {ms['dot']:6.1f} ms   multiply-reduce [out, in] {ms['multiply_reduce']:6.1f} ms   "
              f"(weights {mb:.0f} MB, read floor {floor_ms:.1f} ms)", flush=True)
    return dict(weights_mb=mb, floor_ms=floor_ms, rows=rows)


def copy_bandwidth_gbs() -> float:
    """GB/s of a jitted sum over 540 MB (the embedded target's float32 weights)."""
    x = jnp.ones((135_000_000 // 576, 576), jnp.float32)
    f = jax.jit(lambda x: x.sum())
    ms = interleaved({"sum": f}, {"sum": (x,)}, 5)["sum"]
    return x.size * 4 / 1e6 / ms


def mixed_prompts() -> list[str]:
    ev = data.evaluation_prompts()
    return DEMO_PROMPTS + ev["humaneval"][:5] + ev["mtbench"][:6] + ev["general"][:10]


def part_block(target, drafter) -> dict:
    prompts = mixed_prompts()
    out = {}
    for block in (16, 4, 6, 8):
        res = speculative_generate(target, drafter, prompts, block_size=block, verify_mode="static", max_new_tokens=64)
        acc = np.concatenate([np.asarray(a) for a in res.acceptance_lengths])
        out[block] = dict(tau=float(acc.mean()), cycles=int(acc.size))
        if block == 16:
            out["full_block_capped"] = {w: float(np.minimum(acc, w + 1).mean()) for w in (3, 5, 7)}
        print(f"block {block:2d}: static tau {acc.mean():.3f} over {acc.size} cycles", flush=True)
    print("full block, acceptance capped at 3 / 5 / 7 drafts: " + " / ".join(
        f"{v:.3f}" for v in out["full_block_capped"].values()), flush=True)
    return out


def part_vocab(target) -> dict:
    tok = target.tokenizer
    counts = np.zeros(target.config.vocab_size, np.int64)
    for conv in itertools.islice(data.iter_json_array(data.sharegpt_path()), 30000):
        for turn in conv.get("conversations") or []:
            if turn.get("from") == "gpt":
                np.add.at(counts, tok.encode(str(turn.get("value", ""))[:4000], chat=False), 1)
    sources = sorted(data.python_sources()[0].rglob("*.py"))
    random.Random(0).shuffle(sources)
    for path in sources[:1500]:
        try:
            np.add.at(counts, tok.encode(path.read_text()[:20000], chat=False), 1)
        except (UnicodeDecodeError, OSError):
            continue
    ev = data.evaluation_prompts()
    ref = generate(target, ev["humaneval"][:24] + ev["mtbench"][:16] + ev["general"][:24], max_new_tokens=128)
    produced = np.concatenate([np.asarray(r) for r in ref.token_ids])
    order = np.argsort(-counts, kind="stable")
    coverage = {n: float(np.isin(produced, order[:n]).mean()) for n in (4096, 8192, 16384, 24576)}
    print(f"{produced.size} target tokens; covered by the most frequent 4k / 8k / 16k / 24k: " + " / ".join(
        f"{v:.3f}" for v in coverage.values()), flush=True)
    return dict(target_tokens=int(produced.size), coverage=coverage)


def _untransposed(q, k_cache, v_cache, mask):
    """Decode attention without relayouting the cache: all query heads × all KV heads, own head kept."""
    b, t, n, h = q.shape
    s, kh = k_cache.shape[1:3]
    g = n // kh
    own = jnp.eye(kh, dtype=jnp.float32)
    scores = jnp.einsum("bqh,bch->bqc", q.reshape(b, t * n, h), k_cache.reshape(b, s * kh, h),
                        preferred_element_type=jnp.float32).reshape(b, t, kh, g, s, kh)
    scores = jnp.einsum("btkgsj,kj->btkgs", scores, own) * (h ** -0.5)
    p = jax.nn.softmax(jnp.where(mask[:, :, None, None, :], scores, attention.NEG_INF), axis=-1)
    out = jnp.einsum("bqs,bsc->bqc", p.reshape(b, t * n, s).astype(v_cache.dtype), v_cache.reshape(b, s, kh * h),
                     preferred_element_type=jnp.float32).reshape(b, t, kh, g, kh, h)
    return jnp.einsum("btkgjh,kj->btkgh", out, own).reshape(b, t, n, h).astype(q.dtype)


def part_attention(target, reps: int) -> dict:
    rng = np.random.default_rng(0)
    layers, b, n, kh, h = 30, 3, 9, 3, 64

    def stack(form):
        def run(q, ks, vs, pos):
            mask = jnp.arange(ks[0].shape[1])[None, None, :] <= pos[:, :, None]
            for k, v in zip(ks, vs):
                q = form(q, k, v, pos) if form is attention.cache_attention else form(q, k, v, mask)
            return q
        return jax.jit(run)

    fns = {"grouped": stack(attention.cache_attention), "untransposed": stack(_untransposed)}
    rows = []
    for s in (128, 320, 640, 2048):
        for t in (1, 4):
            q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
            ks = [jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32) for _ in range(layers)]
            vs = [jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32) for _ in range(layers)]
            pos = jnp.broadcast_to(s // 2 + jnp.arange(t, dtype=jnp.int32), (b, t))
            ms = interleaved(fns, {k: (q, ks, vs, pos) for k in fns}, reps)
            rows.append(dict(cache=s, tokens=t, **{f"{k}_ms": v for k, v in ms.items()}))
            print(f"30 layers, batch 3, S={s:5d} T={t}: grouped {ms['grouped']:6.1f} ms  untransposed "
                  f"{ms['untransposed']:6.1f} ms ({ms['grouped'] / ms['untransposed']:.2f}×)", flush=True)
    # End to end: the target's decode with each form (cache_attention patched for T·K ≤ 12, as tried).
    reference = attention.cache_attention

    def patched(q, k_cache, v_cache, q_positions, *, impl="xla", sinks=None, window=None):
        if q.shape[1] * k_cache.shape[2] > 12 or sinks is not None or window is not None:
            return reference(q, k_cache, v_cache, q_positions, impl=impl, sinks=sinks, window=window)
        return _untransposed(q, k_cache, v_cache, jnp.arange(k_cache.shape[1])[None, None, :] <= q_positions[:, :, None])

    prompt = np.random.default_rng(1).integers(100, 40000, 600).tolist()
    decode_s = {"grouped": [], "untransposed": []}
    for _ in range(3):
        for name, form in (("grouped", reference), ("untransposed", patched)):
            attention.cache_attention = form
            jax.clear_caches()
            generate(target, [prompt], max_new_tokens=64, stop_token_ids=[])  # compile
            decode_s[name].append(generate(target, [prompt], max_new_tokens=64, stop_token_ids=[]).stats["decode_s"])
    attention.cache_attention = reference
    per_token = {k: statistics.median(v) / 64 * 1e3 for k, v in decode_s.items()}
    print("embedded target, batch 1, 600-token prompt, 64 new tokens: " + ", ".join(
        f"{k} {v:.1f} ms/token" for k, v in per_token.items()), flush=True)
    return dict(isolated=rows, decode_s=decode_s, decode_ms_per_token=per_token)


def part_cache_reads(target, drafter, reps: int) -> dict:
    kw = dict(max_new_tokens=96)  # the demo's

    def speculative(tied: bool) -> float:
        attention.TIE_CPU_CACHE_READS = tied  # a program cache key of its own (generation.trace_switches)
        return speculative_generate(target, drafter, DEMO_PROMPTS, **kw).stats["decode_s"]

    def autoregressive() -> float:
        return generate(target, DEMO_PROMPTS, **kw).stats["decode_s"]

    runs = {"tied": speculative, "untied": speculative, "autoregressive": autoregressive}
    args = {"tied": (True,), "untied": (False,), "autoregressive": ()}
    for name, f in runs.items():  # compiles, and a CPU's first run of a program sets up its kernels
        f(*args[name])
    decode_s = {name: [] for name in runs}
    for _ in range(reps):
        for name, f in runs.items():
            decode_s[name].append(f(*args[name]))
    attention.TIE_CPU_CACHE_READS = True
    median = {name: statistics.median(t) for name, t in decode_s.items()}
    for name, t in decode_s.items():
        print(f"  {name:15s} decode {median[name]:.3f} s (median of {reps}), ÷ AR "
              f"{median['autoregressive'] / median[name]:.3f}", flush=True)
    return dict(decode_s=decode_s, median_s=median,
                vs_autoregressive={name: median["autoregressive"] / median[name] for name in ("tied", "untied")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if jax.default_backend() != "cpu":
        sys.exit("bench_cpu_costs.py measures the CPU (run it with JAX_PLATFORMS=cpu)")
    parts = args.parts.split(",")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(commit=commit, machine=platform.processor() or platform.machine(), jax=jax.__version__)
    target, drafter = load_pair("smollm2-135m", dtype="float32")
    for part in parts:
        print(f"== {part}", flush=True)
        if part == "steps":
            result[part] = part_steps(target, drafter, args.reps)
        elif part == "matmul":
            result[part] = part_matmul(args.reps)
        elif part == "block":
            result[part] = part_block(target, drafter)
        elif part == "vocab":
            result[part] = part_vocab(target)
        elif part == "attention":
            result[part] = part_attention(target, args.reps)
        elif part == "cache_reads":
            result[part] = part_cache_reads(target, drafter, args.reps)
        else:
            sys.exit(f"unknown part {part!r} (parts: {', '.join(PARTS)})")
        if args.out:  # after every part: an interrupted run keeps what it measured
            args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
