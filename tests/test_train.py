"""Drafter training: anchors, visibility, labels/weights, train-vs-inference alignment, learning, export,
exact resume (in process and after a real SIGKILL), bad input."""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from conftest import ZLAB, fast_options, random_prompts, tiny_subprocess_env, tiny_target
from dflash_jax import ConfigError, generate, load_drafter, random_drafter, speculative_generate
from dflash_jax.loading import deepen_drafter, load_target, with_config
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.train import data as data_mod
from dflash_jax.train.objective import (_multi_block_attention, block_inputs, dflash_loss, drafter_forward_blocks,
                                        loss_weights, repeated_blocks, sample_anchors, target_features, walked_tau)
from dflash_jax.train.pipeline import load_run_config
from dflash_jax.train.trainer import Trainer, TrainSettings, batch_for_step


# The training rows of these tests have at most 52 tokens: batches padded to a multiple of 64 tokens rather than
# the default 128 (the time-budget test below buckets lengths) do half the work per step.
SHORT = 64


def test_anchor_sampling():
    rng = np.random.default_rng(0)
    lengths, plens = np.array([20, 9, 6, 5]), np.array([4, 3, 5, 4])
    anchors, valid = sample_anchors(rng, lengths, plens, max_anchors=8)
    # eligible p: prompt_len <= p <= len-2  →  row0: 4..18 (15), row1: 3..7 (5), row2: 5..4 (none), row3: none
    assert valid.sum(1).tolist() == [8, 5, 0, 0]
    for a, v, n, p in zip(anchors, valid, lengths, plens):
        chosen = a[v]
        assert len(set(chosen.tolist())) == len(chosen)
        assert all(p <= x <= n - 2 for x in chosen)
    # Uniform over eligible positions.
    counts = np.zeros(20)
    for s in range(400):
        a, v = sample_anchors(np.random.default_rng(s), np.array([20]), np.array([4]), 3)
        counts[a[v]] += 1
    assert counts[:4].sum() == 0 and counts[19] == 0 and counts[4:19].min() > 40


def test_repeated_blocks_and_weighted_anchors():
    # Row: prompt [1 2], then "5 6 7" twice and a tail. With n = 3, anchor p is a repeat iff tokens p+1…p+3
    # already started at an earlier position: the second "5 6 7" starts at 5, so anchor 4 is the only one.
    row = np.array([[1, 2, 5, 6, 7, 5, 6, 7, 8, 9, 0, 0]])
    rep = repeated_blocks(row, np.array([10]), ngram=3)
    assert rep[0].tolist() == [False] * 4 + [True] + [False] * 7
    # A looping row: 10 novel tokens, then a 4-token cycle from position 12 whose second turn starts at 16, so
    # anchors 15 … are repeats. Weighted draws favour the novel anchors while drawing as many as uniform does.
    loop = np.concatenate([[1, 2], np.arange(10, 20), np.tile([30, 31, 32, 33], 10)])[None]
    lengths, plens = np.array([loop.shape[1]]), np.array([2])
    rep = repeated_blocks(loop, lengths, ngram=4)
    assert not rep[0, :15].any() and rep[0, 15:lengths[0] - 4].all()
    novel = {False: 0, True: 0}
    for s in range(200):
        for weight in (1.0, 0.05):
            a, v = sample_anchors(np.random.default_rng(s), lengths, plens, 12, rep, weight)
            assert v.sum() == 12
            novel[weight < 1] += int((~rep[0, a[v]]).sum())
    assert novel[True] > 2 * novel[False]
    # Weight 1.0 is the SPEC's uniform draw, bit for bit.
    a1, _ = sample_anchors(np.random.default_rng(3), lengths, plens, 12, rep, 1.0)
    a0, _ = sample_anchors(np.random.default_rng(3), lengths, plens, 12)
    assert (a1 == a0).all()


def test_visibility_hand_computed():
    """Uniform queries and one-hot values reveal exactly which keys each block query attends to."""
    t, l = 8, 3
    anchors = jnp.array([[2, 5]])  # two blocks: positions 2,3,4 and 5,6,7
    h = t + 2 * l  # head dim = number of keys, so values can be one-hot key ids
    q = jnp.zeros((1, 2, l, 1, h))
    ctx_v = jnp.eye(t + 2 * l)[:t][None, :, None, :]  # context key j → one-hot j
    blk_v = jnp.eye(t + 2 * l)[t:].reshape(2, l, 1, t + 2 * l)[None]  # block a slot m → one-hot t+a*l+m
    out = _multi_block_attention(q, jnp.zeros((1, t, 1, h)), ctx_v.astype(jnp.float32), jnp.zeros((1, 2, l, 1, h)),
                                 blk_v.astype(jnp.float32), anchors)
    seen = np.asarray(out[0, :, :, 0] > 0)  # [A, L, keys]
    expected = np.zeros((2, l, t + 2 * l), bool)
    expected[0, :, [0, 1]] = True  # block at p=2 sees context 0,1 …
    expected[0, :, t: t + l] = True  # … and its own three slots, never block 1
    expected[1, :, 0:5] = True  # block at p=5 sees context 0..4 (strictly before 5)
    expected[1, :, t + l:] = True
    np.testing.assert_array_equal(seen, expected)
    # Weights are uniform over the visible keys.
    np.testing.assert_allclose(np.asarray(out[0, 0, 0, 0]).max(), 1 / 5, rtol=1e-6)


