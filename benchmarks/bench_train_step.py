"""Where does a drafter training step spend its time? (SmolLM2-135M-shaped target, random weights.)

Times, for each (sequences per step, anchors per sequence) setting: the frozen target's feature forward
alone, the loss forward (features + drafter + lm_head + cross-entropy), and the whole optimizer step
(``Trainer``'s jitted step: forward, backward, AdamW), as medians over ``--reps`` calls on synthetic
sequences of ``--seq-len`` tokens (prompt ``--prompt-len``). Throughput is reported as trained block
tokens (anchors × block size) per second, the figure that decides how much training a budget buys.

Each row also carries XLA's cost analysis of the compiled pieces (TFLOP, GB accessed and GB of temporaries,
by the feature forward, and by the drafter-side loss forward and forward + backward given the features): where
the bytes go, on whatever backend compiles them. ``--cost-only`` skips the timing (useful on a CPU).

    python benchmarks/bench_train_step.py --settings 32x128,64x64,16x256 --out bench_train_step.json
    python benchmarks/bench_train_step.py --settings 32x128 --cost-only     # no accelerator needed
    python benchmarks/bench_train_step.py --settings 32x128 --ce-chunk-rows 8192   # the chunked cross-entropy
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flax import nnx  # noqa: E402

from common import SMOLLM2_135M, random_target  # noqa: E402
from dflash_jax import random_drafter  # noqa: E402
from dflash_jax.train.objective import dflash_loss, target_features  # noqa: E402
from dflash_jax.train.trainer import Trainer, TrainSettings, batch_for_step  # noqa: E402


def cost(fn, *args) -> tuple[float, float, float]:
    """(TFLOP, GB accessed, GB of temporaries) of ``fn`` compiled for these arguments (XLA's estimates;
    nothing runs). XLA's cost analysis counts a loop body once, so with ``--ce-chunk-rows`` the TFLOP and GB
    figures leave out all chunks but one; the temporaries (peak scratch memory) are whole."""
    compiled = jax.jit(fn).lower(*args).compile()
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list) else c
    temp = compiled.memory_analysis().temp_size_in_bytes
    return c.get("flops", 0.0) / 1e12, c.get("bytes accessed", 0.0) / 1e9, temp / 1e9


def drafter_loss(trainer: Trainer, target, params, batch, features):
    """The step's loss as a function of the drafter's fp32 master parameters (cast to the compute dtype)."""
    drafter = nnx.merge(trainer.d_graph, jax.tree.map(lambda x: x.astype(trainer.compute_dtype), params))
    return dflash_loss(drafter, target.model, batch, weights=trainer.weights, features=features,
                       ce_chunk_rows=trainer.s.ce_chunk_rows)[0]


def median_time(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def synthetic_data(rows: int, seq_len: int, prompt_len: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, vocab, (rows, seq_len)).astype(np.int32),
            "lengths": np.full(rows, seq_len, np.int32), "prompt_lengths": np.full(rows, prompt_len, np.int32)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="32x128,64x64,16x256,64x128")
    ap.add_argument("--seq-len", type=int, default=500)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_train_step.json")
    ap.add_argument("--quick", action="store_true", help="a 4-layer target and short sequences (CPU smoke test)")
    ap.add_argument("--cost-only", action="store_true", help="XLA cost analysis only, no timing")
    ap.add_argument("--ce-chunk-rows", type=int, default=None,
                    help="TrainSettings.ce_chunk_rows: the cross-entropy's lm_head in chunks of this many slots")
    args = ap.parse_args()
    cfg = dataclasses.replace(SMOLLM2_135M, num_layers=4) if args.quick else SMOLLM2_135M
    target = random_target(cfg, jnp.float32)  # the trained drafter's target runs in float32
    rows = []
    for setting in args.settings.split(","):
        bs, anchors = (int(x) for x in setting.split("x"))
        drafter = random_drafter(target, num_layers=args.layers, block_size=16, mask_token_id=16, dtype="float32")
        s = TrainSettings(batch_size=bs, max_anchors=anchors, compute_dtype="bfloat16",
                          ce_chunk_rows=args.ce_chunk_rows)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(target, drafter, s, tmp)
            trainer._build()
            data = synthetic_data(bs * 4, args.seq_len, args.prompt_len, cfg.vocab_size)
            batch = {k: jnp.asarray(v) for k, v in batch_for_step(data, 0, s, 16).items()}
            capture = drafter.config.target_layer_ids
            feats = jax.jit(lambda tokens: target_features(target.model, tokens, capture))
            loss = functools.partial(drafter_loss, trainer, target)
            with jax.default_matmul_precision("bfloat16"):  # as the step runs
                f_struct = jax.eval_shape(feats, batch["tokens"])
                costs = {"features": cost(feats, batch["tokens"]),
                         "loss_forward": cost(loss, trainer.params, batch, f_struct),
                         "loss_forward_backward": cost(jax.grad(loss), trainer.params, batch, f_struct)}
            row = dict(batch=bs, anchors=anchors, seq_len=int(batch["tokens"].shape[1]),
                       ce_chunk_rows=args.ce_chunk_rows, **{f"{k}_TFLOP": v[0] for k, v in costs.items()},
                       **{f"{k}_GB": v[1] for k, v in costs.items()},
                       **{f"{k}_temp_GB": v[2] for k, v in costs.items()})
            if not args.cost_only:
                params = jax.tree.map(jnp.copy, trainer.params)
                opt_state = trainer.tx.init(params)

                def step():
                    nonlocal params, opt_state
                    params, opt_state, m = trainer._step_fn(params, opt_state, trainer.t_state, batch,
                                                            jnp.float32(1e-5))
                    return m

                with jax.default_matmul_precision("bfloat16"):
                    features = feats(batch["tokens"])
                    fwd = jax.jit(loss)
                    row["features_ms"] = 1e3 * median_time(lambda: feats(batch["tokens"]), args.reps)
                    row["loss_forward_ms"] = 1e3 * (median_time(lambda: fwd(trainer.params, batch, features),
                                                                args.reps) + row["features_ms"] / 1e3)
                step_s = median_time(step, args.reps)
                row.update(step_ms=step_s * 1e3, block_tokens_per_s=bs * anchors * 16 / step_s,
                           sequences_per_s=bs / step_s)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    print(f"\n{jax.devices()[0].device_kind}: SmolLM2-135M-shaped target, {args.layers}-layer drafter, block 16")
    print("| seqs × anchors | T | features GB | loss fwd GB (no features) | loss fwd+bwd GB | fwd+bwd temporaries GB | "
          "features ms | loss fwd ms | step ms | block tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        timed = (f"{r['features_ms']:.1f} | {r['loss_forward_ms']:.1f} | {r['step_ms']:.1f} | "
                 f"{r['block_tokens_per_s']:,.0f}") if "step_ms" in r else "– | – | – | –"
        print(f"| {r['batch']}×{r['anchors']} | {r['seq_len']} | {r['features_GB']:.1f} | {r['loss_forward_GB']:.1f} | "
              f"{r['loss_forward_backward_GB']:.1f} | {r['loss_forward_backward_temp_GB']:.1f} | {timed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
