"""Step cost tables for the confidence scheduler (:mod:`dflash_jax.decode.schedule`).

A table holds, for a (target, drafter) pair on one machine, the time of one decode step — draft, compact
verify, accept, commit — at each packed-verify tier: ``step_ms[batch][tokens per row]``, where a tier of
``batch`` rows verifies ``batch × tokens per row`` tokens (:func:`schedule.tiers_for`). ``dflash-jax
calibrate --config <pair>`` measures it (:func:`measure`) and writes ``<pair>.costs.json`` next to the pair's
YAML: one table per backend under the backend's name (``"gpu"``), and beside it, under ``"gpu@<device kind>"``,
the tables of other devices of that backend (an H100's steps are not an H200's scaled: RESULTS.md, session 28);
:func:`dflash_jax.load_pair` picks up the file, and :func:`pick` takes this device's table from it, else the
backend's. Without one, the table shipped for the backend (``dflash_jax/assets/costs/<backend>.json``, the
embedded pair measured on our machines) is used: the scheduler only compares costs of one batch shape, so a
table's shape matters more than its absolute figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import subprocess
import time
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
    device: str  # e.g. "NVIDIA H200"
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
                f"(GPUs, TPUs: benchmarks/RESULTS.md); on a CPU every verified token costs real compute.")

    def merged_into(self, older: "CostTable") -> "CostTable":
        """This table with ``older``'s batches that it did not measure (a calibration of more batches adds them
        to the table; a batch measured again replaces its row). Only for the same measurement: pair, machine,
        dtype, verify width and context."""
        key = lambda t: (t.backend, t.device, t.dtype, t.pair, t.block_size, t.context)  # noqa: E731
        if key(older) != key(self):
            return self
        return dataclasses.replace(self, step_ms={**older.step_ms, **self.step_ms}, ar_ms={**older.ar_ms, **self.ar_ms},
                                   static_ms={**older.static_ms, **self.static_ms})

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["step_ms"] = {str(b): {str(t): round(ms, 4) for t, ms in row.items()} for b, row in self.step_ms.items()}
        d["ar_ms"] = {str(b): round(ms, 4) for b, ms in self.ar_ms.items()}
        d["static_ms"] = {str(b): round(ms, 4) for b, ms in self.static_ms.items()}
        return d

    @staticmethod
    def from_json(d: Any, where: str) -> "CostTable":
        try:
            step = {int(b): {int(t): float(ms) for t, ms in row.items()} for b, row in d["step_ms"].items()}
            ar = {int(b): float(ms) for b, ms in (d.get("ar_ms") or {}).items()}
            static = {int(b): float(ms) for b, ms in (d.get("static_ms") or {}).items()}
            table = CostTable(str(d["backend"]), str(d.get("device", "")), str(d.get("dtype", "")),
                              str(d.get("pair", "")), int(d["block_size"]), int(d.get("context", 0)), step,
                              str(d.get("created", "")), ar, static)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CostTableError(f"{where}: not a cost table ({type(e).__name__}: {e})") from None
        if not step or any(not row or min(row.values()) <= 0 for row in step.values()):
            raise CostTableError(f"{where}: a cost table needs positive step times for at least one batch")
        if any(ms <= 0 for ms in (*ar.values(), *static.values())):
            raise CostTableError(f"{where}: autoregressive and static step times must be positive")
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
    """A costs file's key for a table of ``device`` beside its backend's own (``"gpu@NVIDIA H100 80GB HBM3"``)."""
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
    return _shipped_table(backend, _device_kind())


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
    here = _device_kind()
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


def _device_kind() -> str:
    import jax

    device = jax.devices()[0]
    return getattr(device, "device_kind", str(device))


@functools.cache
def _note_other_device(measured_on: str, here: str) -> None:
    """Once per process and device: the table found for the pair (or shipped) was timed on another device.
    Its tiers still run, but the scheduler's windows follow that device's costs (an H100's steps are not an
    H200's scaled: RESULTS.md, session 28), so a table measured here schedules better."""
    if measured_on and here and measured_on != here:
        log.warning("the step cost table was measured on %s, this is %s: `dflash-jax calibrate --config <pair>` "
                    "measures one here (compact mode schedules with it)", measured_on, here)


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------

ROUNDS = 3  # timed calls per tier in measure()


def measure(target, drafter, *, batches=(1, 4, 16, 32, 64, 128), block_size: int | None = None,
            context: int = 256, repeats: int = 20, pair: str = "", progress=None, time_static: bool = True
            ) -> CostTable:
    """Time one compact step (draft + packed verify of ``per_row`` tokens per row + accept + commit) at every
    tier of every batch, the scheduler's autoregressive step (no drafting) and the static verify's step, the
    rows' caches holding ``context`` tokens. One program per batch and mode (the tier is a runtime argument,
    as in the decode loop) that runs the step in a ``lax.while_loop``, as decoding does: one call's dispatch
    and the host's wait are spread over its steps instead of added to each (on a GPU they are a large part of
    a small model's step, and timing one step per call flattened the table). ``repeats`` steps per tier after
    one warm-up, in ``ROUNDS`` calls; the median of the calls' per-step times is kept. ``progress``: called
    with a line per batch; ``time_static=False`` leaves the static step out (one program less to compile)."""
    import jax

    from dflash_jax import generation

    target, drafter, block = generation.speculative_settings(target, drafter, block_size)
    rng = np.random.default_rng(0)
    step_ms: dict[int, dict[int, float]] = {}
    ar_ms: dict[int, float] = {}
    static_ms: dict[int, float] = {}
    for b in batches:
        ids = rng.integers(0, target.config.vocab_size, (b, context)).tolist()
        row = _time_compact_steps(target, drafter, ids, block, repeats)
        ar_ms[b] = row.pop(0)
        step_ms[b] = row
        if time_static:
            static_ms[b] = _time_static_step(target, drafter, ids, block, repeats)
        if progress:
            progress(f"batch {b:4d}: " + "  ".join(f"{n}/row {ms:.2f} ms" for n, ms in row.items())
                     + f"  autoregressive {ar_ms[b]:.2f} ms"
                     + (f"  static {static_ms[b]:.2f} ms" if time_static else ""))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return CostTable(jax.default_backend(), _device_kind(),
                     str(target.model.dtype), pair or target.name, block, context, step_ms,
                     f"{datetime.date.today().isoformat()} {commit}".strip(), ar_ms, static_ms)


def _time_compact_steps(target, drafter, ids: list[list[int]], block: int, repeats: int) -> dict[int, float]:
    """tokens per row → ms of the compact step at each tier of ``len(ids)`` rows; 0 → the AR step's."""
    import jax.numpy as jnp

    from dflash_jax import generation
    from dflash_jax.decode import loop, schedule

    b = len(ids)
    tiers = schedule.tiers_for(b, block)
    # Costs proportional to the tokens keep every tier (schedule.prune_tiers) and offer the AR step.
    proportional = CostTable("", "", "", "", block, 0, {1: {t // b: float(t) for t in tiers}}, ar_ms={1: 0.5})
    job = generation.prepare(target, drafter, ids, max_new_tokens=4 * block, block_size=block, stop_token_ids=[],
                             verify_mode="compact", cost_table=proportional,
                             decode=False)  # the steps below are timed in a program of their own
    assert job.spec.tiers == tiers
    # The AR step is a branch of the compact step only where the scheduler may pick it (drafters without a
    # confidence head); it is timed for every drafter (the table's ar_ms explains when drafting pays).
    spec = dataclasses.replace(job.spec, ar_step=True)
    graphdefs = (job.target.split().static, job.drafter.split().static)

    def step(params, state, tier):
        t, d = loop.merge_models(graphdefs, params)
        window = jnp.full((b,), (jnp.asarray(tiers + (b,), jnp.int32) // b - 1)[tier], jnp.int32)  # AR: 0
        return _same_positions(loop.compact_step(t, d, state, spec, d.config.mask_token_id, window, tier), state)

    fn, state = _step_program(job, step)
    row = {}
    for i, size in enumerate(tiers + (0,)):  # index len(tiers): the autoregressive step
        row[size // b], state = _timed(fn, job.params, state, i, repeats)
    return row


def _time_static_step(target, drafter, ids: list[list[int]], block: int, repeats: int) -> float:
    """ms of the static verify's step (the decode loop's cycle) of ``len(ids)`` rows."""
    from dflash_jax import generation
    from dflash_jax.decode import loop

    job = generation.prepare(target, drafter, ids, max_new_tokens=4 * block, block_size=block, stop_token_ids=[],
                             verify_mode="static", decode=False)
    graphdefs = (job.target.split().static, job.drafter.split().static)

    def step(params, state, _):
        t, d = loop.merge_models(graphdefs, params)
        return _same_positions(loop.cycle(t, d, state, job.spec, d.config.mask_token_id), state)

    fn, state = _step_program(job, step)
    return _timed(fn, job.params, state, 0, repeats)[0]


def _same_positions(out, state):
    """The state after a step, back at the positions before it: every timed step then writes and attends the
    same cache slots. The state is donated, so the caches are updated in place as in the decode loop (timing
    a step on a kept state would add a copy of every cache to each entry: +55 ms a step at batch 3 on a
    2-core CPU, which flattened the table's ratios and made the scheduler over-verify)."""
    return dataclasses.replace(out, num_new=state.num_new, anchor_pos=state.anchor_pos, done=state.done)


def _step_program(job, step):
    """(``fn(params, state, index, n)``: ``step`` run ``n`` times in one ``while_loop``, the state donated,
    compiled; the prefilled state)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import generation

    def steps(params, state, index, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (step(params, c[0], index), c[1] + 1),
                                  (state, jnp.zeros((), jnp.int32)))[0]

    state, _ = job.programs.prefill(*job.pre_args)
    lowered = jax.jit(steps, donate_argnums=1).lower(job.params, state, np.int32(0), np.int32(1))
    fn = generation.compile_steps(lowered, job.spec, state)  # as the decode loop compiles its steps
    return fn, state


def _timed(fn, params, state, index: int, repeats: int):
    """(median ms a step of program index ``index`` over ``ROUNDS`` calls after a warm-up, the state after)."""
    import jax

    per_call = max(1, repeats // ROUNDS)
    state = jax.block_until_ready(fn(params, state, np.int32(index), np.int32(1)))
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(params, state, np.int32(index), np.int32(per_call)))
        times.append((time.perf_counter() - t0) / per_call)
    return float(np.median(times) * 1e3), state


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
