"""Acceptance by block position — the "suffix decay" plot (issue 19): for each evaluation set, the conditional
acceptance of draft k (P(draft k accepted | drafts < k accepted)) and the survival P(a ≥ k), per drafter, from
the acceptance-length histograms that the training pipeline's eval stage writes (``eval.json``: index = a+1,
the tokens a cycle commits) or ``eval_tau.py`` (``PATH#LABEL``: one drafter of its output); a third row draws
the histograms themselves (the share of cycles committing each number of tokens).

    python benchmarks/tools/plot_suffix_decay.py --run DFlash=benchmarks/results/2026-12-01_train7_h200.json \
        --run DSpark=eval.json --out suffix_decay.png
    python benchmarks/tools/plot_suffix_decay.py --run DFlash=tau.json#DFlash --run DSpark=tau.json#DSpark --out s.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def histograms(spec: str) -> dict[str, np.ndarray]:
    """{set name: histogram} from an eval.json, a RESULTS raw file holding one under "eval", or
    ``path#LABEL``: the drafter LABEL of an ``eval_tau.py`` output."""
    path, _, label = spec.partition("#")
    data = json.loads(Path(path).read_text())
    data = data[label] if label else data.get("eval", data)
    return {Path(k).stem: np.asarray(v["acceptance_histogram"], float) for k, v in data.items()
            if isinstance(v, dict) and "acceptance_histogram" in v}


def by_position(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(survival S_k = P(a ≥ k), conditional S_k / S_{k-1}) for drafts k = 1 … len-2."""
    total = hist.sum()
    accepted = np.arange(len(hist)) - 1  # index a+1 → a
    survival = np.asarray([hist[accepted >= k].sum() / total for k in range(1, len(hist) - 1)])
    previous = np.concatenate([[1.0], survival[:-1]])
    return survival, np.divide(survival, previous, out=np.zeros_like(survival), where=previous > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help="LABEL=path to eval.json (or a RESULTS raw json)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: histograms(p) for label, p in (r.split("=", 1) for r in args.run)}
    sets = sorted(set.intersection(*(set(h) for h in runs.values())))
    fig, axes = plt.subplots(3, len(sets), figsize=(5 * len(sets), 10), squeeze=False)
    summary = {}
    for j, name in enumerate(sets):
        for label, hists in runs.items():
            survival, conditional = by_position(hists[name])
            k = np.arange(1, len(survival) + 1)
            axes[0, j].plot(k, conditional, marker="o", label=label)
            axes[1, j].plot(k, survival, marker="o", label=label)
            width = 0.8 / len(runs)
            offset = (list(runs).index(label) - (len(runs) - 1) / 2) * width
            committed = np.arange(len(hists[name]))
            axes[2, j].bar(committed + offset, hists[name] / hists[name].sum(), width=width,
                           label=f"{label} (τ {(committed * hists[name]).sum() / hists[name].sum():.2f})")
            summary.setdefault(name, {})[label] = {"conditional": conditional.round(3).tolist(),
                                                   "survival": survival.round(4).tolist()}
        axes[0, j].set_title(f"{name}: P(draft k accepted | drafts < k accepted)")
        axes[1, j].set_title(f"{name}: P(at least k drafts accepted)")
        axes[1, j].set_yscale("log")
        axes[2, j].set_title(f"{name}: tokens committed per cycle (share of cycles)")
        axes[2, j].set_xlabel("tokens committed (accepted drafts + 1)")
        for ax in axes[:2, j]:
            ax.set_xlabel("draft position k")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
