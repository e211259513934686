"""Prefill: the target's one-shot prompt forward with the attention reference (``Kernels("xla")``) vs the GPU path
(``Kernels("cuda")``: cuDNN's fused attention, :func:`dflash_jax.kernels.attention.prefill_attention`).

Random weights of a real shape (``--model smollm2`` or ``qwen3-8b``), bf16, over (rows, prompt length) cases:
median ms of the jitted forward (cache written, last position's logits), and the largest logit difference between
the two paths.

    python benchmarks/bench_prefill.py --model smollm2 --cases 8x512,64x256,1x1024 --out prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import QWEN3_8B, SMOLLM2_135M, random_target, source_commit, warm_up  # noqa: E402
from dflash_jax.models.split import merge_model, split_model  # noqa: E402
from dflash_jax.tuning import Kernels  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "qwen3-8b"))
    ap.add_argument("--cases", default="8x512,64x256,1x1024", help="rows x prompt length, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("prefill.json"))
    args = ap.parse_args()
    cfg = {"smollm2": SMOLLM2_135M, "qwen3-8b": QWEN3_8B}[args.model]
    target = random_target(cfg, jnp.bfloat16)
    split = split_model(target.model)
    result = dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind, model=args.model,
                  commit=source_commit(),
                  cases=[])
    for case in args.cases.split(","):
        b, p = map(int, case.split("x"))
        ids = jnp.asarray(np.random.default_rng(p).integers(0, cfg.vocab_size, (b, p)), jnp.int32)
        row = dict(rows=b, prompt_len=p)
        logits = {}
        for impl in ("xla", "cuda"):
            @jax.jit
            def forward(leaves, ids, impl=impl):
                model = merge_model(split.static, leaves)
                positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
                h, _, cache = model(ids, positions, model.new_cache(b, p), prefill=True,
                                     kernels=Kernels(impl))
                return model.logits(h[:, -1]), cache

            warm_up(forward, split.leaves, ids)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(forward(split.leaves, ids))
                times.append(time.perf_counter() - t0)
            row[f"{impl}_ms"] = 1e3 * statistics.median(times)
            logits[impl] = np.asarray(forward(split.leaves, ids)[0], np.float32)
        row["xla_over_cuda"] = row["xla_ms"] / row["cuda_ms"]
        row["max_logit_diff"] = float(np.abs(logits["xla"] - logits["cuda"]).max())
        row["same_argmax"] = float((logits["xla"].argmax(-1) == logits["cuda"].argmax(-1)).mean())
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
