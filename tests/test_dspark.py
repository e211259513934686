"""DSpark drafters (SPEC §7): sequential drafting as the formula says, lossless greedy and sampled decoding,
the public checkpoint format (round trip, reduced draft vocabulary, clear errors), survival statistics."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import random_prompts, tiny_target
from test_sampling import V, chi2_pvalue, draw, exact_distribution, logits, pair  # noqa: F401 (fixtures)
from dflash_jax import config, drafters, generate, load_drafter, random_drafter, speculative_generate
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.checkpoints.safetensors_io import CheckpointError, read_safetensors, save_safetensors
from dflash_jax.config import ConfigError, drafter_kinds
from dflash_jax.decode import loop
from dflash_jax.engine import job as jobs
from dflash_jax.loading import Drafter
from dflash_jax.models.drafter import MODULE_CLASSES, DSparkDrafter


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=21)


PROMPTS = random_prompts(4, [5, 17, 9, 30], 64, seed=2)  # one shape for every run here: shared programs
MAX_NEW = 30


@pytest.fixture(scope="module")
def reference(target):
    return generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])


@pytest.fixture(scope="module")
def dspark(target):
    """A random DSpark drafter (γ = 7 drafts, verify width 8) with a small Markov rank."""
    return random_drafter(target, kind="dspark", block_size=7, num_layers=1, markov_rank=16, seed=3)


class OracleDSpark(DSparkDrafter):
    """Trunk logits point at ``table[row, position + 1]`` (the anchor's output predicts the next position);
    the real Markov head is added on top, as in every DSpark draft."""

    def __init__(self, cfg, table: np.ndarray):
        super().__init__(cfg, rngs=nnx.Rngs(0))
        self.table = nnx.Variable(jnp.asarray(table, jnp.int32))

    def __call__(self, block_embeds, positions, cache, ctx_len, *, kernels=None):
        return jnp.take_along_axis(self.table[...], positions + 1, axis=1)

    def draft_logits(self, hidden, target, kernels=None):
        return jax.nn.one_hot(hidden, self.config.layers.vocab_size) * 10.0


def oracle_dspark(target, prompts, continuations, *, drafts: int, corrupt: float, seed: int = 0) -> Drafter:
    tc = target.config
    rng = np.random.default_rng(seed)
    table = np.zeros((len(prompts), 512), np.int64)
    for b, (p, c) in enumerate(zip(prompts, continuations)):
        table[b, : len(p) + len(c)] = list(p) + list(c)
    wrong = rng.random(table.shape) < corrupt
    table = np.where(wrong, (table + 1 + rng.integers(0, tc.vocab_size - 1, table.shape)) % tc.vocab_size, table)
    cfg = dataclasses.replace(random_drafter(target, kind="dspark", block_size=drafts, num_layers=1,
                                             markov_rank=8, confidence_head=False).config)
    return Drafter(OracleDSpark(cfg, table), "oracle dspark", True)


def test_drafts_follow_the_sequential_formula(target, dspark):
    """x_k = argmax(U_k + W2·W1[x_{k-1}]), x_{-1} = anchor; c_k = σ(w·[h_k; W1[x_{k-1}]] + b) — checked
    against a plain numpy loop over the block."""
    job = jobs.make(target, dspark, PROMPTS[:3], 16, block_size=8)
    state = job.programs.prefill(*job.pre_args)[0]
    t, d = target.model, dspark.model
    block, q, conf, _ = loop.propose(t, d, state, job.spec, dspark.config.mask_token_id)
    assert q is None and block.shape == (3, 8) and conf.shape == (3, 7)

    masks = jnp.full((3, 6), dspark.config.mask_token_id, jnp.int32)
    h = d(t.embed(jnp.concatenate([state.anchor[:, None], masks], 1)), loop.block_positions(state, 7),
          state.draft_cache, state.anchor_pos)
    u = np.asarray(d.base_logits(h, t))
    h = np.asarray(h)
    w1 = np.asarray(d.markov_head.markov_w1.embedding[...])
    w2 = np.asarray(d.markov_head.markov_w2.kernel[...])
    w, bias = np.asarray(d.confidence_head.proj.kernel[...])[:, 0], float(d.confidence_head.proj.bias[...][0])
    prev = np.asarray(state.anchor)
    for k in range(7):
        e = w1[prev]
        x = np.argmax(u[:, k] + e @ w2, axis=-1)
        c = 1 / (1 + np.exp(-(np.concatenate([h[:, k], e], -1) @ w + bias)))
        np.testing.assert_array_equal(np.asarray(block[:, k + 1]), x)
        np.testing.assert_allclose(np.asarray(conf[:, k]), c, rtol=1e-5)
        prev = x
    assert np.asarray(block[:, 0]).tolist() == np.asarray(state.anchor).tolist()
    # The Markov head matters: without it, some drafts differ.
    assert (np.argmax(u, -1) != np.asarray(block[:, 1:])).any()


def test_every_drafter_kind_has_a_module_and_a_drafting(target, dspark):
    """The config's kinds, the module classes and the drafting kinds the loop calls are the same set; a kind
    says what the loop needs to know about it."""
    assert set(drafters.names()) == set(drafter_kinds()) == set(MODULE_CLASSES)
    kind = drafters.kind_of(dspark.model)
    assert kind.sequential and kind.has_confidence and kind.trunk_width(8) == 7
    headless = random_drafter(target, kind="dspark", block_size=4, num_layers=1, markov_rank=8,
                              confidence_head=False)
    assert not drafters.kind_of(headless.model).has_confidence
    dflash = drafters.kind_of(random_drafter(target, block_size=4, num_layers=1).model)
    assert not dflash.sequential and not dflash.has_confidence and dflash.trunk_width(8) == 8


def test_a_new_drafter_kind_is_one_registered_class(target, reference, monkeypatch):
    """A kind defined and registered here — DFlash's drafting under another name and checkpoint format — is
    parsed, validated, exported, built and decoded losslessly with no other change."""
    for registry in (drafters.KINDS, MODULE_CLASSES, config._DRAFTER_SCHEMAS):
        monkeypatch.setitem(registry, "echo", None)  # removed again after the test

    def to_hf(c, out):
        out["dflash_config"]["projector_type"] = "echo"

    @drafters.register
    class Echo(drafters.dflash.DFlash):
        name = "echo"
        schema = config.DrafterSchema(kind="echo", architecture="EchoDraftModel",
                                      detect=lambda cfg, value: value("projector_type") == "echo", to_hf=to_hf)

    assert "echo" in config.drafter_kinds() and "echo" in drafters.names()
    d = random_drafter(target, kind="echo", block_size=4, num_layers=1)
    assert d.config.kind == "echo" and d.config.verify_width == 4 and not d.config.sequential
    hf = config.drafter_config_to_hf(d.config)
    assert hf["architectures"] == ["EchoDraftModel"] and hf["auto_map"] == {"AutoModel": "echo.EchoDraftModel"}
    assert config.drafter_config_from_hf(hf) == d.config
    with pytest.raises(ConfigError, match="block_size must be >= 2"):
        dataclasses.replace(d.config, block_size=1).validate()
    assert isinstance(drafters.kind_of(d.model), Echo)
    out = speculative_generate(target, d, PROMPTS, max_new_tokens=MAX_NEW, block_size=4, stop_token_ids=[])
    assert out.token_ids == reference.token_ids
    with pytest.raises(ConfigError, match="drafter kind 'nope' is not supported"):
        dataclasses.replace(d.config, kind="nope").validate()


@pytest.mark.parametrize("width", [2, 5, 8])
def test_random_dspark_is_lossless(target, dspark, reference, width):
    out = speculative_generate(target, dspark, PROMPTS, max_new_tokens=MAX_NEW, block_size=width, stop_token_ids=[])
    assert out.token_ids == reference.token_ids
    assert all(1 <= a <= width for row in out.acceptance_lengths for a in row)
    # The confidence head's predicted survival per draft, next to the realised acceptance.
    s = out.stats
    assert len(s["predicted_survival"]) == len(s["realized_survival"]) == width - 1
    assert all(1 >= a >= b >= 0 for a, b in zip(s["predicted_survival"], s["predicted_survival"][1:]))
    assert s["predicted_tau"] == pytest.approx(1 + sum(s["predicted_survival"]), rel=1e-4)
    cycles = [a for row in out.acceptance_lengths for a in row]
    realized = [sum(a - 1 > j for a in cycles) / len(cycles) for j in range(width - 1)]
    assert s["realized_survival"] == pytest.approx(realized, abs=1e-4)


@pytest.mark.parametrize("drafts", [1, 3, 15])
@pytest.mark.parametrize("corrupt", [0.0, 0.3])
def test_oracle_dspark_lossless_every_acceptance_length(target, reference, drafts, corrupt):
    """γ drafts from γ block inputs (verify width γ+1); every acceptance length 1 … γ+1 occurs."""
    drafter = oracle_dspark(target, PROMPTS, reference.token_ids, drafts=drafts, corrupt=corrupt)
    assert drafter.config.verify_width == drafts + 1
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert out.token_ids == reference.token_ids
    lengths = {a for row in out.acceptance_lengths for a in row}
    if corrupt == 0.0:
        assert max(lengths) == drafts + 1 and out.tau > (drafts + 1) * 0.6
    else:
        assert len(lengths) >= min(drafts + 1, 3)


def test_sampled_dspark_matches_target_distribution(pair, logits):
    """Sequential drafts, sampled (q_k conditioned on the drafts before it: min(1, p/q) stays exact) and argmax:
    χ² against the enumerated target distribution (tests/test_sampling.py's target and machinery)."""
    small = pair[0]
    drafter = random_drafter(small, kind="dspark", block_size=3, num_layers=1, seed=5, mask_token_id=V - 1,
                             markov_rank=4)
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    for draft_sampling in (True, False):  # sampled drafts (min(1, p/q)), then argmax drafts (accept w.p. p(x))
        samples, out = draw(lambda *a, **k: speculative_generate(small, drafter, *a, **k), with_output=True,
                            temperature=1.0, seed=2, draft_sampling=draft_sampling)
        assert chi2_pvalue(samples, probs) > 1e-3
        firsts = [row[0] for row in out.acceptance_lengths if row]
        assert 1 in firsts and max(firsts) >= 2


def test_checkpoint_round_trip_and_reduced_vocabulary(target, dspark, reference, tmp_path):
    path = export_drafter(dspark.model, tmp_path / "dspark")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dflash_config"]["projector_type"] == "dspark" and cfg["dflash_config"]["markov_rank"] == 16
    tensors = read_safetensors([path / "model.safetensors"])
    v, d = target.config.vocab_size, target.config.hidden_size
    assert tensors["markov_head.markov_w1.weight"].shape == (v, 16)
    assert tensors["markov_head.markov_w2.weight"].shape == (v, 16)
    assert tensors["confidence_head.proj.weight"].shape == (1, d + 16)
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    loaded = load_drafter(path, target)
    assert isinstance(loaded.model, DSparkDrafter) and loaded.config == dspark.config
    again = read_safetensors([export_drafter(loaded.model, tmp_path / "again") / "model.safetensors"])
    assert tensors.keys() == again.keys() and all(np.array_equal(tensors[k], again[k]) for k in tensors)

    # A reduced draft vocabulary: 40 of the 64 target ids, mapped by d2t offsets.
    keep = np.sort(np.random.default_rng(0).choice(v, 40, replace=False))
    small = dict(tensors, **{"markov_head.markov_w2.weight": tensors["markov_head.markov_w2.weight"][keep],
                             "d2t": keep - np.arange(40)})
    reduced = tmp_path / "reduced"
    reduced.mkdir()
    (reduced / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": 40}))
    save_safetensors(small, reduced / "model.safetensors")
    drafter = load_drafter(reduced, target)
    np.testing.assert_array_equal(np.asarray(drafter.model.d2t[...]), keep)
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, d)), jnp.float32)
    assert drafter.model.draft_head[...].shape == (40, d)  # the drafts' head reads the kept rows only
    np.testing.assert_allclose(np.asarray(drafter.model.base_logits(h, target.model)),
                               np.asarray(loaded.model.base_logits(h, target.model))[..., keep], rtol=1e-5, atol=1e-5)
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert out.token_ids == reference.token_ids
    roundtrip = read_safetensors([export_drafter(drafter.model, tmp_path / "r2") / "model.safetensors"])
    np.testing.assert_array_equal(roundtrip["d2t"], keep - np.arange(40))

    # Bad or mismatched heads name what is wrong.
    del small["d2t"]
    save_safetensors(small, reduced / "model.safetensors")
    with pytest.raises(CheckpointError, match="d2t"):
        load_drafter(reduced, target)
    bad = dict(tensors, **{"markov_head.markov_w1.weight": tensors["markov_head.markov_w1.weight"][:, :8]})
    save_safetensors(bad, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="markov_head.markov_w1.weight"):
        load_drafter(path, target)
    no_conf = {k: x for k, x in tensors.items() if not k.startswith("confidence_head")}
    save_safetensors(no_conf, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="confidence_head.proj"):
        load_drafter(path, target)
    (path / "config.json").write_text(json.dumps({**cfg, "dflash_config": {
        **cfg["dflash_config"], "use_confidence_head": False}}))
    assert load_drafter(path, target).model.confidence_head is None
    (path / "config.json").write_text(json.dumps({**cfg, "dflash_config": {
        **cfg["dflash_config"], "confidence_temperatures": [1.0, 2.0]}}))
    with pytest.raises(ConfigError, match="confidence_temperatures"):
        load_drafter(path, target)
