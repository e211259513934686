"""Ready (target, drafter) pairs described by YAML files in ``configs/`` — schema and validation.

```yaml
name: qwen3-8b
target: Qwen/Qwen3-8B                 # hub id, local HF dir, .gguf file, or "smollm2-135m" (embedded)
drafter: z-lab/Qwen3-8B-DFlash-b16    # hub id or local dir; "embedded" = the DFlash drafter shipped in the
                                      # package, "embedded:<name>" = dflash_jax/assets/<name>
dtype: bfloat16                       # float32 | bfloat16 (the compute dtype)
quantization: int8                    # optional: none (as stored) | int8 | fp8 — the target's linear layers
drafter_quantization: none            # optional, likewise for the drafter (default: none)
block_size: 16                        # default block size at serving time (≤ the drafter's trained size)
chat_template_kwargs: {enable_thinking: false}
mesh: {tp: 1, dp: 1}                  # suggested mesh for this pair
draft_vocab:                          # optional: DFlash drafts over the most frequent tokens only
  ranking: embedded:smollm2-135m      # token ranking (dflash_jax.draft_vocab): embedded:<name> or a path
  size: {cpu: 16384}                  # tokens kept, per backend (unlisted backends: the whole vocabulary)
training: {...}                       # optional: `dflash-jax train` settings (see train/pipeline.py)
```
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from dflash_jax.config import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
_KEYS = {"name", "target", "drafter", "dtype", "block_size", "chat_template_kwargs", "mesh", "training",
         "description", "draft_vocab", "quantization", "drafter_quantization"}
QUANTIZATIONS = ("none", "int8", "fp8")
_BACKENDS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class PairConfig:
    name: str
    target: str
    drafter: str | None
    dtype: str = "bfloat16"
    block_size: int | None = None
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    mesh: dict = dataclasses.field(default_factory=lambda: {"tp": 1, "dp": 1})
    description: str = ""
    path: str = ""
    draft_vocab_ranking: str | None = None
    draft_vocab_sizes: dict = dataclasses.field(default_factory=dict)  # backend → tokens kept
    quantization: str | None = None  # the target's (None: as the checkpoint stores it)
    drafter_quantization: str | None = None

    def draft_vocab_size(self, backend: str) -> int | None:
        """Tokens the drafts keep on ``backend`` (None: the whole vocabulary)."""
        return self.draft_vocab_sizes.get(backend) if self.draft_vocab_ranking else None


def find_pair_file(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"pair config {path} does not exist")
        return path
    for candidate in (CONFIG_DIR / f"{name_or_path}.yaml", Path.cwd() / "configs" / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"unknown pair {str(name_or_path)!r}: not a YAML file and not one of {known}")


def parse_pair(raw: Any, where: str) -> PairConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (allowed: {sorted(_KEYS)})")
    for key in ("name", "target"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise ConfigError(f"{where}: '{key}' must be a non-empty string")
    drafter = raw.get("drafter")
    if drafter is not None and (not isinstance(drafter, str) or not drafter.strip()):
        raise ConfigError(f"{where}: 'drafter' must be a path, a hub id, 'embedded[:<name>]' or null")
    dtype = raw.get("dtype", "bfloat16")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"{where}: dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    block = raw.get("block_size")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 2):
        raise ConfigError(f"{where}: block_size must be an integer >= 2, got {block!r}")
    chat = raw.get("chat_template_kwargs") or {}
    if not isinstance(chat, dict):
        raise ConfigError(f"{where}: chat_template_kwargs must be a mapping")
    mesh = raw.get("mesh") or {"tp": 1, "dp": 1}
    if not isinstance(mesh, dict) or set(mesh) - {"tp", "dp"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh.values()):
        raise ConfigError(f"{where}: mesh must be a mapping with positive integers tp and/or dp, got {mesh!r}")
    if "training" in raw and not isinstance(raw["training"], dict):
        raise ConfigError(f"{where}: 'training' must be a mapping")
    ranking, sizes = _draft_vocab(raw.get("draft_vocab"), where)
    quantized = {}
    for key in ("quantization", "drafter_quantization"):
        value = raw.get(key)
        if value is not None and value not in QUANTIZATIONS:
            raise ConfigError(f"{where}: {key} must be one of {list(QUANTIZATIONS)}, got {value!r}")
        quantized[key] = None if value in (None, "none") else value
    return PairConfig(name=raw["name"], target=raw["target"], drafter=drafter, dtype=dtype, block_size=block,
                      chat_template_kwargs=dict(chat), mesh={"tp": 1, "dp": 1, **mesh},
                      description=str(raw.get("description", "")), path=where, draft_vocab_ranking=ranking,
                      draft_vocab_sizes=sizes, **quantized)


def _draft_vocab(raw: Any, where: str) -> tuple[str | None, dict]:
    if raw is None:
        return None, {}
    if not isinstance(raw, dict) or set(raw) != {"ranking", "size"}:
        raise ConfigError(f"{where}: draft_vocab must be a mapping with 'ranking' and 'size', got {raw!r}")
    ranking, sizes = raw["ranking"], raw["size"]
    if not isinstance(ranking, str) or not ranking.strip():
        raise ConfigError(f"{where}: draft_vocab.ranking must be a path or 'embedded:<name>'")
    if not isinstance(sizes, dict) or set(sizes) - set(_BACKENDS) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes.values()):
        raise ConfigError(f"{where}: draft_vocab.size must map backends {list(_BACKENDS)} to positive integers, "
                          f"got {sizes!r}")
    return ranking, dict(sizes)


def load_pair_config(name_or_path: str | Path) -> PairConfig:
    path = find_pair_file(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return parse_pair(raw, str(path))


def all_pair_configs() -> list[PairConfig]:
    return [load_pair_config(p) for p in sorted(CONFIG_DIR.glob("*.yaml"))]
