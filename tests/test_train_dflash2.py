"""DFlash2 training: the warm start from a DFlash drafter drafts exactly what it drafts, the loss against a direct
computation, a short run that learns (selector included) and resumes, the acceptance replay against real
speculative decoding, export → load of the trained drafter, and the pipeline's pieces.

Compiles are the cost on a CPU, so the module shares one Trainer (its training step and its replay serve every
test) and one probe program.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from conftest import random_prompts, tiny_target
from dflash_jax import drafters, generate, load_drafter, random_drafter, speculative_generate
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.config import ConfigError
from dflash_jax.loading import Drafter, dflash2_from_dflash, dspark_from_dflash
from dflash_jax.models.drafter import DFlash2Drafter
from dflash_jax.train.data import pack_rows
from dflash_jax.train.objective import (block_inputs, default_gamma, drafter_forward_blocks, target_features,
                                        target_states, walked_cycles)
from dflash_jax.train.trainer import Trainer, TrainSettings, batch_for_step, plot_history

L, K, RANK, GROUP, NEW = 6, 4, 16, 8, 28  # block (verify width), candidates, selector rank, channels per delta group
UNOPTIMISED = {"xla_backend_optimization_level": 0}  # programs that run a few times: compile them fast
greedy = lambda row, key: (jnp.argmax(row, -1).astype(jnp.int32), None)  # noqa: E731 (the loop's argmax pick)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=1, num_layers=2)


@pytest.fixture(scope="module")
def trunk(target):
    return random_drafter(target, block_size=L, num_layers=1, seed=0)


@pytest.fixture(scope="module")
def warm(trunk):
    return dflash2_from_dflash(trunk, L, conv_group_size=GROUP, selector_top_k=K, selector_rank=RANK, seed=1)


@pytest.fixture(scope="module")
def rows(target):
    """Greedy rows of the target (prompt + answer)."""
    prompts = random_prompts(16, [4, 8, 12], target.config.vocab_size, seed=0)
    out = generate(target, prompts, max_new_tokens=NEW, stop_token_ids=[])
    return prompts, pack_rows(prompts, out.token_ids, max(len(p) for p in prompts) + NEW)


def _copy(d: Drafter) -> Drafter:
    """A DFlash2 drafter with its own copy of ``d``'s weights."""
    model = nnx.eval_shape(lambda: DFlash2Drafter(d.config, rngs=nnx.Rngs(0)))
    nnx.update(model, jax.tree.map(jnp.copy, nnx.state(d.model)))
    return Drafter(model, d.name, d.trained)


def _params(d: Drafter) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(d.model, nnx.Param)))


@pytest.fixture(scope="module")
def trained(target, warm, rows, tmp_path_factory):
    """(trainer, history, initial weights): 24 steps, interrupted after 10 and resumed from the checkpoint."""
    s = TrainSettings(batch_size=4, max_anchors=8, max_steps=24, lr=1e-2, save_every=12, log_every=6,
                      val_rows=4, val_every=12, ce_chunk_rows=7, length_bucket=32, block_widths=(3, L, L),
                      selector_teacher=0.25)
    trainer = Trainer(target, _copy(warm), s, tmp_path_factory.mktemp("dflash2_train"), compiler_options=UNOPTIMISED)
    trainer.fit(rows[1], progress=False, stop_after=10)
    trainer.params = jax.tree.map(jnp.zeros_like, trainer.params)  # a new process: weights from the checkpoint
    history = trainer.fit(rows[1], progress=False)
    return trainer, history, _params(warm)


