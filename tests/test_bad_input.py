"""Bad input gets one clear error naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import ZLAB, random_prompts, tiny_target
from dflash_jax import (CheckpointError, ConfigError, TokenizerMissingError, generate, load_drafter, load_target,
                        random_drafter, speculative_generate)


@pytest.fixture()
def drafter_dir(tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(ZLAB / "drafter", d)
    return d


def edit_config(directory, **changes):
    cfg = json.loads((directory / "config.json").read_text())
    for k, v in changes.items():
        if k in cfg.get("dflash_config", {}):
            cfg["dflash_config"][k] = v
        else:
            cfg[k] = v
    (directory / "config.json").write_text(json.dumps(cfg))


def test_drafter_hidden_size_mismatch(zlab_target):
    other = tiny_target("qwen3", hidden_size=48, vocab_size=256, num_layers=6)
    with pytest.raises(ConfigError, match="hidden_size 64 != target hidden_size 48"):
        load_drafter(ZLAB / "drafter", other)


def test_drafter_vocab_mismatch():
    other = tiny_target("qwen3", hidden_size=64, vocab_size=300, num_layers=6)
    with pytest.raises(ConfigError, match="vocab_size 256 != target vocab_size 300"):
        load_drafter(ZLAB / "drafter", other)


def test_target_layer_ids_out_of_range(drafter_dir, zlab_target):
    edit_config(drafter_dir, target_layer_ids=[1, 9])
    with pytest.raises(ConfigError, match=r"target_layer_ids \[1, 9\] include \[9\]"):
        load_drafter(drafter_dir, zlab_target)


def test_mask_id_outside_vocabulary(drafter_dir):
    edit_config(drafter_dir, mask_token_id=256)
    with pytest.raises(ConfigError, match="mask_token_id 256 is outside the vocabulary"):
        load_drafter(drafter_dir)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="missing config file"):
        load_target(tmp_path)


def test_corrupt_config(tmp_path):
    shutil.copytree(ZLAB / "target", tmp_path / "t")
    (tmp_path / "t" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="corrupt config file"):
        load_target(tmp_path / "t")


def test_missing_required_config_field(tmp_path):
    shutil.copytree(ZLAB / "target", tmp_path / "t")
    edit_config(tmp_path / "t", hidden_size=None)
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        load_target(tmp_path / "t")


def test_missing_safetensors(tmp_path):
    (tmp_path / "t").mkdir()
    shutil.copy(ZLAB / "target" / "config.json", tmp_path / "t")
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        load_target(tmp_path / "t")


def test_corrupt_safetensors(tmp_path):
    shutil.copytree(ZLAB / "target", tmp_path / "t")
    f = tmp_path / "t" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: 5000])
    with pytest.raises(CheckpointError, match="corrupt safetensors file"):
        load_target(tmp_path / "t")


def test_corrupt_gguf(tmp_path):
    """A file that is not GGUF, and one cut short (its header, then its last tensor's data)."""
    from dflash_jax.loading import embedded_gguf_path

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="corrupt GGUF file .*bad magic"):
        load_target(tmp_path / "junk.gguf")
    with embedded_gguf_path().open("rb") as f:
        head = f.read(4 << 20)  # the metadata and tensor index, part of the data
    for size, why in ((3000, "corrupt GGUF file"), (len(head), "runs past the end of the file")):
        (tmp_path / "cut.gguf").write_bytes(head[:size])
        with pytest.raises(CheckpointError, match=why):
            load_target(tmp_path / "cut.gguf")


def test_checkpoint_for_another_shape(drafter_dir, zlab_target):
    edit_config(drafter_dir, intermediate_size=96)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_drafter(drafter_dir, zlab_target)


def test_pickle_checkpoints_are_never_read(tmp_path):
    (tmp_path / "t").mkdir()
    shutil.copy(ZLAB / "target" / "config.json", tmp_path / "t")
    (tmp_path / "t" / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="only safetensors and GGUF are read"):
        load_target(tmp_path / "t")


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="not in the huggingface_hub cache"):
        load_target("nobody-here/not-a-model")


