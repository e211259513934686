"""Where does a drafter training step spend its time? (SmolLM2-135M-shaped target, random weights.)

Times, for each (sequences per step, anchors per sequence) setting: the frozen target's feature forward
alone, the loss forward (features + drafter + lm_head + cross-entropy), and the whole optimizer step
(``Trainer``'s jitted step: forward, backward, AdamW), as medians over ``--reps`` calls on synthetic
sequences of ``--seq-len`` tokens (prompt ``--prompt-len``). Throughput is reported as trained block
tokens (anchors × block size) per second, the figure that decides how much training a budget buys.

    python benchmarks/bench_train_step.py --settings 32x128,64x64,16x256 --out bench_train_step.json
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench_decode import random_target  # noqa: E402
from dflash_jax import random_drafter  # noqa: E402
from dflash_jax.config import ModelConfig, RopeConfig  # noqa: E402
from dflash_jax.train.objective import dflash_loss, target_features  # noqa: E402
from dflash_jax.train.trainer import Trainer, TrainSettings, batch_for_step  # noqa: E402

SMOLLM2_135M = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                           rope=RopeConfig(theta=100000.0), max_position_embeddings=8192,
                           tie_word_embeddings=True)


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
    args = ap.parse_args()
    cfg = dataclasses.replace(SMOLLM2_135M, num_layers=4) if args.quick else SMOLLM2_135M
    target = random_target(cfg, jnp.float32)  # the trained drafter's target runs in float32
    rows = []
    for setting in args.settings.split(","):
        bs, anchors = (int(x) for x in setting.split("x"))
        drafter = random_drafter(target, num_layers=args.layers, block_size=16, mask_token_id=16, dtype="float32")
        s = TrainSettings(batch_size=bs, max_anchors=anchors, compute_dtype="bfloat16")
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(target, drafter, s, tmp)
            trainer._build()
            data = synthetic_data(bs * 4, args.seq_len, args.prompt_len, cfg.vocab_size)
            batch = {k: jnp.asarray(v) for k, v in batch_for_step(data, 0, s, 16).items()}
            capture = drafter.config.target_layer_ids
            feats = jax.jit(lambda tokens: target_features(target.model, tokens, capture))
            params = jax.tree.map(jnp.copy, trainer.params)
            opt_state = trainer.tx.init(params)

            def step():
                nonlocal params, opt_state
                params, opt_state, m = trainer._step_fn(params, opt_state, trainer.t_state, batch, jnp.float32(1e-5))
                return m

            with jax.default_matmul_precision("bfloat16"):
                t_feat = median_time(lambda: feats(batch["tokens"]), args.reps)
                fwd = jax.jit(lambda b: dflash_loss(trainer_merge(trainer), target.model, b,
                                                    weights=trainer.weights)[0])
                t_fwd = median_time(lambda: fwd(batch), args.reps)
            t_step = median_time(step, args.reps)
        block_tokens = bs * anchors * 16
        row = dict(batch=bs, anchors=anchors, seq_len=int(batch["tokens"].shape[1]), features_ms=t_feat * 1e3,
                   loss_forward_ms=t_fwd * 1e3, step_ms=t_step * 1e3,
                   block_tokens_per_s=block_tokens / t_step, sequences_per_s=bs / t_step)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    print(f"\n{jax.devices()[0].device_kind}: SmolLM2-135M-shaped target, {args.layers}-layer drafter, block 16")
    print("| seqs × anchors | T | features ms | loss fwd ms | step ms | block tokens/s | seqs/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']}×{r['anchors']} | {r['seq_len']} | {r['features_ms']:.1f} | {r['loss_forward_ms']:.1f} | "
              f"{r['step_ms']:.1f} | {r['block_tokens_per_s']:,.0f} | {r['sequences_per_s']:.0f} |")
    return 0


def trainer_merge(trainer: Trainer):
    """The drafter module in the trainer's compute dtype (as the step builds it)."""
    from flax import nnx
    return nnx.merge(trainer.d_graph, jax.tree.map(lambda x: x.astype(trainer.compute_dtype), trainer.params))


if __name__ == "__main__":
    sys.exit(main())
