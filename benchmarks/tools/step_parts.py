r"""Where the time of one drafted decode step goes, on a real-size shape: each part of a static-verify cycle timed
in a program of its own, next to the floors the HBM bandwidth and the peak bf16 FLOP/s put under it.

A Qwen3-8B-shaped target (``--shape 8b``) or a Qwen3-30B-A3B-shaped MoE target (``--shape moe``), random bf16 weights
(``common.random_target``), and a random DFlash drafter of the target's shape (``--drafter-layers``). Every row's
caches hold ``--context`` tokens (a prefill of random ids); the parts of one cycle at batch B, block L:

1. draft trunk    the drafter over [anchor, MASK × (L−1)] against its context cache (``loop.draft_hidden``)
2. draft LM head  the drafter's logits over the B × G draft hidden states (G = L − 1) + their argmax
3. verify         the target over the B × L block (its K/V written, the drafter's layers captured), its LM head
                  over B × L and the argmax of those logits (``accept_greedy``'s one pass over [B, L, V])
4. accept+commit  the rest of greedy acceptance (``accept_greedy_ids``) and ``loop.commit``
5. cache writes   the drafter's context K/V of the B × L captured features (``drafter.materialize``)
6. static cycle   ``loop.cycle`` with the static LoopSpec: what 1–5 should add up to
7. AR step        the target over the anchor alone + LM head + argmax + commit (``generate``'s step)

Each part runs ``--steps`` times in one ``lax.while_loop`` (a call's dispatch spread over its steps, as
``dflash_jax.engine.calibrate`` times the cost table), positions reset after each step (``calibrate.same_positions``) and
the state donated, so the same cache slots are written in place every step; ``--repeats`` calls after one
warm-up call, median. Floors: bytes = the weights a part reads (parameter bytes of its modules; a MoE layer's
experts as the share that B·T tokens routed uniformly touch) + the K/V it attends at that context (+ what it
writes, for the cache writes) ÷ HBM bandwidth; compute = 2 × parameters per token × tokens + attention ÷ peak
dense bf16 FLOP/s (no floor on an unknown device or the CPU, unless ``--hbm-gbps`` and ``--peak-tflops``).

    # GPU
    python benchmarks/tools/step_parts.py --shape 8b --batches 64 --out $OUT/parts_8b_b64.json
    python benchmarks/tools/step_parts.py --shape moe --batches 64 --out $OUT/parts_moe_b64.json
    # CPU smoke test (a tiny shape; its times mean nothing)
    python benchmarks/tools/step_parts.py --small --batches 2 --steps 2 --repeats 1 --out /tmp/parts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (dflash_jax)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (common, bench_compact_scaled)

from bench_compact_scaled import CPU_FAST_COMPILE, SHAPES  # noqa: E402
from common import random_target, source_commit  # noqa: E402
from dflash_jax import drafters, random_drafter  # noqa: E402
from dflash_jax.decode import loop, sampling  # noqa: E402
from dflash_jax.engine import calibrate  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.engine import programs as progs  # noqa: E402
from dflash_jax.models.split import merge_model  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402

PARTS = ("draft trunk", "draft LM head", "verify", "accept+commit", "cache writes", "static cycle", "AR step")
CYCLE_PARTS = PARTS[:5]  # what the static cycle is made of
# (substring of jax's device_kind, HBM bytes/s, peak dense bf16 FLOP/s); H200 first: its name holds no "H100"
DEVICES = (("H200", 4.8e12, 989e12), ("H100", 3.35e12, 989e12))  # H100: the SXM part's figures
BIG = 3e38  # no float value a part computes exceeds it: a comparison XLA cannot fold that never fires


def count(*modules, experts: bool | None = None) -> int:
    """Parameters of ``modules``; ``experts`` True / False: only / all but a MoE layer's stacked experts."""
    n = 0
    for m in modules:
        for path, x in nnx.to_flat_state(nnx.state(m, nnx.Param)):
            if experts is None or experts == ("experts" in path):
                n += int(np.prod(x.shape))
    return n


def itemsize(model) -> int:
    """Bytes per weight (and per cached K/V value: the caches take the model's dtype)."""
    return jax.tree.leaves(nnx.state(model.embed_tokens, nnx.Param))[0].dtype.itemsize


