"""Drafter training loop (DFlash, DSpark, DFlash2): optax AdamW, fp32 master weights, orbax checkpoints, exact resume.

Determinism: the batch order of step ``s`` comes from a permutation seeded by ``(seed, epoch)`` and its
anchors from ``(seed, s)``, so a run resumed from the checkpoint of step ``k`` replays steps ``k+1 …``
exactly as an uninterrupted run would (tests assert equal final parameters).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from dflash_jax import drafters
from dflash_jax.config import ConfigError
from dflash_jax.loading import Drafter, Target
from dflash_jax.train import sts
from dflash_jax.train.data import pack_rows
from dflash_jax.train.objective import (cosine_with_warmup, default_gamma, loss_weights, objective_for,
                                        repeated_blocks, sample_anchors, walked_cycles, walked_tau)

log = logging.getLogger("dflash_jax")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    batch_size: int = 16  # sequences per step
    max_anchors: int = 512  # anchors per sequence (fewer when a response is shorter)
    epochs: float = 6.0
    max_steps: int | None = None  # overrides epochs when set
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; default from the block size (SPEC §6)
    compute_dtype: str = "float32"  # "bfloat16": bf16 compute, fp32 master weights
    seed: int = 0
    save_every: int = 200
    log_every: int = 10
    length_bucket: int = 128  # sequence lengths are padded to a multiple of this per batch
    # Relative draw weight of anchors whose block starts by copying earlier text (objective.repeated_blocks);
    # 1.0 = uniform anchors as in SPEC §6. Lower values spend the anchors of looping rows on novel text.
    repeat_anchor_weight: float = 1.0
    repeat_ngram: int = 8
    time_budget_s: float | None = None  # cap the planned steps so training fits this wall-clock budget
    # Held-out rows (never trained on) whose decoding τ is replayed from teacher-forced blocks every
    # val_every steps (default: save_every) and logged as val_tau, next to fit_tau on as many training rows:
    # the τ evaluation would measure, and how far the drafter has specialised in its own training rows.
    val_rows: int = 0
    val_every: int | None = None
    # Draft slots per lm_head chunk of the cross-entropy (objective.slot_cross_entropy); None = all at once.
    # Chunks hold one chunk's float32 logits instead of every slot's, at the price of recomputing them
    # in the backward pass.
    ce_chunk_rows: int | None = None
    # Each anchor's block is trained at a width drawn uniformly from these (a value may repeat to weight it;
    # None: the drafter's block size only): a parallel drafter trained so drafts as well over ``[anchor,
    # MASK × (w-1)]`` as the compact steps that verify at most w tokens a row run it (``Tuning.tier_draft_span``),
    # instead of far worse than over the whole block. The exported config lists them (``trained_widths``).
    block_widths: tuple[int, ...] | None = None
    # DFlash2: the share λ of the selector's loss taken from the target's own distribution over each slot's K
    # candidates rather than the row's token (objective.dflash2_loss); 0 = the token only. Costs one target LM
    # head per slot, as DSpark's p_t.
    selector_teacher: float = 0.0

    def trained_widths(self, verify_width: int) -> tuple[int, ...] | None:
        """The widths below ``verify_width`` the drafter is trained at (its config's ``trained_widths``)."""
        narrower = sorted({int(w) for w in self.block_widths or () if w < verify_width})
        return tuple(narrower) or None

    def total_steps(self, num_rows: int) -> int:
        if self.max_steps is not None:
            return int(self.max_steps)
        return max(1, int(math.ceil(self.epochs * num_rows / self.batch_size)))


@dataclasses.dataclass(frozen=True)
class Replayed:
    """Greedy decoding's cycles replayed along known answers (``Trainer.replay_answers``). N complete cycles
    (every draft has a label in its row), G drafts per cycle."""

    cycles: list[list[int]]  # per row, the tokens each cycle commits (``walked_cycles``)
    z: np.ndarray | None = None  # [N, G] confidence logits; None for a drafter without confidences
    accepted: np.ndarray | None = None  # [N, G] draft k accepted (all drafts up to k right)


def make_optimizer(s: TrainSettings) -> optax.GradientTransformation:
    """Clip + AdamW whose learning rate is an input (set each step from the schedule on the host), so the
    compiled step does not depend on the planned number of steps."""
    return optax.chain(optax.clip_by_global_norm(s.grad_clip),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=s.lr, b1=0.9, b2=0.95,
                                                             weight_decay=s.weight_decay))


