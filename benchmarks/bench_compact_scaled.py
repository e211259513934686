r"""Verify modes on a target whose verified tokens cost real time: AR, static, compact and auto (the default mode
users get) at several batch sizes on a Qwen3-8B-shaped target (``--shape 8b``) or a Qwen3-30B-A3B-shaped MoE target
(``--shape moe``: 48 layers, 128 experts, top-8; ``common.QWEN3_30B_A3B``), random bf16 weights drawn on the
device, with a drafter of chosen acceptance.

The embedded 135M pair is launch-bound on a GPU (a whole block costs ≤ 1.5× one token per row even at batch
128), so trimming can save little there. Here a verify token is a real share of a step. The drafter is a DFlash
drafter of the target's shape (``--drafter-layers`` random layers: its full cost — context projection, trunk over
the block, the target's LM head over the drafts compact verifies) whose drafts are then forced to the target's
own greedy continuation, each replaced by a wrong token with probability ``--corrupt`` (seeded per position):
draft j survives with probability (1 − p)^j, as a trained drafter's acceptance decays along the block (p = 0.3:
τ ≈ 3.3 at block 16; p = 0.2: τ ≈ 4.9). Random weights' greedy text is what it is; only its cost and the
acceptance pattern matter here.

Per batch (prompts of ``--prompt-len`` random ids, ``--max-new`` new tokens, no stop tokens): the AR reference
(which also gives the continuation the drafter knows), the cost table for that batch
(:func:`dflash_jax.engine.calibrate.measure`, unless ``--cost-table``; it times the static step too when auto
runs, as ``dflash-jax calibrate`` does for users: auto gets the whole table, compact the table without that
column, so that it always runs its own tiers), then each of ``--modes`` (default static, compact, auto),
each timed after an untimed first call (median of ``--repeats``): tokens/s, τ, verified tokens per committed
token, the mode that ran (auto's resolution), compact's tiers, and whether each mode's tokens equal AR's (bf16: a
verify of several tokens may round differently from one step, so a few rows can differ; float32 runs are
token-identical, tests/test_schedule.py). ``--plot`` draws the throughput–latency curve of every mode and AR:
tokens/s against per-row ms per token (1000 × batch ÷ tokens/s), log-log, each point labelled by its batch.

    # GPU: the Qwen3-8B shape at p = 0.2
    python benchmarks/bench_compact_scaled.py --batches 1,4,16,32,64,128 --corrupt 0.2 --out $OUT/8b.json \
        --plot $OUT/8b.png
    # the Qwen3-30B-A3B shape at both rates, each batch's AR reference and table shared: moe_p0.3.json, moe_p0.2.json
    python benchmarks/bench_compact_scaled.py --shape moe --batches 1,4,16,32,64,128 --corrupt 0.3,0.2 \
        --out $OUT/moe.json --plot $OUT/moe.png
    # CPU smoke tests (tiny shapes)
    python benchmarks/bench_compact_scaled.py --small --batches 2,4 --repeats 1 --out /tmp/s8b.json --plot /tmp/s8b.png
    python benchmarks/bench_compact_scaled.py --small --shape moe --batches 2,4 --repeats 1 --out /tmp/smoe.json \
        --plot /tmp/smoe.png

The JSON and the plot are rewritten after each batch, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))  # table_ceiling

import table_ceiling  # noqa: E402
from common import (QWEN3_8B, QWEN3_30B_A3B, SCHEMES, fallback_log_line, quantize_model,  # noqa: E402
                    random_target, source_commit)
from dflash_jax import costs, generate, random_drafter, speculative_generate  # noqa: E402
from dflash_jax.config import model_config_from_hf  # noqa: E402
from dflash_jax.engine import calibrate  # noqa: E402
from dflash_jax.loading import Drafter  # noqa: E402
from dflash_jax.models.drafter import DFlashDrafter  # noqa: E402
from dflash_jax.models.moe import SparseMoE  # noqa: E402
from dflash_jax.tuning import Kernels, Tuning  # noqa: E402

SMALL = dataclasses.replace(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
# --shape: (name, full config, --small config); the small MoE as bench_families' SMALL["moe"] (16 experts of 32, top-4)
SHAPES = {
    "8b": ("qwen3-8b", QWEN3_8B, SMALL),
    "moe": ("qwen3-30b-a3b", model_config_from_hf(QWEN3_30B_A3B),
            model_config_from_hf(dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                      max_position_embeddings=4096))),
}
MODES = ("static", "compact", "auto")
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

    def draft_logits(self, hidden, target, kernels=Kernels()):
        logits = super().draft_logits(hidden[..., :-1].astype(target.dtype), target, kernels)
        ids = hidden[..., -1].astype(jnp.int32)
        return logits * 0.0 + jax.nn.one_hot(ids, logits.shape[-1], dtype=logits.dtype)


def make_predictable(target, seed: int = 0, residual_scale: float = 1e-2) -> None:
    """Give the random target a greedy continuation that rounding cannot change: the next token is a fixed
    permutation of the current one. Random weights' logits are nearly flat, so a 16-token verify and an AR step
    round differently in bf16, rows leave the AR text the drafter proposes, and every later draft is wrong
    (τ ~1.2 instead of ~3.3, almost no row identical to AR). Here the embedding
    dominates the residual stream (each layer's output projections scaled by ``residual_scale``: attention's
    ``o_proj`` and the MLP's ``down_proj`` — for a sparse MoE block the experts' stacked ``down_proj`` and the shared
    expert's) and the LM head is the embedding's rows permuted, so the permuted token's logit leads by ~√D times
    the rest's spread. Every layer still runs at full size: only values change, not the cost."""
    m = target.model
    v, d = m.embed_tokens.embedding[...].shape
    dtype = m.embed_tokens.embedding[...].dtype
    embed = jax.random.normal(jax.random.key(seed), (v, d), jnp.float32).astype(dtype)
    m.embed_tokens.embedding.set_value(embed)
    successor = np.random.default_rng(seed).permutation(v)  # token x is followed by successor[x]
    m.lm_head.kernel.set_value(embed[np.argsort(successor)].T)  # column y: the embedding of y's predecessor
    for layer in m.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            outs = [mlp.experts.down_proj]
            if mlp.shared_expert is not None:
                outs.append(mlp.shared_expert.down_proj.kernel)
        else:
            outs = [mlp.down_proj.kernel]
        for param in [layer.self_attn.o_proj.kernel] + outs:
            param.set_value((param[...] * residual_scale).astype(dtype))


def known_drafter(target, prompts: list[list[int]], continuations: list[list[int]], *, layers: int, block: int,
                  corrupt: float, seed: int = 0, trained_widths: tuple[int, ...] | None = None) -> Drafter:
    """A :class:`KnownDrafter` whose table holds each row's prompt and AR continuation, each position replaced
    by another token with probability ``corrupt``; ``trained_widths``: what its config says it was trained at
    (its compact steps then draft only what their tier verifies, as a drafter trained at those widths would)."""
    vocab = target.config.vocab_size
    rng = np.random.default_rng(seed)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    table = np.zeros((len(seqs), max(map(len, seqs)) + block + 1), np.int64)
    for row, s in enumerate(seqs):
        table[row, : len(s)] = s
    wrong = rng.random(table.shape) < corrupt
    table = np.where(wrong, (table + 1 + rng.integers(0, vocab - 1, table.shape)) % vocab, table)
    base = random_drafter(target, num_layers=layers, block_size=block, seed=seed)
    cfg = dataclasses.replace(base.model.config, trained_widths=trained_widths).validate()
    model = KnownDrafter(cfg, table, dtype=target.model.dtype, rngs=nnx.Rngs(seed))
    return Drafter(model, f"known continuation, corrupt {corrupt}", True)


# A timed call that compiled more than this (``stats["compile_s"]``: e.g. auto's fallback segments, first met in a
# later call than the untimed one) is timed again: 7 s of compiling once read as 0.22× autoregressive at 32 rows.
COMPILED_S = 0.05
EXTRA_CALLS = 3


def timed(fn, repeats: int):
    """(the first timed call's output, median wall seconds of ``repeats`` calls after an untimed one; a call that
    compiled is left out and replaced, up to ``EXTRA_CALLS`` times)."""
    fn()
    walls, outs, extra = [], [], 0
    while len(walls) < repeats:
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        if out.stats.get("compile_s", 0.0) > COMPILED_S and extra < EXTRA_CALLS:
            extra += 1
            print(f"  (a call compiled {out.stats['compile_s']:.1f} s: timed again)", flush=True)
            continue
        outs.append(out)
        walls.append(wall)
    return outs[0], statistics.median(walls)


def earlier_table(paths: list[Path], batch: int) -> costs.CostTable | None:
    """The cost table for ``batch`` from the first of ``paths`` that has one: a costs file, or an earlier run's JSON
    (the table it timed at that batch). None where no earlier run timed that batch: it is timed then."""
    for path in paths:
        raw = json.loads(path.read_text())
        if "batches" not in raw:
            return costs.resolve(path, jax.default_backend())
        if str(batch) in raw["batches"]:
            return costs.CostTable.from_json(raw["batches"][str(batch)]["cost_table"], f"{path} [batch {batch}]")
    return None


def batch_case(target, batch: int, args, table_files: list[Path]) -> dict[float, dict]:
    """Every rate of ``args.corrupts`` at ``batch`` rows: the AR reference and the cost table once (the drafter's
    cost does not depend on its acceptance), then each rate's modes → {rate: that rate's JSON case}."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, target.config.vocab_size, (batch, args.prompt_len)).tolist()
    kw = dict(max_new_tokens=args.max_new, stop_token_ids=[], tuning=args.tuning)
    ar, ar_s = timed(lambda: generate(target, prompts, **kw), args.repeats)
    drafters = {p: known_drafter(target, prompts, ar.token_ids, layers=args.drafter_layers, block=args.block_size,
                                 corrupt=p, trained_widths=args.trained_widths) for p in args.corrupts}
    t0 = time.perf_counter()
    table = earlier_table(table_files, batch)
    if table is None:
        table = calibrate.measure(target, drafters[args.corrupts[0]], batches=(batch,), block_size=args.block_size,
                                  context=args.prompt_len + args.max_new // 2, pair=f"{args.shape_name}-shaped",
                                  progress=lambda line: print("  " + line, flush=True), tuning=args.tuning,
                                  time_static="auto" in args.modes)  # auto reads it, as users' tables have it
    calibrate_s = time.perf_counter() - t0
    tokens = sum(map(len, ar.token_ids))
    print(f"batch {batch:4d} ar       {tokens / ar_s:9.1f} tok/s", flush=True)
    return {p: rate_case(target, batch, args, prompts, ar, ar_s, p, drafter, table, calibrate_s)
            for p, drafter in drafters.items()}


def rate_case(target, batch, args, prompts, ar, ar_s, corrupt, drafter, table, calibrate_s) -> dict:
    """Rate ``corrupt``'s modes at ``batch`` rows against the AR reference ``ar`` (``ar_s`` seconds a call)."""
    kw = dict(max_new_tokens=args.max_new, stop_token_ids=[], tuning=args.tuning)
    tokens = sum(map(len, ar.token_ids))
    out = dict(ar=dict(tokens_per_s=tokens / ar_s, wall_s=ar_s), cost_table=table.to_json(),
               calibrate_s=calibrate_s)
    for mode in args.modes:
        # compact without the static column: its own tiers always (static runs beside it), not static's program
        mode_table = dataclasses.replace(table, static_ms={}) if mode == "compact" else table
        res, wall = timed(lambda: speculative_generate(target, drafter, prompts, verify_mode=mode,
                                                       cost_table=mode_table, block_size=args.block_size, **kw),
                          args.repeats)
        n = res.stats["new_tokens"]
        out[mode] = dict(tokens_per_s=n / wall, wall_s=wall, tau=res.tau,
                         verified_per_token=res.stats.get("verify_tokens", n * args.block_size) / n,
                         identical_to_ar=float(np.mean([a == b for a, b in zip(res.token_ids, ar.token_ids)])),
                         verify_mode=res.stats["verify_mode"], tier_steps=res.stats.get("tier_steps"),
                         ar_steps=res.stats.get("ar_steps"), ar_fallback_steps=res.stats.get("ar_fallback_steps"),
                         fallback_switches=res.stats.get("fallback_switches"), cycles=res.stats.get("cycles"),
                         fallback_log=res.stats.get("fallback_log"))
        fell_back = (f", {res.stats['ar_fallback_steps']} of {res.stats['cycles']} steps fallen back"
                     if res.stats.get("ar_fallback_steps") is not None else "")
        print(f"batch {batch:4d} p {corrupt} {mode:8s} {n / wall:9.1f} tok/s  τ {res.tau:.2f}  "
              f"{out[mode]['verified_per_token']:.2f} verified per token  ({res.stats['verify_mode']}{fell_back})",
              flush=True)
        if res.stats.get("fallback_log"):
            print(f"  (segments: {fallback_log_line(res.stats['fallback_log'])})", flush=True)
    ratios = []
    if "compact" in out and "static" in out:
        out["compact_vs_static"] = out["compact"]["tokens_per_s"] / out["static"]["tokens_per_s"]
        ratios.append(f"compact ÷ static {out['compact_vs_static']:.2f}")
    for mode in args.modes:
        out[f"{mode}_vs_ar"] = out[mode]["tokens_per_s"] / out["ar"]["tokens_per_s"]
        ratios.append(f"{mode} ÷ AR {out[f'{mode}_vs_ar']:.2f}")
    if corrupt > 0 and table.step_ms.get(batch):  # what the table allows (tools/table_ceiling.py)
        out["ceiling"] = table_ceiling.ceiling(table, batch, corrupt, args.max_new)
        ratios.append(f"table's whole-call ceiling {out['ceiling']['best_whole_call_ratio']:.2f} "
                      f"(width {out['ceiling']['best_width']})")
    print(f"batch {batch:4d} p {corrupt} " + ", ".join(ratios), flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    """The throughput–latency plot of ``result`` (this script's JSON, or its dict in memory): per mode and AR, a
    line through its batches at x = per-row ms per token (1000 × batch ÷ tokens/s), y = tokens/s, log-log, each
    point labelled by its batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    batches = sorted(result["batches"].items(), key=lambda kv: int(kv[0]))
    modes = ["ar"] + [m for m in MODES + tuple(result.get("modes", ())) if m != "ar"]
    modes = [m for m in dict.fromkeys(modes) if any(m in case for _, case in batches)]
    fig, ax = plt.subplots(figsize=(8, 6), dpi=120)
    for i, mode in enumerate(modes):
        pts = [(int(b), case[mode]["tokens_per_s"]) for b, case in batches if mode in case]
        xs = [1000.0 * b / tps for b, tps in pts]
        ys = [tps for _, tps in pts]
        label = "AR" if mode == "ar" else mode
        if mode == "auto":
            ran = sorted({case["auto"]["verify_mode"] for _, case in batches if "auto" in case})
            label += f" (ran {', '.join(ran)})"
        (line,) = ax.plot(xs, ys, marker="o", linestyle="--" if mode == "ar" else "-", label=label)
        for (b, _), x, y in zip(pts, xs, ys):
            ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(5, 5 if i % 2 else -11), fontsize=8,
                        color=line.get_color())  # modes alternate above and below, so coinciding points stay legible
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax.tick_params(which="minor", labelsize=7)
    ax.set_xlabel("per-row latency, ms per token (1000 × batch ÷ tokens/s)")
    ax.set_ylabel("throughput, tokens/s")
    args = result.get("args", {})
    ax.set_title(f"{result.get('shape', '?')}, {result.get('dtype', '')}, p = {args.get('corrupt', '?')}, "
                 f"block {args.get('block_size', '?')}\n{result.get('device', '')} · points: batch", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                    help="8b: Qwen3-8B (dense); moe: Qwen3-30B-A3B (128 experts, top-8)")
    ap.add_argument("--small", action="store_true", help="a tiny version of the shape (a CPU smoke test, not a "
                                                         "measurement)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="speculative verify modes, comma-separated (default: %(default)s)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--corrupt", default="0.3",
                    help="probability that a draft is made wrong; several, comma-separated, share each batch's AR "
                         "reference and table, each rate written to its own JSON (--out's name + _p<rate>)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", choices=("none", "int8", "fp8", "fp8-block"), default="none",
                    help="the target's linear layers, LM head and routed experts quantized on the device "
                         "(common.SCHEMES, as bench_quantized_step.py; the drafter stays in --dtype). With "
                         "--corrupt 1: what a user gets at τ = 1 on a quantized target (issue 56's cycle at τ = 1)")
    ap.add_argument("--flat-logits", action="store_true",
                    help="keep the random target as drawn (bf16 rounding then leads rows away from AR's text)")
    ap.add_argument("--tier-draft-span", default="none",
                    help="Tuning.tier_draft_span: a compact tier of n tokens per row drafts min(L, span·n) positions "
                         "(none, the library's default: the drafter's, whole blocks unless --trained-widths; 0: "
                         "whole blocks)")
    ap.add_argument("--trained-widths", default="none",
                    help="comma-separated narrower widths the scripted drafter declares it was trained at "
                         "(DrafterConfig.trained_widths; none: whole blocks only, as every public checkpoint). Its "
                         "acceptance does not depend on the width, as a drafter trained at those widths would "
                         "nearly (a whole-block one's falls there: benchmarks/README.md)")
    ap.add_argument("--finish-together", type=float, default=None,
                    help="Tuning.finish_together (default: the library's; 0: the admission weighs every row alike)")
    ap.add_argument("--cost-table", type=Path, action="append", default=[],
                    help="a costs file, or an earlier run's JSON (its table at each batch), instead of timing them; "
                         "repeatable (the first file with a table for the batch gives it; a batch none has is timed)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, help="a PNG of the throughput–latency curves, rewritten after each batch")
    args = ap.parse_args()
    args.modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    name, full, small = SHAPES[args.shape]
    args.shape_name = f"small-{name}" if args.small else name
    args.tuning = Tuning(tier_draft_span=None if args.tier_draft_span == "none" else int(args.tier_draft_span))
    if args.finish_together is not None:
        args.tuning = dataclasses.replace(args.tuning, finish_together=args.finish_together)
    args.trained_widths = (None if args.trained_widths == "none"
                           else tuple(int(w) for w in args.trained_widths.split(",")))
    if args.small and jax.default_backend() == "cpu":
        args.tuning = args.tuning.with_compiler_options(CPU_FAST_COMPILE)
    cfg = small if args.small else full
    target = random_target(cfg, jnp.dtype(args.dtype))
    if not args.flat_logits:
        make_predictable(target)
    if args.quantization != "none":  # after make_predictable: the AR reference is the quantized target's own text
        quantize_model(target.model, SCHEMES[args.quantization])
        args.shape_name += f"-{args.quantization}"
    args.corrupts = tuple(float(p) for p in args.corrupt.split(","))
    device = jax.devices()[0]
    outs = {p: args.out if len(args.corrupts) == 1 else args.out.with_name(f"{args.out.stem}_p{p}{args.out.suffix}")
            for p in args.corrupts}
    results = {p: dict(date=time.strftime("%Y-%m-%d %H:%M"), device=getattr(device, "device_kind", str(device)),
                       platform=platform.platform(), dtype=args.dtype, shape=args.shape_name, modes=list(args.modes),
                       commit=source_commit(), args={**{k: str(v) for k, v in vars(args).items()}, "corrupt": str(p)},
                       batches={})
               for p in args.corrupts}
    for batch in (int(b) for b in args.batches.split(",")):
        for p, case in batch_case(target, batch, args, args.cost_table).items():
            results[p]["batches"][batch] = case
            outs[p].write_text(json.dumps(results[p], indent=1) + "\n")
            if args.plot:
                plot(results[p], args.plot if len(outs) == 1 else args.plot.with_name(f"{args.plot.stem}_p{p}.png"))
    print("→ " + ", ".join(map(str, outs.values())) + (" and their plots" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
