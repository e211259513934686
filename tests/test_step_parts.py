"""benchmarks/tools/step_parts.py runs end to end on a tiny shape: every part of a drafted step timed, its JSON
complete. No timing is asserted (a CPU smoke test; the numbers mean something only on a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "tools" / "step_parts.py"


def test_step_parts_small(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("step_parts", SCRIPT)
    step_parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_parts)
    out = tmp_path / "parts.json"
    assert step_parts.main(["--small", "--batches", "2", "--steps", "2", "--repeats", "1",
                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert tuple(result["parts"]) == step_parts.PARTS
    assert all(part["ms"] > 0 for part in result["parts"].values())
    assert result["sum_of_parts_1_5_ms"] > 0 and result["device_kind"] and result["jax_version"]
    table = capsys.readouterr().out
    assert all(f"| {name} |" in table for name in step_parts.PARTS)


def test_the_scripted_drafter_keeps_the_library_signatures():
    """bench_compact_scaled.py's scripted drafter overrides the drafter's ``__call__`` and ``draft_logits``; a change
    of the library's signatures must reach it (session 42's sweep first failed on one). Its logits' argmax is its
    table's token at each position, whatever kernels are passed."""
    import jax.numpy as jnp
    import numpy as np

    from conftest import tiny_target
    from dflash_jax.tuning import Kernels

    spec = importlib.util.spec_from_file_location(
        "bench_compact_scaled", SCRIPT.parent.parent / "bench_compact_scaled.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    target = tiny_target("qwen3", seed=3)
    drafter = bench.known_drafter(target, [[1, 2, 3]], [[4, 5, 6, 7]], layers=1, block=4, corrupt=0.0)
    ids = jnp.asarray([[5, 9, 2]], jnp.float32)
    hidden = jnp.concatenate([jnp.zeros((1, 3, target.config.hidden_size)), ids[..., None]], axis=-1)
    logits = drafter.model.draft_logits(hidden, target.model, Kernels())
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits, axis=-1)), [[5, 9, 2]])