@functools.lru_cache(maxsize=4)
def _epoch_order(lengths_key: bytes, n: int, batch_size: int, seed: int, epoch: int) -> np.ndarray:
    """Row indices of one epoch as [batches, batch_size]: shuffled, then length-grouped.

    Rows are shuffled, cut into windows of 64 batches, sorted by length inside each window and batched, and
    the batches shuffled again: similar lengths share a batch (less padding: shorter buckets, cheaper
    attention and target forwards) while every epoch still visits every row in a fresh order.
    """
    lengths = np.frombuffer(lengths_key, np.int32)
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(n)
    per_epoch = max(1, n // batch_size)
    perm = perm[: per_epoch * batch_size] if n >= batch_size else rng.choice(n, batch_size)
    window = 64 * batch_size
    grouped = np.concatenate([w[np.argsort(lengths[w], kind="stable")]
                              for w in np.split(perm, range(window, len(perm), window))])
    batches = grouped.reshape(-1, batch_size)
    return batches[rng.permutation(len(batches))]


def padded_rows(data: dict[str, np.ndarray], rows: np.ndarray, s: TrainSettings, block_size: int):
    """The rows' tokens zero-padded to a multiple of ``length_bucket`` that fits a block after the last
    token (few distinct shapes, so few compiles), with their lengths and prompt lengths."""
    lengths, prompt_lengths = data["lengths"][rows], data["prompt_lengths"][rows]
    t = int(math.ceil((lengths.max() + block_size) / s.length_bucket) * s.length_bucket)
    tokens = np.zeros((len(rows), t), np.int32)
    width = min(t, data["tokens"].shape[1])
    tokens[:, :width] = data["tokens"][rows, :width]
    return tokens, lengths, prompt_lengths


def batch_for_step(data: dict[str, np.ndarray], step: int, s: TrainSettings, block_size: int) -> dict:
    """Rows and anchors of step ``step`` (0-based), a pure function of (data, seed, step)."""
    n = len(data["lengths"])
    per_epoch = max(1, n // s.batch_size)
    epoch, i = divmod(step, per_epoch)
    order = _epoch_order(data["lengths"].astype(np.int32).tobytes(), n, s.batch_size, s.seed, epoch)
    rows = order[i]
    tokens, lengths, prompt_lengths = padded_rows(data, rows, s, block_size)
    repeated = data["repeated"][rows] if s.repeat_anchor_weight != 1.0 else None
    anchors, valid = sample_anchors(np.random.default_rng([s.seed, 7919, step]), lengths, prompt_lengths,
                                    s.max_anchors, repeated, s.repeat_anchor_weight)
    batch = {"tokens": tokens, "lengths": lengths.astype(np.int32), "anchors": anchors, "valid": valid}
    if s.block_widths:
        draw = np.random.default_rng([s.seed, 104729, step]).integers(0, len(s.block_widths), anchors.shape)
        batch["widths"] = np.asarray(s.block_widths, np.int32)[draw]
    return batch


class Trainer:
    """Trains ``drafter`` (in place) against the frozen ``target`` on a tokenized self-distillation set.

    ``compiler_options``: XLA options for the step and replay programs (CPU tests pass
    ``{"xla_backend_optimization_level": 0}``: half the compile time, and their few steps hardly run).
    """

    def __init__(self, target: Target, drafter: Drafter, settings: TrainSettings, out_dir: str | Path,
                 compiler_options: dict | None = None):
        dc = drafter.config
        dc.check_target(target.config)
        if dc.verify_width < 2:
            raise ConfigError(f"block size must be >= 2, got {dc.block_size}")
        # The kind must have an objective; what it cannot train (its ``check``) is refused by ``fit`` only: the
        # replay of such a drafter (a pair's, drafting over a reduced vocabulary) is exact.
        objective_for(dc.kind)
        if not 0.0 < settings.repeat_anchor_weight <= 1.0:
            raise ConfigError(f"repeat_anchor_weight must be in (0, 1], got {settings.repeat_anchor_weight}")
        if not 0.0 <= settings.selector_teacher <= 1.0:
            raise ConfigError(f"selector_teacher must be in [0, 1], got {settings.selector_teacher}")
        if settings.ce_chunk_rows is not None and settings.ce_chunk_rows < 1:
            raise ConfigError(f"ce_chunk_rows must be >= 1 (or unset), got {settings.ce_chunk_rows}")
        if settings.val_rows < 0 or (settings.val_every is not None and settings.val_every < 1):
            raise ConfigError(f"val_rows must be >= 0 and val_every >= 1, got {settings.val_rows} and "
                              f"{settings.val_every}")
        if settings.block_widths is not None:
            w = settings.block_widths
            if not w or not all(isinstance(x, int) and 2 <= x <= dc.verify_width for x in w):
                raise ConfigError(f"block_widths must be integers in [2, {dc.verify_width}] (the block size), "
                                  f"got {list(w)}")
            # What the exported config will say; its validation refuses narrower widths for sequential drafters.
            dataclasses.replace(dc, trained_widths=settings.trained_widths(dc.verify_width)).validate()
        self.target, self.drafter, self.s = target, drafter, settings
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # Tokens a block covers (anchor + drafts): DFlash's L, DSpark's G+1. The loss weights, one per draft, are
        # the same for both at equal draft counts.
        self.block_size = dc.verify_width
        self.weights = jnp.asarray(loss_weights(self.block_size, settings.gamma or default_gamma(self.block_size)))
        self.compute_dtype = jnp.bfloat16 if settings.compute_dtype in ("bfloat16", "bf16") else jnp.float32
        # The drafter's parameters (trained) and its other variables (a reduced draft vocabulary's token map and
        # head rows: a pair's drafter replays as it drafts), which the programs take with the target's state.
        self.d_graph, params, d_rest = nnx.split(drafter.model, nnx.Param, ...)
        self.params = jax.tree.map(lambda x: x.astype(jnp.float32), nnx.to_pure_dict(params))
        self.t_graph, t_state = nnx.split(target.model)
        self.frozen = (t_state, d_rest)
        self.compiler_options = compiler_options
        self._step_fn = None
        self._accept_fn = None
        self.completed = False  # set by fit: every planned step done

    # ---- the jitted step ------------------------------------------------------------------------
    def _build(self):
        tx = make_optimizer(self.s)
        d_graph, t_graph, weights, cdt = self.d_graph, self.t_graph, self.weights, self.compute_dtype
        ce_chunk_rows = self.s.ce_chunk_rows
        objective = objective_for(self.drafter.config.kind)
        loss, replay, verify_width = objective.loss, objective.replay, self.block_size
        options = objective.options(self.s)

        def models(params, frozen):
            t_state, d_rest = frozen
            drafter = nnx.merge(d_graph, jax.tree.map(lambda x: x.astype(cdt), params), d_rest)
            return drafter, nnx.merge(t_graph, t_state)

        def loss_fn(params, frozen, batch):
            drafter, target = models(params, frozen)
            return loss(drafter, target, batch, weights=weights, ce_chunk_rows=ce_chunk_rows, **options)

        def step(params, opt_state, frozen, batch, lr):
            grads, metrics = jax.grad(loss_fn, has_aux=True)(params, frozen, batch)
            opt_state[1].hyperparams["learning_rate"] = lr
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, metrics

        self.tx = tx
        jitted = jax.jit(step, donate_argnums=(0, 1), compiler_options=self.compiler_options)
        # bf16 compute: the frozen float32 target's matmuls may use bf16 passes too (features only).
        precision = "bfloat16" if cdt == jnp.bfloat16 else None

        def run(*args):
            with jax.default_matmul_precision(precision):
                return jitted(*args)

        self._step_fn = run

        def accept(params, frozen, batch):
            """(acceptance [Bs, A], a scoring drafter's confidence logits [Bs, A, G] or None)."""
            return replay(*models(params, frozen), batch, verify_width)

        accept_jitted = jax.jit(accept, compiler_options=self.compiler_options)

        def run_accept(*args):
            with jax.default_matmul_precision(precision):
                return accept_jitted(*args)

        self._accept_fn = run_accept

    # ---- held-out τ -------------------------------------------------------------------------------
    def split_validation(self, data: dict[str, np.ndarray]) -> tuple[dict, dict[str, dict]]:
        """(training rows, {"val_tau": held-out rows, "fit_tau": as many training rows}); a fixed split.

        Only greedy rows are held out and replayed when the data marks sampled ones (``sampled``): greedy
        decoding's τ is what evaluation measures. Rows with a held-out row's prompt (its sampled answers)
        are not trained on either.
        """
        v = self.s.val_rows
        if not v:
            return data, {}
        n = len(data["lengths"])
        greedy = np.flatnonzero(~data["sampled"]) if "sampled" in data else np.arange(n)
        if v >= len(greedy):
            raise ConfigError(f"val_rows={v} leaves no training rows (the data set has {len(greedy)} greedy rows)")
        held = np.sort(np.random.default_rng([self.s.seed, 104729]).permutation(greedy)[:v])
        prompt = lambda i: data["tokens"][i, : data["prompt_lengths"][i]].tobytes()  # noqa: E731
        held_prompts = {prompt(i) for i in held}
        kept = np.asarray([i for i in range(n) if prompt(i) not in held_prompts], np.int64)
        rows = lambda idx: {k: x[idx] for k, x in data.items()}  # noqa: E731
        fit = np.intersect1d(greedy, kept)[:v]
        return rows(kept), {"val_tau": rows(held), "fit_tau": rows(fit)}

    def replayed_cycles(self, params, rows: dict[str, np.ndarray]) -> list[list[int]]:
        """Per row, the cycles greedy speculative decoding of its prompt would run (``walked_cycles``), from
        every anchor's acceptance computed in training-shaped batches (no decoding loop)."""
        return self.replayed(rows, params).cycles

    def replayed(self, rows: dict[str, np.ndarray], params=None) -> Replayed:
        """The cycles greedy decoding runs along ``rows`` (greedy answers), replayed with ``params`` (default: the
        trainer's): each row's cycles and, for a drafter that scores its drafts, the complete cycles'
        confidences as STS data (``sts.cycle_calibration``)."""
        acceptance, z = self.replay(self.params if params is None else params, rows)
        cycles = [walked_cycles(a, p, n) for a, p, n in zip(acceptance, rows["prompt_lengths"], rows["lengths"])]
        if z is None:
            return Replayed(cycles)
        return Replayed(cycles, *sts.cycle_calibration(acceptance, z, rows["prompt_lengths"], rows["lengths"]))

    def replay_answers(self, prompts: list[list[int]], answers: list[list[int]], params=None) -> Replayed:
        """``replayed`` along the greedy ``answers`` to ``prompts`` (what greedy speculative decoding, being
        lossless, commits)."""
        return self.replayed(pack_rows(prompts, answers, max(len(p) + len(a) for p, a in zip(prompts, answers))),
                             params)

    def replay(self, params, rows: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """Every anchor's acceptance [N, T] (tokens a greedy cycle anchored there commits) and, for drafters
        that score their drafts (DSpark with a confidence head, DFlash2), its drafts' confidence logits [N, T, G]
        (else None)."""
        if self._accept_fn is None:
            self._build()
        bs, a_max, n = self.s.batch_size, self.s.max_anchors, len(rows["lengths"])
        acceptance = np.zeros(rows["tokens"].shape, np.int32)
        scored = drafters.kind_of(self.drafter.model).has_confidence
        z_all = np.zeros((*rows["tokens"].shape, self.block_size - 1), np.float32) if scored else None
        for r0 in range(0, n, bs):
            idx = np.minimum(np.arange(r0, r0 + bs), n - 1)  # the last batch repeats its last row
            tokens, lengths, plens = padded_rows(rows, idx, self.s, self.block_size)
            lengths = lengths.astype(np.int32)
            for a0 in range(0, int((lengths - 1 - plens).max(initial=0)), a_max):
                anchors = plens[:, None] + a0 + np.arange(a_max)
                valid = anchors <= lengths[:, None] - 2
                anchors = np.where(valid, anchors, plens[:, None]).astype(np.int32)
                got, z = jax.device_get(self._accept_fn(params, self.frozen, {
                    "tokens": tokens, "lengths": lengths, "anchors": anchors, "valid": valid}))
                for i in range(min(bs, n - r0)):
                    acceptance[r0 + i, anchors[i, valid[i]]] = got[i, valid[i]]
                    if z_all is not None:
                        z_all[r0 + i, anchors[i, valid[i]]] = z[i, valid[i]]
        return acceptance, z_all

    def _plan(self, data, epochs_total: int) -> int:
        """Total steps: from epochs / max_steps, capped by ``time_budget_s`` using measured step times.

        Saved in ``plan.json`` the first time, so a resumed run keeps the same schedule.
        """
        path = self.out_dir / "plan.json"
        if path.is_file():
            return int(json.loads(path.read_text())["total_steps"])
        total, step_s = epochs_total, None
        if self.s.time_budget_s:
            params = jax.tree.map(jnp.copy, self.params)
            opt_state = self.tx.init(params)
            # Time one batch shape again and again: every new length bucket compiles, and timing a sequence
            # of different batches once measured compiles (8.8 s "steps" where a step takes 0.15 s). The
            # longest bucket among the first steps makes the estimate err on the safe side.
            batch = max((batch_for_step(data, i, self.s, self.block_size) for i in range(16)),
                        key=lambda b: b["tokens"].shape[1])
            times = []
            for _ in range(6):  # the first call compiles; time the rest
                t = time.perf_counter()
                params, opt_state, m = self._step_fn(params, opt_state, self.frozen, batch, jnp.float32(0.0))
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t)
            step_s = float(np.median(times[2:]))
            # Sequences differ in length: pad the estimate by 15% for longer buckets and checkpoints.
            total = max(1, min(total, int(self.s.time_budget_s / (1.15 * step_s))))
        path.write_text(json.dumps({"total_steps": total, "epoch_steps": epochs_total, "step_s": step_s}))
        return total

    # ---- checkpoints ------------------------------------------------------------------------------
    def _manager(self) -> ocp.CheckpointManager:
        opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1, create=True)
        return ocp.CheckpointManager((self.out_dir / "checkpoints").absolute(), options=opts)

    def _history_path(self) -> Path:
        return self.out_dir / "history.jsonl"

    def _read_history(self, upto: int) -> list[dict]:
        path = self._history_path()
        if not path.is_file():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r["step"] <= upto]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # drop steps after the checkpoint
        return rows

    # ---- the loop --------------------------------------------------------------------------------
    def fit(self, data: dict[str, np.ndarray], *, resume: bool = True, stop_after: int | None = None,
            stop_after_s: float | None = None, progress: bool = True) -> list[dict]:
        """Train to the planned number of steps; returns the loss history (also in history.jsonl).

        ``stop_after``: leave the loop after that many steps of *this* call (an interruption, for tests).
        ``stop_after_s``: leave it once this call has trained that many seconds, with a checkpoint of the step
        reached, so that one planned schedule can span several time-limited processes (e.g. device calls
        capped at 10 minutes): the next ``fit`` resumes there and the result equals an unbroken run.
        """
        objective = objective_for(self.drafter.config.kind)
        if objective.check is not None:
            objective.check(self.drafter.config)
        if self._step_fn is None:
            self._build()
        data, val_sets, total = self._prepare_fit(data, resume)
        val_every = self.s.val_every or self.s.save_every
        mngr = self._manager()
        params, opt_state, start = self._restore_or_start(mngr, resume)
        history = self._read_history(start)
        end = total if stop_after is None else min(total, start + stop_after)
        bar = tqdm(total=total, initial=start, disable=not progress, desc="train", unit="step", dynamic_ncols=True)
        tokens_seen, t0 = 0, time.perf_counter()
        # Metrics are summed on the device between logs (no host sync per step); a history row holds the mean
        # over the steps this process ran since the previous row (one length bucket's batch alone is noisy).
        summed, counted = None, 0

        def log_row(done: int, hist, extra: dict) -> None:
            nonlocal summed, counted
            m = {k: (np.asarray(v, np.float64) / counted).tolist() for k, v in jax.device_get(summed).items()} | extra
            rate = tokens_seen / max(time.perf_counter() - t0, 1e-9)
            # logged_steps: fewer than log_every in the first row after a resume or a timed stop
            row = {"step": done, **m, "logged_steps": counted, "lr": float(self.schedule(done)),
                   "block_tokens_per_s": rate}
            summed, counted = None, 0
            history.append(row)
            hist.write(json.dumps(row) + "\n")
            hist.flush()
            held = {"val_tau": f"{m['val_tau']:.2f}"} if "val_tau" in m else {}
            bar.set_postfix(loss=f"{m['loss']:.3f}", tau=f"{m['tau']:.2f}", **held, tok_s=f"{rate:,.0f}")

        with self._history_path().open("a") as hist:
            for step in range(start, end):
                batch = batch_for_step(data, step, self.s, self.block_size)
                lr = jnp.float32(self.schedule(step))
                params, opt_state, metrics = self._step_fn(params, opt_state, self.frozen, batch, lr)
                summed = metrics if summed is None else _add_metrics(summed, metrics)
                counted += 1
                tokens_seen += int(batch["valid"].sum()) * (self.block_size - 1)
                done = step + 1
                out_of_time = stop_after_s is not None and time.perf_counter() - t0 >= stop_after_s
                extra = {name: walked_tau(self.replayed_cycles(params, rows)) for name, rows in val_sets.items()} \
                    if done % val_every == 0 or done == end or out_of_time else {}
                if done % self.s.log_every == 0 or done == end or out_of_time or extra:
                    log_row(done, hist, extra)
                if done % self.s.save_every == 0 or done == end or out_of_time:
                    mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
                bar.update(1)
                if out_of_time and done != end:
                    log.warning("stopping at step %d of %d after %.0f s (stop_after_s); run again to resume",
                                done, total, time.perf_counter() - t0)
                    break
        bar.close()
        mngr.wait_until_finished()
        self.completed = int(mngr.latest_step() or 0) >= total
        mngr.close()
        self.params = params
        self._write_back(params)
        return history

    def _prepare_fit(self, data: dict[str, np.ndarray], resume: bool):
        """The rows to train on, the held-out validation sets and the planned number of steps (the plan and
        the learning-rate schedule are fixed by the first run in this directory, or anew when not resuming)."""
        if self.s.repeat_anchor_weight != 1.0 and "repeated" not in data:
            data = {**data, "repeated": repeated_blocks(data["tokens"], data["lengths"], self.s.repeat_ngram)}
        if not resume:  # start over: forget the plan and checkpoints of an earlier run in this directory
            import shutil

            (self.out_dir / "plan.json").unlink(missing_ok=True)
            shutil.rmtree(self.out_dir / "checkpoints", ignore_errors=True)
        data, val_sets = self.split_validation(data)
        total = self._plan(data, self.s.total_steps(len(data["lengths"])))
        self.schedule = cosine_with_warmup(self.s.lr, total, self.s.warmup_frac)
        return data, val_sets, total

    def _restore_or_start(self, mngr, resume: bool):
        """(params, opt_state, first step): from the latest checkpoint when resuming, else fresh."""
        opt_state = self.tx.init(self.params)
        params = self.params
        if not (resume and mngr.latest_step() is not None):
            self._history_path().unlink(missing_ok=True)
            return params, opt_state, 0
        start = int(mngr.latest_step())
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        restored = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
        # Restored arrays are committed to a device, fresh ones are not, and jit keys its programs on that:
        # taken as they are, a resumed run would compile its step again (as long as a whole first compile).
        restored = jax.tree.map(jnp.asarray, jax.device_get(restored))
        log.info("resumed from step %d", start)
        return restored["params"], restored["opt_state"], start

    def _write_back(self, params) -> None:
        """Copy the fp32 master weights into the drafter module (in its own dtype)."""
        state = nnx.state(self.drafter.model, nnx.Param)
        dtype = self.drafter.model.dtype
        nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, dtype), params))
        nnx.update(self.drafter.model, state)


