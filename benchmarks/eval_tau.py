"""Greedy τ and acceptance histograms of drafters on the evaluation sets, on any backend.

``--method decode`` runs speculative decoding at full verify width (only: the pipeline's eval stage also
decodes every prompt autoregressively to count identical rows). ``--method replay`` decodes each prompt once
autoregressively — greedy speculative decoding is lossless, so every drafter's run commits exactly these
tokens — and replays each drafter's cycles along those answers (``Trainer.replay_answers``: every anchor's
acceptance in training-shaped batches, then the walk decoding takes; tested against real decoding in
tests/test_train.py). The cycles are
decoding's except the last one of a row, which stops at ``max_new_tokens`` (on the real SmolLM2 pair, 24 of 24
rows gave static decoding's cycles). The AR answers are shared by every drafter scored. Either way a whole set
is GPU work: on this project's 2-core CPU one batch of 32 AR answers of 256 tokens took ~9 minutes.

Results go to ``--out`` in the eval stage's ``eval.json`` shape per drafter (``plot_suffix_decay.py`` reads
them), written after each batch (and the AR answers, for replay): an interrupted run resumes where it stopped.

With ``--method replay``, a drafter that scores its drafts (DSpark, DFlash2) also gets the eval stage's survival
calibration per set (``sts.reliability``: ECE of the predicted survival pooled and per draft position, before
and after its own temperatures, predicted against realised τ) and a reliability diagram
``<out>_reliability_<label>_<set>.png`` beside ``--out``. ``--fit-sts SET`` fits STS temperatures on that set's
cycles (``sts.fit_sts``) and reports the ECE they give on every other set, out of sample (``sts_fit`` in the
drafter's entry, diagrams ``…_<set>_sts.png``): whether the raw confidences need STS. The complete cycles'
confidences are kept beside the run's replay scratch (``.replay-<out>/``), so a resumed run re-reports them.

    python benchmarks/eval_tau.py --drafter DFlash=smollm2-135m --drafter DSpark=smollm2-135m-dspark \
        --sets general --method replay --out benchmarks/results/general_tau.json
    # survival calibration of a scoring drafter on a few prompts (CPU): STS fitted on HumanEval, ECE on general
    python benchmarks/eval_tau.py --drafter DSpark=smollm2-135m-dspark --sets humaneval,general --limit 8 \
        --max-new-tokens 64 --fit-sts humaneval --out /tmp/cal.json
    # on the GPU machine (tools/remote_gpu/README.md, session 6): all three sets, full width, ~85 s a drafter
    python3 benchmarks/eval_tau.py --target $M --drafter DSpark=dflash_jax/assets/smollm2-135m-dspark \
        --method decode --batch-size 180 --prompt-dir runs/device --out $OUT/tau.json
    # verify widths below the trained one (the trunk then runs over fewer positions: compact's narrow tiers)
    python3 benchmarks/eval_tau.py --target $M --drafter DFlash=dflash_jax/assets/smollm2-135m-dflash \
        --block-sizes 4,8,16 --method decode --batch-size 180 --prompt-dir runs/device --out $OUT/tau_width.json
    # the DFlash drafter over its whole vocabulary and over the 8,192 / 16,384 most frequent tokens
    python3 benchmarks/eval_tau.py --target $M --drafter DFlash=dflash_jax/assets/smollm2-135m-dflash \
        --draft-vocab 0,8192,16384 --method decode --batch-size 180 --prompt-dir runs/device --out $OUT/tau_vocab.json
    # each drafter against the target as stored and with int8 / fp8 weights (load_target's quantization)
    python3 benchmarks/eval_tau.py --target $M --drafter DFlash=dflash_jax/assets/smollm2-135m-dflash \
        --quantization none,int8,fp8 --method decode --batch-size 180 --prompt-dir runs/device --out $OUT/tau_quant.json

With ``--quantization`` the target is loaded once per quantization (one at a time) and every drafter variant is
scored against it, labelled ``LABEL/int8`` etc.; replay's AR answers are kept per quantization too (a quantized
target answers differently), under ``answers["<set>/int8"]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: common

from common import source_commit  # noqa: E402
from dflash_jax import (draft_vocab, drafters, generate, load_drafter, load_pair, load_target,  # noqa: E402
                        speculative_generate)
from dflash_jax.loading import restrict_draft_vocab  # noqa: E402
from dflash_jax.train import sts  # noqa: E402
from dflash_jax.train.data import EVALUATION_SETS, evaluation_prompts  # noqa: E402
from dflash_jax.train.trainer import Trainer, TrainSettings  # noqa: E402


def load(spec: str, target, dtype: str, quantization: str):
    """A pair name (its drafter, as the pair loaded with the target's ``quantization`` gives it: a reduced draft
    vocabulary then reads the quantized head's rows) or a drafter directory, for ``target``."""
    if Path(spec).is_dir():
        return load_drafter(spec, target, dtype=dtype)
    return load_pair(spec, dtype=dtype, quantization=quantization)[1]


def save(results: dict, out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out)


def add_cycles(entry: dict, committed: list[int]) -> None:
    """Adds cycles (tokens each committed) to an eval.json-shaped entry: histogram, cycles, τ."""
    hist = np.asarray(entry["acceptance_histogram"]) + np.bincount(committed,
                                                                   minlength=len(entry["acceptance_histogram"]))
    entry["acceptance_histogram"] = hist.tolist()
    entry["cycles"] += len(committed)
    entry["tau"] = float((hist * np.arange(len(hist))).sum() / max(hist.sum(), 1))


def ar_answers(target, results: dict, out: Path, name: str, ids: list[list[int]], args) -> list[list[int]]:
    """Greedy AR answers to every prompt of a set (kept in ``results["answers"][name]``, resumable by batch;
    ``name`` is the set's, ``<set>/<quantization>`` for a quantized target)."""
    done = results.setdefault("answers", {}).setdefault(name, [])
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    by_index = dict(done)
    todo = [i for i in order if i not in by_index]
    for start in tqdm(range(0, len(todo), args.batch_size), desc=f"AR answers {name}", unit="batch"):
        batch = todo[start: start + args.batch_size]
        res = generate(target, [ids[i] for i in batch], max_new_tokens=args.max_new_tokens)
        done += [[i, row] for i, row in zip(batch, res.token_ids)]
        save(results, out)
    by_index = dict(done)
    return [by_index[i] for i in range(len(ids))]


def read_prompt_dir(path: Path) -> dict[str, list[str]]:
    return {f.stem: [json.loads(line)["prompt"] for line in f.read_text().splitlines() if line.strip()]
            for f in sorted(path.glob("*.jsonl"))}


def decode_sets(target, drafter, label: str, runs: dict, set_ids: dict[str, list[list[int]]], args, results: dict,
                out: Path, block_size: int | None = None) -> None:
    """Static speculative decoding of every prompt not done yet, the sets' prompts mixed in batches of similar
    lengths; each set's entry grows (and the file is saved) after every batch."""
    done = {name: set(runs[name].setdefault("done_ids", [])) for name in set_ids}
    pending = [(name, i) for name, ids in set_ids.items() for i in range(len(ids)) if i not in done[name]]
    pending.sort(key=lambda item: len(set_ids[item[0]][item[1]]))
    size = args.batch_size or len(pending)
    bar = tqdm(total=len(pending), desc=f"{label} decode", unit="prompt")
    for start in range(0, len(pending), size):
        batch = pending[start: start + size]
        res = speculative_generate(target, drafter, [set_ids[name][i] for name, i in batch],
                                   max_new_tokens=args.max_new_tokens, block_size=block_size,
                                   verify_mode="static")  # the drafter's τ, not a scheduler's windows
        for (name, i), lengths in zip(batch, res.acceptance_lengths):
            entry = runs[name]
            add_cycles(entry, list(lengths))
            entry["done_ids"].append(i)
            entry["done"] = len(entry["done_ids"])
        save(results, out)
        bar.update(len(batch))
    bar.close()


def replay_sets(target, drafter, label: str, runs: dict, set_ids: dict[str, list[list[int]]], args, results: dict,
                out: Path, suffix: str = "") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Replays the drafter's cycles along the AR answers of every set not done yet (its cycles into
    ``runs[set]``). Returns, for a drafter that scores its drafts, each set's complete cycles' confidence logits
    and acceptance (``Replayed.z``, ``Replayed.accepted``), kept in the scratch directory for a resumed run."""
    scored = drafters.kind_of(drafter.model).has_confidence
    trainer, calibration = None, {}
    for name, ids in set_ids.items():
        entry = runs[name]
        kept = scratch(out) / f"{label.replace('/', '-')}_{Path(name).stem}.npz"
        if entry["done"] < len(ids) or (scored and not kept.is_file()):
            answers = ar_answers(target, results, out, name + suffix, ids, args)  # suffix: the target's quantization
            trainer = trainer or Trainer(target, drafter, TrainSettings(batch_size=8, max_anchors=64), scratch(out))
            replayed = trainer.replay_answers(ids, answers)
            if entry["done"] < len(ids):
                add_cycles(entry, [c for row in replayed.cycles for c in row])
                entry["done"] = len(ids)
            if scored:
                np.savez(kept, z=replayed.z, accepted=replayed.accepted)
            save(results, out)
        if scored:
            with np.load(kept) as f:
                calibration[name] = (f["z"], f["accepted"])
    return calibration


def scratch(out: Path) -> Path:
    """The replay's working directory beside ``--out`` (the trainer's, and the kept calibration cycles)."""
    return Path(out.parent, f".replay-{out.stem}")


def diagram(out: Path, label: str, name: str, tail: str = "") -> Path:
    """Drafter ``label``'s reliability diagram on set ``name``, beside ``--out`` (a label's ``/`` becomes ``-``)."""
    return out.parent / f"{out.stem}_reliability_{label.replace('/', '-')}_{Path(name).stem}{tail}.png"


def calibrate(label: str, runs: dict, data: dict[str, tuple[np.ndarray, np.ndarray]], temperatures,
              fit_set: str | None, out: Path) -> None:
    """Each set's survival calibration (``data``: its complete cycles' confidence logits and acceptance) at the
    drafter's ``temperatures`` into ``runs[set]["calibration"]``, with its reliability diagram; with ``fit_set``,
    STS temperatures fitted on that set's cycles and the calibration they give on the others (out of sample)
    into ``runs["sts_fit"]``."""
    for name, (z, accepted) in data.items():
        plot = diagram(out, label, name)
        runs[name]["calibration"] = {**sts.reliability(z, accepted, temperatures, plot,
                                                       f"{label}: survival calibration on {name}"),
                                     **({"plot": str(plot)} if len(z) else {})}
    if fit_set is None:
        return
    if not len(data[fit_set][0]):
        raise SystemExit(f"--fit-sts {fit_set}: {label} ran no complete cycle on it (more prompts or tokens)")
    fit = sts.fit_sts(*data[fit_set])
    runs["sts_fit"] = {"set": fit_set, "temperatures": fit["temperatures"], fit_set: fit}
    for name, (z, accepted) in data.items():
        if name != fit_set:
            runs["sts_fit"][name] = sts.reliability(z, accepted, fit["temperatures"], diagram(out, label, name, "_sts"),
                                                    f"{label}: STS fitted on {fit_set}, on {name}")


def report_calibration(label: str, runs: dict, sets) -> None:
    """Prints each set's survival ECE (pooled, then per draft position) and predicted against realised τ."""
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    for name in sets:
        c = runs[name].get("calibration")
        if c and c["cycles"]:
            print(f"{label} {name}: survival ECE {c['overall_ece_before']:.3f} at T = 1, {c['overall_ece_after']:.3f} "
                  f"at the drafter's temperatures over {c['cycles']} complete cycles; predicted tau "
                  f"{c['predicted_tau_before']:.2f} / {c['predicted_tau_after']:.2f} against {c['realised_tau']:.2f}"
                  f"\n  per draft at T = 1: {fmt(c['ece_before'])}\n  at its T:         {fmt(c['ece_after'])}",
                  flush=True)
    fit = runs.get("sts_fit")
    if fit:
        print(f"{label} STS fitted on {fit['set']}: T = {fmt(fit['temperatures'])}", flush=True)
        for name in sets:
            c = fit[name]
            where = "in sample" if name == fit["set"] else "out of sample"
            print(f"  {name} ({where}, {c['cycles']} cycles): ECE {c['overall_ece_before']:.3f} at T = 1, "
                  f"{c['overall_ece_after']:.3f} at the fitted T; per draft {fmt(c['ece_after'])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", required=True, help="LABEL=pair name or drafter directory")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sets", default=",".join(EVALUATION_SETS))
    ap.add_argument("--method", choices=("replay", "decode"), default="replay")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32,
                    help="rows per call (each new batch shape compiles anew, ~1 min on the H200; 180 covers the three "
                         "sets in 3 calls); 0: every pending prompt in one call (538 rows in float32 ran out of the "
                         "H200's memory in the prefill)")
    ap.add_argument("--prompt-dir", type=Path,
                    help="read the sets from <dir>/<set>.jsonl ({'prompt': …} lines, "
                         "tools/remote_gpu/make_run_config.py writes them) instead of the installed evaluation packages")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts of each set (0: all)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-vocab", default="0",
                    help="comma-separated draft vocabulary sizes to score each DFlash drafter at (the embedded "
                         "ranking's N most frequent tokens; 0: the whole vocabulary), labelled LABEL/vN")
    ap.add_argument("--block-sizes", default="0",
                    help="comma-separated verify widths to decode at (--method decode; 0: the drafter's own), "
                         "labelled LABEL/bN")
    ap.add_argument("--quantization", default="none",
                    help="comma-separated target quantizations to score each drafter against (none: as stored; "
                         "int8; fp8: load_target's quantization), labelled LABEL/int8 etc.; the target is loaded "
                         "once per quantization, one at a time")
    ap.add_argument("--fit-sts", metavar="SET",
                    help="--method replay: fit STS temperatures on SET's cycles (one of --sets) for every drafter "
                         "that scores its drafts, and report the ECE they give on the other sets")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results["info"] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
                       "commit": source_commit(),
                       "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "method": args.method}
    sizes = [int(n) for n in args.draft_vocab.split(",")]
    widths = [int(n) for n in args.block_sizes.split(",")]
    if widths != [0] and args.method != "decode":
        ap.error("--block-sizes needs --method decode")
    quantizations = [q.strip().lower() for q in args.quantization.split(",")]
    for q in quantizations:
        if q not in ("none", "int8", "fp8"):
            ap.error(f"--quantization takes none, int8, fp8 (comma-separated), got {q!r}")
    prompts = read_prompt_dir(args.prompt_dir) if args.prompt_dir else evaluation_prompts()
    if args.fit_sts and (args.method != "replay" or args.fit_sts not in args.sets.split(",")):
        ap.error("--fit-sts names one of --sets, with --method replay")
    set_ids = None
    for quantization in quantizations:
        target = None  # the previous quantization's target is released before the next one loads
        target = load_target(args.target, dtype=args.dtype, quantization=quantization)
        if set_ids is None:  # one tokenizer whatever the weights
            set_ids = {name: [target.tokenizer.encode(p) for p in prompts[name][: args.limit or None]]
                       for name in args.sets.split(",")}
        score(target, quantization, set_ids, sizes, widths, args, results, out)
    return 0


