"""DSpark training (SPEC §7): the loss against a direct computation, the warm start from a DFlash trunk, a short
run that learns and resumes, STS, and the acceptance replay against real speculative decoding.

Compiles are the cost on a CPU, so the module shares one set: one DSpark decode program (both decoding calls have
the same drafter structure and shapes) and one Trainer (its training step and its replay serve every test).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from conftest import random_prompts, tiny_target
from dflash_jax import load_drafter, random_drafter, speculative_generate
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.config import ConfigError
from dflash_jax.loading import Drafter, dspark_from_dflash, restrict_draft_vocab, with_confidence_temperatures
from dflash_jax.models.drafter import DSparkDrafter
from dflash_jax.train import sts
from dflash_jax.train.data import pack_rows
from dflash_jax.train.objective import (default_gamma, dspark_block_inputs, drafter_forward_blocks,
                                        sequential_drafts, target_states, walked_cycles, walked_tau)
from dflash_jax.train.trainer import Trainer, TrainSettings, batch_for_step, plot_history

G, RANK, NEW = 4, 64, 28  # drafts per block; Markov rank = the tiny vocabulary (one-hot bigram heads fit)
UNOPTIMISED = {"xla_backend_optimization_level": 0}  # programs that run a few times: compile them fast


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=1, num_layers=1)


@pytest.fixture(scope="module")
def trunk(target):
    return random_drafter(target, block_size=6, num_layers=1, seed=0)


@pytest.fixture(scope="module")
def warm(target, trunk):
    return dspark_from_dflash(trunk, G, RANK, seed=1)


@pytest.fixture(scope="module")
def rows(target, warm):
    """Greedy rows of the target (prompt + answer) from lossless DSpark decoding."""
    prompts = random_prompts(16, [4, 8, 12], target.config.vocab_size, seed=0)
    out = speculative_generate(target, warm, prompts, max_new_tokens=NEW, stop_token_ids=[])
    return prompts, pack_rows(prompts, out.token_ids, max(len(p) for p in prompts) + NEW)


@pytest.fixture(scope="module")
def trained(target, warm, rows, tmp_path_factory):
    """(trainer, history, initial weights): 16 steps, interrupted after 6 and resumed from the checkpoint."""
    params0 = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(warm.model, nnx.Param)))
    s = TrainSettings(batch_size=4, max_anchors=8, max_steps=16, lr=3e-3, save_every=8, log_every=4,
                      val_rows=4, val_every=8, ce_chunk_rows=5)
    out = tmp_path_factory.mktemp("dspark_train")
    # It trains its drafter in place: a copy keeps `warm` as it is. Unoptimised programs compile twice as fast.
    trainer = Trainer(target, _copy(warm), s, out, compiler_options=UNOPTIMISED)
    trainer.fit(rows[1], progress=False, stop_after=6)
    # A new process: the weights it starts from are not the run's (they come from the checkpoint).
    trainer.params = jax.tree.map(lambda x: jnp.zeros_like(x), trainer.params)
    history = trainer.fit(rows[1], progress=False)
    return trainer, history, params0


def _copy(d: Drafter) -> Drafter:
    """A DSpark drafter with its own copy of ``d``'s weights."""
    model = nnx.eval_shape(lambda: DSparkDrafter(d.config, rngs=nnx.Rngs(0)))
    nnx.update(model, jax.tree.map(jnp.copy, nnx.state(d.model)))
    return Drafter(model, d.name, d.trained)


@pytest.fixture(scope="module")
def probe(target, warm, trained, rows):
    """``warm``'s view of one training batch, computed once (one compile): the batch, its DSpark blocks, the
    target's hidden states, the trunk's hidden states, and the sequential drafts with their confidence logits."""
    batch = batch_for_step(rows[1], 3, trained[0].s, trained[0].block_size)
    graphs, params = zip(nnx.split(warm.model), nnx.split(target.model))

    @functools.partial(jax.jit, compiler_options=UNOPTIMISED)
    def run(params, batch):
        d, t = (nnx.merge(g, p) for g, p in zip(graphs, params))
        t_hidden, feats = target_states(t, batch["tokens"], d.config.target_layer_ids)
        blocks = dspark_block_inputs(batch["tokens"], batch["lengths"], batch["anchors"], batch["valid"], G,
                                     d.config.mask_token_id)
        h = drafter_forward_blocks(d, t, feats, blocks[0], blocks[1], batch["anchors"])
        drafts, z = sequential_drafts(d, t, h, blocks[0][..., 0])
        return t_hidden, blocks, h, drafts, z, d.draft_logits(h, t).argmax(-1)

    return batch, jax.tree.map(np.asarray, run(params, jax.tree.map(jnp.asarray, batch)))


