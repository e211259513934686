"""The compact loop's compile options on a GPU: XLA's command-buffer types read from its own compile options,
less conditionals (dflash_jax.cuda.graphs), only where the loop plans its tiers ahead."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import pytest

from dflash_jax.cuda import graphs
from dflash_jax.decode.state import LoopSpec
from dflash_jax.engine import programs
from dflash_jax.tuning import Tuning


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, payload: bytes) -> bytes:  # length-delimited
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_packed_field_reads_nested_and_unpacked_repeats():
    packed = _field(258, b"".join(_varint(v) for v in (5, 300, 1)))
    other = _varint(7 << 3 | 0) + _varint(123456) + _varint(9 << 3 | 5) + b"\0\0\0\0"  # varint, fixed32
    message = _field(1, b"xyz") + _field(3, other + _field(3, other + packed) + _field(4, packed))
    assert graphs._packed_field(message, (3, 3, 258)) == [5, 300, 1]
    unpacked = _varint(258 << 3 | 0) + _varint(2) + _varint(258 << 3 | 0) + _varint(8)
    assert graphs._packed_field(_field(3, _field(3, unpacked)), (3, 3, 258)) == [2, 8]
    assert graphs._packed_field(_field(3, _field(3, other)), (3, 3, 258)) is None
    assert graphs._packed_field(_field(3, _field(4, packed)), (3, 3, 258)) is None


@pytest.mark.parametrize("found,options", [
    (["CONDITIONAL", "CUBLAS", "FUSION"], {graphs.OPTION: "CUBLAS,FUSION"}),
    (["FUSION"], {}),  # conditionals are not recorded anyway
    (["CONDITIONAL"], {}),  # nothing would be left: XLA's choice stands
    (None, {}),  # unreadable
])
def test_without_conditional_nodes(found, options, monkeypatch):
    monkeypatch.setattr(graphs, "command_buffer_types", lambda: found)
    assert graphs.without_conditional_nodes() == options


def test_the_types_are_xla_s_own_and_follow_xla_flags():
    assert {"FUSION", "CONDITIONAL"} <= set(graphs.command_buffer_types())  # XLA's defaults in this process
    code = "import json; from dflash_jax.cuda import graphs; print(json.dumps(graphs.command_buffer_types()))"
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=CUSTOM_CALL,CONDITIONAL,FUSION",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert sorted(json.loads(out.stdout.strip().splitlines()[-1])) == ["CONDITIONAL", "CUSTOM_CALL", "FUSION"]


def test_only_a_compact_loop_that_plans_ahead_on_a_gpu_drops_conditional_nodes(monkeypatch):
    tuning = Tuning().with_compiler_options({"xla_cpu_enable_fast_math": False})
    compact = LoopSpec(block_size=8, new_capacity=16, capture=(), verify_mode="compact", tuning=tuning)
    sampled = LoopSpec(block_size=8, new_capacity=16, capture=(), verify_mode="compact", sampling=True,
                       draft_sampling=True, tuning=tuning)
    counted = types.SimpleNamespace(schedule=types.SimpleNamespace(counts=object()))
    confident = types.SimpleNamespace(schedule=types.SimpleNamespace(counts=None))  # a DSpark drafter's
    monkeypatch.setattr(graphs, "command_buffer_types", lambda: ["CONDITIONAL", "FUSION"])
    assert programs.decode_compiler_options(compact, counted) == {"xla_cpu_enable_fast_math": False}  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert programs.decode_compiler_options(compact, counted) == {"xla_cpu_enable_fast_math": False,
                                                                    graphs.OPTION: "FUSION"}
    assert programs.decode_compiler_options(compact, confident)[graphs.OPTION] == "FUSION"  # drafts planned too
    assert programs.decode_compiler_options(sampled, counted)[graphs.OPTION] == "FUSION"
    # Sampled drafts with confidences are not planned ahead (q would have to be carried): the node stays.
    assert programs.decode_compiler_options(sampled, confident) == {"xla_cpu_enable_fast_math": False}
    cap = LoopSpec(block_size=8, new_capacity=16, capture=(), verify_mode="cap-accept", tuning=tuning)
    assert programs.decode_compiler_options(cap, counted) == {"xla_cpu_enable_fast_math": False}
    on_device = dataclasses.replace(compact, tuning=tuning.replace(host_tier_switch=False))
    assert programs.decode_compiler_options(on_device, counted) == {"xla_cpu_enable_fast_math": False}


def test_options_this_xla_refuses_fall_back_to_its_defaults(monkeypatch):
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((4,), "float32"))
    spec = LoopSpec(block_size=8, new_capacity=16, capture=(), verify_mode="compact")
    monkeypatch.setattr(programs, "decode_compiler_options", lambda *a: {graphs.OPTION: "NOT_A_TYPE"})
    with pytest.raises(Exception, match="NOT_A_TYPE"):  # the options reach XLA, which refuses them…
        lowered.compile({graphs.OPTION: "NOT_A_TYPE"})
    compiled = programs.compile_steps(lowered, spec, None)  # …and the program compiles without them
    assert compiled(jax.numpy.ones(4)).tolist() == [2.0] * 4
