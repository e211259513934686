"""The real SmolLM2-135M-Instruct weights (float32): lossless decoding with the shipped DFlash and DSpark drafters
(every block size from 2 to 16, and random drafters, are covered on tiny models in test_lossless.py), the
confidence scheduler's compact verify, incremental text and the chat command (which streams). One file, so that
one worker loads the target once and every test compares against one autoregressive reference (one behaviour per
test, the prompts and lengths shared so that the programs are too)."""

from __future__ import annotations

import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import generate, speculative_generate
from dflash_jax.config import ConfigError
from dflash_jax.costs import CostTable
from dflash_jax.engine import job as jobs
from dflash_jax.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Say 'thank you' in Chinese, Japanese and Korean, please.",
    "What is 17 times 3? Explain your answer in one short sentence.",
    "Name a primary colour.",
]
MAX_NEW = 32  # four prompts of ≤ 64 tokens; room for several whole 16-token blocks per row (training check)


@pytest.fixture(scope="module")
def reference(smollm2):
    ref = generate(smollm2, PROMPTS, max_new_tokens=MAX_NEW)
    assert len({len(p) for p in ref.prompt_token_ids}) == 4  # different prompt lengths in one batch
    assert ref.finish_reasons[0] == "length" and "stop" in ref.finish_reasons  # a short answer ends in the budget
    return ref


def test_shipped_drafter_is_lossless_with_real_acceptance(smollm2, smollm2_drafter, reference):
    """The embedded trained drafter on a batch of four prompt lengths with stop tokens: it accepts several tokens
    per cycle and changes nothing; the training objective sees the blocks decoding saw. (Streams equal whole
    calls on tiny models, tests/test_streaming.py; real text streams through the chat test below.)"""
    drafter = smollm2_drafter
    assert drafter.trained and drafter.config.block_size == 16
    out = speculative_generate(smollm2, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    assert out.token_ids == reference.token_ids and out.texts == reference.texts
    assert out.tau > 1.3 and max(a for row in out.acceptance_lengths for a in row) >= 4
    assert_training_objective_sees_the_same_blocks(smollm2, drafter, out)
    assert any(ord(c) > 127 for c in out.texts[1])  # text the chat test below streams, split over tokens


@pytest.mark.auto_verify
def test_default_is_compact_on_the_cpu_and_lossless(smollm2, smollm2_drafter, reference):
    """What `load_pair("smollm2-135m")` gives on a CPU: drafts over the 16,384 most frequent tokens (the pair
    config's draft_vocab) and, from the shipped table, compact verify with steps without drafting offered."""
    from dflash_jax.loading import _pair_draft_vocab
    from dflash_jax.pairs import load_pair_config

    cfg = load_pair_config("smollm2-135m")
    assert _pair_draft_vocab(cfg, smollm2, smollm2_drafter, 0) is smollm2_drafter  # draft_vocab=0: all tokens
    drafter = _pair_draft_vocab(cfg, smollm2, smollm2_drafter, None)
    assert drafter.model.draft_head[...].shape == (16384, 576) and smollm2_drafter.model.d2t is None
    # The default on this CPU, from the shipped table: compact (whole blocks cost ~2x one token per row), with
    # steps without drafting offered (decided on the host; nothing compiles).
    mode, tiers, cost, ar_step = jobs.resolve_verify_mode("auto", drafter, 2, 16)
    assert mode.name == "compact" and ar_step and len(tiers) >= 2 and len(cost) == len(tiers) + 1
    # Lossless on the real pair with a table that keeps two tiers (up to 8 tokens a row, or whole blocks) and the
    # AR step (fewer branches to compile than the default's five; the tiers' code is the same).
    small = CostTable("cpu", "test", "float32", "smollm2", 16, 64, {2: {8: 1.0, 16: 2.0}}, ar_ms={2: 0.6})
    out = speculative_generate(smollm2, drafter, PROMPTS[:2], max_new_tokens=MAX_NEW, cost_table=small)
    assert out.stats["verify_mode"] == "compact" and list(out.stats["tier_steps"]) != []
    assert out.token_ids == reference.token_ids[:2] and out.tau > 1.3


def test_embedded_pair_without_the_configs_folder(smollm2, monkeypatch):
    """Installed without configs/ (a wheel, e.g. the notebook's Colab install): load_pair still gives the
    embedded pair with its CPU draft vocabulary (built-in settings)."""
    from dflash_jax import load_pair, loading

    monkeypatch.setattr(loading, "_configs_installed", lambda: False)
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: smollm2)  # the session's target, not a reload
    target, drafter = load_pair("smollm2-135m")
    assert target is smollm2 and drafter.trained and drafter.cost_tables is None
    assert drafter.model.draft_head[...].shape == (16384, 576)


def test_shipped_dspark_drafter_is_lossless(smollm2, reference):
    """The shipped DSpark pair's drafter (trained Markov and confidence heads, STS temperatures), greedy:
    identical to autoregressive decoding, with real acceptance; a pair naming a drafter that is not shipped
    says so."""
    from dflash_jax.loading import _pair_drafter
    from dflash_jax.pairs import load_pair_config

    cfg = load_pair_config("smollm2-135m-dspark")
    drafter = _pair_drafter(cfg, smollm2)
    assert drafter.config.verify_width == 16 and drafter.config.markov_rank == 64
    assert drafter.config.confidence_temperatures is not None
    out = speculative_generate(smollm2, drafter, PROMPTS[:2], max_new_tokens=MAX_NEW, verify_mode="static")
    assert out.token_ids == reference.token_ids[:2]
    assert out.tau > 1.5, out.tau
    assert len(out.stats["predicted_survival"]) == 15
    with pytest.raises(ConfigError, match="no drafter 'nope' is shipped"):
        _pair_drafter(dataclasses.replace(cfg, drafter="embedded:nope"), smollm2)


