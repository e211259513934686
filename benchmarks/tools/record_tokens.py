"""Greedy tokens of the embedded pairs in every verify mode (+ AR), to compare a refactor's output with the
tree before it: python record_tokens.py OUT.json (run from the repository root)."""
import json, sys, time
import jax
from dflash_jax import generate, load_pair, speculative_generate

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "What is the capital of France? Answer in one sentence.",
           "Explain what a hash table is to a ten-year-old.",
           "List three prime numbers larger than 100."]
out = {}
for pair in ("smollm2-135m", "smollm2-135m-dspark"):
    t, d = load_pair(pair)
    r = generate(t, PROMPTS, 48)
    out[f"{pair}/ar"] = r.token_ids
    for mode in ("static", "compact", "cap-accept", "auto"):
        t0 = time.time()
        r = speculative_generate(t, d, PROMPTS, 48, verify_mode=mode)
        out[f"{pair}/{mode}"] = r.token_ids
        out[f"{pair}/{mode}/acc"] = r.acceptance_lengths
        print(pair, mode, "same as AR:", r.token_ids == out[f"{pair}/ar"], "tau", round(r.tau, 3),
              r.stats.get("verify_mode"), f"{time.time()-t0:.1f}s", flush=True)
json.dump(out, open(sys.argv[1], "w"))
