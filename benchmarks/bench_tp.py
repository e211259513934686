"""Tensor-parallel speculative decoding across the GPUs of one host: step times, memory, scaling.

For each tp in ``--tps`` the same Qwen3-8B-shaped target (random bf16 weights built on the device) and a
random 5-layer drafter are placed on a ``make_mesh(tp=tp)`` mesh (tp = 1 runs without a mesh, the plain
single-device path) and timed at each batch size:

* AR step = decode time ÷ generated tokens of ``generate``; spec cycle = decode time ÷ cycles of
  ``speculative_generate`` (random drafter: τ ≈ 1, so a cycle is the full cost of draft + 16-token verify);
* scaling efficiency = t(tp=1) ÷ (tp · t(tp=N)) for both;
* per-device memory: the parameter bytes each device holds and the device allocator's bytes in use.

Losslessness across tp is checked in the same run on a small float32 Qwen3 model (matmuls at "highest"
precision, so TF32 does not blur the comparison): greedy speculative and AR outputs for every tp must be
token-identical to tp = 1. The bf16 8B-shaped outputs are compared too (agreement fraction: random weights
give near-flat logits, where bf16 reduction order flips near-ties).

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_tp.py --tps 1,2 --out bench_tp.json
    # on CPU, as a smoke test with 8 simulated devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_tp.py --shape tiny --tps 1,2,4
"""

from __future__ import annotations

import os

# NVLink multicast stays off: a program using it can take the shared host's GPUs out of service.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_8B, copy_bandwidth, param_bytes, random_target, source_commit  # noqa: E402
from dflash_jax import generate, make_mesh, random_drafter, shard, speculative_generate  # noqa: E402
from dflash_jax.config import ModelConfig  # noqa: E402

SHAPES = {
    "qwen3-8b": QWEN3_8B,
    "tiny": dataclasses.replace(QWEN3_8B, vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=4,
                                num_heads=8, num_kv_heads=4, head_dim=32),
}
# The identity check's float32 model: small, but every split the 8B shape has (8 KV heads over up to 8 GPUs).
CHECK = dataclasses.replace(QWEN3_8B, vocab_size=32768, hidden_size=512, intermediate_size=1536, num_layers=4,
                            num_heads=16, num_kv_heads=8, head_dim=64)


def per_device_param_bytes(model) -> list[int]:
    """Parameter bytes held by each device (shards of split arrays, full copies of replicated ones)."""
    held: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for s in leaf.addressable_shards:
            held[s.device] = held.get(s.device, 0) + s.data.nbytes
    return [held.get(d, 0) for d in jax.devices()]


def allocator_bytes() -> list[int | None]:
    out = []
    for d in jax.devices():
        stats = d.memory_stats() or {}
        out.append(stats.get("bytes_in_use"))
    return out


def place(target, drafter, tp: int):
    if tp > 1:
        mesh = make_mesh(tp=tp)
        shard(target, mesh)
        shard(drafter, mesh)
    return target, drafter


def time_case(target, drafter, batch: int, prompt_len: int, max_new: int, repeats: int) -> dict:
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, target.config.vocab_size, prompt_len).tolist() for _ in range(batch)]
    kw = dict(max_new_tokens=max_new, stop_token_ids=[])
    generate(target, prompts, **kw)  # compile
    speculative_generate(target, drafter, prompts, block_size=16, **kw)
    ar = [generate(target, prompts, **kw) for _ in range(repeats)]
    sp = [speculative_generate(target, drafter, prompts, block_size=16, **kw) for _ in range(repeats)]
    return dict(ar_step_ms=1e3 * statistics.median(r.stats["decode_s"] / r.stats["cycles"] for r in ar),
                spec_cycle_ms=1e3 * statistics.median(r.stats["decode_s"] / r.stats["cycles"] for r in sp),
                tau=sp[0].tau, ar_tokens=ar[0].token_ids, spec_tokens=sp[0].token_ids)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return float(np.mean([x == y for x, y in pairs])) if pairs else 1.0