def target_weights(model, tokens: int) -> tuple[float, float]:
    """(bytes of the target's layers + final norm + LM head that ``tokens`` tokens read, parameters each token
    multiplies by). Of a MoE layer's E experts a token uses k (top-k routing), and ``tokens`` uniformly routed
    tokens touch E·(1 − (1 − k/E)^tokens) of them."""
    cfg = model.config
    dense = count(model.layers, model.norm, model.lm_head or model.embed_tokens, experts=False)
    experts, share, touched = count(model.layers, experts=True), 0.0, 0.0
    if experts:
        k_of_e = cfg.num_experts_per_tok / cfg.num_experts
        share, touched = k_of_e, 1.0 - (1.0 - k_of_e) ** tokens
    return (dense + experts * touched) * itemsize(model), dense + experts * share


def floors(target, drafter, b: int, l: int, c: int) -> dict[str, tuple[float, float]]:
    """part → (bytes it must move, FLOPs it must do) at B = ``b`` rows, L = ``l``, C = ``c`` context tokens."""
    t, d = target.model, drafter.model
    tc, dc = t.config, d.config.layers
    g, item = l - 1, itemsize(t)
    kv_t = tc.num_layers * 2 * tc.num_kv_heads * tc.head_dim * item  # target K/V bytes per cached token
    kv_d = dc.num_layers * 2 * dc.num_kv_heads * dc.head_dim * item  # drafter's
    attn = lambda cfg, layers, tokens, keys: 4 * b * tokens * keys * cfg.num_heads * cfg.head_dim * layers  # noqa
    # The f32 logits a head writes and its argmax reads back (B·T·V·8 bytes) are left out: a head fused with its
    # argmax would not move them. Embedding rows gathered (B·T·D) are left out too.
    # trunk: every drafter layer (its block K/V too) over B × L queries, attending C context + L block keys
    trunk = count(d.layers, d.norm)
    parts = {"draft trunk": (trunk * item + b * c * kv_d, 2 * trunk * b * l + attn(dc, dc.num_layers, l, c + l))}
    head = d.draft_head[...].size if d.draft_head is not None else tc.vocab_size * tc.hidden_size  # (not a Param)
    parts["draft LM head"] = (head * item, 2 * head * b * g)
    w_bytes, w_per_token = target_weights(t, b * l)
    parts["verify"] = (w_bytes + b * (c + l) * kv_t, 2 * w_per_token * b * l + attn(tc, tc.num_layers, l, c + l))
    parts["accept+commit"] = (2 * b * l * 4, 0.0)  # reads the block and the target's choices (int32)
    # cache writes: fc + hidden_norm, each layer's K/V projections; reads the features, writes the K/V
    ctx = count(d.fc, d.hidden_norm, *(m for x in d.layers for m in (x.self_attn.k_proj, x.self_attn.v_proj,
                                                                      x.self_attn.k_norm)))
    features = d.config.num_features * tc.hidden_size
    parts["cache writes"] = (ctx * item + b * l * (features * item + kv_d), 2 * ctx * b * l)
    parts["static cycle"] = tuple(sum(parts[p][i] for p in CYCLE_PARTS) for i in range(2))  # its parts' sums
    w_bytes, w_per_token = target_weights(t, b)
    parts["AR step"] = (w_bytes + b * (c + 1) * kv_t, 2 * w_per_token * b + attn(tc, tc.num_layers, 1, c + 1))
    return parts


def _nudge(state, flag):
    """The state with each row's anchor moved by ``flag`` [B] (never set): the next step's input depends on
    this step's output, so XLA can neither drop the part nor hoist it out of the loop as loop-invariant."""
    return dataclasses.replace(state, anchor=state.anchor + flag.astype(state.anchor.dtype))


def _vary(x, flag):
    """``x`` [B, …] with its first element per row rewritten through ``flag`` [B] (never set), in place: a part
    whose input is carried (not the state) depends on its previous step's output at the cost of B elements."""
    corner = (0,) * x.ndim
    first = jax.lax.slice(x, corner, (x.shape[0],) + (1,) * (x.ndim - 1))
    return jax.lax.dynamic_update_slice(x, jnp.where(flag.reshape(first.shape), 0, first).astype(x.dtype), corner)


