#!/usr/bin/env bash
# Local preparation (this machine, not the GPU): prompts, evaluation sets, the device run config, the target
# GGUF cut into parts that fit next to the working tree in a call's 64 MiB, and the gguf wheel the GPU
# image lacks. Everything lands in git-ignored folders: runs/device, .xfer, .whl.
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p runs/device .xfer .whl
$PY -m dflash_jax.cli train --config configs/smollm2-135m.yaml --stages prompts --out-dir runs/prep --no-progress
gzip -9 -c runs/prep/prompts.jsonl > runs/device/prompts.jsonl.gz
$PY tools/remote_gpu/make_run_config.py --data-seed "${DATA_SEED:-0}"
G=$($PY -c "from dflash_jax.loading import embedded_gguf_path; print(embedded_gguf_path())")
split -b 36500000 -a 1 --numeric-suffixes=0 "$G" .xfer/p
$PY -m pip download --quiet --no-deps "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')" -d .whl
ls -la runs/device .xfer .whl