def test_warm_start_drafts_exactly_what_the_dflash_drafter_drafts(target, trunk, warm):
    """Trunk copied, identity convolutions (kernel_projection zero) and a zero hidden projection: the same hidden
    states, in decoding's forward and in training's, and greedy walks that take DFlash's argmax."""
    src, dst = _params(trunk), _params(warm)
    for key in ("fc", "hidden_norm", "norm"):
        for a, b in zip(jax.tree.leaves(src[key]), jax.tree.leaves(dst[key])):
            np.testing.assert_array_equal(a, b)
    layer = dst["layers"][0]
    for a, b in zip(jax.tree.leaves(src["layers"][0]), jax.tree.leaves({k: layer[k] for k in src["layers"][0]})):
        np.testing.assert_array_equal(a, b)
    for conv in (layer["attention_conv"], layer["mlp_conv"]):
        assert (conv["base_kernel"] == np.zeros((2, 2, 32)) + (np.arange(2) == 0)[None, :, None]).all()
        assert not conv["kernel_projection"]["kernel"].any()
    assert not dst["candidate_selector"]["hidden_projection"]["kernel"].any()
    assert dst["candidate_selector"]["predecessor_codebook"].std() > 0.1  # the projection's gradient needs them
    assert warm.config.kind == "dflash2" and warm.config.verify_width == L
    assert (warm.config.selector_top_k, warm.config.selector_rank, warm.config.conv_group_size) == (K, RANK, GROUP)

    rng = np.random.default_rng(0)
    b, s = 6, 9
    feats = jnp.asarray(rng.normal(size=(b, s, trunk.config.num_features * 32)), jnp.float32)
    anchors = jnp.asarray(rng.integers(0, 64, b), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 24)), jnp.int32)
    block_anchors = jnp.asarray([[3, 9, 14], [5, 11, 17]], jnp.int32)

    # A random trunk's hidden states hardly vary (one or two tokens drafted everywhere): the walk is also fed
    # random hidden states, whose top-1 differs from position to position.
    spread = jnp.asarray(rng.normal(size=(b, L - 1, 32)), jnp.float32)

    @nnx.jit
    def views(t, d):
        pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        cache = d.materialize(d.new_cache(b, 32), feats, pos)
        block = jnp.concatenate([anchors[:, None], jnp.full((b, L - 1), d.config.mask_token_id)], 1)
        hidden = d(t.embed(block), s + jnp.broadcast_to(jnp.arange(L), (b, L)), cache, jnp.full((b,), s))
        kind = drafters.kind_of(d)
        drafts = kind.draft(t, hidden[:, 1:], anchors, greedy, None)[0]
        spread_drafts = kind.draft(t, spread, anchors, greedy, None)[0]
        ids, pos, _, _ = block_inputs(tokens, jnp.asarray([24, 24]), block_anchors, jnp.ones((2, 3), bool), L,
                                      d.config.mask_token_id)
        trained = drafter_forward_blocks(d, t, target_features(t, tokens, d.config.target_layer_ids), ids, pos,
                                         block_anchors)
        return hidden, trained, drafts, spread_drafts

    dflash, dflash2 = (jax.tree.map(np.asarray, views(target.model, d.model)) for d in (trunk, warm))
    for name, a, b in zip(("hidden", "training hidden", "drafts", "drafts of spread states"), dflash, dflash2):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert len(np.unique(dflash[3])) > 10  # drafts that could differ
    with pytest.raises(ConfigError, match="takes a DFlash drafter"):
        dflash2_from_dflash(warm, L)


@pytest.fixture(scope="module")
def probe(target, trained, rows):
    """The trained drafter's view of one training batch (one compile): the batch, its blocks, the drafter's hidden
    states and the target's final ones."""
    trainer = trained[0]
    batch = batch_for_step(rows[1], 3, trainer.s, trainer.block_size)
    graphs, params = zip(nnx.split(trainer.drafter.model), nnx.split(target.model))

    @functools.partial(jax.jit, compiler_options=UNOPTIMISED)
    def run(params, batch):
        d, t = (nnx.merge(g, p) for g, p in zip(graphs, params))
        hidden_t, feats = target_states(t, batch["tokens"], d.config.target_layer_ids)
        blocks = block_inputs(batch["tokens"], batch["lengths"], batch["anchors"], batch["valid"], L,
                              d.config.mask_token_id, batch["widths"])
        hidden = drafter_forward_blocks(d, t, feats, blocks[0], blocks[1], batch["anchors"], batch["widths"])
        return blocks, hidden, hidden_t

    return batch, jax.tree.map(np.asarray, run(params, jax.tree.map(jnp.asarray, batch)))