def test_incremental_text_never_splits_a_character(smollm2):
    """Multi-byte characters whose bytes span several tokens: no piece holds half a character, and the pieces
    concatenate to the decoded whole, however the ids are grouped."""
    tok = smollm2.tokenizer
    text = "Grüße aus 東京 🙂🚀 — naïve café, ½ ≈ 0.5 ✓ 中文 and a final dot ."
    ids = tok.hf.encode(text)
    assert len(ids) > len(text.encode("utf-8")) / 4  # byte-level tokens: some characters span several
    rng = np.random.default_rng(0)
    for group in (1, 2, 3, None):
        detok, pieces, i = IncrementalDetokenizer(tok), [], 0
        while i < len(ids):
            n = group or int(rng.integers(1, 6))
            pieces.append(detok.push(ids[i: i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces)
        assert sum(bool(p) for p in pieces) > 5


def test_chat_command_through_stdin(smollm2, smollm2_drafter, monkeypatch):
    """`dflash-jax chat` driven through its stdin: two turns (the second sees the first), /reset, an unknown
    command, an answer stopped with Ctrl-C (the chat goes on), end of input ends it."""
    from dflash_jax import chat, cli, loading

    monkeypatch.setattr(loading, "load_pair", lambda *a, **k: (smollm2, smollm2_drafter))
    seen = []
    real_stream = chat.speculative_stream

    def recording_stream(target, drafter, prompts, **kw):
        seen.append(list(prompts[0]))
        return real_stream(target, drafter, prompts, **kw)

    monkeypatch.setattr(chat, "speculative_stream", recording_stream)
    stdin = io.StringIO("What is the capital of France?\nAnd of Italy?\n/reset\n/what\nCount to fifty.\nHi\n")

    class CtrlCOnce(io.StringIO):
        """A terminal where Ctrl-C is pressed while the third answer is printed."""
        answers = 0

        def write(self, s):
            if s.startswith("> ") or s.startswith("\n> "):
                pass
            elif seen and len(seen) == 3 and s and not s.startswith(("\n[", "[")) and not self.answers:
                self.answers += 1
                raise KeyboardInterrupt
            return super().write(s)

    stdout = CtrlCOnce()
    monkeypatch.setattr("sys.stdin", stdin)
    monkeypatch.setattr("sys.stdout", stdout)
    assert cli.main(["chat", "--max-new-tokens", "24", "--no-compile-cache"]) == 0
    out = stdout.getvalue()
    assert "Paris" in out
    assert out.count("[τ ") == 3 and "[stopped]" in out
    assert "(conversation cleared)" in out and "unknown command '/what'" in out
    # Turn 2 carries turn 1 (user, assistant, user); after /reset the conversation starts over.
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"] and "Paris" in seen[1][1]["content"]
    assert [m["role"] for m in seen[2]] == ["user"]
    assert [m["role"] for m in seen[3]] == ["user", "assistant", "user"]  # the stopped answer is kept


def assert_training_objective_sees_the_same_blocks(target, drafter, out):
    """At the anchors the decoding loop actually visited, the training objective's batched blocks predict
    exactly the accepted lengths the loop recorded: training and inference are aligned at real scale
    (SPEC §6's pitfalls would show here as a mismatch, not just as a low τ)."""
    from dflash_jax.train.objective import anchor_acceptance

    block = drafter.config.block_size
    rows = []  # per prompt: its sequence, the anchors of the cycles checked, their recorded acceptance lengths
    for prompt, new, acc in zip(out.prompt_token_ids, out.token_ids, out.acceptance_lengths):
        seq = prompt + new
        # cycle c starts after the prefill token and the tokens of cycles < c; its anchor is the last one
        anchors = [len(prompt) + sum(acc[:c]) for c in range(len(acc))]
        cycles = [c for c in range(len(acc)) if anchors[c] + block <= len(seq)]  # whole block labelled
        if cycles:  # (a short answer may end before any whole block)
            rows.append((seq, [anchors[c] for c in cycles], [acc[c] for c in cycles]))
    assert len(rows) >= 2 and sum(len(r[1]) for r in rows) >= 6
    # All rows in one batch (right-padded, as training batches are): one compiled program.
    tokens = np.zeros((len(rows), max(len(r[0]) for r in rows)), np.int32)
    anchors = np.zeros((len(rows), max(len(r[1]) for r in rows)), np.int32)
    valid = np.zeros(anchors.shape, bool)
    for i, (seq, anc, _) in enumerate(rows):
        tokens[i, :len(seq)], anchors[i, :len(anc)], valid[i, :len(anc)] = seq, anc, True
    batch = {"tokens": jnp.asarray(tokens), "lengths": jnp.asarray([len(r[0]) for r in rows], jnp.int32),
             "anchors": jnp.asarray(anchors), "valid": jnp.asarray(valid)}
    accepted = np.asarray(nnx.jit(anchor_acceptance, static_argnums=(3,))(drafter.model, target.model, batch, block))
    for i, (_, anc, want) in enumerate(rows):
        assert accepted[i, :len(anc)].tolist() == want
