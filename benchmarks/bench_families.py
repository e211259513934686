"""The new target families on the GPU: AR decode step against the bytes-read floor, speculative cycle vs AR step.

Random weights of the real shapes (bf16), drawn on the device, one model at a time (freed before the next):

* ``moe``: Qwen3-30B-A3B (``qwen3_moe``: 48 layers, D 2048, 32 q / 4 kv heads of 128, 128 experts, top-8,
  expert width 768, vocab 151936; its ``config.json`` is ``common.QWEN3_30B_A3B``);
* ``hybrid``: Qwen3.5-9B (``qwen3_5_text``: 32 layers, 3 Gated DeltaNet layers then one gated full-attention
  layer, ×8; D 4096, 16 q / 4 kv heads of 256, linear attention 16 key / 32 value heads of 128, conv 4, MLP
  12288, vocab 248320, untied; the text part of its ``config.json`` below).

Per model, through the library's own decode loop (``generate`` / ``speculative_generate``, token-id prompts of
``--prompt-len`` random ids, ``--max-new`` new tokens, ``stop_token_ids=[]``; every program compiled by an untimed
first call; median of ``--repeats`` calls):

* AR step at batch 1 and 8 = decode_s ÷ decode steps (``stats["cycles"]``: the prefill makes the first token);
* its floor = bytes one step reads ÷ the device copy bandwidth (``common.copy_bandwidth``: read + write bytes of a
  4 GiB elementwise op, as bench_latency measures it). Bytes: every weight except the input embedding (a
  gather; counted when tied, as the lm_head); MoE experts only for the experts a step routes to — batch 1: K = 8
  per layer; batch B: the expected number of distinct experts when each of B tokens routes K distinct experts
  uniformly, ``E·(1 − (1 − K/E)^B)`` (51.6 of 128 at B = 8); plus the K/V of the full-attention layers at the
  mean context of the decode (prompt + max_new/2) and, for the hybrid, the linear layers' recurrent states
  (float32, read and written every step) and conv histories;
* speculative cycle at batch 1 with a random ``--drafter-layers``-layer DFlash drafter (``random_drafter``,
  block ``--block-size``, ``verify_mode="static"``: every cycle drafts and verifies the whole block; the
  untrained drafter's acceptance is ~0, so cycles ≈ steps): decode_s ÷ cycles, against the AR step at batch 1.
  A cycle floor is reported for reference (target at block-size tokens — for the MoE the expected distinct
  experts of that many tokens — plus the drafter, the lm_head again for the draft logits, and the states).
  ``--draft-vocab N`` drafts over N token ids only (``restrict_draft_vocab``; here the first N, the weights being
  random): the draft logits then read N rows of the lm_head, not all V (Qwen3.5's 248,320 × 4096 bf16 rows are
  2 GB, a quarter of the 9B cycle's floor). Lossless either way; a trained pair's τ falls with the tokens left out.

Goals (printed next to the numbers): AR step ≤ 1.3× floor at batch 1; hybrid cycle ≤ 1.15× its AR step at
batch 1. The JSON (``--out``) is rewritten after each model, so a run cut short keeps what it finished.

    python benchmarks/bench_families.py --out bench_families.json            # GPU (H200): both models
    python benchmarks/bench_families.py --models hybrid --out hybrid.json    # one of them
    python benchmarks/bench_families.py --small --out /tmp/families_cpu.json # CPU smoke test (tiny shapes)
    python benchmarks/bench_families.py --models hybrid --draft-vocab 32768 --out hybrid_vocab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
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

from common import QWEN3_30B_A3B, copy_bandwidth, device_profile, param_bytes, print_profile, source_commit  # noqa: E402
from dflash_jax import generate, random_drafter, speculative_generate  # noqa: E402
from dflash_jax import families  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.engine import programs as engine_programs  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402
from dflash_jax.config import model_config_from_hf  # noqa: E402
from dflash_jax.loading import Target, restrict_draft_vocab  # noqa: E402
from dflash_jax.models import moe  # noqa: E402

# Qwen/Qwen3.5-9B config.json's text_config.
QWEN3_5_9B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "attn_output_gate": True, "attention_bias": False, "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "eos_token_id": 248044,
}
# --small: the same families, tiny (a CPU smoke test of the script, not a measurement).
SMALL = {
    "moe": dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
                moe_intermediate_size=32, max_position_embeddings=4096),
    "hybrid": dict(QWEN3_5_9B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096),
}
FULL = {"moe": QWEN3_30B_A3B, "hybrid": QWEN3_5_9B}
NAMES = {"moe": "Qwen3-30B-A3B-shaped (qwen3_moe)", "hybrid": "Qwen3.5-9B-shaped (qwen3_5_text)"}
GOAL_AR_OVER_FLOOR = 1.3  # AR step at batch 1 ÷ its floor
GOAL_HYBRID_CYCLE_OVER_AR = 1.15  # hybrid: speculative cycle ÷ AR step at batch 1

# --small on the CPU: cut XLA's compile time (the tests' FAST_COMPILE; tiny programs run instantly anyway).
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}


def _init_rule(path: tuple, shape: tuple, hybrid: bool) -> tuple[float, float]:
    """(shift, scale) of a parameter's random draw ``shift + scale·N(0, 1)``: kernels by fan-in, norms around
    their identity (1, or 0 for the hybrid's zero-centred norms), the DeltaNet's decay parameters as the
    checkpoints have them (A_log ≈ log U(1, 16), dt_bias ≈ 1)."""
    name = str(path[-1])
    if name == "embedding":
        return 0.0, 0.02
    if name == "A_log":
        return 1.4, 0.5
    if name == "dt_bias":
        return 1.0, 0.1
    if name == "bias":
        return 0.0, 0.02
    if name == "weight" and len(shape) == 1:  # RMSNorms (GatedRMSNorm of the DeltaNet scales by w, the rest 1 + w)
        return (0.0 if hybrid and "linear_attn" not in map(str, path) else 1.0), 0.1
    if name == "weight" and len(shape) == 3:  # depthwise conv [C, 1, W]
        return 0.0, 1.0 / np.sqrt(shape[-1])
    if len(shape) >= 2:  # Dense kernels [in, out], stacked experts [E, in, out]
        return 0.0, 1.0 / np.sqrt(shape[-2])
    return 0.0, 0.1


def random_target(cfg, dtype, seed: int = 0) -> Target:
    """A target (dense / MoE or hybrid by ``cfg``) with random weights generated on the device: the module is
    built abstractly (``nnx.eval_shape``), then each parameter is one jitted draw in ``dtype``."""
    cls = families.of(cfg).model
    model = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    draw = jax.jit(lambda key, shape, shift, scale: (shift + scale * jax.random.normal(key, shape, jnp.float32)
                                                     ).astype(dtype), static_argnums=(1,))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        shift, scale = _init_rule(path, tuple(var.shape), cfg.hybrid is not None)
        var.set_value(draw(jax.random.fold_in(key, i), tuple(var.shape), np.float32(shift), np.float32(scale)))
    left = [p for p, v in nnx.to_flat_state(nnx.state(model)) if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if left:
        raise RuntimeError(f"variables left abstract after the random draw: {left[:5]}")
    jax.block_until_ready(nnx.state(model, nnx.Param))
    return Target(model, None, f"random {cfg.family} {cfg.num_layers}L d{cfg.hidden_size}", ())


def weight_groups(model) -> dict[str, int]:
    """Parameter bytes by what a decode step reads of them: ``embedding`` (the input table: a gather),
    ``experts`` (routed expert stacks, all E of each layer) and ``dense`` (everything else)."""
    out = {"embedding": 0, "experts": 0, "dense": 0}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = var.get_value()
        n = v.size * v.dtype.itemsize
        names = [str(p) for p in path]
        key = "embedding" if names[-1] == "embedding" else "experts" if "experts" in names else "dense"
        out[key] += n
    return out


def expected_experts(e: int, k: int, tokens: int) -> float:
    """Expected distinct experts routed by ``tokens`` tokens, each routing ``k`` distinct experts uniformly."""
    return e * (1.0 - (1.0 - k / e) ** tokens)


def state_bytes(cfg, dtype_bytes: int, batch: int, ctx: float) -> dict[str, float]:
    """Bytes of the decode state a step touches: K/V of the full-attention layers up to ``ctx`` positions
    (read), and per linear-attention layer the float32 recurrent state (read + written) and conv history."""
    h = cfg.hybrid
    n_attn = cfg.num_layers if h is None else sum(not h.is_linear(i) for i in range(cfg.num_layers))
    kv = 2.0 * n_attn * batch * ctx * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    if h is None:
        return {"kv": kv, "linear_states": 0.0}
    n_lin = cfg.num_layers - n_attn
    rec = batch * h.value_heads * h.key_head_dim * h.value_head_dim * 4
    conv = batch * (h.conv_kernel - 1) * h.conv_dim * dtype_bytes
    return {"kv": kv, "linear_states": 2.0 * n_lin * (rec + conv)}


def step_floor(cfg, groups: dict, dtype_bytes: int, batch: int, tokens_per_row: int, ctx: float, bw: float,
               extra: float = 0.0) -> dict:
    """Bytes one forward of ``batch`` rows × ``tokens_per_row`` tokens reads, and that ÷ ``bw`` (ms)."""
    dense = groups["dense"] + (groups["embedding"] if cfg.tie_word_embeddings else 0)
    out = {"dense_bytes": dense}
    if cfg.num_experts:
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        per_expert = groups["experts"] / (n_moe * cfg.num_experts)
        tokens = batch * tokens_per_row
        hit = float(cfg.num_experts_per_tok) if tokens == 1 else expected_experts(
            cfg.num_experts, cfg.num_experts_per_tok, tokens)
        out.update(experts_read_per_layer=hit, expert_bytes=n_moe * hit * per_expert)
    out.update(state_bytes(cfg, dtype_bytes, batch, ctx))
    out["extra_bytes"] = extra
    out["total_bytes"] = total = (out["dense_bytes"] + out.get("expert_bytes", 0.0) + out["kv"]
                                  + out["linear_states"] + extra)
    out["floor_ms"] = 1e3 * total / bw
    return out


def _prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(batch)]


def timed(fn, repeats: int) -> dict:
    """One untimed call (compiles the programs), then ``repeats`` timed ones: decode_s ÷ cycles, median."""
    first = fn()
    runs = [fn() for _ in range(repeats)]
    per = [r.stats["decode_s"] / max(r.stats["cycles"], 1) for r in runs]
    s = runs[0].stats
    out = dict(ms=1e3 * statistics.median(per), ms_all=[1e3 * p for p in per], cycles=s["cycles"],
               new_tokens=s["new_tokens"], compile_s=first.stats["compile_s"], token_ids=runs[0].token_ids,
               first_call_s=first.stats["compile_s"] + first.stats["prefill_s"] + first.stats["decode_s"])
    if "verify_mode" in s:
        out.update(verify_mode=s["verify_mode"], tau=runs[0].tau, mean_window=s["mean_window"])
    return out


def decode_call(target, drafter, prompts, **kw):
    """The decode program alone, as a call to profile: the prefill runs here, before the trace. (Profiling whole
    ``generate`` calls spread the prefill's kernels over the steps: in the 2026-12-04 MoE profile a transpose
    and a GEMM of 0.76 calls a step were the prefill's 96 = 2 per layer.)"""
    kw = dict(kw)
    if drafter is None:
        kw.pop("block_size", None)
    job = jobs.make(target, drafter, prompts, kw.pop("max_new_tokens"), **kw)  # the timed calls' programs
    state, _ = job.programs.prefill(*job.pre_args)
    jax.block_until_ready(state)
    return lambda: jobs.fetch_view(job, job.programs.decode(job.params, state, jobs.ALL_CYCLES)[1])


def hlo_lines(profile: dict, out_dir: str) -> dict[str, str]:
    """The optimized HLO of the program just run (the AR call's prefill and decode, written to ``out_dir``) and,
    for each top kernel of ``profile`` that XLA made, its defining instruction (output shape and operands: what
    a fusion named only ``loop_pad_fusion_140`` does), printed and returned by kernel name."""
    programs = list(engine_programs.CACHE.values())[-1]  # the AR b1 call's (inserted last)
    text = programs.decode.as_text()
    Path(out_dir, "decode.hlo.txt").write_text(text)
    Path(out_dir, "prefill.hlo.txt").write_text(programs.prefill.as_text())
    defined = {}  # instruction name → its line
    for line in text.splitlines():
        head = line.strip().removeprefix("ROOT ")
        if head.startswith("%") and " = " in head:
            defined.setdefault(head[1:head.index(" = ")], line.strip()[:400])
    found = {k["name"]: defined[k["name"]] for lane in profile.values() for k in lane["top"] if k["name"] in defined}
    for name, line in found.items():
        print(f"    {name}: {line}", flush=True)
    return found


def moe_paths(cfg, dtype, tokens: list[int]) -> dict:
    """Which expert computation a call of N tokens takes on this backend (the kernel or why not)."""
    reason = getattr(moe, "kernel_unsupported_reason", None)
    out = {}
    for n in tokens:
        d, e, f, k = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        s = jax.ShapeDtypeStruct
        args = (s((n, d), dtype), s((n, k), dtype), s((n, k), jnp.int32), s((e, d, f), dtype), s((e, d, f), dtype),
                s((e, f, d), dtype))
        why = reason(jax.default_backend(), *args) if reason else "moe.kernel_unsupported_reason not available"
        out[f"tokens_{n}"] = "kernel" if why is None else (
            "gathered" if n * k <= e else "all experts") + f" (XLA: {why})"
    return out


def family_case(kind: str, hf: dict, args, bw: float, dtype) -> dict:
    cfg = model_config_from_hf(hf, f"{kind} config")
    dbytes = jnp.dtype(dtype).itemsize
    t0 = time.perf_counter()
    target = random_target(cfg, dtype, seed=0)
    init_s = time.perf_counter() - t0
    drafter = random_drafter(target, block_size=args.block_size, num_layers=args.drafter_layers)
    if args.draft_vocab:
        drafter = restrict_draft_vocab(drafter, target, np.arange(args.draft_vocab))
    jax.block_until_ready(nnx.state(drafter.model))
    groups = weight_groups(target.model)
    res = dict(name=NAMES[kind], config=dataclasses.asdict(cfg), params=param_bytes(target.model) // dbytes,
               weight_bytes=groups, drafter_params=param_bytes(drafter.model) // dbytes,
               drafter_layers=args.drafter_layers, block_size=args.block_size, init_s=init_s,
               draft_vocab=args.draft_vocab or cfg.vocab_size,
               prompt_len=args.prompt_len, max_new=args.max_new, repeats=args.repeats)
    if cfg.num_experts:
        res["expert_path"] = moe_paths(cfg, dtype, sorted({1, *args.batches, args.block_size}))
    print(f"[{kind}] {res['params'] / 1e6:.1f} M params, init {init_s:.1f} s; drafter "
          f"{res['drafter_params'] / 1e6:.1f} M", flush=True)
    ctx = args.prompt_len + args.max_new / 2  # mean context over the decode
    kw = dict(max_new_tokens=args.max_new, stop_token_ids=[], tuning=args.tuning)
    for b in args.batches:
        prompts = _prompts(cfg.vocab_size, b, args.prompt_len)
        t = timed(lambda: generate(target, prompts, **kw), args.repeats)
        floor = step_floor(cfg, groups, dbytes, b, 1, ctx, bw)
        ids = t.pop("token_ids")
        if b == 1:
            ar1_ids = ids[0]
        res[f"ar_b{b}"] = dict(t, step_ms=t["ms"], floor=floor, floor_ms=floor["floor_ms"],
                               over_floor=t["ms"] / floor["floor_ms"])
        print(f"[{kind}] AR b{b}: {t['ms']:.3f} ms/step ({t['cycles']} steps), floor {floor['floor_ms']:.3f} ms "
              f"→ {t['ms'] / floor['floor_ms']:.2f}× (compile {t['compile_s']:.1f} s)", flush=True)
        if args.profile and b == 1:
            prof = device_profile(decode_call(target, None, prompts, block_size=1, **kw),
                                  f"{args.profile}/{kind}_ar_b1", per=t["cycles"])
            res["ar_b1"]["profile_per_step"] = prof
            print_profile(prof, f"[{kind}] AR b1 per step")
            res["ar_b1"]["profile_hlo"] = hlo_lines(prof, f"{args.profile}/{kind}_ar_b1")
    prompts = _prompts(cfg.vocab_size, 1, args.prompt_len)
    t = timed(lambda: speculative_generate(target, drafter, prompts, block_size=args.block_size,
                                           verify_mode="static", **kw), args.repeats)
    # the lm_head rows the draft logits read (again: the target's verify reads them too)
    lm_head = cfg.hidden_size * (args.draft_vocab or cfg.vocab_size) * dbytes
    drafter_bytes = param_bytes(drafter.model)
    floor = step_floor(cfg, groups, dbytes, 1, args.block_size, ctx, bw, extra=drafter_bytes + lm_head)
    ar1 = res["ar_b1"]["step_ms"]
    spec_ids = t.pop("token_ids")[0]
    # greedy speculative = greedy AR up to bf16 rounding (a 16-token verify and 1-token steps round differently)
    agree = float(np.mean([x == y for x, y in zip(ar1_ids, spec_ids)]))
    if args.profile:
        res["spec_b1_profile_per_cycle"] = prof = device_profile(
            decode_call(target, drafter, prompts, block_size=args.block_size, verify_mode="static", **kw),
            f"{args.profile}/{kind}_spec_b1", per=t["cycles"])
        print_profile(prof, f"[{kind}] spec b1 per cycle")
    res["spec_b1"] = dict(t, cycle_ms=t["ms"], cycle_floor=floor, cycle_floor_ms=floor["floor_ms"],
                          cycle_over_ar_b1=t["ms"] / ar1, identical_to_ar=spec_ids == ar1_ids,
                          token_agreement_with_ar=agree)
    print(f"[{kind}] spec b1: {t['ms']:.3f} ms/cycle ({t['cycles']} cycles, tau {t['tau']:.2f}, "
          f"{t['verify_mode']}) → {t['ms'] / ar1:.2f}× the AR step; cycle floor {floor['floor_ms']:.3f} ms; "
          f"tokens = AR's: {spec_ids == ar1_ids} ({agree:.2f}) (compile {t['compile_s']:.1f} s)", flush=True)
    return res


def free() -> None:
    """Drop the compiled programs (the models went with family_case's frame) before the next model is built."""
    engine_programs.CACHE.clear()
    jax.clear_caches()
    gc.collect()


def verdict(value: float, goal: float) -> str:
    return f"goal ≤ {goal}: {'met' if value <= goal else 'NOT met'}"


def table(results: dict, batches: list[int]) -> str:
    rows = ["| model | " + " | ".join(f"AR b{b} ms / floor ms / ×floor" for b in batches)
            + " | spec cycle b1 ms | cycle ÷ AR b1 |", "|---" * (3 + len(batches)) + "|"]
    for kind, r in results.items():
        cells = []
        for b in batches:
            a = r[f"ar_b{b}"]
            goal = f" ({verdict(a['over_floor'], GOAL_AR_OVER_FLOOR)})" if b == 1 else ""
            cells.append(f"{a['step_ms']:.3f} / {a['floor_ms']:.3f} / {a['over_floor']:.2f}×{goal}")
        s = r["spec_b1"]
        ratio = s["cycle_over_ar_b1"]
        goal = verdict(ratio, GOAL_HYBRID_CYCLE_OVER_AR) if kind == "hybrid" else "no goal"
        rows.append(f"| {r['name']} | " + " | ".join(cells) + f" | {s['cycle_ms']:.3f} | {ratio:.2f}× ({goal}) |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="moe,hybrid", help="comma-separated: moe, hybrid (in this order)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--max-new", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft over this many token ids (the drafter's LM head reads only their rows; 0: all)")
    ap.add_argument("--bandwidth-gib", type=float, help="size of the copy-bandwidth probe (default 4; --small 0.0625)")
    ap.add_argument("--out", default="bench_families.json")
    ap.add_argument("--profile", metavar="DIR", help="also profile one AR b1 decode and one speculative decode "
                    "(the decode programs alone; JAX profiler traces under DIR): device time per step by kernel, in the JSON and printed, with the AR "
                    "program's optimized HLO (DIR/<model>_ar_b1/*.hlo.txt) and each top XLA kernel's instruction")
    ap.add_argument("--delta-rule", choices=["kernel", "xla"], default="kernel",
                    help="hybrid short blocks: the GPU gated-delta-rule kernel (the library's default) or the XLA path")
    ap.add_argument("--commit")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if 1 not in args.batches:
        args.batches.insert(0, 1)  # the floor goal and the cycle ratio are at batch 1
    args.prompt_len = args.prompt_len or (16 if args.small else 128)
    args.max_new = args.max_new or (16 if args.small else 128)
    args.repeats = args.repeats or (1 if args.small else 3)
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    bad = [k for k in kinds if k not in FULL]
    if bad:
        ap.error(f"unknown models {bad} (expected moe, hybrid)")
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("dflash_jax").setLevel(logging.INFO)  # kernel fallbacks, if any, are worth seeing
    args.tuning = Tuning().replace(delta_rule_kernel=args.delta_rule == "kernel")  # "xla": every block on jnp
    if args.small and jax.default_backend() == "cpu":
        args.tuning = args.tuning.with_compiler_options(CPU_FAST_COMPILE)

    dev = jax.devices()[0]
    info = dict(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S"), host=platform.node(), small=args.small,
                xla_flags=os.environ.get("XLA_FLAGS", ""), dtype="bfloat16", delta_rule=args.delta_rule,
                commit=args.commit or source_commit(),
                setting=dict(batches=args.batches, prompt_len=args.prompt_len, max_new=args.max_new,
                             repeats=args.repeats, block_size=args.block_size, drafter_layers=args.drafter_layers,
                             draft_vocab=args.draft_vocab,
                             verify_mode="static", attention_impl="auto"),
                floor_note="bytes read per step ÷ copy bandwidth; input embedding excluded (gather); MoE: K "
                           "experts per layer for one token, E·(1−(1−K/E)^N) expected distinct experts for N tokens "
                           "otherwise; K/V at the mean decode context; hybrid recurrent states read + written")
    print(json.dumps(info), flush=True)
    t0 = time.perf_counter()
    gib = args.bandwidth_gib or (1 / 16 if args.small else 4.0)
    bw = copy_bandwidth(nbytes=int(gib * (1 << 30)), reps=5 if args.small else 20)
    info["copy_bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s ({time.perf_counter() - t0:.1f} s)", flush=True)
    out = {"info": info, "models": {}}
    dtype = jnp.bfloat16
    for kind in kinds:
        t1 = time.perf_counter()
        hf = SMALL[kind] if args.small else FULL[kind]
        res = family_case(kind, hf, args, bw, dtype)
        res["wall_s"] = time.perf_counter() - t1
        res["goals"] = {"ar_b1_over_floor": verdict(res["ar_b1"]["over_floor"], GOAL_AR_OVER_FLOOR)}
        if kind == "hybrid":
            res["goals"]["cycle_over_ar_b1"] = verdict(res["spec_b1"]["cycle_over_ar_b1"], GOAL_HYBRID_CYCLE_OVER_AR)
        stats = dev.memory_stats() or {}
        res["peak_device_bytes"] = stats.get("peak_bytes_in_use")
        out["models"][kind] = res
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
        free()
        stats = dev.memory_stats() or {}
        res["device_bytes_after_free"] = stats.get("bytes_in_use")
        print(f"[{kind}] done in {res['wall_s']:.0f} s; device bytes in use after freeing: "
              f"{res['device_bytes_after_free']}", flush=True)
    info["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(table(out["models"], args.batches), flush=True)
    print(f"total {info['wall_s']:.0f} s → {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