def score(target, quantization: str, set_ids: dict[str, list[list[int]]], sizes: list[int], widths: list[int], args,
          results: dict, out: Path) -> None:
    """Every drafter variant (draft vocabulary × verify width) against ``target``, loaded with ``quantization``."""
    suffix = "" if quantization == "none" else f"/{quantization}"
    for label, spec, size, width in ((*d.split("=", 1), n, w) for d in args.drafter for n in sizes for w in widths):
        drafter = load(spec, target, args.dtype, quantization)
        if size:
            ids = draft_vocab.top_ids(draft_vocab.resolve_ranking("embedded:smollm2-135m"), size,
                                      target.config.vocab_size)
            drafter, label = restrict_draft_vocab(drafter, target, ids), f"{label}/v{size}"
        label = (f"{label}/b{width}" if width else label) + suffix
        runs = results.setdefault(label, {"drafter": spec, **({"block_size": width} if width else {}),
                                          **({"quantization": quantization} if suffix else {})})
        for name, ids in set_ids.items():
            runs.setdefault(name, {"prompts": len(ids), "done": 0, "cycles": 0, "tau": 0.0,
                                   "acceptance_histogram": [0] * ((width or drafter.config.verify_width) + 1)})
        if args.method == "replay":
            calibration = replay_sets(target, drafter, label, runs, set_ids, args, results, out, suffix)
            if calibration:
                calibrate(label, runs, calibration, sts.drafter_temperatures(drafter.config), args.fit_sts, out)
                save(results, out)
        if args.method == "decode":
            decode_sets(target, drafter, label, runs, set_ids, args, results, out, width or None)
        for name in set_ids:
            print(f"{label} {name}: tau {runs[name]['tau']:.3f} over {runs[name]['prompts']} prompts", flush=True)
        report_calibration(label, runs, set_ids)


if __name__ == "__main__":
    sys.exit(main())
