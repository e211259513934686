"""LLaMA-architecture GGUF files (e.g. the embedded SmolLM2-135M-Instruct Q4_1) → HF-named tensors.

The file is parsed here (:func:`read_gguf`: metadata and tensor index; the data stays memory-mapped) and
quantized tensors are dequantized with the ``gguf`` package. llama.cpp stores ``attn_q`` / ``attn_k`` rows
permuted for its interleaved RoPE; :func:`unpermute_qk` restores the HF (rotate-half) layout (SPEC §4).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.checkpoints.safetensors_io import CheckpointError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


# GGUF value types (the GGUF spec's ``gguf_type``): struct formats of the scalars, little-endian.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types stored as plain elements (gguf.GGUFReader's dtypes); every other type is quantized blocks.
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # ggml type (gguf.GGMLQuantizationType's value)
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # memory-mapped: elements [.., shape[0]], or quantized rows as bytes [.., row bytes]


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its metadata as Python values (strings, numbers, lists) and its tensors."""
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads GGUF values from a buffer, advancing ``off``."""

    def __init__(self, buf: memoryview, off: int):
        self.buf, self.off = buf, off

    def unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        self.off += n
        if self.off > len(self.buf):
            raise ValueError("the file ends inside its metadata")
        return str(self.buf[self.off - n: self.off], "utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.unpack("<" + _SCALARS[kind])[0]
        if kind == _ARRAY:
            item, n = self.unpack("<IQ")
            if item in _SCALARS:  # one read for the whole array
                fmt = "<" + _SCALARS[item]
                start, self.off = self.off, self.off + n * struct.calcsize(fmt)
                return np.frombuffer(self.buf, np.dtype(fmt), n, start).tolist()
            return [self.value(item) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {kind} at byte {self.off}")


def _parse(path: str) -> GGUFFile:
    """Header, metadata and tensor index of a (little-endian, version 2 or 3) GGUF file; tensor data stays
    memory-mapped. The same values gguf.GGUFReader gives, without its per-value numpy views, which made
    parsing a tokenizer's ~100k strings take seconds (tests/test_smollm2.py compares the two)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (big-endian files read as huge versions)")
    cur = _Cursor(buf, 24)
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        (kind,) = cur.unpack("<I")
        if key in fields:
            raise ValueError(f"duplicate metadata key {key!r}")
        fields[key] = cur.value(kind)
    index = []  # (name, shape, ggml type, offset from the data start)
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        index.append((name, cur.unpack(f"<{n_dims}Q"), *cur.unpack("<IQ")))
    align = fields.get("general.alignment", 32)
    if align <= 0 or align & (align - 1):
        raise ValueError(f"invalid alignment {align}")
    return GGUFFile(fields, _map_tensors(mm, index, -(-cur.off // align) * align))


def _map_tensors(mm: np.memmap, index: list[tuple], start: int) -> list[GGUFTensor]:
    """Views of the memory map (nothing read) for each indexed tensor; its data begins at byte ``start``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    tensors, names = [], set()
    for name, shape, ttype, rel in index:
        if name in names:
            raise ValueError(f"duplicate tensor {name!r}")
        names.add(name)
        count = int(np.prod(shape, dtype=np.int64))
        dims = tuple(reversed(shape))
        if ttype in _PLAIN:
            dtype, nbytes = np.dtype(_PLAIN[ttype]), count * np.dtype(_PLAIN[ttype]).itemsize
        else:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            dtype, nbytes, dims = np.dtype(np.uint8), count * type_size // block, quant_shape_to_byte_shape(dims, qtype)
        if start + rel + nbytes > len(mm):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, ttype, tuple(int(d) for d in shape),
                                  np.ndarray(dims, dtype, buffer=mm, offset=start + rel)))
    return tensors


def read_gguf(path: Path) -> GGUFFile:
    """The parsed GGUF (metadata + tensor index, memory-mapped); the config and the tensors of one load share
    one parse."""
    if not path.is_file():
        raise CheckpointError(f"missing GGUF file {path}")
    st = path.stat()
    return _parsed(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> GGUFFile:  # size / mtime: a rewritten file is parsed afresh
    try:
        return _parse(path)
    except Exception as e:
        raise CheckpointError(f"corrupt GGUF file {path}: {e}") from None


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """An HF-style config dict read from GGUF metadata (llama architecture only)."""
    r = read_gguf(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    p = lambda k, d=None: _field(r, f"llama.{k}", d)  # noqa: E731
    names = {t.name for t in r.tensors}
    vocab = p("vocab_size") or len(r.fields["tokenizer.ggml.tokens"])
    heads = int(p("attention.head_count"))
    return {
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": int(p("embedding_length")),
        "intermediate_size": int(p("feed_forward_length")),
        "num_hidden_layers": int(p("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(p("attention.head_count_kv", heads)),
        "head_dim": int(p("rope.dimension_count", int(p("embedding_length")) // heads)),
        "rms_norm_eps": float(p("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(p("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(p("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
    }


def read_gguf_tensors(path: Path, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """All tensors, dequantized to float32, under HF names (``model.layers.0.self_attn.q_proj.weight`` …)."""
    from gguf.quants import dequantize

    r = read_gguf(path)
    out: dict[str, np.ndarray] = {}
    for t in r.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
            if parts[2] == "attn_q":
                w = unpermute_qk(w, cfg["num_attention_heads"])
            elif parts[2] == "attn_k":
                w = unpermute_qk(w, cfg["num_key_value_heads"])
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        out[name] = w
    return out