def test_labels_and_weights():
    tokens = jnp.arange(100, 112)[None]  # token at position i is 100+i
    anchors, valid = jnp.array([[3, 9]]), jnp.array([[True, True]])
    ids, pos, labels, ok = block_inputs(tokens, jnp.array([11]), anchors, valid, 4, mask_token_id=7)
    assert ids.tolist() == [[[103, 7, 7, 7], [109, 7, 7, 7]]]
    assert pos.tolist() == [[[3, 4, 5, 6], [9, 10, 11, 12]]]
    assert labels[0, 0].tolist() == [104, 105, 106]  # slot k predicts token p+k (same position)
    assert ok.tolist() == [[[True, True, True], [True, False, False]]]  # positions ≥ length have no loss
    *_, ok = block_inputs(tokens, jnp.array([12]), anchors, valid, 4, mask_token_id=7, widths=jnp.array([[2, 3]]))
    assert ok.tolist() == [[[True, False, False], [True, True, False]]]  # nor slots past the block's width
    np.testing.assert_allclose(loss_weights(16, 7.0)[:3], np.exp(-np.arange(3) / 7.0))
    assert loss_weights(4, 4.0).shape == (3,)


def test_training_forward_equals_inference_forward():
    """The batched training pass gives, for each anchor, exactly the inference drafter's hidden states."""
    t = tiny_target("qwen3", seed=1)
    d = random_drafter(t, block_size=8, num_layers=2, seed=0)
    tm, dm = t.model, d.model
    seq = jnp.asarray(random_prompts(1, [30], 64, seed=3))
    anchors = jnp.array([[5, 12, 20]])
    ids, pos, _, _ = block_inputs(seq, jnp.array([30]), anchors, jnp.ones((1, 3), bool), 8, dm.config.mask_token_id)

    # Each side as one program (op by op, every operation would compile a program of its own).
    @nnx.jit
    def training(dm, tm, seq, ids, pos, anchors):
        feats = target_features(tm, seq, dm.config.target_layer_ids)
        return feats, drafter_forward_blocks(dm, tm, feats, ids, pos, anchors)

    @nnx.jit
    def inference(dm, tm, context_feats, ids, pos):  # the drafter's cache holds the context before the anchor
        p = context_feats.shape[1]
        cache = dm.materialize(dm.new_cache(1, 64), context_feats, jnp.arange(p)[None])
        return dm(tm.embed(ids), pos, cache, jnp.array([p]))

    feats, h = training(dm, tm, seq, ids, pos, anchors)
    for j, p in enumerate([5, 12, 20]):
        hi = inference(dm, tm, feats[:, :p], ids[:, j], pos[:, j])
        np.testing.assert_allclose(np.asarray(hi), np.asarray(h[:, j]), atol=1e-5)
    # Blocks trained at narrower widths (TrainSettings.block_widths): a block of width w is the inference pass
    # over [anchor, MASK × (w-1)] alone, whatever its masked slots hold.
    widths = jnp.array([[3, 8, 5]])
    hw = nnx.jit(drafter_forward_blocks)(dm, tm, feats, ids, pos, anchors, widths)
    for j, (p, w) in enumerate(zip([5, 12, 20], [3, 8, 5])):
        hi = inference(dm, tm, feats[:, :p], ids[:, j, :w], pos[:, j, :w])
        np.testing.assert_allclose(np.asarray(hi), np.asarray(hw[:, j, :w]), atol=1e-5)
    assert not np.allclose(np.asarray(hw[:, 0, :3]), np.asarray(h[:, 0, :3]), atol=1e-3)  # the width mattered