def test_loss_matches_a_direct_computation(target, trained, probe):
    """CE, the selector's K-way CE (label put in for the K-th candidate where missing) mixed with its CE against
    the target's distribution over the candidates (λ = 0.25), their sum, acc / τ of the teacher-forced walk, the
    trunk's acc / τ and the top-K recall, from the compiled (chunked) step, equal a numpy computation from the
    trained drafter's hidden states and weights and the target's final hidden states."""
    trainer = trained[0]
    batch, ((ids, pos, labels, ok), hidden, hidden_t) = probe
    copy = jax.tree.map(jnp.copy, trainer.params)  # the step donates its input (the drafter shares it)
    _, _, m = trainer._step_fn(copy, trainer.tx.init(copy), trainer.frozen, batch, jnp.float32(0.0))
    sel = trainer.drafter.model.candidate_selector
    pcb, scb = np.asarray(sel.predecessor_codebook[...]), np.asarray(sel.successor_codebook[...])
    wh = np.asarray(sel.hidden_projection.kernel[...])
    assert np.abs(wh).max() > 1e-3  # training moved the projection: the pairwise term is in play
    h = hidden[:, :, 1:]
    lm_head = np.asarray(target.model.lm_head.kernel[...])
    logits = h @ lm_head  # [Bs, A, L-1, V]
    prev = np.concatenate([ids[..., :1], labels[..., :-1]], -1)
    lse = lambda x: np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)  # noqa: E731
    ce = lse(logits) - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    top = np.argsort(-logits, -1, kind="stable")[..., :K]
    found = (top == labels[..., None]).any(-1)
    top_in = top.copy()
    top_in[..., -1] = np.where(found, top[..., -1], labels)
    at = np.where(found, (top_in == labels[..., None]).argmax(-1), K - 1)
    scores = np.take_along_axis(logits, top_in, -1) + np.einsum("...r,...cr->...c", pcb[prev] * (h @ wh), scb[top_in])
    log_q = scores - lse(scores)[..., None]
    sel_ce = -np.take_along_axis(log_q, at[..., None], -1)[..., 0]
    at_t = np.minimum(pos[..., :-1], hidden_t.shape[1] - 1)  # the target's logits there predict slot k's token
    teacher = np.take_along_axis(np.stack([ht[p] for ht, p in zip(hidden_t, at_t)]) @ lm_head, top_in, -1)
    p_t = np.exp(teacher - lse(teacher)[..., None])
    teacher_ce = -(p_t * log_q).sum(-1)
    w = np.exp(-np.arange(L - 1) / default_gamma(L)) * ok
    sel_right = found & (scores.argmax(-1) == at) & ok
    unary_right = (logits.argmax(-1) == labels) & ok
    v = batch["valid"]
    tau = lambda right: (np.cumprod(right, -1).sum(-1) + 1)[v].mean()  # noqa: E731
    mean = lambda x: (x * w).sum() / w.sum()  # noqa: E731
    want = {"ce": mean(ce), "selector": 0.75 * mean(sel_ce) + 0.25 * mean(teacher_ce),
            "selector_teacher": mean(teacher_ce),
            "acc": sel_right.sum() / ok.sum(), "tau": tau(sel_right), "unary_acc": unary_right.sum() / ok.sum(),
            "unary_tau": tau(unary_right), "recall": (found & ok).sum() / ok.sum(), "recall_tau": tau(found & ok)}
    want["loss"] = want["ce"] + want["selector"]
    assert abs(want["selector_teacher"] - mean(sel_ce)) > 1e-3  # the distribution is not the token's one-hot
    for k, x in want.items():
        np.testing.assert_allclose(float(m[k]), x, rtol=2e-4, err_msg=k)
    assert 0 < want["recall"] < 1 and (~found & ok).any()  # labels both among the top-K and put in
    assert want["tau"] <= want["recall_tau"]  # the walk finds the label only where it is a candidate
    # Blocks trained at width 3 (block_widths): two drafts labelled, the rest hidden (their loss is not counted).
    narrow = batch["widths"] == 3
    assert narrow.any() and (~narrow).any() and not ok[narrow][:, 2:].any()
    # The teacher-forced τ is decoding's: the walk over the same blocks (the replay's program) commits as much.
    accepted, z = jax.device_get(trainer._accept_fn(trainer.params, trainer.frozen, batch))
    assert accepted[v].mean() == pytest.approx(want["tau"]) and z.shape == (*v.shape, L - 1)


