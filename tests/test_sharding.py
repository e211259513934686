"""Tensor/data parallelism on 8 simulated CPU devices, in a subprocess (this process keeps one device)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_jax.sharding import ShardingError, check_splittable, parse_mesh
from conftest import tiny_config


def test_multidevice_suite():
    here = Path(__file__).parent
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(here / "multidevice" / "md_sharding.py")], env=env, capture_output=True, text=True,
                          timeout=1200, cwd=here.parent)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


def test_parse_mesh_and_split_checks():
    assert parse_mesh("tp=2,dp=4") == {"tp": 2, "dp": 4}
    assert parse_mesh("dp=2") == {"tp": 1, "dp": 2}
    with pytest.raises(ShardingError, match="bad mesh spec"):
        parse_mesh("tp=two")
    check_splittable(tiny_config(num_heads=8, num_kv_heads=2), 4)  # 2 KV heads replicated over 4
    with pytest.raises(ShardingError, match="3 KV heads"):
        check_splittable(tiny_config(num_heads=6, num_kv_heads=3, intermediate_size=64), 2)
