"""The host side of a decode call, below the public API (docs/engine.md).

* :mod:`~dflash_jax.engine.job`: one batch — prepare (bucket, resolve the verify mode, fetch or compile the
  programs, pack the inputs) → launch → collect.
* :mod:`~dflash_jax.engine.programs`: the program cache, compile options and the compile count.
* :mod:`~dflash_jax.engine.pool`: continuous batching (more prompts than rows).
* :mod:`~dflash_jax.engine.calibrate`: measuring a step cost table.

Every function takes a :class:`~dflash_jax.settings.DecodeSettings`, built once by the public API.
"""
