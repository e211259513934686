r"""Each call of ``verify_mode="auto"`` timed alone, on the Qwen3-8B shape with ``bench_compact_scaled.py``'s scripted
drafter (p = 0.3, block 16, 128-token prompts, 128 new tokens): wall, compile seconds, steps fallen back and
switches per call, four calls per ``finish_together`` value, after one autoregressive call timed as the reference.
What a median of a few calls hides: a call that compiles a program the first one did not need, a probe.

    python benchmarks/tools/auto_calls.py 32 <an earlier bench_compact_scaled JSON with a table at 32 rows> 2,0
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_compact_scaled import SHAPES, earlier_table, known_drafter, make_predictable  # noqa: E402
from common import random_target  # noqa: E402

from dflash_jax import generate, speculative_generate  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402


def main() -> None:
    batch, table_file, powers = int(sys.argv[1]), Path(sys.argv[2]), [float(g) for g in sys.argv[3].split(",")]
    target = random_target(SHAPES["8b"][1], jnp.bfloat16)
    make_predictable(target)
    prompts = np.random.default_rng(batch).integers(0, target.config.vocab_size, (batch, 128)).tolist()
    kw = dict(max_new_tokens=128, stop_token_ids=[])
    generate(target, prompts, **kw)
    t0 = time.perf_counter()
    ar = generate(target, prompts, **kw)
    print("ar", batch * 128 / (time.perf_counter() - t0), flush=True)
    drafter = known_drafter(target, prompts, ar.token_ids, layers=5, block=16, corrupt=0.3, trained_widths=None)
    table = earlier_table([table_file], batch)
    for power in powers:
        for i in range(4):
            t0 = time.perf_counter()
            r = speculative_generate(target, drafter, prompts, verify_mode="auto", cost_table=table,
                                     tuning=Tuning(finish_together=power), **kw)
            wall, s = time.perf_counter() - t0, r.stats
            print(f"g{power} call {i}: {batch * 128 / wall:8.1f} tok/s wall {wall:.3f} compile_s "
                  f"{s.get('compile_s', 0):.2f} decode_s {s.get('decode_s', 0):.3f} fallback "
                  f"{s.get('ar_fallback_steps')} switches {s.get('fallback_switches')} tiers {s.get('tier_steps')} "
                  f"cycles {s.get('cycles')}", flush=True)


if __name__ == "__main__":
    main()
