"""Verify modes on a target whose verified tokens cost real time: AR, static and compact at several batch sizes on
a Qwen3-8B-shaped target (random bf16 weights, drawn on the device), with a drafter of chosen acceptance.

The embedded 135M pair is launch-bound on an H200 (a whole block costs ≤ 1.5× one token per row even at batch
128), so trimming can save little there (RESULTS.md, 2026-12-04). Here a verify token is a real share of an 8B
step. The drafter is a DFlash drafter of the target's shape (``--drafter-layers`` random layers: its full cost —
context projection, trunk over the block, the target's LM head over the drafts compact verifies) whose drafts
are then forced to the target's own greedy continuation, each replaced by a wrong token with probability
``--corrupt`` (seeded per position): draft j survives with probability (1 − p)^j, as a trained drafter's
acceptance decays along the block (p = 0.3: τ ≈ 3.3 at block 16). Random weights' greedy text is what it is;
only its cost and the acceptance pattern matter here.

Per batch (prompts of ``--prompt-len`` random ids, ``--max-new`` new tokens, no stop tokens): the AR reference
(which also gives the continuation the drafter knows), the cost table for that batch
(:func:`dflash_jax.engine.calibrate.measure`, unless ``--cost-table``), then static and compact, each timed after an
untimed first call (median of ``--repeats``): tokens/s, τ, verified tokens per committed token, compact's tiers,
and whether each mode's tokens equal AR's (bf16: a verify of several tokens may round differently from one
step, so a few rows can differ; float32 runs are token-identical, tests/test_schedule.py).

    python benchmarks/bench_compact_scaled.py --batches 64 --out $OUT/scaled_64.json   # GPU (H200): a batch a call
    python benchmarks/bench_compact_scaled.py --small --batches 2,4 --out /tmp/scaled_cpu.json   # CPU smoke test

The JSON is rewritten after each batch, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_8B, random_target  # noqa: E402
from dflash_jax import costs, generate, random_drafter, speculative_generate  # noqa: E402
from dflash_jax.engine import calibrate  # noqa: E402
from dflash_jax.loading import Drafter  # noqa: E402
from dflash_jax.models.drafter import DFlashDrafter  # noqa: E402
from dflash_jax.tuning import Kernels, Tuning  # noqa: E402

SMALL = dataclasses.replace(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
# --small on the CPU: cut XLA's compile time (tiny programs run instantly anyway).
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}


class KnownDrafter(DFlashDrafter):
    """A DFlash drafter that runs its own layers and LM head (their cost) but proposes ``table[row, position]``.

    The trunk's hidden states leave :meth:`__call__` with the known token id as one more (float32) channel;
    :meth:`draft_logits` computes the real logits from the rest and returns them times zero plus a one-hot of
    the id (XLA keeps a float product with zero: it is NaN for an infinite operand)."""

    def __init__(self, cfg, table: np.ndarray, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.table = nnx.Variable(jnp.asarray(table, jnp.int32))  # [B, S]: the token at each position

    def __call__(self, block_embeds, positions, cache, ctx_len, *, kernels=Kernels()):
        h = super().__call__(block_embeds, positions, cache, ctx_len, kernels=kernels)  # [B, L, D]
        ids = jnp.take_along_axis(self.table[...], positions, axis=1)  # [B, L]
        return jnp.concatenate([h.astype(jnp.float32), ids[..., None].astype(jnp.float32)], axis=-1)

    def draft_logits(self, hidden, target):
        logits = super().draft_logits(hidden[..., :-1].astype(target.dtype), target)
        ids = hidden[..., -1].astype(jnp.int32)
        return logits * 0.0 + jax.nn.one_hot(ids, logits.shape[-1], dtype=logits.dtype)


def make_predictable(target, seed: int = 0, residual_scale: float = 1e-2) -> None:
    """Give the random target a greedy continuation that rounding cannot change: the next token is a fixed
    permutation of the current one. Random weights' logits are nearly flat, so a 16-token verify and an AR step
    round differently in bf16, rows leave the AR text the drafter proposes, and every later draft is wrong
    (τ ~1.2 instead of ~3.3, almost no row identical to AR). Here the embedding
    dominates the residual stream (each layer's output projections scaled by ``residual_scale``) and the LM head
    is the embedding's rows permuted, so the permuted token's logit leads by ~√D times the rest's spread. Every
    layer still runs at full size: only values change, not the cost."""
    m = target.model
    v, d = m.embed_tokens.embedding[...].shape
    dtype = m.embed_tokens.embedding[...].dtype
    embed = jax.random.normal(jax.random.key(seed), (v, d), jnp.float32).astype(dtype)
    m.embed_tokens.embedding.set_value(embed)
    successor = np.random.default_rng(seed).permutation(v)  # token x is followed by successor[x]
    m.lm_head.kernel.set_value(embed[np.argsort(successor)].T)  # column y: the embedding of y's predecessor
    for layer in m.layers:
        for dense in (layer.self_attn.o_proj, layer.mlp.down_proj):
            dense.kernel.set_value((dense.kernel[...] * residual_scale).astype(dtype))


def known_drafter(target, prompts: list[list[int]], continuations: list[list[int]], *, layers: int, block: int,
                  corrupt: float, seed: int = 0) -> Drafter:
    """A :class:`KnownDrafter` whose table holds each row's prompt and AR continuation, each position replaced
    by another token with probability ``corrupt``."""
    vocab = target.config.vocab_size
    rng = np.random.default_rng(seed)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    table = np.zeros((len(seqs), max(map(len, seqs)) + block + 1), np.int64)
    for row, s in enumerate(seqs):
        table[row, : len(s)] = s
    wrong = rng.random(table.shape) < corrupt
    table = np.where(wrong, (table + 1 + rng.integers(0, vocab - 1, table.shape)) % vocab, table)
    base = random_drafter(target, num_layers=layers, block_size=block, seed=seed)
    model = KnownDrafter(base.model.config, table, dtype=target.model.dtype, rngs=nnx.Rngs(seed))
    return Drafter(model, f"known continuation, corrupt {corrupt}", True)


def timed(fn, repeats: int):
    """(the first timed call's output, median wall seconds of ``repeats`` calls after an untimed one)."""
    fn()
    walls, outs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs.append(fn())
        walls.append(time.perf_counter() - t0)
    return outs[0], statistics.median(walls)


def earlier_table(path: Path, batch: int) -> costs.CostTable:
    """The cost table in ``path``: a costs file, or an earlier run's JSON (the table it timed at ``batch``)."""
    raw = json.loads(path.read_text())
    if "batches" not in raw:
        return costs.resolve(path, jax.default_backend())
    if str(batch) not in raw["batches"]:
        raise SystemExit(f"{path} timed no table at batch {batch} (it has {sorted(raw['batches'], key=int)})")
    return costs.CostTable.from_json(raw["batches"][str(batch)]["cost_table"], f"{path} [batch {batch}]")


def batch_case(target, batch: int, args, table_file: Path | None) -> dict:
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, target.config.vocab_size, (batch, args.prompt_len)).tolist()
    kw = dict(max_new_tokens=args.max_new, stop_token_ids=[], tuning=args.tuning)
    ar, ar_s = timed(lambda: generate(target, prompts, **kw), args.repeats)
    drafter = known_drafter(target, prompts, ar.token_ids, layers=args.drafter_layers, block=args.block_size,
                            corrupt=args.corrupt)
    t0 = time.perf_counter()
    if table_file is not None:
        table = earlier_table(table_file, batch)
    else:
        table = calibrate.measure(target, drafter, batches=(batch,), block_size=args.block_size,
                                  context=args.prompt_len + args.max_new // 2, pair="qwen3-8b-shaped",
                                  progress=lambda line: print("  " + line, flush=True), tuning=args.tuning,
                                  time_static=False)  # static runs below: compact's own tiers are compared with it
    calibrate_s = time.perf_counter() - t0
    tokens = sum(map(len, ar.token_ids))
    out = dict(ar=dict(tokens_per_s=tokens / ar_s, wall_s=ar_s), cost_table=table.to_json(),
               calibrate_s=calibrate_s)
    print(f"batch {batch:4d} ar       {tokens / ar_s:9.1f} tok/s", flush=True)
    for mode in ("static", "compact"):
        res, wall = timed(lambda: speculative_generate(target, drafter, prompts, verify_mode=mode, cost_table=table,
                                                       block_size=args.block_size, **kw), args.repeats)
        n = res.stats["new_tokens"]
        out[mode] = dict(tokens_per_s=n / wall, wall_s=wall, tau=res.tau,
                         verified_per_token=res.stats.get("verify_tokens", n * args.block_size) / n,
                         identical_to_ar=float(np.mean([a == b for a, b in zip(res.token_ids, ar.token_ids)])),
                         verify_mode=res.stats["verify_mode"], tier_steps=res.stats.get("tier_steps"),
                         ar_steps=res.stats.get("ar_steps"))
        print(f"batch {batch:4d} {mode:8s} {n / wall:9.1f} tok/s  τ {res.tau:.2f}  "
              f"{out[mode]['verified_per_token']:.2f} verified per token  ({res.stats['verify_mode']})", flush=True)
    out["compact_vs_static"] = out["compact"]["tokens_per_s"] / out["static"]["tokens_per_s"]
    out["compact_vs_ar"] = out["compact"]["tokens_per_s"] / out["ar"]["tokens_per_s"]
    out["static_vs_ar"] = out["static"]["tokens_per_s"] / out["ar"]["tokens_per_s"]
    print(f"batch {batch:4d} compact ÷ static {out['compact_vs_static']:.2f}, compact ÷ AR "
          f"{out['compact_vs_ar']:.2f}, static ÷ AR {out['static_vs_ar']:.2f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test, not a measurement)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--corrupt", type=float, default=0.3, help="probability that a draft is made wrong")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--flat-logits", action="store_true",
                    help="keep the random target as drawn (bf16 rounding then leads rows away from AR's text)")
    ap.add_argument("--cost-table", type=Path,
                    help="a costs file, or an earlier run's JSON (its table at each batch), instead of timing them")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.tuning = Tuning()
    if args.small and jax.default_backend() == "cpu":
        args.tuning = args.tuning.with_compiler_options(CPU_FAST_COMPILE)
    cfg = SMALL if args.small else QWEN3_8B
    target = random_target(cfg, jnp.dtype(args.dtype))
    if not args.flat_logits:
        make_predictable(target)
    device = jax.devices()[0]
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=getattr(device, "device_kind", str(device)),
                  platform=platform.platform(), dtype=args.dtype, shape="small" if args.small else "qwen3-8b",
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
                  args={k: str(v) for k, v in vars(args).items()}, batches={})
    for batch in (int(b) for b in args.batches.split(",")):
        result["batches"][batch] = batch_case(target, batch, args, args.cost_table)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
