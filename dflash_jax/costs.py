"""Step cost tables for the confidence scheduler (:mod:`dflash_jax.decode.schedule`).

A table holds, for a (target, drafter) pair on one machine, the time of one decode step — draft, compact
verify, accept, commit — at each packed-verify tier: ``step_ms[batch][tokens per row]``, where a tier of
``batch`` rows verifies ``batch × tokens per row`` tokens (:func:`schedule.tiers_for`). ``dflash-jax
calibrate --config <pair>`` measures it (:func:`dflash_jax.engine.calibrate.measure`) and writes
``<pair>.costs.json`` next to the pair's YAML: one table per backend under the backend's name (``"gpu"``), and
beside it, under ``"gpu@<device kind>"``, the tables of other devices of that backend (one GPU's steps are not
another's scaled);
:func:`dflash_jax.load_pair` picks up the file, and :func:`pick` takes this device's table from it, else the
backend's. Without one, the table shipped for the backend (``dflash_jax/assets/costs/<backend>.json``, the
embedded pair, measured on one device of that backend) is used: the scheduler only compares costs of one batch
shape, so a table's shape matters more than its absolute figures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("dflash_jax")
SHIPPED = Path(__file__).parent / "assets" / "costs"


class CostTableError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class CostTable:
    backend: str  # "cpu", "gpu", "tpu"
    device: str  # the device kind JAX reports (a GPU's product name; "cpu")
    dtype: str
    pair: str
    block_size: int  # L the tiers were measured for
    context: int  # cache length the steps attended over
    step_ms: dict[int, dict[int, float]]  # batch → tokens per row → ms per step
    created: str = ""  # date, commit
    # batch → ms of a plain autoregressive step (no drafting): the scheduler may then skip drafting for a step
    # (compact mode, drafters without a confidence head). Empty: not measured, not offered.
    ar_ms: dict[int, float] = dataclasses.field(default_factory=dict)
    # batch → ms of the static verify's step (the whole block drafted, verified and committed, no scheduler):
    # compact runs static's program where none of its tiers saves on this. Empty: not measured.
    static_ms: dict[int, float] = dataclasses.field(default_factory=dict)
    # batch → ms of a plain autoregressive step (the step generate runs, capturing the drafter's features): what
    # verify mode auto falls back to where drafting does not pay (dflash_jax.engine.switching). Empty: not
    # measured (the fallback then counts the scheduler's step without drafting, ar_ms).
    fallback_ms: dict[int, float] = dataclasses.field(default_factory=dict)

    def step_costs(self, batch: int, tiers: tuple[int, ...]) -> np.ndarray:
        """Milliseconds of a step at each tier of ``batch`` rows: interpolated in tokens per row, and in
        log₂ batch between measured batches (beyond the largest, scaled with the batch)."""
        per_row = np.asarray(tiers, np.float64) / batch

        def at(b: int) -> np.ndarray:
            row = self.step_ms[b]
            xs = sorted(row)
            return np.interp(per_row, xs, [row[x] for x in xs])

        return _in_batch(self.step_ms, batch, at)

    def ar_cost(self, batch: int) -> float | None:
        """Milliseconds of an autoregressive step of ``batch`` rows (None: not in the table)."""
        return _column(self.ar_ms, batch)

    def static_cost(self, batch: int) -> float | None:
        """Milliseconds of a static verify's step of ``batch`` rows (None: not in the table)."""
        return _column(self.static_ms, batch)

    def fallback_cost(self, batch: int) -> float | None:
        """Milliseconds of a plain autoregressive step of ``batch`` rows: :attr:`fallback_ms`, else the scheduler's
        step without drafting (None: neither in the table). Each measured batch gives its own (a table that a
        calibration of some batches was merged into times the plain step at those only), interpolated between."""
        return _column({**self.ar_ms, **self.fallback_ms}, batch)

    def explain(self, batch: int) -> str | None:
        """Why speculative decoding does or does not pay at ``batch`` rows on the machine measured, from the
        table (None without an AR column): what a drafted step verifying one token and a whole block per row
        costs in AR steps — the tokens per row a cycle must commit to break even."""
        ar = self.ar_cost(batch)
        if ar is None:
            return None
        block = max(self.step_ms[min(self.step_ms)])
        one, full = self.step_costs(batch, (batch, block * batch)) / ar
        return (f"Why: by the {self.backend} step costs (table {self.device!r}, {self.created or 'undated'}), at batch "
                f"{batch} a drafted step costs {one:.2f} autoregressive steps before any draft is verified (drafting "
                f"alone) and {full:.2f} verifying all {block} tokens per row, so a cycle must commit more tokens per "
                f"row than that to pay. Speculative decoding wins where verifying a block costs about one step "
                f"(GPUs, TPUs: benchmarks/README.md); on a CPU every verified token costs real compute.")

    def merged_into(self, older: "CostTable") -> "CostTable":
        """This table with ``older``'s batches that it did not measure (a calibration of more batches adds them
        to the table; a batch measured again replaces its row). Only for the same measurement: pair, machine,
        dtype, verify width and context."""
        key = lambda t: (t.backend, t.device, t.dtype, t.pair, t.block_size, t.context)  # noqa: E731
        if key(older) != key(self):
            return self
        return dataclasses.replace(self, step_ms={**older.step_ms, **self.step_ms}, ar_ms={**older.ar_ms, **self.ar_ms},
                                   static_ms={**older.static_ms, **self.static_ms},
                                   fallback_ms={**older.fallback_ms, **self.fallback_ms})

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["step_ms"] = {str(b): {str(t): round(ms, 4) for t, ms in row.items()} for b, row in self.step_ms.items()}
        d["ar_ms"] = {str(b): round(ms, 4) for b, ms in self.ar_ms.items()}
        d["static_ms"] = {str(b): round(ms, 4) for b, ms in self.static_ms.items()}
        d["fallback_ms"] = {str(b): round(ms, 4) for b, ms in self.fallback_ms.items()}
        return d

    @staticmethod
    def from_json(d: Any, where: str) -> "CostTable":
        try:
            step = {int(b): {int(t): float(ms) for t, ms in row.items()} for b, row in d["step_ms"].items()}
            ar = {int(b): float(ms) for b, ms in (d.get("ar_ms") or {}).items()}
            static = {int(b): float(ms) for b, ms in (d.get("static_ms") or {}).items()}
            fallback = {int(b): float(ms) for b, ms in (d.get("fallback_ms") or {}).items()}
            table = CostTable(str(d["backend"]), str(d.get("device", "")), str(d.get("dtype", "")),
                              str(d.get("pair", "")), int(d["block_size"]), int(d.get("context", 0)), step,
                              str(d.get("created", "")), ar, static, fallback)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CostTableError(f"{where}: not a cost table ({type(e).__name__}: {e})") from None
        if not step or any(not row or min(row.values()) <= 0 for row in step.values()):
            raise CostTableError(f"{where}: a cost table needs positive step times for at least one batch")
        if any(ms <= 0 for ms in (*ar.values(), *static.values(), *fallback.values())):
            raise CostTableError(f"{where}: autoregressive, static and fallback step times must be positive")
        return table


