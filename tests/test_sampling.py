"""Sampling stays lossless: the distribution of generated tokens equals the target's, for both acceptance
modes, temperatures 0.7 / 1.0, top-k and top-p — and the test demonstrably fails for biased samplers."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from conftest import tiny_target
from dflash_jax import generate, random_drafter, speculative_generate
from dflash_jax.decode import sampling
from dflash_jax.decode.sampling import SamplingParams, filtered_probs
from dflash_jax.engine import pool, programs
from dflash_jax.loading import restrict_draft_vocab

V = 8
PROMPT = [1, 2, 3, 4]
N = 10_000  # draws (rows of one batched run)
STEPS = 3  # tokens per draw: the 1st comes from prefill, the 2nd and 3rd through draft/verify cycles


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", seed=11, vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=8)
    drafter = random_drafter(target, block_size=4, num_layers=1, seed=5, mask_token_id=V - 1)
    return target, drafter


@pytest.fixture(scope="module")
def logits(pair):
    """The target's logits for x1, x2 and x3 after PROMPT + [a, b], for every (a, b): [V², 3, V] from one
    forward pass over the V² sequences (causal attention: position t sees tokens ≤ t only, so the x1 and x2
    logits of a row depend on its prefix alone)."""
    seqs = jnp.asarray([PROMPT + [a, b] for a, b in itertools.product(range(V), range(V))], jnp.int32)
    n, t = seqs.shape

    @nnx.jit  # one program: op by op, this forward compiled ~90 small programs (3x the CPU time)
    def forward(model, seqs):
        h, _, _ = model(seqs, jnp.broadcast_to(jnp.arange(t), (n, t)), None, prefill=True)
        return model.logits(h[:, -3:])

    return forward(pair[0].model, seqs)


def exact_distribution(logits, temperature, top_k, top_p) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) from the target's logits (float64 [V, V, V])."""
    n = logits.shape[0]
    sp = SamplingParams(jnp.full((n,), temperature, jnp.float32), jnp.full((n,), top_k, jnp.int32),
                        jnp.full((n,), top_p, jnp.float32))
    probs = np.asarray(filtered_probs(logits, sp, use_top_k=top_k > 0, use_top_p=top_p < 1), np.float64)
    probs = probs.reshape(V, V, 3, V)  # [a, b, slot, token]
    p1, p2, p3 = probs[0, 0, 0], probs[:, 0, 1], probs[:, :, 2]
    return p1[:, None, None] * p2[:, :, None] * p3


def draw(fn, with_output: bool = False, **kw):
    out = fn([PROMPT] * N, max_new_tokens=STEPS, stop_token_ids=[], **kw)
    assert all(len(t) == STEPS for t in out.token_ids)
    return (np.asarray(out.token_ids), out) if with_output else np.asarray(out.token_ids)


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of 3-token sequences to the exact joint; cells with expected count < 5 pooled."""
    counts = np.zeros(probs.size)
    np.add.at(counts, np.ravel_multi_index(samples.T, probs.shape), 1)
    expected = probs.ravel() * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert counts[(probs.ravel() == 0)].sum() == 0, "a token outside the filtered support was sampled"
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()  # exact probabilities sum to 1 only up to rounding
    return float(stats.chisquare(obs[keep], exp).pvalue)


CASES = [  # temperature, top_k, top_p, draft_sampling
    (1.0, 0, 1.0, False),
    (0.7, 0, 1.0, False),
    (1.0, 0, 1.0, True),
    (0.7, 0, 1.0, True),
    (1.0, 3, 1.0, False),
    (1.0, 0, 0.8, True),
    (0.7, 4, 0.9, False),
]


@pytest.mark.parametrize("temperature,top_k,top_p,draft_sampling", CASES)
def test_speculative_sampling_matches_target_distribution(pair, logits, temperature, top_k, top_p,
                                                           draft_sampling):
    target, drafter = pair
    probs = exact_distribution(logits, temperature, top_k, top_p)
    samples, out = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), with_output=True,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=1, draft_sampling=draft_sampling)
    assert chi2_pvalue(samples, probs) > 1e-3
    # The drafts were really exercised: some accepted, some rejected.
    firsts = [row[0] for row in out.acceptance_lengths if row]
    assert 1 in firsts and max(firsts) >= 2


def test_sampled_drafts_over_a_reduced_draft_vocabulary(pair, logits):
    """Drafts drawn among 5 of the 8 tokens (q zero elsewhere): still exactly the target's distribution."""
    target, drafter = pair
    small = restrict_draft_vocab(drafter, target, [0, 2, 3, 5, 6])
    probs = exact_distribution(logits, 1.0, 3, 1.0)
    samples, out = draw(lambda *a, **k: speculative_generate(target, small, *a, **k), with_output=True,
                        temperature=1.0, top_k=3, seed=2, draft_sampling=True)
    assert chi2_pvalue(samples, probs) > 1e-3
    firsts = [row[0] for row in out.acceptance_lengths if row]
    assert 1 in firsts and max(firsts) >= 2


