"""Export a drafter in the exact z-lab DFlash format (SPEC §4), so other engines can serve it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_jax.checkpoints.safetensors_io import save_safetensors, state_to_hf
from dflash_jax.config import drafter_config_to_hf
from dflash_jax.models.drafter import DFlashDrafter


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write ``config.json`` + one ``model.safetensors`` (z-lab key names, no embeddings or lm_head)."""
    np_dtype = {"float32": np.float32, "bfloat16": None}[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if np_dtype is None:
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    tensors = state_to_hf(drafter, prefix="", dtype=np_dtype)
    cfg = drafter_config_to_hf(drafter.config)
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_safetensors(tensors, out / "model.safetensors")
    return out
