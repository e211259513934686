"""``dflash-jax train --config configs/<pair>.yaml``: prompts → self-distillation data → training → τ
evaluation → z-lab export. Every stage writes into ``out_dir`` and skips work already done, so an
interrupted run is continued by running the same command again.

``training.drafter.kind: dspark`` trains a DSpark drafter (SPEC §7; ``block_size`` = its γ drafts) instead,
optionally warm-started from a DFlash drafter's trunk (``init_from``); its confidences are then calibrated by
STS on the held-out rows, and the eval stage reports their reliability. ``kind: dflash2`` trains a DFlash2
drafter (``block_size`` = its verify width), optionally warm-started from a DFlash drafter (identity
convolutions, a selector that starts as DFlash's argmax); the eval stage reports its confidences' reliability.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from tqdm.auto import tqdm

from dflash_jax import drafters
from dflash_jax.config import ConfigError, drafter_kinds, drafter_schema
from dflash_jax.loading import (Drafter, Target, deepen_drafter, load_drafter, load_target, random_drafter,
                                with_config, with_confidence_temperatures)
from dflash_jax.train import data as data_mod
from dflash_jax.train import sts
from dflash_jax.train.objective import OBJECTIVES, objective_for
from dflash_jax.train.trainer import Trainer, TrainSettings, plot_history

log = logging.getLogger("dflash_jax")

STAGES = ("prompts", "data", "train", "eval", "export")


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    num_layers: int = 2
    block_size: int = 16
    mask_token_id: int | None = None
    num_features: int = 5
    target_layer_ids: tuple[int, ...] | None = None
    seed: int = 0
    init_from: str | None = None  # a z-lab-format drafter directory to start from (warm start)
    kind: str = "dflash"  # "dspark": block_size counts its drafts (γ); "dflash2"; init_from may be a DFlash drafter
    markov_rank: int = 256  # DSpark's Markov head rank r
    # DFlash2 (block_size = its verify width, as DFlash's; defaults: the published checkpoint's): convolution
    # taps and channels per delta group, candidates per position and the selector's rank.
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_top_k: int = 16
    selector_rank: int = 256
    # DSpark: rows that fit the STS temperatures when there are no held-out rows (optim.val_rows = 0);
    # those are training rows, so the fit is then in-sample (sts.json says so).
    sts_rows: int = 256


@dataclasses.dataclass(frozen=True)
class DataSpec:
    num_prompts: int = 20000
    min_chars: int = 16
    max_chars: int = 2000
    later_turns_min_chars: int | None = None  # also use later user turns this long (default: first turns only)
    max_prompt_tokens: int = 256
    max_new_tokens: int = 512
    generate_batch_size: int = 128
    prompts_file: str | None = None  # jsonl of {"prompt": …}; default: ShareGPT first turns
    chunk_batches: int = 8  # data is written in parts of this many generation batches (resumable)
    # Besides its greedy answer, each prompt gets this many answers sampled at sample_temperature (still
    # the target's own behaviour, but more varied rows for the same prompts: a fixed prompt set runs out).
    # They are decoded in the same batch as the greedy answers: generate_batch_size × (1 + this) rows.
    sampled_responses: int = 0
    sample_temperature: float = 0.8
    # Seeds the chunk order and the sampled answers: another seed gives other sampled rows for the same
    # prompts and, for a data stage stopped early, another sample of the prompts (greedy rows do not change).
    # Parts already written in out_dir are kept whatever their seed: use a new out_dir for a new seed.
    seed: int = 0
    # Also this many HumanEval-style code prompts (documented public functions of the standard library and
    # of ``code_packages``, see data.python_function_prompts); ShareGPT has few "write this function" asks.
    code_prompts: int = 0
    code_packages: tuple[str, ...] = ()
    # Also this many self-synthesised instructions: user messages the target samples after the bare chat
    # template's user header (data.synthesise_prompts), at synth_temperature, at most synth_max_tokens long.
    # Made in the prompts stage (with the target: run it where the data stage runs).
    synth_prompts: int = 0
    synth_temperature: float = 1.0
    synth_max_tokens: int = 128


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    sets: tuple[str, ...] = data_mod.EVALUATION_SETS  # or JSONL prompt files
    max_new_tokens: int = 256
    batch_size: int = 32
    limit: int | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str
    target: str
    out_dir: str
    dtype: str = "float32"
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    drafter: DrafterSpec = DrafterSpec()
    data: DataSpec = DataSpec()
    train: TrainSettings = TrainSettings()
    eval: EvalSpec = EvalSpec()
    export_dtype: str = "bfloat16"


def _section(cls, raw: Any, where: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (allowed: {sorted(names)})")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    return cls(**kw)


def load_run_config(path: str | Path, out_dir: str | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    tr = raw.get("training")
    if not isinstance(tr, dict):
        raise ConfigError(f"{path}: no 'training' section (needed by `dflash-jax train`)")
    for key in ("target",):
        if key not in raw:
            raise ConfigError(f"{path}: missing key {key!r}")
    cfg = RunConfig(
        name=str(raw.get("name", path.stem)),
        target=str(raw["target"]),
        out_dir=out_dir or str(tr.get("out_dir", f"runs/{path.stem}")),
        dtype=str(raw.get("dtype", "float32")),
        chat_template_kwargs=dict(raw.get("chat_template_kwargs") or {}),
        drafter=_section(DrafterSpec, tr.get("drafter"), "training.drafter"),
        data=_section(DataSpec, tr.get("data"), "training.data"),
        train=_section(TrainSettings, tr.get("optim"), "training.optim"),
        eval=_section(EvalSpec, tr.get("eval"), "training.eval"),
        export_dtype=str(tr.get("export_dtype", "bfloat16")),
    )
    kinds = tuple(k for k in drafter_kinds() if k in OBJECTIVES)  # registered, and trainable
    if cfg.drafter.kind not in kinds:
        raise ConfigError(f"{path}: training.drafter.kind must be one of {kinds}, got {cfg.drafter.kind!r}")
    least = drafter_schema(cfg.drafter.kind).min_block_size  # a DSpark block of γ inputs gives γ drafts
    if cfg.drafter.block_size < least:
        raise ConfigError(f"{path}: training.drafter.block_size must be >= {least}, got {cfg.drafter.block_size}")
    if cfg.data.sampled_responses < 0 or (cfg.data.sampled_responses and not cfg.data.sample_temperature > 0):
        raise ConfigError(f"{path}: training.data needs sampled_responses >= 0 and sample_temperature > 0, got "
                          f"{cfg.data.sampled_responses} and {cfg.data.sample_temperature}")
    return cfg


def out_of_memory(error: Exception) -> bool:
    """Whether ``error`` is the device running out of memory (XLA's RESOURCE_EXHAUSTED)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def generate_fitting(target: Target, prompts: list, *, temperature: list[float], seed: int, **kw
                     ) -> tuple[list[list[int]], int]:
    """``generate`` of ``prompts`` (their answers, new tokens), in halves where the device runs out of memory: a
    recipe's generation batch sized for a larger device still completes on a smaller one. Greedy answers are the
    same either way; the sampled rows of a halved batch draw from other seeds (``seed``, ``seed + 1``)."""
    from dflash_jax import generate

    try:
        out = generate(target, prompts, temperature=temperature, seed=seed, **kw)
        return out.token_ids, out.stats["new_tokens"]
    except Exception as e:  # noqa: BLE001 — only the device's out-of-memory error is handled
        if not out_of_memory(e) or len(prompts) < 2:
            raise
    half = len(prompts) // 2
    log.warning("generation of %d rows ran out of device memory; generating them in halves of %d", len(prompts),
                half)
    a, na = generate_fitting(target, prompts[:half], temperature=temperature[:half], seed=seed, **kw)
    b, nb = generate_fitting(target, prompts[half:], temperature=temperature[half:], seed=seed + 1, **kw)
    return a + b, na + nb