def test_loss_parts_match_a_direct_computation(target, warm, trained, probe):
    """CE, ‖p_d − p_t‖₁, BCE, their weighted mix, acc, τ and survivals of the compiled (chunked) training
    step equal a numpy computation from the trunk's hidden states and the heads' weights."""
    trainer, _, params0 = trained
    batch, (t_hidden, (ids, pos, labels, ok, prev), h, *_) = probe
    copy = jax.tree.map(jnp.asarray, params0)  # warm's weights, as the step's input (the step donates it)
    _, _, m = trainer._step_fn(copy, trainer.tx.init(copy), trainer.frozen, batch, jnp.float32(0.0))
    assert (prev[..., 0] == ids[..., 0]).all() and (prev[..., 1:] == labels[..., :-1]).all()
    assert (ids[..., 1:] == warm.config.mask_token_id).all()
    assert (pos == batch["anchors"][..., None] + np.arange(G)).all()
    model = warm.model
    lm = np.asarray(target.model.lm_head.kernel[...])
    w1 = np.asarray(model.markov_head.markov_w1.embedding[...])
    w2 = np.asarray(model.markov_head.markov_w2.kernel[...])
    wc, bc = np.asarray(model.confidence_head.proj.kernel[...])[:, 0], float(model.confidence_head.proj.bias[...][0])
    logits = h @ lm + w1[prev] @ w2  # [Bs, A, G, V]
    th = np.asarray(t_hidden)[np.arange(len(pos))[:, None, None], np.minimum(pos, t_hidden.shape[1] - 1)]
    p_d, p_t = softmax(logits), softmax(th @ lm)
    ce = -np.log(np.take_along_axis(p_d, labels[..., None], -1)[..., 0])
    tv = np.abs(p_d - p_t).sum(-1)
    z = np.concatenate([h, w1[prev]], -1) @ wc + bc
    y = 1 - tv / 2
    bce = -(y * np.log(1 / (1 + np.exp(-z))) + (1 - y) * np.log(1 / (1 + np.exp(z))))
    w = np.exp(-np.arange(G) / default_gamma(G + 1))  # weights as DFlash's at the same number of drafts
    np.testing.assert_allclose(np.asarray(trainer.weights), w, rtol=1e-6)
    wk = w * ok
    want = {"ce": (ce * wk).sum() / wk.sum(), "tv": (tv * wk).sum() / wk.sum(), "bce": bce[ok].mean()}
    want["loss"] = 0.1 * want["ce"] + 0.9 * want["tv"] + want["bce"]
    correct = (logits.argmax(-1) == labels) & ok
    lead = np.cumprod(correct, -1).sum(-1)
    v = batch["valid"]
    want |= {"acc": correct.sum() / ok.sum(), "tau": (lead + 1)[v].mean(), "conf": (1 / (1 + np.exp(-z)))[ok].mean()}
    for k, x in want.items():
        np.testing.assert_allclose(float(m[k]), x, rtol=2e-4, err_msg=k)
    np.testing.assert_allclose(np.asarray(m["survival_real"]), [(lead[v] > k).mean() for k in range(G)], atol=1e-6)
    surv = np.cumprod(1 / (1 + np.exp(-z)), -1)[v].mean(0)
    np.testing.assert_allclose(np.asarray(m["survival_pred"]), surv, rtol=2e-4)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_warm_start_drafts_like_the_trunk(trunk, warm, probe):
    """dspark_from_dflash copies the trunk and zeroes W2: at step 0 the sequential drafts are argmax U_k."""
    src = nnx.to_pure_dict(nnx.state(trunk.model, nnx.Param))
    dst = nnx.to_pure_dict(nnx.state(warm.model, nnx.Param))
    for a, b in zip(jax.tree.leaves(src), jax.tree.leaves({k: dst[k] for k in src})):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.asarray(warm.model.markov_head.markov_w2.kernel[...]).any()
    assert np.asarray(warm.model.markov_head.markov_w1.embedding[...]).std() > 0.1
    *_, drafts, z, trunk_argmax = probe[1]
    np.testing.assert_array_equal(drafts, trunk_argmax)
    assert np.abs(z).max() < 0.2  # confidences start near ½