def test_generation_argument_errors(zlab_target):
    drafter = load_drafter(ZLAB / "drafter", zlab_target)
    ok = [[1, 2, 3]]
    with pytest.raises(ValueError, match="prompts is empty"):
        speculative_generate(zlab_target, drafter, [], max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(zlab_target, [[1, 2], []], max_new_tokens=8)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
            speculative_generate(zlab_target, drafter, ok, max_new_tokens=bad)
    with pytest.raises(ValueError, match=r"block_size must be in \[2, 4\]"):
        speculative_generate(zlab_target, drafter, ok, max_new_tokens=8, block_size=8)
    with pytest.raises(ValueError, match=r"block_size must be in \[2, 4\]"):
        speculative_generate(zlab_target, drafter, ok, max_new_tokens=8, block_size=1)
    with pytest.raises(ValueError, match="exceeds the model's maximum length 512"):
        generate(zlab_target, [list(range(200)) * 2 + [1] * 100], max_new_tokens=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(zlab_target, [[1, 2, 999]], max_new_tokens=4)
    # A checkpoint directory without tokenizer files works with ids; text prompts get a clear error.
    assert zlab_target.tokenizer is None
    with pytest.raises(TokenizerMissingError, match="loaded without tokenizer files"):
        speculative_generate(zlab_target, drafter, ["Hello"], max_new_tokens=8)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'float16' is not supported"):
        load_target(ZLAB / "target", dtype="float16")


def test_random_drafter_must_fit_target():
    target = tiny_target("qwen3")
    with pytest.raises(ConfigError, match="block_size must be >= 2"):
        random_drafter(target, block_size=1)
    with pytest.raises(ValueError, match="block_size must be in"):
        speculative_generate(target, random_drafter(target, block_size=4), random_prompts(1, [3], 64),
                             max_new_tokens=4, block_size=5)


def test_unknown_attention_impl(zlab_target):
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        generate(zlab_target, [[1, 2, 3]], max_new_tokens=4, attention_impl="flash")


def test_decode_options_each_get_one_error_naming_them(zlab_target):
    """Arguments a new user gets wrong: each is named in one clear error, raised before any work."""
    drafter = load_drafter(ZLAB / "drafter", zlab_target)
    ok = [[1, 2, 3]]
    with pytest.raises(ValueError, match="seed must be an integer, got 'abc'"):
        generate(zlab_target, ok, max_new_tokens=4, seed="abc")
    with pytest.raises(ValueError, match=r"stop_token_ids must be non-negative integer token ids, got 'x'"):
        speculative_generate(zlab_target, drafter, ok, max_new_tokens=4, stop_token_ids=["x"])
    with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
        generate(zlab_target, ok, max_new_tokens=4, stop_token_ids=7)
    with pytest.raises(TypeError, match="unexpected keyword argument 'verify_mode' .*speculative decoding only"):
        generate(zlab_target, ok, max_new_tokens=4, verify_mode="compact")
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        generate(zlab_target, ok, max_new_tokens=4, temprature=0.5)
    with pytest.raises(TypeError, match="tuning must be a dflash_jax.tuning.Tuning"):
        generate(zlab_target, ok, max_new_tokens=4, tuning={"prefill_chunk": 8})
    with pytest.raises(TypeError, match="cost_table must be"):
        speculative_generate(zlab_target, drafter, ok, max_new_tokens=4, cost_table=3)


def test_a_bare_integer_prompt_is_refused(zlab_target):
    """``prompts=[5]`` is not a one-token prompt (that is ``[[5]]``): decoding it silently would hide the slip."""
    with pytest.raises(TypeError, match=r"prompt 0 is a bare integer \(5\).*prompts=\[\[5\]\]"):
        generate(zlab_target, [5], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 must be text, a chat message list or token ids"):
        generate(zlab_target, [[1, 2], [1, "x"]], max_new_tokens=4)


def test_chat_messages_with_an_unknown_role_or_no_content_are_refused(zlab_target):
    with pytest.raises(ValueError, match="prompt 0: message 1 has role 'robot'"):
        generate(zlab_target, [[{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]],
                 max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 0: message 0 \(user\) has no text 'content'"):
        generate(zlab_target, [[{"role": "user"}]], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0: message 1 is not a"):
        generate(zlab_target, [[{"role": "user", "content": "hi"}, "and more"]], max_new_tokens=4)