def test_short_training_lowers_the_loss_moves_the_selector_and_resumes(trained, rows, warm, tmp_path):
    trainer, history, params0 = trained
    assert [r["step"] for r in history] == [6, 10, 12, 18, 24]  # rows of the first call, its stop, the resumed ones
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"] and last["selector"] < first["selector"] and last["ce"] < first["ce"]
    assert {"recall", "unary_acc", "unary_tau", "val_tau", "fit_tau"} <= set(last) and trainer.completed
    now = _params(trainer.drafter)  # written back into the drafter module
    sel0, sel1 = params0["candidate_selector"], now["candidate_selector"]
    assert np.abs(sel1["hidden_projection"]["kernel"]).max() > 1e-3
    for book in ("predecessor_codebook", "successor_codebook"):
        assert np.abs(sel1[book] - sel0[book]).max() > 1e-3
    conv = now["layers"][0]["attention_conv"]
    assert np.abs(conv["kernel_projection"]["kernel"]).max() > 1e-3
    assert np.abs(conv["base_kernel"] - params0["layers"][0]["attention_conv"]["base_kernel"]).max() > 1e-3
    # The resumed run equals an uninterrupted one (same compiled step, another directory).
    trainer.out_dir, resumed = tmp_path / "whole", trainer.params
    trainer.out_dir.mkdir()
    trainer.params = jax.tree.map(jnp.asarray, params0)
    trainer.fit(rows[1], progress=False)
    for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert plot_history(history, tmp_path / "curve.png").stat().st_size > 1000