def test_short_training_lowers_the_loss_and_resumes(trained, rows, tmp_path):
    trainer, history, _ = trained
    steps = [r["step"] for r in history]
    assert steps == [4, 6, 8, 12, 16]  # rows of the first call, its stop, then the resumed call's
    assert history[-1]["loss"] < history[0]["loss"] and history[-1]["tv"] < history[0]["tv"]
    assert {"ce", "tv", "bce", "conf", "val_tau", "fit_tau"} <= set(history[-1])
    assert len(history[-1]["survival_pred"]) == G and history[-1]["val_tau"] >= 1.0
    assert trainer.completed
    # The resumed run equals an uninterrupted one (same compiled step, another directory).
    trainer.out_dir, resumed = tmp_path / "whole", trainer.params
    trainer.out_dir.mkdir()
    trainer.params = jax.tree.map(jnp.asarray, trained[2])
    trainer.fit(rows[1], progress=False)
    for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert plot_history(history, tmp_path / "curve.png").stat().st_size > 1000


def test_sts_recovers_known_temperatures():
    """Cycles simulated with true per-position temperatures: the left-to-right grid search finds them and
    the survival's ECE drops; an already calibrated head keeps T = 1."""
    rng = np.random.default_rng(0)
    true = np.array([0.5, 2.0, 1.0, 3.0])
    z = rng.normal(1.0, 2.5, (40000, 4))
    accepted = np.cumprod(rng.random(z.shape) < 1 / (1 + np.exp(-z / true)), axis=1).astype(bool)
    fit = sts.fit_sts(z, accepted)
    # Within a grid step or so; the last position less tightly (its survival is mostly near 0: less signal).
    tol = np.array([0.08, 0.08, 0.08, 0.3])
    assert (np.abs(np.array(fit["temperatures"]) / true - 1) <= tol).all(), fit["temperatures"]
    before, after = fit["ece_before"], fit["ece_after"]
    assert max(after) < 0.01 < 0.05 < max(before) and all(a < b for a, b in zip(after, before))
    assert fit["overall_ece_after"] < fit["overall_ece_before"] / 4
    assert fit["predicted_tau_after"] == pytest.approx(fit["realised_tau"], abs=0.02)
    assert fit["cycles"] == len(z) and sts.ece(np.full(8, 0.25), np.arange(8) < 2) == 0.0
    assert sts.ece(np.full(8, 0.9), np.arange(8) < 4) == pytest.approx(0.4)
    calibrated = np.cumprod(rng.random(z.shape) < 1 / (1 + np.exp(-z)), axis=1).astype(bool)
    assert (np.abs(np.array(sts.fit_sts(z, calibrated)["temperatures"]) - 1) <= tol).all()
    with pytest.raises(ValueError, match="one shape"):
        sts.fit_sts(z[:, :2], accepted)


def bigram_drafter(warm: Drafter, data: dict, seed: int = 0) -> Drafter:
    """``warm`` with a Markov head that proposes each token's most frequent successor in ``data`` (one-hot
    W1, W2 = 20 × the bigram table), and a random confidence head: acceptance lengths vary, so the replay has
    something to get right."""
    v = warm.config.layers.vocab_size
    counts = np.zeros((v, v))
    for row, p, n in zip(data["tokens"], data["prompt_lengths"], data["lengths"]):
        np.add.at(counts, (row[p - 1: n - 1], row[p:n]), 1)
    d = _copy(warm)
    d.model.markov_head.markov_w1.embedding.set_value(jnp.eye(v, RANK))
    d.model.markov_head.markov_w2.kernel.set_value(jnp.asarray(20.0 * np.eye(v)[counts.argmax(1)])[:RANK])
    rng = np.random.default_rng(seed)
    kernel = d.model.confidence_head.proj.kernel
    kernel.set_value(jnp.asarray(rng.normal(0, 0.5, kernel[...].shape), jnp.float32))
    return d


def test_replayed_acceptance_equals_speculative_decoding(target, warm, rows, trained):
    """The DSpark replay (sequential greedy drafts over training-shaped blocks, no decoding loop) gives the
    cycles real decoding runs, cycle for cycle, and the confidences it computed (predicted survival)."""
    trainer = trained[0]
    prompts, data = rows
    drafter = bigram_drafter(warm, data)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=NEW, stop_token_ids=[])
    decoded = pack_rows(prompts, out.token_ids, data["tokens"].shape[1])
    np.testing.assert_array_equal(decoded["tokens"], data["tokens"])  # lossless: the same greedy rows
    params = nnx.to_pure_dict(nnx.state(drafter.model, nnx.Param))
    acceptance, z = trainer.replay(params, data)
    replayed = [walked_cycles(a, p, n) for a, p, n in zip(acceptance, data["prompt_lengths"], data["lengths"])]
    for got, want in zip(replayed, out.acceptance_lengths):
        assert len(got) == len(want) and got[:-1] == want[:-1] and got[-1] <= want[-1]  # the row ends at NEW
    assert len({a for row in out.acceptance_lengths for a in row}) >= 3 and out.tau > 1.5
    # Each cycle's anchor: the first response token, then where the previous cycle's commits end.
    anchors = [(i, p) for i, row in enumerate(out.acceptance_lengths)
               for p in data["prompt_lengths"][i] + np.cumsum([0] + row[:-1])]
    z_cycles = np.stack([z[i, p] for i, p in anchors])
    np.testing.assert_allclose(sts.survival(z_cycles, [1.0] * G).mean(0), out.stats["predicted_survival"],
                               atol=2e-4)
    # STS data from the replay: full cycles only, accepted = leading-correct drafts.
    zc, acc = sts.cycle_calibration(acceptance, z, data["prompt_lengths"], data["lengths"])
    assert len(zc) >= len(anchors) - 2 * len(prompts) and (np.cumprod(acc, 1) == acc).all()
    assert walked_tau(replayed) == pytest.approx(np.mean([a for r in replayed for a in r]))