class Pipeline:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._target: Target | None = None
        self._replayer: Trainer | None = None  # DSpark evaluation: a Trainer used for its replay only

    @property
    def target(self) -> Target:
        if self._target is None:
            self._target = load_target(self.cfg.target, self.cfg.dtype,
                                       chat_template_kwargs=self.cfg.chat_template_kwargs)
        return self._target

    # ---- stage: prompts ---------------------------------------------------------------------------
    def prompts(self) -> Path:
        path = self.out / "prompts.jsonl"
        if path.is_file():
            return path
        d = self.cfg.data
        if d.prompts_file:
            prompts = data_mod.read_prompt_file(Path(d.prompts_file))[: d.num_prompts]
        else:
            prompts = data_mod.sharegpt_prompts(min_chars=d.min_chars, max_chars=d.max_chars,
                                                limit=d.num_prompts, exclude=data_mod.held_out_texts(),
                                                later_turns_min_chars=d.later_turns_min_chars)
        if d.code_prompts:
            prompts += data_mod.python_function_prompts(data_mod.python_sources(d.code_packages),
                                                        limit=d.code_prompts, exclude=data_mod.held_out_texts())
        if d.synth_prompts:
            prompts += self._synthesise_prompts(exclude=[p for p in prompts if isinstance(p, str)])
        rows = [{"prompt": p} if isinstance(p, str) else {"token_ids": p} for p in prompts]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.rename(path)
        log.info("%d prompts → %s", len(rows), path)
        return path

    def _synthesise_prompts(self, exclude: list[str]) -> list[str]:
        """``data.synth_prompts`` user messages the target writes itself (sampled after the template's user
        header; evaluation prompts and the prompts already chosen excluded)."""
        from dflash_jax import generate

        d, tok = self.cfg.data, self.target.tokenizer
        if tok is None:
            raise data_mod.DataError("synth_prompts needs the target's tokenizer (its chat template)")
        prefix = tok.user_turn_prefix()

        def sample(batch: int, round_: int) -> list[list[int]]:
            out = generate(self.target, [prefix] * batch, max_new_tokens=d.synth_max_tokens, chat_template=False,
                           temperature=d.synth_temperature, seed=d.seed * 1_000_003 + 7_919 * (round_ + 1))
            return out.token_ids

        return data_mod.synthesise_prompts(sample, tok.decode, tok.eos_token_ids, d.synth_prompts,
                                           batch_size=d.generate_batch_size, min_chars=d.min_chars,
                                           max_chars=d.max_chars, exclude=self._evaluation_texts() + exclude)

    def _evaluation_texts(self) -> list[str]:
        """Every evaluation prompt this run knows of: the built-in sets' (where their packages are installed:
        a GPU machine may have only the run's files) and the text prompts of ``eval.sets`` files."""
        texts: list[str] = []
        try:
            texts += data_mod.held_out_texts()
        except data_mod.DataError as e:
            log.warning("built-in evaluation sets not excluded from synthesised prompts: %s", e)
        for name in self.cfg.eval.sets:
            if name not in data_mod.EVALUATION_SETS:
                texts += [p for p in data_mod.read_prompt_file(Path(name)) if isinstance(p, str)]
        return texts

    def _token_ids(self, prompts: list) -> list[list[int]]:
        """Text prompts through the serving chat template; token-id prompts as they are."""
        tok = self.target.tokenizer
        if tok is None and any(isinstance(p, str) for p in prompts):
            raise data_mod.DataError("the target has no tokenizer: text prompts cannot be templated")
        return [tok.encode(p) if isinstance(p, str) else list(p)
                for p in tqdm(prompts, desc="tokenize", unit="prompt", mininterval=2)]

    # ---- stage: data ------------------------------------------------------------------------------
    @property
    def data_path(self) -> Path:
        return self.out / "data.npz"

    def data_complete(self) -> bool:
        """Whether ``data.npz`` holds every chunk (a data stage stopped by ``stop_after_s`` leaves the
        finished chunks merged in ``data.npz`` with ``"complete": false`` in ``data_summary.json``)."""
        summary = self.out / "data_summary.json"
        if not self.data_path.is_file():
            return False
        return not summary.is_file() or json.loads(summary.read_text()).get("complete", True)

    def data(self, stop_after_s: float | None = None) -> Path:
        """Self-distill every prompt (resuming from the parts already written).

        ``stop_after_s``: stop once this call has generated that long (after the chunk in progress, so at
        least one chunk is written); the finished chunks are merged into ``data.npz`` all the same, which the
        train stage can use, and the next call generates the rest.
        """
        final = self.data_path
        if self.data_complete():
            return final
        d = self.cfg.data
        ids = self._token_ids(data_mod.read_prompt_file(self.prompts()))
        keep = [i for i, p in enumerate(ids) if len(p) <= d.max_prompt_tokens]
        if not keep:
            raise data_mod.DataError(f"every prompt is longer than max_prompt_tokens={d.max_prompt_tokens}")
        order = sorted(keep, key=lambda i: len(ids[i]))  # similar lengths together: fewer shape buckets
        batches = [order[i: i + d.generate_batch_size] for i in range(0, len(order), d.generate_batch_size)]
        parts_dir = self.out / "data_parts"
        parts_dir.mkdir(exist_ok=True)
        chunks = [batches[i: i + d.chunk_batches] for i in range(0, len(batches), d.chunk_batches)]
        # Chunks run in a seeded random order: a data stage stopped part-way leaves parts that sample every
        # prompt length and source, which can be trained on (resuming fills in the rest).
        chunk_order = np.random.default_rng(d.seed).permutation(len(chunks))
        bar = tqdm(total=len(order), desc="self-distill", unit="prompt", dynamic_ncols=True)
        t0, new_tokens = time.perf_counter(), 0
        part_of = lambda c: parts_dir / f"part_{c:05d}.npz"  # noqa: E731
        for c in map(int, chunk_order):
            chunk = chunks[c]
            part = part_of(c)
            n_rows = sum(len(b) for b in chunk)
            if part.is_file():
                bar.update(n_rows)
                continue
            if stop_after_s is not None and new_tokens and time.perf_counter() - t0 >= stop_after_s:
                break
            prompts, responses, sampled_rows = [], [], []
            for j, b in enumerate(chunk):
                # One call per batch: the greedy rows, then each sampled round's rows (temperature is per row;
                # greedy rows of a sampling batch decode exactly greedily), so one compiled program serves both.
                copies = 1 + d.sampled_responses
                batch_prompts = [ids[i] for i in b] * copies
                flags = [False] * len(b) + [True] * (len(b) * d.sampled_responses)
                temps = [d.sample_temperature if f else 0.0 for f in flags]
                answers, made = generate_fitting(self.target, batch_prompts, max_new_tokens=d.max_new_tokens,
                                                 temperature=temps, seed=d.seed * 1_000_003 + c * d.chunk_batches + j)
                prompts += batch_prompts
                responses += answers
                sampled_rows += flags
                new_tokens += made
                bar.update(len(b))
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):,.0f}")
            max_len = d.max_prompt_tokens + d.max_new_tokens
            tmp = part.with_name(part.stem + ".tmp.npz")
            data_mod.save_dataset(tmp, prompts, responses, max_len, sampled_rows if d.sampled_responses else None)
            tmp.rename(part)
        bar.close()
        done = [part_of(c) for c in range(len(chunks)) if part_of(c).is_file()]
        summary = self._merge_parts(done, final)
        summary.update(generation_s=time.perf_counter() - t0, chunks_done=len(done), chunks_total=len(chunks),
                       complete=len(done) == len(chunks))
        (self.out / "data_summary.json").write_text(json.dumps(summary, indent=1))
        if not summary["complete"]:  # only a stop leaves chunks undone
            log.warning("data stage stopped after %.0f s (stop_after_s) with %d of %d chunks; data.npz holds "
                        "them; run the data stage again to generate the rest", summary["generation_s"],
                        len(done), len(chunks))
        return final

    @staticmethod
    def _merge_parts(parts: list[Path], final: Path) -> dict:
        loaded = [dict(np.load(p)) for p in parts]
        width = max(x["tokens"].shape[1] for x in loaded)
        tokens = np.concatenate([np.pad(x["tokens"], ((0, 0), (0, width - x["tokens"].shape[1]))) for x in loaded])
        lengths = np.concatenate([x["lengths"] for x in loaded])
        plens = np.concatenate([x["prompt_lengths"] for x in loaded])
        if len(lengths) == 0:
            raise data_mod.DataError("self-distillation produced no usable rows")
        extra = {"sampled": np.concatenate([x["sampled"] for x in loaded])} \
            if all("sampled" in x for x in loaded) else {}
        tmp = final.with_name("data.tmp.npz")
        np.savez_compressed(tmp, tokens=tokens, lengths=lengths, prompt_lengths=plens, **extra)
        tmp.rename(final)
        return {"rows": int(len(lengths)), **({"sampled_rows": int(extra["sampled"].sum())} if extra else {}),
                "response_tokens": int((lengths - plens).sum()),
                "prompt_tokens": int(plens.sum()), "max_len": int(width)}

    # ---- drafter ----------------------------------------------------------------------------------
    def new_drafter(self) -> Drafter:
        s = self.cfg.drafter
        if s.init_from:
            d = load_drafter(s.init_from, self.target, dtype="float32")
            warm_start = objective_for(s.kind).warm_start  # e.g. DSpark on a DFlash trunk: any γ, same or more layers
            if d.config.kind != s.kind and warm_start is not None:
                if d.config.layers.num_layers > s.num_layers:
                    raise ConfigError(f"init_from drafter {s.init_from} has {d.config.layers.num_layers} layers; the "
                                      f"config asks for {s.num_layers} (a warm start may add layers, not remove them)")
                d = deepen_drafter(d, s.num_layers, seed=s.seed)
                log.info("init_from: %s drafter (block size %d) on the trunk of %s", s.kind, s.block_size,
                         s.init_from)
                return warm_start(d, s)
            if d.config.kind != s.kind:
                raise ConfigError(f"init_from drafter {s.init_from} is a {d.config.kind} drafter; the config asks "
                                  f"for {s.kind}")
            if d.config.block_size != s.block_size or d.config.layers.num_layers > s.num_layers:
                raise ConfigError(f"init_from drafter {s.init_from} has block size {d.config.block_size} and "
                                  f"{d.config.layers.num_layers} layers; the config asks for {s.block_size} and "
                                  f"{s.num_layers} (a warm start may add layers, not remove them)")
            if d.config.layers.num_layers < s.num_layers:
                log.info("init_from: %d-layer drafter deepened to %d layers (new layers start as the identity)",
                         d.config.layers.num_layers, s.num_layers)
                d = deepen_drafter(d, s.num_layers, seed=s.seed)
            return d
        # Every kind's fields are passed (as markov_rank is): a kind reads its own, and their defaults are the
        # config's, so the other kinds' configs stay as they were.
        return random_drafter(self.target, num_layers=s.num_layers, block_size=s.block_size,
                              mask_token_id=s.mask_token_id, num_features=s.num_features,
                              target_layer_ids=s.target_layer_ids, seed=s.seed, dtype="float32", kind=s.kind,
                              markov_rank=s.markov_rank, conv_kernel_size=s.conv_kernel_size,
                              conv_group_size=s.conv_group_size, selector_top_k=s.selector_top_k,
                              selector_rank=s.selector_rank)

    # ---- stage: train -----------------------------------------------------------------------------
    def train(self, *, progress: bool = True, stop_after_s: float | None = None) -> Drafter:
        """Train (resuming from the run's checkpoints), plot, summarize and export the drafter.

        ``stop_after_s``: stop this call after that many seconds of training (checkpointed, and the weights
        reached are exported); ``self.train_summary["completed"]`` then says whether every planned step is done.
        """
        # The data made so far, also by a data stage that was stopped early (the data stage completes it).
        data = data_mod.load_dataset(self.data_path if self.data_path.is_file() else self.data())
        drafter = self.new_drafter()
        trainer = Trainer(self.target, drafter, self.cfg.train, self.out)
        t0 = time.perf_counter()
        history = trainer.fit(data, resume=True, progress=progress, stop_after_s=stop_after_s)
        if history:
            plot_history(history, self.out / "loss_curve.png", title=f"{self.cfg.name} drafter")
        meta = {"train_s_this_run": time.perf_counter() - t0, "steps": history[-1]["step"] if history else 0,
                "completed": trainer.completed,
                "rows": int(len(data["lengths"])), "settings": dataclasses.asdict(self.cfg.train),
                "drafter": dataclasses.asdict(self.cfg.drafter)}
        if objective_for(drafter.config.kind).calibrates and drafters.kind_of(drafter.model).has_confidence:
            drafter = self.calibrate(trainer, data, drafter)
            meta["sts"] = json.loads((self.out / "sts.json").read_text())
        widths = self.cfg.train.trained_widths(drafter.config.verify_width)
        if widths is not None:
            drafter = with_config(drafter, trained_widths=widths)
        (self.out / "train_summary.json").write_text(json.dumps(meta, indent=1))
        self.train_summary = meta
        self.export(drafter)
        return drafter

    def calibrate(self, trainer: Trainer, data: dict, drafter: Drafter) -> Drafter:
        """STS (SPEC §7): temperatures fitted on the cycles greedy decoding of the held-out rows runs (replayed,
        exact), written to ``sts.json``; returns the drafter with them in its config (export writes them)."""
        _, val_sets = trainer.split_validation(data)
        rows, held_out = val_sets.get("val_tau"), True
        if rows is None:  # no held-out rows: the first sts_rows training rows (in-sample)
            rows, held_out = {k: v[: self.cfg.drafter.sts_rows] for k, v in data.items()}, False
        replayed = trainer.replayed(rows)
        z, accepted = replayed.z, replayed.accepted
        if not len(z):
            log.warning("STS: no complete cycle in the calibration rows; confidences left unscaled")
            return drafter
        fit = sts.fit_sts(z, accepted)
        (self.out / "sts.json").write_text(json.dumps({**fit, "held_out": held_out,
                                                       "rows": int(len(rows["lengths"]))}, indent=1))
        log.warning("STS on %d cycles (%s rows): T = %s; survival ECE %.3f → %.3f", fit["cycles"],
                    "held-out" if held_out else "training", [round(t, 2) for t in fit["temperatures"]],
                    fit["overall_ece_before"], fit["overall_ece_after"])
        return with_confidence_temperatures(drafter, fit["temperatures"])

    # ---- stage: export ----------------------------------------------------------------------------
    def export(self, drafter: Drafter | None = None) -> Path:
        from dflash_jax.checkpoints.export import export_drafter

        if drafter is None:
            drafter = self._restore_trained()
        return export_drafter(drafter.model, self.out / "drafter", dtype=self.cfg.export_dtype)

    def _restore_trained(self) -> Drafter:
        exported = self.out / "drafter"
        if (exported / "config.json").is_file():
            return load_drafter(exported, self.target, dtype="float32")
        return self.train()

    # ---- stage: eval ------------------------------------------------------------------------------
    def evaluate(self, drafter: Drafter | None = None) -> dict:
        from dflash_jax import generate, speculative_generate

        drafter = drafter or load_drafter(self.out / "drafter", self.target)
        e = self.cfg.eval
        results: dict[str, Any] = {"block_size": drafter.config.block_size, "max_new_tokens": e.max_new_tokens}
        for name in e.sets:
            if name in data_mod.EVALUATION_SETS:
                prompts = data_mod.evaluation_prompts()[name]
            else:  # a JSONL prompts file
                prompts = data_mod.read_prompt_file(Path(name))
            prompts = prompts[: e.limit] if e.limit else prompts
            ids = self._token_ids(prompts)
            order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
            acc, spec_s, ar_s, tokens, same, answered = [], 0.0, 0.0, 0, 0, ([], [])
            for i in tqdm(range(0, len(order), e.batch_size), desc=f"eval {name}", unit="batch"):
                b = [ids[j] for j in order[i: i + e.batch_size]]
                # τ at the drafter's full verify width: "auto" may resolve to compact on the machine's cost
                # table and verify scheduled windows only, which caps acceptance (a speed choice, not the drafter's).
                out = speculative_generate(self.target, drafter, b, max_new_tokens=e.max_new_tokens,
                                           verify_mode="static")
                ref = generate(self.target, b, max_new_tokens=e.max_new_tokens)
                acc += [a for row in out.acceptance_lengths for a in row]
                spec_s += out.stats["prefill_s"] + out.stats["decode_s"]
                ar_s += ref.stats["prefill_s"] + ref.stats["decode_s"]
                tokens += out.stats["new_tokens"]
                same += sum(x == y for x, y in zip(out.token_ids, ref.token_ids))
                answered[0].extend(b)
                answered[1].extend(ref.token_ids)
            results[name] = {"prompts": len(prompts), "tau": float(np.mean(acc)), "cycles": len(acc),
                             "new_tokens": tokens, "spec_s": spec_s, "ar_s": ar_s,
                             "speedup": ar_s / max(spec_s, 1e-9), "identical_rows": same,
                             "acceptance_histogram": np.bincount(acc, minlength=drafter.config.verify_width + 1)
                             .tolist()}
            if drafters.kind_of(drafter.model).has_confidence:
                results[name]["calibration"] = self._eval_calibration(drafter, name, *answered)
            log.warning("%s: tau %.2f over %d prompts (speculative %.1fs vs AR %.1fs)", name,
                        results[name]["tau"], len(prompts), spec_s, ar_s)
        (self.out / "eval.json").write_text(json.dumps(results, indent=1))
        from dflash_jax.batch import plot_acceptance

        plot_acceptance({Path(n).stem: results[n]["acceptance_histogram"] for n in e.sets},
                        self.out / "eval_acceptance.png",
                        title=f"{self.cfg.name}: acceptance lengths, block {drafter.config.block_size}")
        return results

    def _eval_calibration(self, drafter: Drafter, name: str, prompts: list[list[int]],
                          answers: list[list[int]]) -> dict:
        """A scoring drafter's survival calibration on an evaluation set (out of sample: STS saw none of it):
        the cycles greedy decoding ran on it, replayed with their confidences; ECE before and after its
        temperatures (its STS ones; 1 where none were fitted, e.g. a public checkpoint's) and a
        reliability diagram ``eval_reliability_<set>.png``."""
        if self._replayer is None or self._replayer.drafter is not drafter:
            self._replayer = Trainer(self.target, drafter, self.cfg.train, self.out)  # its replay only
        replayed = self._replayer.replay_answers(prompts, answers)
        stem = Path(name).stem
        report = sts.reliability(replayed.z, replayed.accepted, sts.drafter_temperatures(drafter.config),
                                 self.out / f"eval_reliability_{stem}.png",
                                 f"{self.cfg.name}: survival calibration on {stem}")
        if report["cycles"]:
            log.warning("%s: survival ECE %.3f before STS, %.3f after (%d cycles)", name,
                        report["overall_ece_before"], report["overall_ece_after"], report["cycles"])
        return report


