"""LLaMA-architecture GGUF files (e.g. the embedded SmolLM2-135M-Instruct Q4_1) → HF-named tensors.

Quantized tensors are dequantized with the ``gguf`` package. llama.cpp stores ``attn_q`` / ``attn_k`` rows
permuted for its interleaved RoPE; :func:`unpermute_qk` restores the HF (rotate-half) layout (SPEC §4).
"""

from __future__ import annotations

import functools
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


def _reader(path: Path):
    """The parsed GGUF (metadata + tensor index, memory-mapped). Parsing the tokenizer's ~300k metadata
    strings takes seconds, so the config and the tensors of one load share one parse."""
    if not path.is_file():
        raise CheckpointError(f"missing GGUF file {path}")
    st = path.stat()
    return _parsed(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int):  # size / mtime: a rewritten file is parsed afresh
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise CheckpointError(f"corrupt GGUF file {path}: {e}") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """An HF-style config dict read from GGUF metadata (llama architecture only)."""
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    p = lambda k, d=None: _field(r, f"llama.{k}", d)  # noqa: E731
    names = {t.name for t in r.tensors}
    vocab = p("vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
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

    r = _reader(path)
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