def test_a_reduced_vocabulary_drafter_replays_but_does_not_train(target, warm, rows, trained, tmp_path):
    """A drafter over a reduced draft vocabulary (a pair's on a CPU) replays as it drafts — here a permutation of
    the whole vocabulary, so its cycles and confidences are the unrestricted drafter's only if the replay reads
    its token map and head rows — and training it is refused with a clear error."""
    data = rows[1]
    drafter = bigram_drafter(warm, data)
    perm = np.random.default_rng(3).permutation(target.config.vocab_size)
    trainer = Trainer(target, restrict_draft_vocab(drafter, target, perm), trained[0].s, tmp_path,
                      compiler_options=UNOPTIMISED)
    acceptance, z = trainer.replay(trainer.params, data)
    want_acceptance, want_z = trained[0].replay(nnx.to_pure_dict(nnx.state(drafter.model, nnx.Param)), data)
    np.testing.assert_array_equal(acceptance, want_acceptance)
    np.testing.assert_allclose(z, want_z, atol=1e-5)
    assert acceptance.max() >= 3
    with pytest.raises(ConfigError, match="reduced draft vocabulary is not supported"):
        trainer.fit(data, progress=False)


def test_pipeline_pieces(target, trunk, trained, rows, tmp_path):
    """``kind: dspark`` in the YAML; warm start from an exported DFlash drafter; STS written into the
    exported config; the eval stage's calibration report and reliability diagram."""
    from dflash_jax.train.pipeline import Pipeline, load_run_config

    export_drafter(trunk.model, tmp_path / "dflash")
    drafter = {"kind": "dspark", "block_size": G, "num_layers": 2, "markov_rank": RANK,
               "init_from": str(tmp_path / "dflash")}  # a deeper DSpark drafter on the 1-layer DFlash trunk
    cfg = {"target": "unused", "training": {"out_dir": str(tmp_path / "run"), "drafter": drafter}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    pipe = Pipeline(load_run_config(tmp_path / "c.yaml"))
    pipe._target = target
    d = pipe.new_drafter()
    assert d.config.sequential and d.config.block_size == G and d.config.layers.num_layers == 2
    trainer = trained[0]
    calibrated = pipe.calibrate(trainer, rows[1], trainer.drafter)
    fit = json.loads((tmp_path / "run" / "sts.json").read_text())
    assert fit["held_out"] and len(fit["temperatures"]) == G
    assert calibrated.config.confidence_temperatures == tuple(fit["temperatures"])
    loaded = load_drafter(export_drafter(calibrated.model, tmp_path / "exported"), target)
    assert loaded.config.confidence_temperatures == tuple(fit["temperatures"])
    pipe._replayer = trainer
    report = pipe._eval_calibration(trainer.drafter, "set.jsonl", rows[0], [
        r[p:n].tolist() for r, p, n in zip(rows[1]["tokens"], rows[1]["prompt_lengths"], rows[1]["lengths"])])
    assert report["cycles"] > 10 and len(report["ece_before"]) == G
    assert (tmp_path / "run" / "eval_reliability_set.png").stat().st_size > 1000
    with_t = with_confidence_temperatures(trainer.drafter, [2.0] * G)
    assert with_t.config.confidence_temperatures == (2.0,) * G


def test_eval_tau_calibration_report(target, warm, rows, trained, tmp_path, capsys):
    """benchmarks/eval_tau.py --method replay --fit-sts a: per set, the survival calibration of the complete
    cycles its own replay ran equals sts.calibration_report of the cycles the module's trainer replays (at the
    drafter's temperatures); those cycles are the τ cycles' complete ones; STS fitted on set a gives the
    report on set b out of sample; a resumed run replays nothing and reports the same."""
    import argparse
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("eval_tau", Path(__file__).parents[1] / "benchmarks" / "eval_tau.py")
    eval_tau = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_tau)
    prompts, data = rows
    temps = [0.5, 2.0, 1.0, 1.5]
    drafter = with_confidence_temperatures(bigram_drafter(warm, data), temps)
    answers = [r[p:n].tolist() for r, p, n in zip(data["tokens"], data["prompt_lengths"], data["lengths"])]
    half = len(prompts) // 2
    set_ids = {"a": prompts[:half], "b": prompts[half:]}
    # The AR answers as a finished earlier run left them: the script generates none.
    results = {"answers": {"a": [[i, a] for i, a in enumerate(answers[:half])],
                           "b": [[i, a] for i, a in enumerate(answers[half:])]}}
    runs = {name: {"prompts": len(ids), "done": 0, "cycles": 0, "tau": 0.0, "acceptance_histogram": [0] * (G + 2)}
            for name, ids in set_ids.items()}
    args, out = argparse.Namespace(max_new_tokens=NEW, batch_size=8, fit_sts="a"), tmp_path / "cal.json"
    label = "DSpark/x"
    got = eval_tau.replay_sets(target, drafter, label, runs, set_ids, args, results, out)
    eval_tau.calibrate(label, runs, got, sts.drafter_temperatures(drafter.config), "a", out)

    params = nnx.to_pure_dict(nnx.state(drafter.model, nnx.Param))
    want = {}
    for name, sl in (("a", slice(None, half)), ("b", slice(half, None))):
        part = {k: v[sl] for k, v in data.items()}
        acceptance, z = trained[0].replay(params, part)
        want[name] = sts.cycle_calibration(acceptance, z, part["prompt_lengths"], part["lengths"])
        np.testing.assert_allclose(got[name][0], want[name][0], atol=1e-5)
        np.testing.assert_array_equal(got[name][1], want[name][1])
        cycles = [walked_cycles(a, p, n) for a, p, n in zip(acceptance, part["prompt_lengths"], part["lengths"])]
        assert runs[name]["tau"] == pytest.approx(walked_tau(cycles))
        # The calibration cycles are the τ cycles whose G drafts all have labels (anchor p <= n - 1 - G), with the
        # same acceptance (up to G: a row's last cycle can lose its bonus token to the row's end).
        complete = [min(a, G) for c, p, n in zip(cycles, part["prompt_lengths"], part["lengths"])
                    for a, at in zip(c, p + np.cumsum([0] + c[:-1])) if at <= n - 1 - G]
        assert sum(map(len, cycles)) == runs[name]["cycles"] > len(complete)
        np.testing.assert_array_equal(np.bincount(np.minimum(got[name][1].sum(1) + 1, G), minlength=G + 1),
                                      np.bincount(complete, minlength=G + 1))
        report, expected = runs[name]["calibration"], sts.calibration_report(*want[name], temps)
        assert set(report) == set(expected) | {"plot"} and Path(report["plot"]).stat().st_size > 1000
        for key, value in expected.items():
            assert report[key] == pytest.approx(value, abs=1e-6), key
        assert report["overall_ece_before"] != report["overall_ece_after"]
    assert len({a for row in cycles for a in row}) >= 3  # acceptance lengths vary: the report has something to say
    fit = runs["sts_fit"]
    fitted = sts.fit_sts(*want["a"])
    assert fit["set"] == "a" and fit["temperatures"] == pytest.approx(fitted["temperatures"])
    out_of_sample = sts.calibration_report(*want["b"], fitted["temperatures"])
    for key, value in out_of_sample.items():
        assert fit["b"][key] == pytest.approx(value, abs=1e-6), key
    assert fit["a"]["overall_ece_after"] == pytest.approx(fitted["overall_ece_after"], abs=1e-6)
    assert eval_tau.diagram(out, label, "b", "_sts").stat().st_size > 1000
    eval_tau.report_calibration(label, runs, set_ids)
    printed = capsys.readouterr().out
    assert f"{label} b: survival ECE {runs['b']['calibration']['overall_ece_before']:.3f} at T = 1" in printed
    assert "b (out of sample" in printed

    # Resumed: every set done and its cycles kept, so nothing is replayed and nothing counted twice.
    eval_tau.Trainer = None  # a replay would fail
    before = json.loads(json.dumps(runs))
    again = eval_tau.replay_sets(target, drafter, label, runs, set_ids, args, results, out)
    assert runs == before and all((again[n][1] == got[n][1]).all() for n in set_ids)
