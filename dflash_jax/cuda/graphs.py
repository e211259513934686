"""XLA:GPU's command buffers (CUDA graphs) without conditional nodes: compile options for the compact decode loop.

XLA records a step's kernels into CUDA graphs, and by default a ``lax.switch`` too, as a conditional node whose
branches are child graphs. Such a node cost a compact step ~0.13 ms at batch 64, several percent of the step
(compact's autoregressive branch ran ~0.2 ms slower than the plain autoregressive step with the node, ~0.05 ms
without). Without the node XLA runs the switch from the host: it copies the branch index to the host, waits for
it, and launches the chosen branch as a graph of its own — cheap when the index is ready as the step starts
(the compact loop plans each step's tier at the end of the step before: ``decode.loop.plans_ahead``); where the
index comes out of the step itself, decoding measured no faster than with the node (the host waits for the GPU
to drain).

:func:`without_conditional_nodes` keeps every other command type XLA would record (its defaults, or what
``XLA_FLAGS`` asked for): read from the compile options XLA itself would use.
"""

from __future__ import annotations

# DebugOptions.CommandBufferCmdType: the numbers of the types this XLA names (checked against
# ``XLA_FLAGS=--xla_gpu_enable_command_buffer=<name>`` on JAX 0.10); a number not here leaves XLA's defaults.
_TYPES = {1: "FUSION", 2: "CUBLAS", 3: "CUDNN", 4: "COLLECTIVES", 5: "CONDITIONAL", 6: "WHILE", 7: "CUSTOM_CALL",
          8: "CUBLASLT", 9: "DYNAMIC_SLICE_FUSION", 11: "CONVOLUTION"}
# Field numbers: CompileOptionsProto.executable_build_options → ExecutableBuildOptionsProto.debug_options →
# DebugOptions.xla_gpu_enable_command_buffer (a packed repeated enum).
_PATH = (3, 3, 258)
OPTION = "xla_gpu_enable_command_buffer"


def command_buffer_types() -> list[str] | None:
    """The command types XLA records into command buffers in this process (its defaults with ``XLA_FLAGS``
    applied), or None where they cannot be read (another XLA's options layout, a type not in :data:`_TYPES`)."""
    from jax._src import compiler

    try:
        proto = compiler.get_compile_options(num_replicas=1, num_partitions=1).SerializeAsString()
        numbers = _packed_field(proto, _PATH)
    except Exception:  # noqa: BLE001 — a private API: anything unexpected means "unknown", never a failure
        return None
    if numbers is None or any(n not in _TYPES for n in numbers):
        return None
    return [_TYPES[n] for n in numbers]


def without_conditional_nodes() -> dict[str, str]:
    """Compile options that record everything XLA records now but conditionals ({} where conditionals are not
    recorded, or the types cannot be read: XLA's own choice then stands)."""
    types = command_buffer_types()
    if not types or "CONDITIONAL" not in types or types == ["CONDITIONAL"]:
        return {}
    return {OPTION: ",".join(t for t in types if t != "CONDITIONAL")}


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _packed_field(data: bytes, path: tuple[int, ...]) -> list[int] | None:
    """The varints of the packed field at ``path`` (field numbers, outermost first) of a serialized protocol
    buffer message; None if it is absent. Only what the wire format needs: varint, fixed and length-delimited
    fields."""
    i, found = 0, None
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            if len(path) == 1 and number == path[0]:  # an unpacked repeated element
                found = (found or []) + [value]
        elif wire == 2:
            size, i = _varint(data, i)
            body, i = data[i: i + size], i + size
            if number == path[0]:
                if len(path) == 1:
                    found, j = found or [], 0
                    while j < len(body):
                        value, j = _varint(body, j)
                        found.append(value)
                else:
                    inner = _packed_field(body, path[1:])
                    found = inner if inner is not None else found
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return found
