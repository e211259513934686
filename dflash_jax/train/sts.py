"""Sequential temperature scaling (STS, SPEC §7) of a DSpark drafter's confidences, and its reliability report.

A scheduler admits draft k by its predicted survival ``Π_{i≤k} σ(z_i / T_i)``, the probability that drafts
1 … k all pass verification, so it is that product that must be calibrated, position by position, not each
confidence alone. Fitting left to right works because position k's survival depends on T_1 … T_k only: with
the earlier temperatures fixed, ``T_k`` is the grid value that minimises the ECE of the survival at k against
the survival realised in greedy decoding cycles.

Shapes: N cycles, G drafts per cycle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# 0.25 … 4, log-spaced and symmetric around 1 (which is on the grid: an unscaled head stays unscaled on ties)
GRID = np.geomspace(0.25, 4.0, 41)


def survival(z: np.ndarray, temperatures) -> np.ndarray:
    """Predicted survival [N, G]: ``Π_{i≤k} σ(z_i / T_i)``."""
    t = np.asarray(temperatures, np.float64)
    return np.cumprod(1.0 / (1.0 + np.exp(-np.asarray(z, np.float64) / t)), axis=-1)


def ece(pred: np.ndarray, real: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error over ``bins`` equal-width bins of ``pred`` ∈ [0, 1]: the mean over samples
    of |mean prediction − mean outcome| of the sample's bin."""
    pred, real = np.ravel(pred), np.ravel(real).astype(np.float64)
    if pred.size == 0:
        return 0.0
    idx = np.minimum((pred * bins).astype(np.int64), bins - 1)
    gap = np.abs(np.bincount(idx, pred, bins) - np.bincount(idx, real, bins))  # per bin: n·|mean p − mean y|
    return float(gap.sum() / pred.size)


def fit_sts(z: np.ndarray, accepted: np.ndarray, grid: np.ndarray = GRID, bins: int = 10) -> dict:
    """Temperatures T_1 … T_G from cycles' confidence logits ``z`` [N, G] and ``accepted`` [N, G] (draft k was
    accepted: all drafts up to k were right), fitted left to right by grid search on the survival's ECE.
    Returns ``calibration_report`` with them (ECE before and after, per position and pooled)."""
    z = np.asarray(z, np.float64)
    accepted = np.asarray(accepted, bool)
    if z.ndim != 2 or z.shape != accepted.shape or not len(z):
        raise ValueError(f"fit_sts needs z and accepted of one shape [N, G] with N > 0, got {z.shape} and "
                         f"{accepted.shape}")
    realised = np.cumprod(accepted, axis=1).astype(np.float64)  # leading-correct, whatever the input says
    order = np.argsort(np.abs(np.log(grid)), kind="stable")  # on a tie, the value closest to 1 wins
    temps, prefix = [], np.ones(len(z))
    for k in range(z.shape[1]):
        scores = [ece(prefix / (1.0 + np.exp(-z[:, k] / grid[j])), realised[:, k], bins) for j in order]
        t = float(grid[order[int(np.argmin(scores))]])
        temps.append(t)
        prefix = prefix / (1.0 + np.exp(-z[:, k] / t))
    return calibration_report(z, accepted, temps, bins)


def calibration_report(z: np.ndarray, accepted: np.ndarray, temperatures, bins: int = 10) -> dict:
    """ECE of the predicted survival before (all T = 1) and after scaling with ``temperatures``, per position
    and pooled over every (cycle, position); predicted τ (1 + Σ survival) beside the realised one."""
    realised = np.cumprod(np.asarray(accepted, bool), axis=1)
    out = {"cycles": int(len(z)), "temperatures": [float(t) for t in temperatures]}
    for name, temps in (("before", np.ones(z.shape[1])), ("after", temperatures)):
        pred = survival(z, temps)
        out[f"ece_{name}"] = [ece(pred[:, k], realised[:, k], bins) for k in range(z.shape[1])]
        out[f"overall_ece_{name}"] = ece(pred, realised, bins)
        out[f"predicted_tau_{name}"] = float(1 + pred.sum(1).mean()) if len(z) else 0.0
    out["realised_tau"] = float(1 + realised.sum(1).mean()) if len(z) else 0.0
    return out


def drafter_temperatures(config) -> tuple[float, ...]:
    """The temperatures a drafter's confidences are used at (``config``: its ``DrafterConfig``): its STS ones
    (DSpark, DFlash2, once calibrated), else 1 per draft."""
    return tuple(config.confidence_temperatures or (1.0,) * (config.verify_width - 1))


def reliability(z: np.ndarray, accepted: np.ndarray, temperatures, plot: str | Path | None = None,
                title: str = "") -> dict:
    """``calibration_report`` of cycles' confidences ``z`` [N, G] at ``temperatures``, and its reliability
    diagram written to ``plot`` (where given and there are cycles)."""
    report = calibration_report(z, accepted, temperatures)
    if plot is not None and len(z):
        plot_reliability(z, accepted, temperatures, plot, title)
    return report


def cycle_calibration(acceptance: np.ndarray, z: np.ndarray, prompt_lengths: np.ndarray, lengths: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The cycles greedy decoding of each row runs (the walk of ``objective.walked_cycles``), as STS data:
    their confidence logits [N, G] and which drafts were accepted [N, G]. ``acceptance`` [Bs, T] and ``z``
    [Bs, T, G] come from ``Trainer.replay``. Only cycles whose G drafts all have labels in the row are kept
    (the row's end says nothing about drafts past it)."""
    g = z.shape[-1]
    zs, acc = [], []
    for a_row, z_row, p, n in zip(acceptance, z, prompt_lengths, lengths):
        p, n = int(p), int(n)
        while p <= n - 2:
            a = int(a_row[p])
            if p + g <= n - 1:
                zs.append(z_row[p])
                acc.append(np.arange(g) < a - 1)
            p += min(a, n - 1 - p)
    return np.asarray(zs, np.float32).reshape(-1, g), np.asarray(acc, bool).reshape(-1, g)


def plot_reliability(z: np.ndarray, accepted: np.ndarray, temperatures, path: str | Path, title: str,
                     bins: int = 10) -> Path:
    """Reliability diagram: per draft position, measured acceptance (survival) against predicted survival in
    equal-width bins, before (all T = 1) and after STS, one panel each; the diagonal is perfect calibration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    realised = np.cumprod(np.asarray(accepted, bool), axis=1)
    g = z.shape[1]
    colors = plt.cm.viridis(np.linspace(0, 0.9, g))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    for ax, (name, temps) in zip(axes, (("before STS", np.ones(g)), ("after STS", temperatures))):
        pred = survival(z, temps)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        for k in range(g):
            idx = np.minimum((pred[:, k] * bins).astype(np.int64), bins - 1)
            count = np.bincount(idx, minlength=bins)
            keep = count > 0
            px = np.bincount(idx, pred[:, k], bins)[keep] / count[keep]
            py = np.bincount(idx, realised[:, k], bins)[keep] / count[keep]
            ax.plot(px, py, marker="o", markersize=3, linewidth=1, color=colors[k],
                    label=f"draft {k + 1} (ECE {ece(pred[:, k], realised[:, k], bins):.3f})")
        ax.set_title(f"{name}: pooled ECE {ece(pred, realised, bins):.3f}")
        ax.set_xlabel("predicted survival Π σ(z/T)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("measured acceptance")
    axes[1].legend(fontsize=6, loc="upper left", ncol=2 if g > 8 else 1)
    fig.suptitle(f"{title} ({len(z)} cycles)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
