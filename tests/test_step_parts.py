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