def _column(by_batch: dict[int, float], batch: int) -> float | None:
    """A one-number-per-batch column at ``batch`` rows (None: not measured)."""
    if not by_batch:
        return None
    return float(_in_batch(by_batch, batch, lambda b: np.asarray(by_batch[b])))


def _in_batch(by_batch: dict[int, Any], batch: int, at) -> np.ndarray:
    """``at(b)`` interpolated in log₂ batch between the measured batches ``by_batch`` (beyond the largest,
    scaled with the batch; below the smallest, the smallest's)."""
    batches = sorted(by_batch)
    if batch >= batches[-1]:
        return at(batches[-1]) * batch / batches[-1]
    if batch <= batches[0]:
        return at(batches[0])
    hi = next(i for i, b in enumerate(batches) if b >= batch)
    lo_b, hi_b = batches[hi - 1], batches[hi]
    f = (np.log2(batch) - np.log2(lo_b)) / (np.log2(hi_b) - np.log2(lo_b))
    return (1 - f) * at(lo_b) + f * at(hi_b)


def tables_path(pair_yaml: str | Path) -> Path:
    """``configs/<pair>.yaml`` → ``configs/<pair>.costs.json``."""
    p = Path(pair_yaml)
    return p.with_name(p.stem + ".costs.json")


def device_key(backend: str, device: str) -> str:
    """A costs file's key for a table of ``device`` beside its backend's own (``"gpu@<device kind>"``)."""
    return f"{backend}@{device}"


def load_tables(path: str | Path) -> dict[str, CostTable]:
    """key → table, from a costs file (missing file: empty); keys are backends, or :func:`device_key`."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CostTableError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CostTableError(f"{path}: expected a mapping of backend → table")
    tables = {key: CostTable.from_json(t, f"{path} [{key}]") for key, t in raw.items()}
    for key, table in tables.items():
        if key not in (table.backend, device_key(table.backend, table.device)):
            raise CostTableError(f"{path} [{key}]: holds a table of the {table.backend} backend measured on "
                                 f"{table.device!r}: its key must be {table.backend!r} or "
                                 f"{device_key(table.backend, table.device)!r}")
    return tables


def pick(tables: dict[str, CostTable] | None, backend: str, device: str) -> CostTable | None:
    """The table measured on ``device`` if ``tables`` has one, else the backend's (None: neither)."""
    tables = tables or {}
    return tables.get(device_key(backend, device)) or tables.get(backend)


