"""Reduced draft vocabularies (DFlash drafts over the N most frequent tokens): the drafts' head over the kept
rows, lossless in every verify mode (greedy token-identical; sampled exact by χ², in test_sampling), the
ranking file, the pair config's per-backend choice, and clear errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import oracle_drafter, random_prompts, tiny_target
from test_schedule import TABLE
from dflash_jax import ConfigError, generate, random_drafter, speculative_generate
from dflash_jax import draft_vocab
from dflash_jax.loading import restrict_draft_vocab
from dflash_jax.pairs import parse_pair

PROMPTS_LENS = [5, 17, 9, 30]
MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=1)


@pytest.fixture(scope="module")
def prompts(target):
    return random_prompts(4, PROMPTS_LENS, target.config.vocab_size, seed=3)


@pytest.fixture(scope="module")
def reference(target, prompts):
    return generate(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])


def test_head_over_kept_rows_is_the_full_head_at_those_ids(target):
    drafter = random_drafter(target, block_size=8, num_layers=1, seed=2)
    ids = np.random.default_rng(0).permutation(target.config.vocab_size)[:37]
    small = restrict_draft_vocab(drafter, target, ids)
    assert drafter.model.d2t is None and small.model.draft_head[...].shape == (37, target.config.hidden_size)
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, target.config.hidden_size)), jnp.float32)
    full = np.asarray(drafter.model.draft_logits(h, target.model))
    np.testing.assert_allclose(np.asarray(small.model.draft_logits(h, target.model)), full[..., ids],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(small.model.to_target_ids(jnp.arange(37))), ids)
    q = jnp.full((2, 37), 1 / 37)
    p = np.asarray(small.model.to_target_probs(q))
    assert p.shape == (2, target.config.vocab_size) and np.allclose(p.sum(-1), 1)
    assert (p[:, np.setdiff1d(np.arange(target.config.vocab_size), ids)] == 0).all()


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_every_token_kept_in_another_order_drafts_the_same(target, prompts, reference, mode):
    """A draft vocabulary holding every token, permuted: the same drafts, so the same acceptance cycle by
    cycle (the id maps are exact), and the target's tokens."""
    drafter = oracle_drafter(target, prompts, reference.token_ids, block_size=8, corrupt=0.2, seed=1)
    perm = np.random.default_rng(5).permutation(target.config.vocab_size)
    permuted = restrict_draft_vocab(drafter, target, perm)
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[], verify_mode=mode, cost_table=TABLE)
    full, out = (speculative_generate(target, d, prompts, **kw) for d in (drafter, permuted))
    assert out.token_ids == reference.token_ids
    assert out.acceptance_lengths == full.acceptance_lengths and full.tau > 2


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_a_small_draft_vocabulary_is_lossless_and_drafts_only_its_tokens(target, prompts, reference, mode):
    """Half of the tokens the target emits are outside the kept set: an oracle drafter then stops being right at
    each of them (τ falls), and the output is still the target's."""
    drafter = oracle_drafter(target, prompts, reference.token_ids, block_size=8, corrupt=0.0, seed=1)
    emitted = sorted({t for row in reference.token_ids for t in row})
    kept = np.array(emitted[::2])
    small = restrict_draft_vocab(drafter, target, kept)
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[], verify_mode=mode, cost_table=TABLE)
    full, out = (speculative_generate(target, d, prompts, **kw) for d in (drafter, small))
    assert out.token_ids == reference.token_ids
    assert out.tau < full.tau
    # A cycle's accepted drafts are the target's next tokens, all of them kept ones.
    for row, lengths in zip(out.token_ids, out.acceptance_lengths):
        pos = 1  # the first token comes from prefill
        for a in lengths:
            assert set(row[pos: pos + a - 1]) <= set(kept.tolist())
            pos += a


def test_bad_draft_vocabularies(target):
    drafter = random_drafter(target, block_size=4, num_layers=1, seed=2)
    v = target.config.vocab_size
    for ids in ([], [0, 0, 1], [0, v], [-1, 2], [0.5, 1.0]):
        with pytest.raises(ConfigError, match="distinct token ids"):
            restrict_draft_vocab(drafter, target, np.asarray(ids))
    small = restrict_draft_vocab(drafter, target, [1, 2])
    with pytest.raises(ConfigError, match="already drafts over a reduced vocabulary"):
        restrict_draft_vocab(small, target, [1])