def run(config: str | Path, stages: tuple[str, ...] = STAGES, out_dir: str | None = None,
        progress: bool = True, stop_after_s: float | None = None) -> dict:
    """Run the given stages in order.

    ``stop_after_s`` caps this call's data generation and training together (see ``Pipeline.data`` and
    ``Pipeline.train``): a data stage that stops with chunks missing skips the later stages and says so in
    ``result["data_incomplete"]``; a stopped training skips the later stages and says so in
    ``result["stopped_at"]``. Running the same call again continues both."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stages {unknown} (known: {STAGES})")
    p = Pipeline(load_run_config(config, out_dir))
    result: dict[str, Any] = {"out_dir": str(p.out)}
    drafter = None
    if "prompts" in stages:
        result["prompts"] = str(p.prompts())
    t0 = time.perf_counter()
    if "data" in stages:
        result["data"] = str(p.data(stop_after_s=stop_after_s))
        if not p.data_complete():
            result["data_incomplete"] = json.loads((p.out / "data_summary.json").read_text())
            return result
    if "train" in stages:
        left = None if stop_after_s is None else max(0.0, stop_after_s - (time.perf_counter() - t0))
        drafter = p.train(progress=progress, stop_after_s=left)
        if not p.train_summary["completed"]:
            result["stopped_at"] = p.train_summary["steps"]
            return result
    if "export" in stages:
        result["export"] = str(p.export(drafter))
    if "eval" in stages:
        result["eval"] = p.evaluate()
    return result
