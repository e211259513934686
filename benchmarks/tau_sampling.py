"""τ of the embedded pair at temperature 1.0 vs greedy, on the same prompts in one run (any backend).

    python benchmarks/tau_sampling.py --per-set 12 --max-new 128
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import source_commit  # noqa: E402
from dflash_jax import load_pair, speculative_generate  # noqa: E402
from dflash_jax.train.data import evaluation_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-set", type=int, default=12, help="prompts from each of HumanEval and MT-Bench")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seeds", default="0,1", help="sampled runs (τ averaged over them)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target, drafter = load_pair("smollm2-135m", dtype=args.dtype)
    sets = {k: v[: args.per_set] for k, v in evaluation_prompts().items()}
    rows = []
    for name, prompts in sets.items():
        kw = dict(max_new_tokens=args.max_new)
        greedy = speculative_generate(target, drafter, prompts, **kw)
        row = {"set": name, "prompts": len(prompts), "greedy_tau": greedy.tau}
        for mode in (False, True):
            taus = [speculative_generate(target, drafter, prompts, temperature=1.0, seed=int(s), draft_sampling=mode,
                                         **kw).tau for s in args.seeds.split(",")]
            row["t1_sampled_drafts_tau" if mode else "t1_argmax_drafts_tau"] = sum(taus) / len(taus)
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
            "host": platform.node(), "commit": source_commit()}
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"\n{info}\n| set | prompts | τ greedy | τ T=1.0 argmax drafts | τ T=1.0 sampled drafts |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['prompts']} | {r['greedy_tau']:.2f} | {r['t1_argmax_drafts_tau']:.2f} | "
              f"{r['t1_sampled_drafts_tau']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