def test_dspark_drafts_over_a_reduced_vocabulary(target, prompts, reference):
    """A DSpark drafter keeps its Markov head's columns of the kept ids: the same logits there, lossless
    decoding, and the config of a reduced-vocabulary checkpoint."""
    dspark = random_drafter(target, block_size=7, num_layers=1, kind="dspark", markov_rank=8, seed=4)
    ids = np.random.default_rng(6).permutation(target.config.vocab_size)[:20]
    small = restrict_draft_vocab(dspark, target, ids)
    assert small.config.draft_vocab_size == 20 and dspark.config.draft_vocab_size is None
    assert small.model.markov_head.markov_w2.kernel[...].shape == (8, 20)
    assert dspark.model.markov_head.markov_w2.kernel[...].shape == (8, target.config.vocab_size)  # unchanged
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, target.config.hidden_size)), jnp.float32)
    e = small.model.markov_head.embed(jnp.asarray([[3, 4, 5], [6, 7, 8]]))
    full = np.asarray(dspark.model.base_logits(h, target.model) + dspark.model.markov_head.bias(e))
    np.testing.assert_allclose(np.asarray(small.model.base_logits(h, target.model) + small.model.markov_head.bias(e)),
                               full[..., ids], rtol=1e-5, atol=1e-5)
    out = speculative_generate(target, small, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                               verify_mode="static")
    assert out.token_ids == reference.token_ids


class _CharTokenizer:
    def encode(self, text, chat=True):
        assert chat is False
        return [ord(c) - ord("a") for c in text]


def test_ranking_file_and_pair_settings(tmp_path):
    ids, counts = draft_vocab.token_ranking(_CharTokenizer(), ["abca", "cab", "c"])
    assert ids.tolist() == [0, 2, 1] and counts.tolist() == [3, 3, 2]  # ties by id
    path = draft_vocab.save_ranking(tmp_path / "r.npz", ids, counts, 26, "test")
    assert draft_vocab.top_ids(path, 2, 26).tolist() == [0, 2]
    assert draft_vocab.coverage(path, [1, 3]) == {1: 0.375, 3: 1.0}
    with pytest.raises(ConfigError, match="26-token vocabulary"):
        draft_vocab.top_ids(path, 2, 30)
    with pytest.raises(ConfigError, match="holds 3 tokens"):
        draft_vocab.top_ids(path, 4, 26)
    with pytest.raises(ConfigError, match="does not exist"):
        draft_vocab.top_ids(tmp_path / "none.npz", 2, 26)
    base = {"name": "p", "target": "t", "drafter": "d"}
    cfg = parse_pair({**base, "draft_vocab": {"ranking": "r.npz", "size": {"cpu": 2}}}, str(tmp_path / "p.yaml"))
    assert cfg.draft_vocab_size("cpu") == 2 and cfg.draft_vocab_size("gpu") is None
    assert draft_vocab.resolve_ranking(cfg.draft_vocab_ranking, cfg.path) == tmp_path / "r.npz"
    assert draft_vocab.resolve_ranking("embedded:smollm2-135m").is_file()
    for bad in ({"ranking": "r.npz"}, {"ranking": "r.npz", "size": {"cuda": 2}}, {"ranking": "", "size": {}},
                {"ranking": "r.npz", "size": {"cpu": 0}}):
        with pytest.raises(ConfigError, match="draft_vocab"):
            parse_pair({**base, "draft_vocab": bad}, "p.yaml")


def test_cli_draft_vocab_needs_a_pair_config():
    from dflash_jax.cli import main

    with pytest.raises(SystemExit, match="--draft-vocab takes its token ranking from a pair config"):
        main(["generate", "--no-compile-cache", "--target", "some/dir", "--draft-vocab", "8", "--input", "in.jsonl",
              "--output", "out.jsonl"])


def test_built_in_embedded_pair_settings_match_its_config():
    """An install without configs/ (a wheel) loads the embedded pair from built-in settings: the YAML's."""
    from dflash_jax.loading import EMBEDDED_PAIR_SETTINGS
    from dflash_jax.pairs import load_pair_config

    built_in, yaml_cfg = parse_pair(EMBEDDED_PAIR_SETTINGS, "built-in"), load_pair_config("smollm2-135m")
    for field in ("name", "target", "drafter", "dtype", "block_size", "chat_template_kwargs", "mesh",
                  "draft_vocab_ranking", "draft_vocab_sizes"):
        assert getattr(built_in, field) == getattr(yaml_cfg, field), field
