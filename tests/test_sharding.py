"""Tensor/data parallelism on 8 simulated CPU devices, in a subprocess (this process keeps one device)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dflash_jax.config import HybridConfig
from dflash_jax.sharding import ShardingError, check_splittable, parse_mesh
from conftest import BackgroundRun, tiny_config


HERE = Path(__file__).parent
# Started when the session has collected the test (conftest.BackgroundRun): it runs beside the tests before it.
MULTIDEVICE = BackgroundRun(
    "test_sharding.py::test_multidevice_suite",
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "multidevice" / "md_sharding.py")],
    env={**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu", "DFLASH_JAX_AUTO_COMPACT_RATIO": "inf"}, cwd=HERE.parent)


def test_multidevice_suite():
    rc, out = MULTIDEVICE.result(timeout=1200)
    assert rc == 0, out[-9000:]
    assert " passed" in out and "skipped" not in out.strip().splitlines()[-1]


def test_parse_mesh_and_split_checks():
    assert parse_mesh("tp=2,dp=4") == {"tp": 2, "dp": 4}
    assert parse_mesh("dp=2") == {"tp": 1, "dp": 2}
    with pytest.raises(ShardingError, match="bad mesh spec"):
        parse_mesh("tp=two")
    check_splittable(tiny_config(num_heads=8, num_kv_heads=2), 4)  # 2 KV heads replicated over 4
    with pytest.raises(ShardingError, match="3 KV heads"):
        check_splittable(tiny_config(num_heads=6, num_kv_heads=3, intermediate_size=64), 2)
    # Qwen3.5-MoE / Qwen3-Next: the routed and the shared experts' widths split like the MLP's; the Gated DeltaNet
    # layers split by key head where tp divides them, replicated otherwise (never an error).
    hybrid = HybridConfig(("linear_attention", "full_attention"), key_heads=2, value_heads=4, rotary_dim=4)
    moe = dict(num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, hybrid=hybrid)
    check_splittable(tiny_config("qwen3_5_moe", shared_expert_intermediate_size=24, **moe), 4)
    with pytest.raises(ShardingError, match="shared expert width 6"):
        check_splittable(tiny_config("qwen3_5_moe", shared_expert_intermediate_size=6, **moe), 4)
    with pytest.raises(ShardingError, match="expert MLP width 12"):
        check_splittable(tiny_config("qwen3_next", **dict(moe, moe_intermediate_size=12)), 8)
