"""Experiment: the DFlash drafter's LM head over a reduced draft vocabulary on a CPU (`make demo`'s batch).

On a 2-core CPU the drafts' LM head reads the whole 49,152 × 576 embedding (113 MB in float32) every drafted step,
however few drafts are verified — ~15 ms of a ~140 ms step at batch 3. Restricting the drafts to the N most
frequent tokens of ShareGPT's answers (tokenised with the target's tokenizer; not the evaluation prompts) reads
N / 49,152 of it; drafts outside the set can no longer be proposed, so τ falls somewhat. This script measures
both effects on `make demo`'s three prompts (96 new tokens, compact verify, the shipped CPU cost table): warm
decode time of AR, the full head and each reduced head, interleaved ``--repeats`` times, medians. The reduced head
is patched in (``DFlashDrafter.draft_logits`` returns the full vocabulary with −1e30 outside the set, so every
path stays exact); it is an experiment, not a library feature.

    python benchmarks/exp_draft_vocab.py --sizes 8192,16384 --out draft_vocab_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import generate, generation, load_pair, speculative_generate
from dflash_jax.cli import DEMO_PROMPTS
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.train.data import iter_json_array, sharegpt_path


def token_ranking(tokenizer, conversations: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids by frequency in the answers of the first ``conversations`` ShareGPT conversations, and counts."""
    counts: collections.Counter = collections.Counter()
    for conv in itertools.islice(iter_json_array(sharegpt_path()), conversations):
        for turn in conv.get("conversations") or []:
            if turn.get("from") == "gpt":
                counts.update(tokenizer.encode(str(turn.get("value", ""))[:4000], chat=False))
    ranked = counts.most_common()
    return np.array([i for i, _ in ranked], np.int32), np.array([c for _, c in ranked], np.int64)


def reduced_head(target, ids: np.ndarray):
    """A ``draft_logits`` over ``ids`` only (−1e30 elsewhere)."""
    m = target.model
    w = m.embed_tokens.embedding[...] if m.lm_head is None else m.lm_head.kernel[...].T  # [V, D]
    rows, cols, vocab = jnp.asarray(np.asarray(w)[ids]), jnp.asarray(ids), w.shape[0]

    def draft_logits(self, hidden, target):
        sub = jnp.einsum("...d,vd->...v", hidden, rows, preferred_element_type=jnp.float32)
        return jnp.full(hidden.shape[:-1] + (vocab,), -1e30, jnp.float32).at[..., cols].set(sub)
    return draft_logits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8192,16384", help="draft vocabulary sizes")
    ap.add_argument("--conversations", type=int, default=6000, help="ShareGPT conversations to count tokens in")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="draft_vocab_cpu.json")
    args = ap.parse_args()
    target, drafter = load_pair("smollm2-135m")
    ids, counts = token_ranking(target.tokenizer, args.conversations)
    total = int(counts.sum())
    full_head = DFlashDrafter.draft_logits
    heads = {"ar": None, "full": full_head}
    coverage = {}
    for n in (int(x) for x in args.sizes.split(",")):
        heads[f"top{n}"] = reduced_head(target, ids[:n])
        coverage[n] = float(counts[:n].sum() / total)
        print(f"top {n}: {coverage[n]:.3f} of {total} answer tokens", flush=True)

    def run(mode):
        if mode == "ar":
            return generate(target, DEMO_PROMPTS, max_new_tokens=args.max_new)
        return speculative_generate(target, drafter, DEMO_PROMPTS, max_new_tokens=args.max_new)

    programs = {}
    for mode, head in heads.items():  # compile, then run once untimed (a CPU program's first run costs more)
        DFlashDrafter.draft_logits = head or full_head
        generation._PROGRAMS.clear()
        run(mode), run(mode)
        programs[mode] = dict(generation._PROGRAMS)
    times: dict = {mode: [] for mode in heads}
    taus: dict = {}
    for _ in range(args.repeats):
        for mode, head in heads.items():
            DFlashDrafter.draft_logits = head or full_head
            generation._PROGRAMS.clear()
            generation._PROGRAMS.update(programs[mode])
            out = run(mode)
            times[mode].append(out.stats["decode_s"])
            taus[mode] = out.tau
        print({m: [round(t, 3) for t in ts] for m, ts in times.items()}, flush=True)
    DFlashDrafter.draft_logits = full_head
    ar = statistics.median(times["ar"])
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=jax.devices()[0].device_kind,
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
                  answer_tokens=total, coverage=coverage,
                  modes={m: dict(decode_s=times[m], median_s=statistics.median(times[m]), tau=taus[m],
                                 vs_ar=ar / statistics.median(times[m])) for m in heads})
    for m, r in result["modes"].items():
        print(f"{m:10s} decode {r['median_s']:.3f} s  tau {r['tau']:.3f}  vs AR {r['vs_ar']:.3f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