def test_chunked_cross_entropy_equals_full(tmp_path):
    """ce_chunk_rows (lm_head chunks under jax.checkpoint) changes memory, not the loss, metrics or gradients
    (chunks of 5 slots, the last one padded), here and through the Trainer."""
    target = tiny_target("qwen3", seed=1)
    drafter = random_drafter(target, block_size=8, num_layers=2, seed=0)
    _, data = self_distilled(target, n=8, new=24)
    s = TrainSettings(batch_size=4, max_anchors=8, length_bucket=SHORT)
    batch = {k: jnp.asarray(v) for k, v in batch_for_step(data, 0, s, 8).items()}
    weights = jnp.asarray(loss_weights(8, 4.0))
    graph, params = nnx.split(drafter.model, nnx.Param)

    def loss(p, chunk):
        return dflash_loss(nnx.merge(graph, p), target.model, batch, weights=weights, ce_chunk_rows=chunk)

    slots = batch["anchors"].size * 7
    assert slots % 5 != 0  # chunks of 5 leave a padded last chunk
    loss_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (full, m_full), g_full = loss_and_grad.lower(params, None).compile(fast_options())(params)
    (part, m_part), g_part = loss_and_grad.lower(params, 5).compile(fast_options())(params)
    np.testing.assert_allclose(float(part), float(full), rtol=1e-5)
    assert {k: float(v) for k, v in m_part.items()} == pytest.approx({k: float(v) for k, v in m_full.items()})
    for a, b in zip(jax.tree.leaves(g_part), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert float(full) > 0 and any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_full))
    # Through the Trainer: two steps with chunks train to the same weights as two without.
    trained = []
    for chunk in (None, 5):
        d = random_drafter(target, block_size=8, num_layers=2, seed=0)
        t = Trainer(target, d, dataclasses.replace(s, max_steps=2, ce_chunk_rows=chunk), tmp_path / str(chunk),
                    compiler_options=fast_options())  # programs that run twice: compile them fast
        t.fit(data, progress=False)
        trained.append(t.params)
    for a, b in zip(jax.tree.leaves(trained[0]), jax.tree.leaves(trained[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def self_distilled(target, n=48, new=40, seed=0):
    prompts = random_prompts(n, [4, 8, 12], target.config.vocab_size, seed=seed)
    resp = generate(target, prompts, max_new_tokens=new, stop_token_ids=[]).token_ids
    rows = [p + r for p, r in zip(prompts, resp)]
    tokens = np.zeros((n, max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return prompts, {"tokens": tokens, "lengths": np.array([len(r) for r in rows], np.int32),
                     "prompt_lengths": np.array([len(p) for p in prompts], np.int32)}


def test_training_raises_acceptance(tmp_path):
    """80 CPU steps: τ at inference clearly above the untrained drafter's (catches misalignment; ~1.85 here)."""
    target = tiny_target("qwen3", seed=1)
    prompts, data = self_distilled(target)
    drafter = random_drafter(target, block_size=8, num_layers=2, seed=0)
    probe = prompts[:16]
    before = speculative_generate(target, drafter, probe, max_new_tokens=40, stop_token_ids=[]).tau
    s = TrainSettings(batch_size=8, max_anchors=16, max_steps=80, lr=1e-2, save_every=80, log_every=20,
                      val_rows=8, val_every=40, length_bucket=SHORT)
    # Compiled fast: its 80 steps of this size trained in 9 s so, 12 s with XLA's optimisation.
    trainer = Trainer(target, drafter, s, tmp_path, compiler_options=fast_options())
    history = trainer.fit(data, progress=False)
    assert history[-1]["loss"] < history[0]["loss"]
    out = speculative_generate(target, drafter, probe, max_new_tokens=40, stop_token_ids=[])
    assert out.token_ids == generate(target, probe, max_new_tokens=40, stop_token_ids=[]).token_ids
    assert before < 1.1 and out.tau > 1.6, (before, out.tau)
    # The held-out τ logged during training replays the cycles decoding those held-out prompts runs.
    assert [r["step"] for r in history if "val_tau" in r] == [40, 80]
    kept, sets = trainer.split_validation(data)
    held = sets["val_tau"]
    held_prompts = [held["tokens"][i, :p].tolist() for i, p in enumerate(held["prompt_lengths"])]
    assert len(held_prompts) == 8 and len(kept["lengths"]) == len(data["lengths"]) - 8
    replayed = trainer.replayed_cycles(trainer.params, held)
    decoded = speculative_generate(target, drafter, held_prompts, max_new_tokens=40, stop_token_ids=[])
    for got, want in zip(replayed, decoded.acceptance_lengths):
        assert got[:-1] == want[:-1] and got[-1] <= want[-1]  # the row ends where max_new_tokens does
    assert sum(map(len, replayed)) > 8 * 10  # real cycles, not one per row
    assert history[-1]["val_tau"] == pytest.approx(walked_tau(replayed))
    assert history[-1]["fit_tau"] > 1.0


def test_export_round_trip(tmp_path):
    target = tiny_target("llama", seed=2)
    drafter = random_drafter(target, block_size=4, num_layers=2, seed=4)
    export_drafter(drafter.model, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == list(drafter.config.target_layer_ids)
    assert cfg["num_target_layers"] == 4 and cfg["layer_types"] == ["full_attention"] * 2
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "numpy") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "layers.1.self_attn.q_norm.weight" in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    loaded = load_drafter(tmp_path / "d", target)
    prompts = random_prompts(3, [5, 9, 4], 64, seed=5)
    a = speculative_generate(target, drafter, prompts, max_new_tokens=20, stop_token_ids=[])
    b = speculative_generate(target, loaded, prompts, max_new_tokens=20, stop_token_ids=[])
    assert a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths
    for x, y in zip(jax.tree.leaves(nnx.state(drafter.model)), jax.tree.leaves(nnx.state(loaded.model))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The z-lab fixture drafter survives export → load unchanged.
    z = load_drafter(ZLAB / "drafter")
    export_drafter(z.model, tmp_path / "z")
    with safe_open(str(ZLAB / "drafter" / "model.safetensors"), "numpy") as f1, \
            safe_open(str(tmp_path / "z" / "model.safetensors"), "numpy") as f2:
        assert set(f1.keys()) == set(f2.keys())
        for k in f1.keys():
            np.testing.assert_array_equal(f1.get_tensor(k), f2.get_tensor(k))


def test_deepened_drafter_starts_identical_then_trains_its_new_layers(tmp_path):
    """A warm start may add layers: the new ones start as the identity (same drafts), and training moves them."""
    target = tiny_target("qwen3", seed=1)
    _, data = self_distilled(target, n=16, new=24)
    shallow = random_drafter(target, block_size=4, num_layers=1, seed=3)
    deep = deepen_drafter(shallow, 3, seed=5)
    assert deep.config.layers.num_layers == 3 and deep.config.layer_types == ("full_attention",) * 3
    prompts = random_prompts(3, [5, 9, 4], 64, seed=5)
    a = speculative_generate(target, shallow, prompts, max_new_tokens=16, stop_token_ids=[])
    b = speculative_generate(target, deep, prompts, max_new_tokens=16, stop_token_ids=[])
    assert a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths
    new_o = lambda d: np.asarray(d.model.layers[2].self_attn.o_proj.kernel[...])  # noqa: E731
    assert not new_o(deep).any()
    Trainer(target, deep, TrainSettings(batch_size=4, max_anchors=8, max_steps=3, log_every=3, length_bucket=SHORT),
            tmp_path / "t", compiler_options=fast_options()).fit(data, progress=False)
    assert np.abs(new_o(deep)).max() > 0
    with pytest.raises(ConfigError, match="cannot deepen"):
        deepen_drafter(deep, 2)


def test_resume_equals_uninterrupted(tmp_path):
    target = tiny_target("qwen3", seed=1)
    _, data = self_distilled(target, n=16, new=24)
    s = TrainSettings(batch_size=4, max_anchors=8, max_steps=30, save_every=5, log_every=5, length_bucket=SHORT)

    def params(d):
        return [np.asarray(x) for x in jax.tree.leaves(nnx.state(d.model))]

    fast = fast_options()  # the same program in all three (bitwise comparison), compiled fast: few steps run
    full = random_drafter(target, block_size=4, num_layers=1, seed=0)
    h_full = Trainer(target, full, s, tmp_path / "full", compiler_options=fast).fit(data, progress=False)
    part = random_drafter(target, block_size=4, num_layers=1, seed=0)
    Trainer(target, part, s, tmp_path / "part", compiler_options=fast).fit(data, stop_after=12, progress=False)
    fresh = random_drafter(target, block_size=4, num_layers=1, seed=9)  # a new process: weights from the ckpt
    h_res = Trainer(target, fresh, s, tmp_path / "part", compiler_options=fast).fit(data, progress=False)
    for a, b in zip(params(full), params(fresh)):
        np.testing.assert_array_equal(a, b)
    # The loss curve continues identically: every row that averages the same steps in both runs is equal (the
    # first row after the resume averages only the steps the resumed process ran).
    by_step = {r["step"]: r for r in h_res}
    assert [r["step"] for r in h_res] == [r["step"] for r in h_full[:2]] + [12] + [r["step"] for r in h_full[2:]]
    same = [r for r in h_full if by_step[r["step"]]["logged_steps"] == r["logged_steps"]]
    assert len(same) == len(h_full) - 1 and by_step[15]["logged_steps"] == 3
    assert all(by_step[r["step"]]["loss"] == r["loss"] for r in same)


def test_timed_stops_then_resume_equal_uninterrupted(tmp_path):
    """stop_after_s (time-limited jobs): each call checkpoints where it stopped; the calls together train
    exactly the planned schedule of an unbroken run (here with repeat-weighted anchors, which must replay too)."""
    target = tiny_target("qwen3", seed=1)
    _, data = self_distilled(target, n=16, new=24)
    s = TrainSettings(batch_size=4, max_anchors=8, max_steps=10, save_every=50, log_every=4, length_bucket=SHORT,
                      repeat_anchor_weight=0.2, repeat_ngram=2)
    full = random_drafter(target, block_size=4, num_layers=1, seed=0)
    Trainer(target, full, s, tmp_path / "full", compiler_options=fast_options()).fit(data, progress=False)
    steps = []
    for call in range(3):
        # The first call starts from the same initial weights; later ones must take theirs from the checkpoint.
        part = random_drafter(target, block_size=4, num_layers=1, seed=0 if call == 0 else call + 7)
        trainer = Trainer(target, part, s, tmp_path / "part", compiler_options=fast_options())
        history = trainer.fit(data, progress=False, stop_after_s=0.0 if call < 2 else None)
        steps.append(history[-1]["step"])
        assert trainer.completed == (call == 2)
    assert steps == [1, 2, 10]  # a zero budget still trains (and checkpoints) one step per call
    for a, b in zip(jax.tree.leaves(nnx.state(full.model)), jax.tree.leaves(nnx.state(part.model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_time_budget_probe_times_one_compiled_shape(tmp_path):
    """time_budget_s plans from a steady-state step: the probe runs one batch shape (the widest of the first
    steps) repeatedly, never a sequence of different buckets whose compiles would pose as slow steps."""
    target = tiny_target("qwen3", seed=1)
    _, data = self_distilled(target, n=16, new=24)
    data["lengths"] = (data["prompt_lengths"] + np.arange(16) % 4 * 6 + 6).astype(np.int32)  # 4 length buckets
    s = TrainSettings(batch_size=4, max_anchors=8, epochs=4, length_bucket=8, time_budget_s=1e6)
    trainer = Trainer(target, random_drafter(target, block_size=4, num_layers=1, seed=0), s, tmp_path,
                      compiler_options=fast_options())
    trainer._build()
    step_fn, widths = trainer._step_fn, []

    def counting_step(params, opt_state, frozen, batch, lr):
        widths.append(batch["tokens"].shape[1])
        return step_fn(params, opt_state, frozen, batch, lr)

    trainer._step_fn = counting_step
    total = trainer._plan(data, s.total_steps(16))
    first_widths = {batch_for_step(data, i, s, 4)["tokens"].shape[1] for i in range(16)}
    assert len(first_widths) > 1  # the data does span several buckets
    assert len(widths) == 6 and set(widths) == {max(first_widths)}
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert total == plan["total_steps"] == 16  # a generous budget keeps the planned epochs
    assert plan["step_s"] > 0


RESUME_SETTINGS = dict(batch_size=4, max_anchors=8, max_steps=60, save_every=4, log_every=2, length_bucket=SHORT)
RESUME_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from conftest import tiny_target
from dflash_jax import random_drafter
from dflash_jax.train.trainer import Trainer, TrainSettings
target = tiny_target("qwen3", seed=1)
data = dict(np.load({data!r}))
d = random_drafter(target, block_size=4, num_layers=1, seed=0)
Trainer(target, d, TrainSettings(**{settings!r}), {out!r}).fit(data, progress=False)
np.savez({result!r}, *[np.asarray(x) for x in __import__("jax").tree.leaves(__import__("flax").nnx.state(d.model))])
"""


def test_sigkill_then_resume(tmp_path):
    """A real process killed with SIGKILL mid-run, then restarted: same final weights as an unbroken run (this
    process's: the same programs, XLA_FLAGS and initial weights as the subprocesses')."""
    target = tiny_target("qwen3", seed=1)
    _, data = self_distilled(target, n=16, new=24)
    np.savez(tmp_path / "data.npz", **data)

    def script(out, result):
        path = tmp_path / f"run_{out}.py"
        path.write_text(RESUME_SCRIPT.format(tests=str(Path(__file__).parent), data=str(tmp_path / "data.npz"),
                                             out=str(tmp_path / out), result=str(tmp_path / result),
                                             settings=RESUME_SETTINGS))
        return [sys.executable, str(path)]

    env = tiny_subprocess_env()
    proc = subprocess.Popen(script("killed", "killed.npz"), env=env)
    ckpts = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        steps = [int(p.name) for p in ckpts.glob("*") if p.name.isdigit()] if ckpts.exists() else []
        if steps and max(steps) >= 12:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed.npz").exists()
    subprocess.run(script("killed", "killed.npz"), check=True, env=env, timeout=600)
    unbroken = random_drafter(target, block_size=4, num_layers=1, seed=0)
    Trainer(target, unbroken, TrainSettings(**RESUME_SETTINGS), tmp_path / "ref").fit(data, progress=False)
    res = np.load(tmp_path / "killed.npz")
    ref = [np.asarray(x) for x in jax.tree.leaves(nnx.state(unbroken.model))]
    assert len(ref) == len(res.files) > 0
    for i, want in enumerate(ref):
        np.testing.assert_array_equal(res[f"arr_{i}"], want)
    history = [json.loads(x) for x in (tmp_path / "killed" / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == sorted(r["step"] for r in history)  # no duplicated steps
    assert history[-1]["step"] == 60


def row_bytes(data: dict, where: np.ndarray | None = None) -> set[bytes]:
    """A dataset's rows (tokens up to each length) as a set, optionally only where ``where`` is true."""
    keep = np.ones(len(data["lengths"]), bool) if where is None else where
    return {data["tokens"][i, :n].tobytes() for i, n in enumerate(data["lengths"]) if keep[i]}


def test_pipeline_on_token_id_prompts(tmp_path, monkeypatch):
    """prompts → data → train → export → eval through the same code the CLI runs (tiny z-lab target)."""
    import dflash_jax
    from dflash_jax.train import pipeline
    from dflash_jax.train.pipeline import run

    # Its Trainers' programs (20 steps, replays) compiled fast, as the decode programs are (conftest).
    monkeypatch.setattr(pipeline, "Trainer", functools.partial(Trainer, compiler_options=fast_options()))
    verify_modes = []

    def recording(*args, **kw):  # the eval stage's τ is the drafter's at full width, whatever "auto" would pick
        verify_modes.append(kw.get("verify_mode"))
        return speculative_generate(*args, **kw)

    monkeypatch.setattr(dflash_jax, "speculative_generate", recording)

    rng = np.random.default_rng(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": rng.integers(0, 255, int(rng.integers(3, 9))).tolist()})
                               + "\n" for _ in range(40)))
    cfg = {"name": "tiny", "target": str(ZLAB / "target"),
           "training": {"out_dir": str(tmp_path / "run"),
                        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 255, "num_features": 2},
                        "data": {"prompts_file": str(prompts), "num_prompts": 32, "max_new_tokens": 24,
                                 "generate_batch_size": 8, "chunk_batches": 2},
                        "optim": {"batch_size": 4, "max_anchors": 8, "max_steps": 20, "save_every": 10,
                                  "length_bucket": SHORT, "block_widths": [2, 4, 4]},
                        "eval": {"sets": [str(prompts)], "max_new_tokens": 16, "batch_size": 8, "limit": 8},
                        "export_dtype": "float32"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    # Time-limited calls: a zero budget still writes one data chunk per call; the finished chunks are merged
    # into data.npz (marked incomplete) and the later stages wait.
    stopped = run(tmp_path / "cfg.yaml", progress=False, stop_after_s=0.0)
    assert stopped["data_incomplete"]["chunks_done"] == 1 and stopped["data_incomplete"]["rows"] == 16
    assert "stopped_at" not in stopped and not (out / "checkpoints").exists()
    partial = data_mod.load_dataset(out / "data.npz")
    # The second call completes the data; training then stops (checkpointed, weights exported).
    stopped = run(tmp_path / "cfg.yaml", progress=False, stop_after_s=0.0)
    assert "data_incomplete" not in stopped and stopped["stopped_at"] == 1 and "eval" not in stopped
    full = data_mod.load_dataset(out / "data.npz")
    assert len(full["lengths"]) == 32
    parts = [row_bytes(dict(np.load(f))) for f in sorted((out / "data_parts").glob("part_*.npz"))]
    assert len(parts) == 2 and row_bytes(partial) in parts and row_bytes(full) == parts[0] | parts[1]
    assert (out / "drafter" / "model.safetensors").is_file()
    assert json.loads((out / "train_summary.json").read_text())["completed"] is False
    result = run(tmp_path / "cfg.yaml", progress=False)
    assert json.loads((out / "train_summary.json").read_text())["completed"] is True
    assert len(list((out / "data_parts").glob("part_*.npz"))) == 2  # 32 prompts / (8 × 2) per part
    assert json.loads((out / "data_summary.json").read_text())["rows"] == 32
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert (out / "drafter" / "model.safetensors").is_file()
    # Trained at widths 2 and 4 (its block): the exported config says so, and its compact steps may use it.
    assert json.loads((out / "drafter" / "config.json").read_text())["dflash_config"]["trained_widths"] == [2]
    ev = result["eval"][str(prompts)]
    assert ev["prompts"] == 8 and ev["identical_rows"] == 8 and ev["tau"] >= 1.0
    assert verify_modes == ["static"]  # one batch of 8
    assert (out / "eval_acceptance.png").stat().st_size > 1000
    # Running again redoes nothing (every stage is already complete) and yields the same drafter.
    before = (out / "drafter" / "model.safetensors").read_bytes()
    run(tmp_path / "cfg.yaml", stages=("prompts", "data", "export"), progress=False)
    assert (out / "drafter" / "model.safetensors").read_bytes() == before
    # A warm start from that drafter may add layers (deepened, same drafts at first), never remove them.
    from dflash_jax.train.pipeline import Pipeline

    for layers, ok in ((2, True), (0, False)):
        cfg["training"]["drafter"].update(num_layers=layers, init_from=str(out / "drafter"))
        (tmp_path / "warm.yaml").write_text(yaml.safe_dump(cfg))
        pipe = Pipeline(load_run_config(tmp_path / "warm.yaml"))
        if ok:
            assert pipe.new_drafter().config.layers.num_layers == 2
        else:
            with pytest.raises(ConfigError, match="may add layers, not remove them"):
                pipe.new_drafter()


def test_data_stage_adds_seeded_sampled_responses(tmp_path):
    """``sampled_responses: 1``: each prompt's greedy row, then a sampled one; the same config gives the
    same data again (seeded), and the greedy rows are what plain greedy generation gives."""
    from dflash_jax.train.pipeline import run

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 255, int(rng.integers(3, 9))).tolist() for _ in range(12)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    datas = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cfg = {"name": "tiny", "target": str(ZLAB / "target"),
               "training": {"out_dir": str(tmp_path / name),
                            "data": {"prompts_file": str(tmp_path / "prompts.jsonl"), "num_prompts": 12,
                                     "max_new_tokens": 12, "generate_batch_size": 4, "chunk_batches": 2,
                                     "sampled_responses": 1, "sample_temperature": 1.0, "seed": seed}}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        datas.append(data_mod.load_dataset(Path(run(tmp_path / f"{name}.yaml", ("prompts", "data"),
                                                     progress=False)["data"])))
    first, again, reseeded = datas
    assert len(first["lengths"]) == 24
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    rows = [(first["tokens"][i, :p].tolist(), first["tokens"][i, p:n].tolist())
            for i, (p, n) in enumerate(zip(first["prompt_lengths"], first["lengths"]))]
    # each generation batch of 4 prompts (one call of 8 rows): their 4 greedy rows, then their 4 sampled rows
    greedy = [r for k in range(0, 24, 8) for r in rows[k: k + 4]]
    sampled = [r for k in range(0, 24, 8) for r in rows[k + 4: k + 8]]
    assert [p for p, _ in greedy] == [p for p, _ in sampled]
    assert sorted(map(tuple, (p for p, _ in greedy))) == sorted(map(tuple, prompts))
    direct = generate(load_target(ZLAB / "target", "float32"), [p for p, _ in greedy], max_new_tokens=12)
    assert [r for _, r in greedy] == direct.token_ids
    assert sum(g != s for (_, g), (_, s) in zip(greedy, sampled)) >= 6
    assert first["sampled"].tolist() == ([False] * 4 + [True] * 4) * 3
    # Another data seed: the same greedy rows, other sampled ones.
    assert row_bytes(reseeded, ~reseeded["sampled"]) == row_bytes(first, ~first["sampled"])
    assert len(row_bytes(reseeded, reseeded["sampled"]) & row_bytes(first, first["sampled"])) <= 3
    # Held-out τ rows are greedy rows, and their prompts' sampled rows are not trained on either.
    target = load_target(ZLAB / "target", "float32")
    trainer = Trainer(target, random_drafter(target, block_size=4, num_layers=1, mask_token_id=255),
                      TrainSettings(val_rows=2), tmp_path / "t")
    kept, sets = trainer.split_validation(first)
    prompt_of = lambda d, i: tuple(d["tokens"][i, : d["prompt_lengths"][i]])  # noqa: E731
    held = {prompt_of(sets["val_tau"], i) for i in range(2)}
    assert not sets["val_tau"]["sampled"].any() and not sets["fit_tau"]["sampled"].any()
    assert len(kept["lengths"]) == 24 - 4 and not held & {prompt_of(kept, i) for i in range(20)}
    assert {prompt_of(sets["fit_tau"], i) for i in range(2)} <= {prompt_of(kept, i) for i in range(20)}


def test_code_prompts_from_python_sources(tmp_path):
    """Documented public functions become HumanEval-style prompts cut after the docstring; private,
    undocumented, test-folder, duplicate, excluded and unparsable code is skipped; the shuffle is seeded."""
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "mod.py").write_text(
        "import os\n\n"
        "@staticmethod\n"
        "def area(w, h):\n"
        "    \"\"\"Return the area of a w-by-h rectangle, in square units.\"\"\"\n"
        "    return w * h\n\n"
        "def _private(x):\n    \"\"\"A private helper with a long enough docstring here.\"\"\"\n\n"
        "def undocumented(x):\n    return x\n\n"
        "def terse(x):\n    \"\"\"Too short.\"\"\"\n\n"
        "class Box:\n"
        "    def volume(self, depth):\n"
        "        \"\"\"Volume of the box when it is extruded to the given depth.\n\n"
        "        Depth is in the same units as the sides.\n"
        "        \"\"\"\n"
        "        return depth\n")
    (pkg / "copy.py").write_text((pkg / "mod.py").read_text())  # same functions again: deduplicated
    (pkg / "tests" / "test_mod.py").write_text("def test_area():\n    \"\"\"A test, not a specification.\"\"\"\n")
    (pkg / "broken.py").write_text("def oops(:\n")
    prompts = data_mod.python_function_prompts([pkg])
    area = data_mod.humaneval_chat_prompt(
        'def area(w, h):\n    """Return the area of a w-by-h rectangle, in square units."""\n')
    volume = data_mod.humaneval_chat_prompt(
        'def volume(self, depth):\n    """Volume of the box when it is extruded to the given depth.\n\n'
        '    Depth is in the same units as the sides.\n    """\n')
    assert sorted(prompts) == sorted([area, volume])
    assert data_mod.python_function_prompts([pkg], exclude=['def AREA(w, h):  """Return the area of a '
                                                            'w-by-h rectangle, in square units."""']) == [volume]
    assert data_mod.python_function_prompts([pkg], limit=1) == data_mod.python_function_prompts([pkg])[:1]
    # The real sources, the standard library first: four of its packages give hundreds (the whole library
    # thousands, but one parse of it takes ~10 s), in the same order every time.
    stdlib = data_mod.python_sources()[0]
    assert (stdlib / "email").is_dir()
    packages = [stdlib / name for name in ("email", "asyncio", "json", "concurrent")]
    real = data_mod.python_function_prompts(packages)
    assert len(set(real)) == len(real) > 300 and data_mod.python_function_prompts(packages) == real
    with pytest.raises(data_mod.DataError, match="no documented public functions"):
        data_mod.python_function_prompts([pkg / "tests"], min_doc_chars=10**6)
    with pytest.raises(data_mod.DataError, match="'no_such_package' is not installed"):
        data_mod.python_sources(["no_such_package"])


def test_synthesised_prompts_filtered_deduplicated_and_held_out():
    """Self-synthesised instructions: only messages that ended the turn count; loops, junk, duplicates (after
    normalising) and evaluation prompts are dropped; rounds are seeded and capped; the real template's prefix
    is the start of every templated prompt."""
    end = 10**7  # no character's code
    held = data_mod.general_prompts()[0]
    script = [  # what the "target" samples, round by round (ids = characters + the end id)
        ["Explain how tides work, briefly.", "Write a poem about rain in April.", held,
         "no end marker so it was cut off"],
        ["explain HOW tides   work, briefly.", "ha" * 40, "1234 5678 9012 3456 !!!", "Give me three tips for sleep."],
        ["Never reached: the count was met."],
    ]
    encode = lambda text, ended=True: [ord(c) for c in text] + ([end] if ended else [])  # noqa: E731
    calls = []

    def sample(batch, round_):
        calls.append((batch, round_))
        return [encode(t, ended="cut off" not in t) for t in script[round_]]

    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    out = data_mod.synthesise_prompts(sample, decode, [end], 3, batch_size=4, min_chars=16, progress=False,
                                      exclude=data_mod.held_out_texts())
    assert out == ["Explain how tides work, briefly.", "Write a poem about rain in April.",
                   "Give me three tips for sleep."]
    assert calls == [(4, 0), (4, 1)]
    few = data_mod.synthesise_prompts(sample, decode, [end], 50, batch_size=4, max_rounds=2, progress=False)
    assert len(few) == 4 and held.strip() in few  # capped at two rounds; nothing excluded this time
    with pytest.raises(data_mod.DataError, match="synthesised no usable prompts"):
        data_mod.synthesise_prompts(lambda b, r: [encode("x" * 30, ended=False)], decode, [end], 2, batch_size=1,
                                    progress=False)
    from dflash_jax.loading import embedded_gguf_path
    from dflash_jax.tokenizer import Tokenizer

    gguf = embedded_gguf_path()
    tok = Tokenizer.from_dir(gguf.parent, gguf_file=gguf.name)
    prefix = tok.user_turn_prefix()
    assert tok.decode(prefix).endswith("user\n") and tok.encode("Hello there")[: len(prefix)] == prefix
    general = data_mod.evaluation_prompts()["general"]  # IFBench's chat prompts, as they are
    assert len(general) == 294 and len(set(general)) == 294


def test_bad_training_input(tmp_path):
    with pytest.raises(data_mod.DataError, match="does not exist"):
        data_mod.load_dataset(tmp_path / "nope.npz")
    np.savez(tmp_path / "empty.npz", tokens=np.zeros((0, 4), np.int32), lengths=np.zeros(0, np.int32),
             prompt_lengths=np.zeros(0, np.int32))
    with pytest.raises(data_mod.DataError, match="has no rows"):
        data_mod.load_dataset(tmp_path / "empty.npz")
    with pytest.raises(data_mod.DataError, match="no ShareGPT prompts left"):
        data_mod.sharegpt_prompts(min_chars=10**6)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(data_mod.DataError, match="bad.jsonl:2"):
        data_mod.read_prompt_file(tmp_path / "bad.jsonl")
    cfg = {"target": "x", "training": {"drafter": {"block_size": 1}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="block_size must be >= 2"):
        load_run_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"target": "x", "training": {"optim": {"lr0": 1}}}))
    with pytest.raises(ConfigError, match="unknown keys"):
        load_run_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="ce_chunk_rows must be >= 1"):
        small = tiny_target("qwen3")
        Trainer(small, random_drafter(small, block_size=4), TrainSettings(ce_chunk_rows=0), tmp_path / "y")
    for widths in ((1, 4), (2, 5), ()):
        with pytest.raises(ConfigError, match=r"block_widths must be integers in \[2, 4\]"):
            Trainer(small, random_drafter(small, block_size=4), TrainSettings(block_widths=widths), tmp_path / "y")
    with pytest.raises(ConfigError, match="drafts sequentially"):
        Trainer(small, random_drafter(small, block_size=4, kind="dspark"), TrainSettings(block_widths=(2,)),
                tmp_path / "y")
    with pytest.raises(ConfigError, match="trained_widths must be increasing"):
        with_config(random_drafter(small, block_size=4), trained_widths=(4,))
    # A drafter checkpoint made for another target shape cannot be trained or loaded against this target.
    other = tiny_target("qwen3", hidden_size=48, vocab_size=256, num_layers=6)
    with pytest.raises(ConfigError, match="hidden_size"):
        Trainer(other, load_drafter(ZLAB / "drafter"), TrainSettings(), tmp_path / "x")


def test_generation_halves_a_batch_the_device_cannot_hold(monkeypatch):
    """The data stage's generate calls (``generate_fitting``): a batch that runs out of device memory is generated
    in halves (the recipe's batch sized for a larger device); greedy answers are the same; other errors pass."""
    import dflash_jax
    from dflash_jax.train import pipeline

    target = tiny_target("qwen3", seed=2)
    prompts = random_prompts(6, [3, 5, 4, 6, 3, 5], 64, seed=1)
    whole = generate(target, prompts, max_new_tokens=6, stop_token_ids=[])
    sizes = []

    def small_device(target, prompts, **kw):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34.45GiB")
        return generate(target, prompts, **kw)

    monkeypatch.setattr(dflash_jax, "generate", small_device)
    answers, made = pipeline.generate_fitting(target, prompts, temperature=[0.0] * 6, seed=0, max_new_tokens=6,
                                              stop_token_ids=[])
    assert answers == whole.token_ids and made == whole.stats["new_tokens"] and sizes == [6, 3, 1, 2, 3, 1, 2]
    monkeypatch.setattr(dflash_jax, "generate", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad prompt")))
    with pytest.raises(ValueError, match="bad prompt"):
        pipeline.generate_fitting(target, prompts, temperature=[0.0] * 6, seed=0, max_new_tokens=6)