def table_key(tables: dict[str, CostTable], table: CostTable) -> str:
    """``table``'s key among ``tables`` (a costs file's): its backend's, unless the backend's table there is
    another device's; then :func:`device_key`."""
    own = tables.get(table.backend)
    return table.backend if own is None or own.device == table.device else device_key(table.backend, table.device)


def save_table(path: str | Path, table: CostTable) -> CostTable:
    """Put ``table`` in the costs file ``path``: as its backend's, unless that one was measured on another
    device, whose table stays (this one then goes beside it, under :func:`device_key`). Added to the table
    of its key if that is the same measurement (:meth:`CostTable.merged_into`), else in its place. Returns the
    table written."""
    path = Path(path)
    tables = load_tables(path)
    key = table_key(tables, table)
    if key in tables:
        table = table.merged_into(tables[key])
    tables[key] = table
    path.write_text(json.dumps({k: v.to_json() for k, v in tables.items()}, indent=1) + "\n")
    return table


def shipped_table(backend: str) -> CostTable:
    """The table shipped for ``backend`` (this device's if one is shipped; a GPU's for a backend we have none
    for)."""
    return _shipped_table(backend, device_kind())


@functools.cache
def _shipped_table(backend: str, device: str) -> CostTable:
    for name in (backend, "gpu"):
        table = pick(load_tables(SHIPPED / f"{name}.json"), name, device)
        if table:
            if name != backend:
                log.info("no step cost table is shipped for the %s backend: using the GPU's", backend)
            return table
    raise CostTableError(f"no shipped cost table in {SHIPPED}")


def resolve(table: "CostTable | str | Path | None", backend: str, attached: dict | None = None) -> CostTable:
    """The table to schedule with: the one given (or this device's / backend's in a costs file), else the
    pair's for this device or backend (``attached``: what :func:`dflash_jax.load_pair` found next to the pair),
    else the shipped one."""
    if isinstance(table, CostTable):
        return table
    here = device_kind()
    if table is not None:
        tables = load_tables(table)
        if not tables:
            raise CostTableError(f"cost table {table} does not exist")
        found = pick(tables, backend, here)
        if found is None:
            raise CostTableError(f"{table} has no table for the {backend} backend (it has {sorted(tables)}): run "
                                 f"`dflash-jax calibrate` on this machine")
        return found
    table = pick(attached, backend, here) or shipped_table(backend)
    _note_other_device(table.device, here)
    return table


def device_kind() -> str:
    import jax

    device = jax.devices()[0]
    return getattr(device, "device_kind", str(device))


@functools.cache
def _note_other_device(measured_on: str, here: str) -> None:
    """Once per process and device: the table found for the pair (or shipped) was timed on another device.
    Its tiers still run, but the scheduler's windows follow that device's costs (one GPU's steps
    are not another's scaled), so a table measured here schedules better."""
    if measured_on and here and measured_on != here:
        log.warning("the step cost table was measured on %s, this is %s: `dflash-jax calibrate --config <pair>` "
                    "measures one here (compact mode schedules with it)", measured_on, here)


def plot(table: CostTable, path: str | Path) -> Path:
    """Step time against verify tokens, one line per batch (and the ideal: flat until compute-bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for b, row in sorted(table.step_ms.items()):
        xs = sorted(row)
        line, = ax.plot([b * x for x in xs], [row[x] for x in xs], marker="o", label=f"batch {b}")
        if b in table.ar_ms:  # the autoregressive step: b tokens, no drafting
            ax.plot([b], [table.ar_ms[b]], marker="x", markersize=9, color=line.get_color(), linestyle="none")
        if b in table.static_ms:  # the static verify's step: the whole block, no scheduler
            ax.plot([b * max(xs)], [table.static_ms[b]], marker="s", markersize=7, fillstyle="none",
                    color=line.get_color(), linestyle="none")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("verify tokens in the step (batch × tokens per row)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 2, 3, 4 ms rather than 2×10⁰
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylabel("step time (ms): draft + verify + commit")
    ax.set_title(f"{table.pair} on {table.device} ({table.dtype}, context {table.context})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    grey = dict(color="grey", linestyle="none")
    if table.ar_ms:
        handles.append(matplotlib.lines.Line2D([], [], marker="x", label="no drafting (AR step)", **grey))
    if table.static_ms:
        handles.append(matplotlib.lines.Line2D([], [], marker="s", fillstyle="none", label="static verify", **grey))
    ax.legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
