r"""How a quantized target departs from the unquantized one, and what it costs or saves: an embedded pair loaded with
``quantization=None`` (the reference), ``"int8"`` and ``"fp8"``, on the project's mixed prompts
(``data/latency_prompts.json``).

Per quantization: the target's weight bytes; greedy autoregressive text against the reference's — the first
position where a row departs from it (the mean over rows, and how many rows never depart within ``--max-new``),
and the positions equal before that; the teacher-forced top-1 agreement (the quantized target's argmax on the
reference's own continuation, position by position: not thrown off by an early divergence); τ of the pair's
drafter against the quantized target, and whether its speculative tokens equal its own autoregressive ones
(they must: lossless against the target it runs); AR and speculative tokens/s (the fastest of ``--rounds``
timed calls after an untimed one).

    python benchmarks/bench_quantized.py --limit 8 --max-new 64 --out /tmp/quantized.json            # CPU

The JSON is rewritten after each quantization, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import source_commit  # noqa: E402
from dflash_jax import generate, load_pair, speculative_generate  # noqa: E402

PROMPTS = Path(__file__).parent / "data" / "latency_prompts.json"


def timed(fn, rounds: int):
    out = fn()  # compiles
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def teacher_forced_argmax(target, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The target's argmax at each position of ``continuations`` given the prompt and the continuation before it
    (one forward over the rows right-padded to one length: causal, so padding changes no earlier position)."""
    seqs = [p + c for p, c in zip(prompts, continuations)]
    t = max(map(len, seqs))
    ids = jnp.asarray([s + [0] * (t - len(s)) for s in seqs], jnp.int32)

    @nnx.jit
    def forward(model, ids):
        h, _, _ = model(ids, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), ids.shape), None, prefill=True)
        return jnp.argmax(model.logits(h), axis=-1)

    top = np.asarray(forward(target.model, ids))
    return [top[i, len(p) - 1: len(p) - 1 + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, continuations))]


def departure(rows: list[list[int]], ref: list[list[int]]) -> dict:
    first = []
    for a, b in zip(rows, ref):
        n = min(len(a), len(b))
        first.append(next((i for i in range(n) if a[i] != b[i]), n))
    return dict(first_divergence=first, mean_first_divergence=float(np.mean(first)),
                rows_never_departing=sum(f == min(len(a), len(b)) for f, a, b in zip(first, rows, ref)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--quantizations", default="int8,fp8")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the pair's)")
    ap.add_argument("--limit", type=int, default=8, help="the first N prompts of the set (one batch)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    prompts = [p["ids"] for p in json.loads(PROMPTS.read_text())][: args.limit]
    kw = dict(max_new_tokens=args.max_new)
    dtype = {"dtype": args.dtype} if args.dtype else {}
    commit = source_commit()
    result = dict(command=" ".join(sys.argv), date=datetime.date.today().isoformat(), commit=commit,
                  device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                  host=platform.node(), pair=args.pair, prompts=len(prompts), max_new=args.max_new, runs={})
    reference = None
    for q in ["none"] + args.quantizations.split(","):
        target, drafter = load_pair(args.pair, quantization=q, **dtype)
        ar, ar_s = timed(lambda: generate(target, prompts, **kw), args.rounds)
        sp, sp_s = timed(lambda: speculative_generate(target, drafter, prompts, **kw), args.rounds)
        n_ar, n_sp = sum(map(len, ar.token_ids)), sum(map(len, sp.token_ids))
        run = dict(target=target.name, weight_bytes=target.weight_bytes, ar_tokens_per_s=n_ar / ar_s,
                   speculative_tokens_per_s=n_sp / sp_s, tau=sp.tau, verify_mode=sp.stats["verify_mode"],
                   speculative_equals_its_ar=sp.token_ids == ar.token_ids)
        if reference is None:
            reference = ar.token_ids
        else:
            forced = teacher_forced_argmax(target, prompts, reference)
            agree = [sum(int(a == b) for a, b in zip(f, r)) for f, r in zip(forced, reference)]
            run.update(departure(ar.token_ids, reference),
                       teacher_forced_agreement=sum(agree) / sum(map(len, reference)))
        result["runs"][q] = run
        args.out.write_text(json.dumps(result, indent=1))
        extra = "" if q == "none" else (f"  first divergence {run['mean_first_divergence']:.1f} (rows never departing "
                                        f"{run['rows_never_departing']}/{len(prompts)}), teacher-forced agreement "
                                        f"{run['teacher_forced_agreement']:.1%}")
        print(f"{q:5s} {run['weight_bytes'] / 2**20:7.1f} MiB  AR {run['ar_tokens_per_s']:7.1f} tok/s  speculative "
              f"{run['speculative_tokens_per_s']:7.1f} tok/s  τ {run['tau']:.2f}  lossless "
              f"{run['speculative_equals_its_ar']}{extra}", flush=True)
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