def test_replay_equals_speculative_decoding_and_export_round_trip(target, trained, rows, tmp_path):
    """The replay (the kind's top-K and walk over training-shaped blocks, no decoding loop) gives the cycles real
    decoding of the trained drafter runs; the exported drafter (the public DFlash2 layout) loads and decodes
    identically."""
    trainer = trained[0]
    prompts, data = rows
    drafter = trainer.drafter
    out = speculative_generate(target, drafter, prompts, max_new_tokens=NEW, stop_token_ids=[])
    np.testing.assert_array_equal(pack_rows(prompts, out.token_ids, data["tokens"].shape[1])["tokens"],
                                  data["tokens"])  # lossless: the greedy rows
    acceptance, z = trainer.replay(_params(drafter), data)
    replayed = [walked_cycles(a, p, n) for a, p, n in zip(acceptance, data["prompt_lengths"], data["lengths"])]
    for got, want in zip(replayed, out.acceptance_lengths):
        assert len(got) == len(want) and got[:-1] == want[:-1] and got[-1] <= want[-1]  # the row ends at NEW
    assert len({a for row in out.acceptance_lengths for a in row}) >= 3
    # The replay's confidence logits are the walk's probabilities: decoding's predicted survival.
    anchors = [(i, p) for i, row in enumerate(out.acceptance_lengths)
               for p in data["prompt_lengths"][i] + np.cumsum([0] + row[:-1])]
    conf = 1 / (1 + np.exp(-np.stack([z[i, p] for i, p in anchors])))
    np.testing.assert_allclose(np.cumprod(conf, -1).mean(0), out.stats["predicted_survival"], atol=2e-4)

    path = export_drafter(drafter.model, tmp_path / "exported")
    hf = json.loads((path / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["dflash_config"]["selector_rank"] == RANK
    loaded = load_drafter(path, target)
    assert loaded.config == drafter.config
    for a, b in zip(jax.tree.leaves(nnx.state(drafter.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(loaded.model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = speculative_generate(target, loaded, prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert again.acceptance_lengths == out.acceptance_lengths


def test_pipeline_pieces(target, trunk, trained, rows, tmp_path):
    """``kind: dflash2`` in the YAML: a warm start from an exported DFlash drafter (deepened), the eval stage's
    calibration report of the selector's confidences, STS fitted on replayed cycles; the shipped recipe parses."""
    from dflash_jax.train.objective import objective_for
    from dflash_jax.train.pipeline import Pipeline, load_run_config

    export_drafter(trunk.model, tmp_path / "dflash")
    spec = {"kind": "dflash2", "block_size": L, "num_layers": 2, "selector_rank": RANK, "selector_top_k": K,
            "conv_group_size": GROUP, "conv_kernel_size": 3, "init_from": str(tmp_path / "dflash")}
    cfg = {"target": "unused", "training": {"out_dir": str(tmp_path / "run"), "drafter": spec}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    c = _new_drafter(tmp_path / "c.yaml", target).config
    assert (c.kind, c.block_size, c.layers.num_layers, c.conv_kernel_size) == ("dflash2", L, 2, 3)
    assert objective_for("dflash2").calibrates  # STS after training: the kind applies the temperatures
    dspark = dspark_from_dflash(trunk, L - 1, RANK)
    export_drafter(dspark.model, tmp_path / "dspark")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(
        {**cfg, "training": {**cfg["training"], "drafter": {**spec, "init_from": str(tmp_path / "dspark")}}}))
    with pytest.raises(ConfigError, match="a DFlash2 warm start takes a DFlash drafter"):
        _new_drafter(tmp_path / "c.yaml", target)
    trainer = trained[0]
    pipe = Pipeline(load_run_config(tmp_path / "c.yaml"))
    pipe._target, pipe._replayer = target, trainer
    report = pipe._eval_calibration(trainer.drafter, "set.jsonl", rows[0], [
        r[p:n].tolist() for r, p, n in zip(rows[1]["tokens"], rows[1]["prompt_lengths"], rows[1]["lengths"])])
    assert report["cycles"] > 10 and len(report["ece_before"]) == L - 1
    assert report["ece_before"] == report["ece_after"]  # temperatures 1: the confidences as decoding uses them
    assert (tmp_path / "run" / "eval_reliability_set.png").stat().st_size > 1000
    fitted = pipe.calibrate(trainer, rows[1], trainer.drafter)  # STS on the rows' replayed cycles
    fit = json.loads((tmp_path / "run" / "sts.json").read_text())
    assert fitted.config.confidence_temperatures == tuple(fit["temperatures"]) and len(fit["temperatures"]) == L - 1
    assert fit["overall_ece_after"] <= fit["overall_ece_before"] + 1e-9
    recipe = load_run_config(Path(__file__).parents[1] / "configs" / "smollm2-135m-dflash2.yaml")
    r = recipe.drafter
    assert (r.kind, r.block_size, r.init_from) == ("dflash2", 16, "dflash_jax/assets/smollm2-135m-dflash")
    assert 576 % r.conv_group_size == 0 and recipe.out_dir != load_run_config(
        Path(__file__).parents[1] / "configs" / "smollm2-135m-dspark.yaml").out_dir


def _new_drafter(path, target):
    from dflash_jax.train.pipeline import Pipeline, load_run_config

    pipe = Pipeline(load_run_config(path))
    pipe._target = target
    return pipe.new_drafter()