def identity_check(tps: list[int], max_new: int) -> list[dict]:
    """float32 small model: greedy outputs for every tp must equal tp = 1's, token for token."""
    rows = []
    with jax.default_matmul_precision("highest"):
        target = random_target(CHECK, jnp.float32, seed=1)
        drafter = random_drafter(target, block_size=16, num_layers=2, seed=2)
        rng = np.random.default_rng(7)
        prompts = [rng.integers(0, CHECK.vocab_size, n).tolist() for n in (5, 40, 17, 64)]
        kw = dict(max_new_tokens=max_new, stop_token_ids=[])
        ref = None
        for tp in tps:
            place(target, drafter, tp)
            spec = speculative_generate(target, drafter, prompts, **kw).token_ids
            ar = generate(target, prompts, **kw).token_ids
            ref = ref or {"spec": spec, "ar": ar}
            rows.append(dict(tp=tp, spec_identical=spec == ref["spec"], ar_identical=ar == ref["ar"],
                             spec_equals_ar=spec == ar))
            print(json.dumps({"identity": rows[-1]}), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--tps", default=None, help="comma list (default: 1, 2, 4, … up to the device count)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_tp.json")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    n_dev = jax.device_count()
    tps = [int(t) for t in args.tps.split(",")] if args.tps else [t for t in (1, 2, 4, 8) if t <= n_dev]
    batches = [int(b) for b in args.batches.split(",")]
    cfg: ModelConfig = SHAPES[args.shape]

    info = dict(devices=n_dev, device=jax.devices()[0].device_kind, platform=jax.default_backend(),
                jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"), commit=args.commit or source_commit(), shape=args.shape,
                nccl_nvls=os.environ.get("NCCL_NVLS_ENABLE"), copy_bandwidth_GBps=copy_bandwidth(64 << 20, 5) / 1e9
                if args.shape == "tiny" else copy_bandwidth() / 1e9)
    print(json.dumps(info), flush=True)

    identity = identity_check(tps, 32)

    target = random_target(cfg, jnp.bfloat16 if args.shape != "tiny" else jnp.float32)
    drafter = random_drafter(target, block_size=16, num_layers=5)
    info["target_param_GB"] = param_bytes(target.model) / 1e9
    rows = []
    base: dict[int, dict] = {}
    for tp in tps:
        place(target, drafter, tp)
        weights = per_device_param_bytes(target.model)
        drafter_weights = per_device_param_bytes(drafter.model)
        for b in batches:
            r = time_case(target, drafter, b, args.prompt_len, args.max_new, args.repeats)
            base.setdefault(b, r)
            row = dict(tp=tp, batch=b, ar_step_ms=r["ar_step_ms"], spec_cycle_ms=r["spec_cycle_ms"], tau=r["tau"],
                       ar_efficiency=base[b]["ar_step_ms"] / (tp * r["ar_step_ms"]),
                       spec_efficiency=base[b]["spec_cycle_ms"] / (tp * r["spec_cycle_ms"]),
                       ar_speedup_vs_tp1=base[b]["ar_step_ms"] / r["ar_step_ms"],
                       spec_speedup_vs_tp1=base[b]["spec_cycle_ms"] / r["spec_cycle_ms"],
                       target_GB_dev0=weights[0] / 1e9, drafter_GB_dev0=drafter_weights[0] / 1e9,
                       target_share_dev0=weights[0] / param_bytes(target.model),
                       in_use_GB=[None if x is None else round(x / 1e9, 2) for x in allocator_bytes()],
                       bf16_ar_agreement_vs_tp1=agreement(r["ar_tokens"], base[b]["ar_tokens"]),
                       bf16_spec_agreement_vs_ar=agreement(r["spec_tokens"], r["ar_tokens"]))
            rows.append(row)
            print(json.dumps(row), flush=True)

    Path(args.out).write_text(json.dumps({"info": info, "identity": identity, "rows": rows}, indent=1))
    print(f"\n{n_dev}× {info['device']}  jax {info['jax']}  commit {args.commit}  shape {args.shape} "
          f"({info['target_param_GB']:.1f} GB of target weights)  NCCL_NVLS_ENABLE={info['nccl_nvls']}")
    print("float32 identity across tp (spec, AR vs tp=1; spec == AR): "
          + ", ".join(f"tp={r['tp']}: {r['spec_identical']}/{r['ar_identical']}/{r['spec_equals_ar']}"
                      for r in identity))
    print("| tp | batch | AR step ms | AR eff. | spec cycle ms | spec eff. | AR ×tp1 | spec ×tp1 | "
          "target GB/dev | in use GB/dev | AR tokens = tp1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['batch']} | {r['ar_step_ms']:.2f} | {r['ar_efficiency']:.2f} | "
              f"{r['spec_cycle_ms']:.2f} | {r['spec_efficiency']:.2f} | {r['ar_speedup_vs_tp1']:.2f} | "
              f"{r['spec_speedup_vs_tp1']:.2f} | {r['target_GB_dev0']:.2f} | {r['in_use_GB']} | "
              f"{r['bf16_ar_agreement_vs_tp1']:.3f} |")
    ok = all(r["spec_identical"] and r["ar_identical"] and r["spec_equals_ar"] for r in identity)
    print("identity check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