def parts(job) -> dict:
    """part → (``step(target, drafter, state, x)`` → (state, x), the first x: what the part reads besides the
    state, [B, …])."""
    spec, cfg = job.spec, job.drafter.config
    l, g, b, mask = spec.block_size, spec.block_size - 1, len(job.ids), cfg.mask_token_id
    ar_spec = dataclasses.replace(spec, block_size=1, capture=())  # generate's loop: L = 1, nothing captured
    key = jax.random.split(jax.random.key(0), 3)
    drafts = jax.random.randint(key[0], (b, g), 0, job.target.config.vocab_size, jnp.int32)  # [B, G]
    dtype = job.target.model.dtype
    hidden = jax.random.normal(key[1], (b, g, cfg.layers.hidden_size), dtype)  # [B, G, D]
    feats = jax.random.normal(key[2], (b, l, cfg.num_features * job.target.config.hidden_size), dtype)  # [B, L, F]
    above = lambda x: jnp.any((x > BIG).reshape(x.shape[0], -1), axis=1)  # noqa: E731 — [B] flags, never set

    def trunk(t, d, s, x):
        flag = above(loop.draft_hidden(t, d, s, spec, mask))  # hidden [B, G, D]
        # the context cache too, as in a cycle (where materialize rewrites it): nothing read from it is invariant
        cache = jax.tree.map(lambda kv: _vary(kv, flag), s.draft_cache)
        return _nudge(dataclasses.replace(s, draft_cache=cache), flag), x

    def head(t, d, s, h):
        ids = jnp.argmax(drafters.kind_of(d).draft_logits(h, t), axis=-1)  # [B, G, Vd] → [B, G]
        return s, _vary(h, jnp.any(ids < 0, axis=1))

    def verify(t, d, s, x):
        block = jnp.concatenate([s.anchor[:, None], x], axis=1)  # [B, L]
        h, f, cache = t(block, loop.block_positions(s, l), s.target_cache, capture=spec.capture,
                        kernels=spec.kernels, defer=True)  # f: captured features [B, L, F]
        choice = jnp.argmax(t.logits(h), axis=-1).astype(jnp.int32)  # [B, L, V] → [B, L]
        s = dataclasses.replace(s, target_cache=cache)
        return _nudge(s, above(f) | jnp.any(choice < 0, axis=1)), x

    def accept(t, d, s, x):
        block = jnp.concatenate([s.anchor[:, None], x[0]], axis=1)  # [B, L]
        a, last, _ = sampling.accept_greedy_ids(block, x[1])  # the drafts are x[0]: only x[1] can vary
        s = loop.commit(s, sampling.committed_tokens(block, a, last), a + 1)
        return s, (x[0], _vary(x[1], s.anchor < 0))

    def writes(t, d, s, f):
        cache = d.materialize(s.draft_cache, f, loop.block_positions(s, l))
        written = cache.k[-1][jnp.arange(b), s.anchor_pos, 0, 0]  # a slot this step wrote, per row
        return dataclasses.replace(s, draft_cache=cache), _vary(f, written > BIG)

    # the target's choices [B, L]: the first half of the drafts match
    choice = jnp.concatenate([drafts[:, : g // 2], drafts[:, g // 2:] + 1, drafts[:, :1]], axis=1)
    return {"draft trunk": (trunk, jnp.zeros((), jnp.int32)), "draft LM head": (head, hidden),
            "verify": (verify, drafts), "accept+commit": (accept, (drafts, choice)), "cache writes": (writes, feats),
            "static cycle": (lambda t, d, s, x: (loop.cycle(t, d, s, spec, mask), x), jnp.zeros((), jnp.int32)),
            "AR step": (lambda t, d, s, x: (loop.cycle(t, None, s, ar_spec, mask), x), jnp.zeros((), jnp.int32))}


def program(job, step, state, x):
    """``fn(params, state, x, n)``: ``step`` run n times in one ``while_loop``, state and x donated; compiled."""
    graphdefs = (job.target.split().static, job.drafter.split().static)

    def steps(params, state, x, n):
        def body(c):
            s, x, i = c
            out, x = step(merge_model(graphdefs[0], params[0]), merge_model(graphdefs[1], params[1]), s, x)
            return calibrate.same_positions(out, s), x, i + 1

        return jax.lax.while_loop(lambda c: c[2] < n, body, (state, x, jnp.zeros((), jnp.int32)))[:2]

    lowered = jax.jit(steps, donate_argnums=(1, 2)).lower(job.params, state, x, np.int32(1))
    return progs.compile_steps(lowered, job.spec, state)  # with the decode loop's compile options


def timed(fn, params, state, x, steps: int, repeats: int):
    """(median ms a step over ``repeats`` calls of ``steps`` steps after one warm-up call, the state after)."""
    state, x = jax.block_until_ready(fn(params, state, x, np.int32(steps)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, x = jax.block_until_ready(fn(params, state, x, np.int32(steps)))
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times) * 1e3), state


def device_rates(args) -> tuple[float | None, float | None]:
    """(HBM bytes/s, peak FLOP/s): the overrides, else the table's entry for this device (None: no floors)."""
    kind = jax.devices()[0].device_kind
    row = next((r for r in DEVICES if r[0] in kind), None) if jax.default_backend() == "gpu" else None
    hbm = args.hbm_gbps * 1e9 if args.hbm_gbps else (row[1] if row else None)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (row[2] if row else None)
    return hbm, peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="8b: Qwen3-8B; moe: Qwen3-30B-A3B")
    ap.add_argument("--small", action="store_true", help="a tiny version of the shape (a CPU smoke test)")
    ap.add_argument("--batches", type=int, default=64, help="B: rows")
    ap.add_argument("--context", type=int, default=192, help="C: tokens in every row's caches")
    ap.add_argument("--block-size", type=int, default=16, help="L: tokens a cycle verifies")
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed call")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per part (median)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hbm-gbps", type=float, help="HBM bandwidth in GB/s (default: the device table's)")
    ap.add_argument("--peak-tflops", type=float, help="peak dense FLOP/s in TFLOP/s (default: the device table's)")
    ap.add_argument("--out", type=Path, help="a JSON of every number")
    args = ap.parse_args(argv)
    name, full, small = SHAPES[args.shape]
    tuning = Tuning()
    if args.small and jax.default_backend() == "cpu":
        tuning = tuning.with_compiler_options(CPU_FAST_COMPILE)
    b, l, c = args.batches, args.block_size, args.context
    target = random_target(small if args.small else full, jnp.dtype(args.dtype))
    drafter = random_drafter(target, num_layers=args.drafter_layers, block_size=l)
    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, (b, c)).tolist()
    # decode=False: the prefill program only; 4 L new tokens leave room for the block past the anchor
    job = jobs.make(target, drafter, ids, 4 * l, block_size=l, stop_token_ids=[], verify_mode="static",
                    tuning=tuning, decode=False)
    state, _ = job.programs.prefill(*job.pre_args)
    ms = {}
    for part, (step, x) in parts(job).items():
        x = jax.tree.map(jnp.copy, x)  # its own buffers: each program donates its x
        t0 = time.perf_counter()
        fn = program(job, step, state, x)
        compile_s = time.perf_counter() - t0
        ms[part], state = timed(fn, job.params, state, x, args.steps, args.repeats)
        print(f"  {part:14s} {ms[part]:9.3f} ms  (compiled in {compile_s:.1f} s)", file=sys.stderr, flush=True)
    hbm, peak = device_rates(args)
    cycle = ms["static cycle"]
    rows = {}
    for part, (nb, flops) in floors(target, drafter, b, l, c).items():
        bf = nb / hbm * 1e3 if hbm else None
        cf = flops / peak * 1e3 if peak else None
        floor = max(f for f in (bf, cf, 0.0) if f is not None)
        rows[part] = dict(ms=ms[part], pct_of_cycle=100 * ms[part] / cycle, bytes=nb, flops=flops,
                          bytes_floor_ms=bf, compute_floor_ms=cf, ratio=ms[part] / floor if floor else None)
    summed = sum(ms[p] for p in CYCLE_PARTS)
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    kind = jax.devices()[0].device_kind
    print(f"\n{name}{' (small)' if args.small else ''}, {args.dtype}, B {b}, L {l}, C {c}, drafter "
          f"{args.drafter_layers} layers, {kind}\n")
    print("| part | ms | % of static cycle | bytes floor ms | compute floor ms | measured ÷ max(floor) |")
    print("|---|---:|---:|---:|---:|---:|")
    for part, r in rows.items():
        print(f"| {part} | {r['ms']:.3f} | {r['pct_of_cycle']:.1f} | {fmt(r['bytes_floor_ms'], '.3f')} | "
              f"{fmt(r['compute_floor_ms'], '.3f')} | {fmt(r['ratio'], '.2f')} |")
    print(f"| parts 1–5 summed | {summed:.3f} | {100 * summed / cycle:.1f} | | | |")
    if args.out:
        commit = source_commit()
        result = dict(command=" ".join(["python", "benchmarks/tools/step_parts.py", *(sys.argv[1:] if argv is None
                                                                                          else argv)]),
                      date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit, device_kind=kind,
                      jax_version=jax.__version__, shape=f"small-{name}" if args.small else name,
                      args={k: str(v) for k, v in vars(args).items()}, hbm_bytes_per_s=hbm, peak_flops=peak,
                      parts=rows, sum_of_parts_1_5_ms=summed, capacity=job.host.capacity)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
