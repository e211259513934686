"""Export a drafter in the exact public format — z-lab DFlash (SPEC §4) or DSpark (SpecForge keys, SPEC §7) —
so other engines can serve it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_jax.checkpoints.safetensors_io import save_safetensors, state_to_hf
from dflash_jax.config import drafter_config_to_hf
from dflash_jax.models.drafter import DFlashDrafter


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write ``config.json`` + one ``model.safetensors`` (z-lab key names, no embeddings or lm_head; a DSpark
    drafter adds ``markov_head.*``, ``confidence_head.*`` and, with a reduced draft vocabulary, ``d2t``)."""
    np_dtype = {"float32": np.float32, "bfloat16": None}[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if np_dtype is None:
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    tensors = state_to_hf(drafter, prefix="", dtype=np_dtype)
    d2t = getattr(drafter, "d2t", None)
    if d2t is not None:  # EAGLE-3 / SpecForge convention: target id = draft id + d2t[draft id]
        ids = np.asarray(d2t[...]).astype(np.int64)
        tensors["d2t"] = ids - np.arange(len(ids))
    cfg = drafter_config_to_hf(drafter.config)
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_safetensors(tensors, out / "model.safetensors")
    return out