@jax.jit
def _add_metrics(a: dict, b: dict) -> dict:
    """Running sums of the step metrics: one dispatch per step, however many metrics there are."""
    return jax.tree.map(jnp.add, a, b)


def _running_mean(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` points (length-grouped batches make single points jumpy)."""
    c = np.cumsum(np.insert(np.asarray(values, np.float64), 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_history(history: list[dict], path: str | Path, title: str = "DFlash drafter training") -> Path:
    """Loss and training-batch τ against steps, saved as PNG: each logged point faint, a running mean bold;
    the replayed τ of held-out and training rows (``val_rows``) as dashed red lines where logged.

    Batches are grouped by sequence length, so consecutive logged points come from different length buckets
    and jump around; the running mean over ~10% of the run shows the trend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    window = max(1, len(history) // 10)
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax2 = ax1.twinx()
    dspark, dflash2 = "tv" in history[0], "selector" in history[0]
    loss_label = ("loss: 0.1·CE + 0.9·TV + BCE" if dspark else "loss: CE + selector CE" if dflash2
                  else "weighted CE loss")
    for ax, key, color, label in ((ax1, "loss", "tab:blue", loss_label),
                                  (ax2, "tau", "tab:orange", "τ on training blocks")):
        values = [r[key] for r in history]
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _running_mean(values, window), color=color, linewidth=2.0,
                label=f"{label} (mean of {window} logs)")
        ax.set_ylabel(label, color=color)
    parts = (("ce", "--", "CE"), ("tv", ":", "TV ‖p_d − p_t‖₁"), ("bce", "-.", "confidence BCE"),
             ("selector", ":", "selector CE"))
    for key, style, label in parts:
        if (dspark or dflash2) and key in history[0]:  # the loss parts (DSpark's without their 0.1 / 0.9 / 1 factors)
            ax1.plot(steps, _running_mean([r[key] for r in history], window), color="tab:blue", linestyle=style,
                     linewidth=1.0, label=label)
    for key, marker, label in (("val_tau", "o", "τ replayed on held-out rows"),
                               ("fit_tau", "x", "τ replayed on training rows")):
        points = [(r["step"], r[key]) for r in history if key in r]
        if points:
            ax2.plot(*zip(*points), color="tab:red", marker=marker, linestyle="--", linewidth=1.0, label=label)
    ax1.set_xlabel("step")
    ax1.set_title(title)
    lines = [ln for ln in ax1.get_lines() + ax2.get_lines() if ln.get_alpha() is None]  # not the faint per-log ones
    ax1.legend(lines, [ln.get_label() for ln in lines], loc="upper center", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
