"""AR vs speculative decoding step times against the weight-bytes floor (run on a GPU/TPU machine).

Models: SmolLM2-135M-Instruct (real weights from its GGUF, random drafter: tau ≈ 1, so the speculative
figure is the cost of a whole draft+verify cycle) and a Qwen3-8B-shaped target with random bf16 weights
built on the device (plus a random 5-layer drafter). Batch 1 and 8.

Floors: bytes a step must read (target weights + the KV cache entries in use) ÷ the measured device copy
bandwidth (a large device-to-device copy, bytes read + bytes written).

    python benchmarks/bench_decode.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_8B, copy_bandwidth, param_bytes, random_target, source_commit  # noqa: E402
from dflash_jax import generate, load_target, random_drafter, speculative_generate  # noqa: E402
from dflash_jax.config import ModelConfig  # noqa: E402
from dflash_jax.loading import SMOLLM2_MASK_TOKEN_ID  # noqa: E402


def kv_bytes(cfg: ModelConfig, batch: int, context: int, dtype) -> int:
    return 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def run_case(name, target, drafter, batch, prompt_len, max_new, block_size, bandwidth, repeats):
    cfg = target.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    kw = dict(max_new_tokens=max_new, stop_token_ids=[])
    # Warm up (compile), then time `repeats` runs of each; report medians.
    generate(target, prompts, **kw)
    speculative_generate(target, drafter, prompts, block_size=block_size, **kw)
    ar_runs = [generate(target, prompts, **kw) for _ in range(repeats)]
    sp_runs = [speculative_generate(target, drafter, prompts, block_size=block_size, **kw) for _ in range(repeats)]
    ar_step = statistics.median(r.stats["decode_s"] / r.stats["cycles"] for r in ar_runs)
    sp_cycle = statistics.median(r.stats["decode_s"] / r.stats["cycles"] for r in sp_runs)
    ar_tps = statistics.median(r.stats["decode_tokens_per_s"] for r in ar_runs)
    sp_tps = statistics.median(r.stats["decode_tokens_per_s"] for r in sp_runs)
    same = all(a.token_ids == s.token_ids for a, s in zip(ar_runs, sp_runs))
    agree = np.mean([x == y for a, s in zip(ar_runs[0].token_ids, sp_runs[0].token_ids) for x, y in zip(a, s)])
    ctx = prompt_len + max_new
    floor = (param_bytes(target.model) + kv_bytes(cfg, batch, ctx, target.model.dtype)) / bandwidth
    row = dict(case=name, batch=batch, prompt_len=prompt_len, max_new=max_new, block_size=block_size,
               ar_step_ms=ar_step * 1e3, floor_ms=floor * 1e3, ar_over_floor=ar_step / floor,
               spec_cycle_ms=sp_cycle * 1e3, cycle_over_ar_step=sp_cycle / ar_step, tau=sp_runs[0].tau,
               ar_tok_s=ar_tps, spec_tok_s=sp_tps, spec_speedup=sp_tps / ar_tps, identical=bool(same),
               token_agreement=float(agree), ar_compile_s=ar_runs[0].stats["compile_s"])
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="SmolLM2 GGUF path (skip the SmolLM2 cases when absent)")
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--commit", help="the commit benchmarked (when the tree has no .git)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    dev = jax.devices()[0]
    bw = copy_bandwidth()
    info = dict(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__,
                copy_bandwidth_GBps=bw / 1e9, date=time.strftime("%Y-%m-%d"), host=platform.node(),
                commit=args.commit or source_commit())
    print(json.dumps(info), flush=True)
    rows = []
    if args.gguf:
        for dtype in ("bfloat16",):
            t = load_target(args.gguf, dtype=dtype)
            d = random_drafter(t, block_size=16, num_layers=2, mask_token_id=SMOLLM2_MASK_TOKEN_ID)
            for b in batches:
                rows.append(run_case(f"SmolLM2-135M {dtype}", t, d, b, args.prompt_len, args.max_new, 16, bw,
                                     args.repeats))
    if not args.skip_8b:
        t = random_target(QWEN3_8B, jnp.bfloat16)
        d = random_drafter(t, block_size=16, num_layers=5)
        for b in batches:
            rows.append(run_case("Qwen3-8B-shaped bf16 (random)", t, d, b, args.prompt_len, args.max_new, 16, bw,
                                 args.repeats))
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"\n{info['device']}  copy bandwidth {bw / 1e9:.0f} GB/s  jax {info['jax']}  commit {info['commit']}")
    print("| case | batch | AR step ms | floor ms | AR/floor | spec cycle ms | cycle/AR step | tau | "
          "AR tok/s | spec tok/s | spec/AR | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['batch']} | {r['ar_step_ms']:.2f} | {r['floor_ms']:.3f} | {r['ar_over_floor']:.2f} | "
              f"{r['spec_cycle_ms']:.2f} | {r['cycle_over_ar_step']:.2f} | {r['tau']:.2f} | {r['ar_tok_s']:.0f} | "
              f"{r['spec_tok_s']:.0f} | {r['spec_speedup']:.2f} | {r['identical']} ({r['token_agreement']:.3f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