def test_continuous_batching_samples_the_target_distribution(pair, logits):
    """N draws through a pool of N/4 rows (refilled the default fraction at a time): refilled rows draw from keys
    of their own."""
    target, drafter = pair
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    samples, out = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), with_output=True,
                        temperature=1.0, seed=6, draft_sampling=True, batch_size=N // 4)
    assert out.stats["refills"] >= 6 and out.stats["refill_size"] == round(N // 4 * pool.REFILL_FRACTION)
    assert chi2_pvalue(samples, probs) > 1e-3


def test_autoregressive_sampling_matches_target_and_speculative(pair, logits):
    target, drafter = pair
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    ar = draw(lambda *a, **k: generate(target, *a, **k), temperature=1.0, seed=3)
    assert chi2_pvalue(ar, probs) > 1e-3
    # Two-sample homogeneity test, speculative vs plain sampling, on the 2-token prefixes.
    spec = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), temperature=1.0, seed=4)
    cells = lambda s: np.bincount(s[:, 0] * V + s[:, 1], minlength=V * V)  # noqa: E731
    table = np.stack([cells(ar), cells(spec)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


def _accept_always(keys, block, p, q, window=None):
    b, l, _ = p.shape
    a = jnp.full((b,), l - 1, jnp.int32)
    return a, jax.vmap(sampling.sample)(keys, p[:, -1]), a


def _residual_keeps_draft(keys, block, p, q, window=None):
    """A plausible bug: on rejection, resample from p without removing the rejected draft."""
    b, l, _ = p.shape
    k_u, k_tok = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
    u = jax.vmap(lambda k: jax.random.uniform(k, (l - 1,)))(k_u)
    p_x = jnp.take_along_axis(p[:, :-1], block[:, 1:, None], axis=-1)[..., 0]
    a = jnp.cumprod((u < p_x).astype(jnp.int32), axis=1).sum(1)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    return a, jax.vmap(sampling.sample)(k_tok, p_a), a


@pytest.mark.parametrize("biased", [_accept_always, _residual_keeps_draft])
def test_the_test_detects_biased_samplers(pair, logits, monkeypatch, biased):
    target, drafter = pair
    probs = exact_distribution(logits, 1.0, 0, 1.0)
    monkeypatch.setattr(sampling, "accept_sampled", biased)
    monkeypatch.setattr(programs.CACHE, "programs", {})  # force a fresh trace with the biased rule
    samples = draw(lambda *a, **k: speculative_generate(target, drafter, *a, **k), temperature=1.0, seed=1)
    assert chi2_pvalue(samples, probs) < 1e-6


def test_filtered_probs_match_transformers_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    filtered = jax.jit(filtered_probs, static_argnames=("use_top_k", "use_top_p"))  # 4 programs, not 40 ops
    logits = np.random.default_rng(0).normal(size=(5, 50)).astype(np.float32) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 7, 1.0), (0.9, 0, 0.6), (0.8, 10, 0.75), (1.0, 1, 1.0)]:
        x = torch.tensor(logits)
        x = TemperatureLogitsWarper(t)(None, x)
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        ref = torch.softmax(x, -1).numpy()
        sp = SamplingParams(jnp.full((5,), t), jnp.full((5,), k), jnp.full((5,), p))
        ours = np.asarray(filtered(jnp.asarray(logits), sp, use_top_k=k > 0, use_top_p=p < 1))
        np.testing.assert_allclose(ours, ref, atol=1e-6)
    greedy = filtered(jnp.asarray(logits), SamplingParams(jnp.zeros(5), jnp.zeros(5, int), jnp.ones(5)),
                      use_top_k=False, use_top_p=False)
    np.testing.assert_array_equal(np.argmax(np.asarray(greedy), -1), np.argmax(logits, -1))
    assert np.asarray(greedy).max(-1).min() == 1.0


def test_seeded_runs_are_reproducible(pair):
    target, drafter = pair
    prompts = [PROMPT, [5, 6], [7, 1, 2]]
    # top-k and top-p: the programs of the per-row test below (both filters on, argmax drafts)
    kw = dict(max_new_tokens=10, stop_token_ids=[], temperature=1.0, top_k=3, top_p=0.9)
    a = speculative_generate(target, drafter, prompts, seed=7, **kw)
    b = speculative_generate(target, drafter, prompts, seed=7, **kw)
    c = speculative_generate(target, drafter, prompts, seed=8, **kw)
    assert a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths
    assert a.token_ids != c.token_ids
    assert generate(target, prompts, seed=7, **kw).token_ids == generate(target, prompts, seed=7, **kw).token_ids


def test_per_row_settings_and_greedy_rows(pair):
    """Rows with temperature 0 inside a sampling batch decode greedily, exactly as plain greedy decoding."""
    target, drafter = pair
    prompts = [PROMPT, [5, 6, 7], PROMPT]
    greedy = generate(target, prompts, max_new_tokens=12, stop_token_ids=[])
    for ds in (False, True):
        mixed = speculative_generate(target, drafter, prompts, max_new_tokens=12, stop_token_ids=[],
                                     temperature=[1.0, 0.0, 0.0], top_k=[3, 0, 5], top_p=[0.9, 1.0, 0.8], seed=5,
                                     draft_sampling=ds)
        assert mixed.token_ids[1:] == greedy.token_ids[1:]


@pytest.mark.parametrize("kw,match", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be a non-negative integer"),
    ({"temperature": [1.0, 0.5]}, "one value per prompt"),
])
def test_bad_sampling_values(pair, kw, match):
    target, drafter = pair
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, drafter, [PROMPT], max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match=match):
        generate(target, [PROMPT], max_new_tokens=4, **kw)
