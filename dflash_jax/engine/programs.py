"""The program cache: one compiled (prefill, decode) pair per key, compile options, and the compile count.

A key is small and cheap to hash: the decode loop's static spec (:class:`~dflash_jax.decode.state.LoopSpec`,
derived from the :class:`~dflash_jax.settings.DecodeSettings`; it carries the :class:`~dflash_jax.tuning.Tuning`,
compile options included), the argument shapes, and the model structures as the integers of
:class:`~dflash_jax.loading.SplitModel`. Nothing else changes what a program traces to or how it compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dflash_jax.cuda import graphs
from dflash_jax.decode import loop
from dflash_jax.decode.state import DecodeView, LoopSpec


@dataclasses.dataclass(frozen=True)
class Programs:
    prefill: Any  # (params, ints, floats) → (state, packed view)
    decode: Any  # (params, state, max_cycles) → (state, packed view); the state is donated (None: not compiled)
    view_widths: tuple[int, ...]  # the packed view's columns (DecodeView.unpack)


class ProgramCache:
    """Compiled programs by key, how many this process compiled, and which have run warm."""

    def __init__(self):
        self.programs: dict[tuple, Any] = {}
        self.compiled = 0
        # Keys of programs that have run in this process (:mod:`dflash_jax.engine.switching` times a segment only
        # then): on a CPU a program's first runs also set up its kernels — each branch of a drafted program's on
        # its first use, several times a later run's time for a while — so a drafted program is timed from its
        # second call on, the fallback's (one branch) from its second segment on.
        self.warm: set[tuple] = set()

    def get(self, key: tuple, build: Callable[[], Any], count: int = 1):
        """The program(s) of ``key``, built (``count`` programs compiled) on first use."""
        found = self.programs.get(key)
        if found is None:
            found = self.programs[key] = build()
            self.compiled += count
        return found

    def timed_get(self, key: tuple, build: Callable[[], Any]) -> tuple[Any, float]:
        """(:meth:`get`'s program, the seconds spent compiling it now: 0 where it was cached)."""
        if key in self.programs:
            return self.programs[key], 0.0
        t0 = time.perf_counter()
        return self.get(key, build), time.perf_counter() - t0

    def clear(self) -> None:
        """Forget every program (the next call traces afresh; the count stays)."""
        self.programs.clear()
        self.warm.clear()

    def __len__(self) -> int:
        return len(self.programs)

    def values(self):
        return self.programs.values()

    def items(self):
        return self.programs.items()


CACHE = ProgramCache()


def compile_count() -> int:
    """How many programs this process has compiled (tests use it to prove there are no recompiles)."""
    return CACHE.compiled


def decode_compiler_options(spec: LoopSpec, state_info) -> dict[str, Any] | None:
    """The spec's compile options (:attr:`Tuning.compiler_options`) for a program that runs decode steps on the
    state ``state_info`` (a state or its shapes), with the tier switch off the CUDA graphs where the step's tier
    is planned ahead on a GPU (:attr:`Tuning.host_tier_switch`, :mod:`dflash_jax.cuda.graphs`)."""
    options = spec.tuning.compiler_options_dict()
    if not (spec.tuning.host_tier_switch and jax.default_backend() == "gpu" and loop.plans_ahead(state_info, spec)):
        return options
    return {**(options or {}), **graphs.without_conditional_nodes()} or None


def compile_steps(lowered: jax.stages.Lowered, spec: LoopSpec, state_info) -> jax.stages.Compiled:
    """``lowered`` (a program running decode steps on ``state_info``) compiled with
    :func:`decode_compiler_options`, or with the spec's plain compile options should this XLA refuse those."""
    options = decode_compiler_options(spec, state_info)
    plain = spec.tuning.compiler_options_dict()
    try:
        return lowered.compile(options)
    except Exception:  # noqa: BLE001 — e.g. an XLA that names its command-buffer types otherwise
        if options == plain:
            raise
        return lowered.compile(plain)


def mesh_context(spec: LoopSpec):
    """Trace under the spec's (auto-axes) mesh, whatever mesh context the caller is in (e.g. an explicit one)."""
    return jax.set_mesh(spec.plan.mesh) if spec.plan else contextlib.nullcontext()


def programs(key: tuple, graphdefs: tuple, params: tuple, pre_args: tuple, spec: LoopSpec, static: dict,
             mask_id: int, decode: bool = True) -> Programs:
    """The cached programs for ``key``, compiled on first use; the prefill alone without ``decode``."""

    def build() -> Programs:
        options = spec.tuning.compiler_options_dict()
        with mesh_context(spec):
            pre = jax.jit(functools.partial(loop.prefill_fn, spec=spec, **static),
                          static_argnums=0).lower(graphdefs, *pre_args).compile(options)
            dec = None
            if decode:
                lowered = jax.jit(functools.partial(loop.decode_fn, spec=spec, mask_token_id=mask_id),
                                  static_argnums=0, donate_argnums=2).lower(graphdefs, params, pre.out_info[0],
                                                                           jax.ShapeDtypeStruct((), jnp.int32))
                dec = compile_steps(lowered, spec, pre.out_info[0])
        return Programs(pre, dec, DecodeView.widths(pre.out_info[0]))

    return CACHE.get(key, build, 1 + decode)
