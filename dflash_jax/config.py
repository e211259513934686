"""Model configurations parsed from Hugging Face / z-lab ``config.json`` files.

Everything here is a frozen (hashable) dataclass so it can key compilation caches and be passed to
``jax.jit`` as a static argument. Parsing validates what the models rely on and raises
:class:`ConfigError` naming the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping


class ConfigError(ValueError):
    """A config.json is missing, unreadable or describes something we cannot run."""


class CheckpointError(ValueError):
    """Missing, corrupt or mismatched weight files (raised by the checkpoint readers and by the families'
    checkpoint mappings; it sits here, at the bottom, so that both can use it)."""


# --------------------------------------------------------------------------------------------------
# Target families: the config side. Each family module of :mod:`dflash_jax.families` registers its schema
# (through ``families.register``); this module holds no family names itself.
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FamilySchema:
    """How a target family's ``config.json`` reads, and the switches the shared layers take from a
    :class:`ModelConfig` of that family.

    ``prepare(cfg, where)`` fills what the family's configs may leave out before parsing (e.g. transformers'
    defaults); ``fields(cfg, where)`` gives the :class:`ModelConfig` fields beyond the shared ones
    (:func:`shared_fields`), overriding those it repeats; ``check(cfg)`` adds the family's own validation.
    """

    name: str
    model_types: tuple[str, ...]  # HF ``model_type`` values parsed as this family
    fields: Callable[[Mapping[str, Any], str], dict] | None = None
    prepare: Callable[[Mapping[str, Any], str], Mapping[str, Any]] | None = None
    check: Callable[["ModelConfig"], None] | None = None
    qk_norm: bool = False  # RMSNorm on each head's q and k before the rotation
    moe: bool = False  # Qwen-MoE sparse blocks in the layers ModelConfig.is_moe_layer picks (expert fields checked)
    linear_attention: bool = False  # Gated DeltaNet layers: needs ModelConfig.hybrid
    attention_sinks: bool = False  # a learned logit per query head joins every attention softmax


_SCHEMAS: dict[str, FamilySchema] = {}
_MODEL_TYPES: dict[str, str] = {}


def register_schema(schema: FamilySchema) -> FamilySchema:
    """Make ``schema`` known to :class:`ModelConfig` and :func:`model_config_from_hf` (by its name and its
    model types). Called by ``dflash_jax.families.register``; registering a name twice replaces it."""
    taken = {t: _MODEL_TYPES[t] for t in schema.model_types if _MODEL_TYPES.get(t, schema.name) != schema.name}
    if taken:
        raise ValueError(f"family {schema.name!r}: model types already registered by other families: {taken}")
    _SCHEMAS[schema.name] = schema
    _MODEL_TYPES.update({t: schema.name for t in schema.model_types})
    return schema


def family_names() -> tuple[str, ...]:
    """The registered families, in registration order."""
    return tuple(_SCHEMAS)


def family_schema(name: str) -> FamilySchema:
    """The registered schema of family ``name`` (ConfigError naming the known ones if none)."""
    if name not in _SCHEMAS:
        hint = "" if _SCHEMAS else " (none registered: import dflash_jax.families)"
        raise ConfigError(f"model family {name!r} is not supported (expected one of {family_names()}){hint}")
    return _SCHEMAS[name]


def schema_for_model_type(cfg: Mapping[str, Any], where: str) -> FamilySchema:
    """The schema that parses a config of this ``model_type`` (ConfigError listing the accepted types if none)."""
    mt = str(cfg.get("model_type", "")).lower()
    if mt not in _MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {cfg.get('model_type')!r} is not supported "
                          f"(expected one of {sorted(_MODEL_TYPES)})")
    return _SCHEMAS[_MODEL_TYPES[mt]]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (HF ``rope_parameters`` or legacy ``rope_theta`` + ``rope_scaling``)."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


LAYER_KINDS = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Qwen3.5 / Qwen3-Next stacks: Gated DeltaNet (linear attention) layers interleaved with gated full-attention
    layers, per ``layer_types``. Letters: Hk key heads of width dk, Hv value heads of width dv, W conv kernel."""

    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    conv_kernel: int = 4  # W
    key_heads: int = 16  # Hk (q and k heads)
    value_heads: int = 32  # Hv (a multiple of Hk: value head i reads key head i // (Hv/Hk))
    key_head_dim: int = 128
    value_head_dim: int = 128
    rotary_dim: int = 64  # full attention rotates only the first rotary_dim dims of each head
    fused_projections: bool = False  # qwen3_next checkpoints: in_proj_qkvz / in_proj_ba, grouped by key head

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v concatenated."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    def validate(self, cfg: "ModelConfig") -> None:
        if len(self.layer_types) != cfg.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {cfg.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ConfigError(f"layer_types has unknown kinds {bad} (expected {LAYER_KINDS})")
        for name in ("conv_kernel", "key_heads", "value_heads", "key_head_dim", "value_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field linear_{name} must be positive, got {getattr(self, name)}")
        if self.value_heads % self.key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.key_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= cfg.head_dim:
            raise ConfigError(f"partial_rotary_factor gives {self.rotary_dim} rotary dims for head_dim "
                              f"{cfg.head_dim} (must be even and in (0, head_dim])")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer as a target model: LLaMA-3 / Qwen3 / Qwen3-MoE layers, a Qwen3.5 / Qwen3-Next
    hybrid (``hybrid``), gpt-oss, … — ``family`` names a registered :class:`FamilySchema` (see
    :mod:`dflash_jax.families`; docs/families.md lists them)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # qwen3_moe only: top-k routed SwiGLU experts in the layers that is_moe_layer picks
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE / Qwen3-Next: a sigmoid-gated shared expert (0: none)
    hybrid: HybridConfig | None = None  # Qwen3.5 / Qwen3-Next linear-attention layers (None: all full attention)
    # gpt_oss only (experts in every layer, via num_experts … above): attention sinks, sliding-window layers,
    # clamped-SwiGLU experts
    sliding_layers: tuple[int, ...] = ()  # layers whose attention sees only the last sliding_window positions
    sliding_window: int | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @property
    def schema(self) -> FamilySchema:
        """The registered schema of this config's family."""
        return family_schema(self.family)

    @property
    def qk_norm(self) -> bool:
        return self.schema.qk_norm

    @property
    def moe(self) -> bool:
        """Qwen-MoE sparse blocks (in the layers :meth:`is_moe_layer` picks)."""
        return self.schema.moe

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule: every ``decoder_sparse_step``-th layer is sparse unless in ``mlp_only_layers``."""
        return (self.moe and self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_sinks(self) -> bool:
        """A learned logit per query head joins every attention softmax (``self_attn.sinks``; gpt-oss)."""
        return self.schema.attention_sinks

    def layer_window(self, i: int) -> int | None:
        """The attention window of layer ``i`` (None: it sees every earlier position)."""
        return self.sliding_window if i in self.sliding_layers else None

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def validate(self) -> "ModelConfig":
        schema = family_schema(self.family)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if schema.moe:
            self.check_experts()
        if schema.linear_attention:  # (other families ignore ``hybrid``: drafter layers copied from a target)
            if self.hybrid is None:
                raise ConfigError(f"model family {self.family!r} needs its linear-attention settings (layer_types …)")
            self.hybrid.validate(self)
        if schema.check is not None:
            schema.check(self)
        return self

    def check_windows(self) -> None:
        """Raise unless the sliding-window layers exist and have a window (for families with windows; other
        configs may carry a target's fields unused, as a drafter's layers copied from one)."""
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"sliding-window layers {bad} are out of range for {self.num_layers} layers")
        if self.sliding_layers and not (self.sliding_window or 0) > 0:
            raise ConfigError(f"config field sliding_window must be positive for sliding_attention layers, "
                              f"got {self.sliding_window}")

    def check_experts(self) -> None:
        """Raise unless the routed-expert fields describe experts (for families with them)."""
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"config field num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                              f"num_experts ({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"config field mlp_only_layers has {bad}, out of range for {self.num_layers} layers")


# --------------------------------------------------------------------------------------------------
# Drafter kinds: the config side. Each kind module of :mod:`dflash_jax.drafters` registers its schema (through
# ``drafters.register``); this module holds no kind names itself.
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DrafterSchema:
    """How a drafter kind's ``config.json`` reads and writes, and what its :class:`DrafterConfig` means.

    ``detect(cfg, value)`` says whether an HF config is of this kind (``value(key, default)`` reads a key from
    ``dflash_config`` or the top level); a schema without one is the fallback when no other kind claims the
    config. ``fields(value, layers)`` gives the :class:`DrafterConfig` fields the kind reads beyond the shared
    ones; ``check(cfg)`` adds the kind's own validation; ``to_hf(cfg, out)`` adds its keys to an exported
    ``config.json``, whose ``architectures`` / ``auto_map`` name ``architecture``.
    """

    kind: str
    architecture: str  # the z-lab class name (``architectures``; ``auto_map`` points at ``<kind>.<architecture>``)
    # Drafts left to right, the anchor itself predicting the first: γ block inputs give γ drafts (verify width
    # γ+1); a parallel kind's L inputs give L-1 drafts (verify width L).
    sequential: bool = False
    detect: Callable[[Mapping[str, Any], Callable], bool] | None = None
    fields: Callable[[Callable, "ModelConfig"], dict] | None = None
    check: Callable[["DrafterConfig"], None] | None = None
    to_hf: Callable[["DrafterConfig", dict], None] | None = None

    @property
    def min_block_size(self) -> int:
        return 1 if self.sequential else 2

    def verify_width(self, block_size: int) -> int:
        """Tokens one cycle verifies for ``block_size`` block inputs: the anchor plus every draft."""
        return block_size + 1 if self.sequential else block_size


_DRAFTER_SCHEMAS: dict[str, DrafterSchema] = {}


def register_drafter_schema(schema: DrafterSchema) -> DrafterSchema:
    """Make ``schema`` known to :class:`DrafterConfig` and :func:`drafter_config_from_hf`. Called by
    ``dflash_jax.drafters.register``; registering a kind twice replaces it."""
    _DRAFTER_SCHEMAS[schema.kind] = schema
    return schema


def drafter_kinds() -> tuple[str, ...]:
    """The registered drafter kinds, in registration order."""
    return tuple(_DRAFTER_SCHEMAS)


def drafter_schema(kind: str) -> DrafterSchema:
    """The registered schema of drafter kind ``kind`` (ConfigError naming the known ones if none)."""
    if kind not in _DRAFTER_SCHEMAS:
        hint = "" if _DRAFTER_SCHEMAS else " (none registered: import dflash_jax.drafters)"
        raise ConfigError(f"drafter kind {kind!r} is not supported (expected one of {drafter_kinds()}){hint}")
    return _DRAFTER_SCHEMAS[kind]


def _detect_drafter_schema(cfg: Mapping[str, Any], value: Callable, where: str) -> DrafterSchema:
    claimed = [s for s in _DRAFTER_SCHEMAS.values() if s.detect is not None and s.detect(cfg, value)]
    fallback = [s for s in _DRAFTER_SCHEMAS.values() if s.detect is None]
    if not claimed and not fallback:
        raise ConfigError(f"{where}: no drafter kind reads this config (registered: {drafter_kinds()})")
    return (claimed or fallback)[0]


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A z-lab DFlash drafter: Qwen3-style layers over injected target features (SPEC §2, §4); or a DSpark
    drafter (SPEC §7): the same trunk plus a sequential (Markov) head and a confidence head; or a DFlash2
    drafter: the trunk with convolutions around its sublayers, then a candidate selector (docs/drafters.md).

    ``block_size`` counts the drafter's block inputs: DFlash's (and DFlash2's) L inputs give L-1 drafts (verify
    width L);
    DSpark's anchor predicts too, so its γ inputs give γ drafts (verify width γ+1). :attr:`verify_width`
    is what one cycle verifies either way.
    """

    layers: ModelConfig  # the drafter's own transformer shape (vocab = the target's)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    causal_sliding: bool = True  # z-lab: sliding_attention layers are causal unless `is_causal` says otherwise
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    kind: str = "dflash"  # a registered :class:`DrafterSchema` (:func:`drafter_kinds`)
    # DSpark only:
    markov_rank: int = 256  # r: width of the Markov head's token embedding
    draft_vocab_size: int | None = None  # drafts over a reduced vocabulary (ids mapped by the drafter's d2t)
    confidence_head: bool = True  # some released DSpark checkpoints carry none
    confidence_temperatures: tuple[float, ...] | None = None  # STS: one T_k per draft position
    # Verify widths below the trained one that a parallel drafter was also trained to draft at (its block cut to
    # ``[anchor, MASK × (w-1)]``: ``TrainSettings.block_widths``); compact steps then draft only what their tier
    # can verify (``Tuning.tier_draft_span``). This project's key ``dflash_config.trained_widths``; None: whole
    # blocks only (every public checkpoint).
    trained_widths: tuple[int, ...] | None = None
    # DFlash2 only (defaults: the published checkpoint's): a grouped dynamic convolution of ``conv_kernel_size``
    # taps around each sublayer, one delta per ``conv_group_size`` channels; a candidate selector over the
    # ``selector_top_k`` best tokens of each position, pairwise scores of rank ``selector_rank``.
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_top_k: int = 16
    selector_rank: int = 256

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def schema(self) -> DrafterSchema:
        return drafter_schema(self.kind)

    @property
    def sequential(self) -> bool:
        """Drafts left to right (DSpark's Markov head), the anchor itself predicting the first."""
        return self.schema.sequential

    @property
    def verify_width(self) -> int:
        """Tokens one cycle verifies at the trained block size: the anchor plus every draft."""
        return self.schema.verify_width(self.block_size)

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.layers.vocab_size

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_causal(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention" and self.causal_sliding

    def validate(self) -> "DrafterConfig":
        self.layers.validate()
        schema = self.schema
        if self.block_size < schema.min_block_size:
            raise ConfigError(f"drafter block_size must be >= {schema.min_block_size}, got {self.block_size}")
        if schema.check is not None:
            schema.check(self)
        if len(self.layer_types) != self.layers.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.layers.num_layers} drafter layers")
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ConfigError(f"unknown drafter layer type {t!r}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("drafter has sliding_attention layers but no sliding_window")
        if not self.target_layer_ids:
            raise ConfigError("drafter target_layer_ids is empty")
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"(size {self.layers.vocab_size})")
        if self.trained_widths is not None:
            w = self.trained_widths
            if schema.sequential:
                raise ConfigError(f"trained_widths {list(w)}: a {self.kind} drafter drafts sequentially; only "
                                  f"parallel drafters are trained at narrower widths")
            if list(w) != sorted(set(w)) or not all(isinstance(x, int) and 2 <= x < self.verify_width for x in w):
                raise ConfigError(f"trained_widths must be increasing integers in [2, {self.verify_width - 1}] "
                                  f"(narrower than the block), got {list(w)}")
        return self

    def check_target(self, target: ModelConfig) -> None:
        """Raise if this drafter cannot run on ``target`` (SPEC §2: shared hidden size and vocabulary)."""
        if self.layers.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter hidden_size {self.layers.hidden_size} != target hidden_size "
                              f"{target.hidden_size}")
        if self.layers.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter vocab_size {self.layers.vocab_size} != target vocab_size "
                              f"{target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(f"drafter target_layer_ids {list(self.target_layer_ids)} include {bad}, "
                              f"out of range for a target with {target.num_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                              f"(size {target.vocab_size})")


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """z-lab's default feature layers: evenly spread over [1, L-3] (SPEC §2).

    (For targets of fewer than 4 layers the formula leaves the valid range; ids are clamped and deduplicated.)
    """
    if n == 1:
        return (num_target_layers // 2,)
    ids = [int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n)]
    return tuple(dict.fromkeys(min(max(i, 0), num_target_layers - 1) for i in ids))


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------

def read_config_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"missing config file: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"corrupt config file {path}: {e}") from None


def required(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    """``cfg[key]``, or ConfigError naming the field and the file when it is missing or null."""
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: required field {key!r} is missing")
    return cfg[key]


def parse_rope(cfg: Mapping[str, Any]) -> RopeConfig:
    """Accept transformers-5 ``rope_parameters`` and legacy ``rope_theta`` / ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params and isinstance(params["full_attention"], Mapping):
        params = params["full_attention"]  # per-layer-type form: our models use full attention
    scaling = dict(params) if isinstance(params, Mapping) else dict(cfg.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(f"rope type {kind!r} is not supported (default, linear, llama3, yarn)")
    opt = lambda k, d=None: scaling.get(k, d) if scaling.get(k) is not None else d  # noqa: E731
    orig = opt("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(opt("factor", 1.0)),
        low_freq_factor=float(opt("low_freq_factor", 1.0)),
        high_freq_factor=float(opt("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        beta_fast=float(opt("beta_fast", 32.0)),
        beta_slow=float(opt("beta_slow", 1.0)),
        attention_factor=float(opt("attention_factor")) if opt("attention_factor") is not None else None,
        mscale=float(opt("mscale")) if opt("mscale") is not None else None,
        mscale_all_dim=float(opt("mscale_all_dim")) if opt("mscale_all_dim") is not None else None,
        truncate=bool(opt("truncate", True)),
    )


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's settings of a vision-language wrapper (Qwen3.5 / 3.6 ship ``text_config``); the
    wrapper's own token ids and tying fill what the text part leaves out. Other configs as they are."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        return cfg
    shared = ("eos_token_id", "bos_token_id", "tie_word_embeddings")
    return {**{k: cfg[k] for k in shared if k in cfg}, **{k: v for k, v in text.items() if v is not None}}


def model_config_from_hf(cfg: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
    """Parse a target's HF ``config.json`` (or the text part of a vision-language one). The family is the one
    registered for its ``model_type`` (:mod:`dflash_jax.families` registers the supported ones on import)."""
    cfg = text_config(cfg)
    schema = schema_for_model_type(cfg, where)
    if schema.prepare is not None:
        cfg = schema.prepare(cfg, where)
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true targets are not supported")
    shared = shared_fields(cfg, where)
    extra = schema.fields(cfg, where) if schema.fields is not None else {}
    return ModelConfig(family=schema.name, **{**shared, **extra}).validate()


def shared_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every family reads the same way (LLaMA's names and defaults)."""
    hidden = int(required(cfg, "hidden_size", where))
    heads = int(required(cfg, "num_attention_heads", where))
    head_dim = cfg.get("head_dim") or hidden // heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    return dict(
        vocab_size=int(required(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(required(cfg, "intermediate_size", where)),
        num_layers=int(required(cfg, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def drafter_config_from_hf(cfg: Mapping[str, Any], where: str = "drafter config.json") -> DrafterConfig:
    """Parse a z-lab DFlash drafter config; DFlash keys may sit in ``dflash_config`` or at top level."""
    dcfg = dict(cfg.get("dflash_config") or {})
    value = lambda k, d=None: dcfg.get(k, cfg.get(k, d))  # noqa: E731
    # The drafter's layers are Qwen3 layers whatever the target family (q_norm / k_norm always present).
    layers = dataclasses.replace(model_config_from_hf({**cfg, "model_type": "qwen3", "use_sliding_window": False},
                                                      where), family="qwen3")
    if cfg.get("head_dim") is None:
        raise ConfigError(f"{where}: drafter configs must give head_dim explicitly")
    num_target_layers = value("num_target_layers")
    ids = value("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ConfigError(f"{where}: neither target_layer_ids nor num_target_layers is given")
        ids = default_target_layer_ids(int(num_target_layers), layers.num_layers)
    mask = value("mask_token_id")
    if mask is None:
        raise ConfigError(f"{where}: mask_token_id is missing (dflash_config.mask_token_id)")
    layer_types = tuple(cfg.get("layer_types") or ["full_attention"] * layers.num_layers)
    is_causal = value("is_causal")
    softcap = value("final_logit_softcapping")
    schema = _detect_drafter_schema(cfg, value, where)
    extra = schema.fields(value, layers) if schema.fields is not None else {}
    widths = value("trained_widths")
    if widths is not None:
        if not isinstance(widths, (list, tuple)) or not all(isinstance(x, int) for x in widths):
            raise ConfigError(f"{where}: dflash_config.trained_widths must be a list of integers, got {widths!r}")
        extra["trained_widths"] = tuple(widths) or None
    return DrafterConfig(
        layers=layers,
        block_size=int(value("block_size", 16)),
        mask_token_id=int(mask),
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=int(num_target_layers) if num_target_layers is not None else max(ids) + 1,
        layer_types=layer_types,
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        causal_sliding=True if is_causal is None else bool(is_causal),
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        output_multiplier=float(value("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        kind=schema.kind,
        **extra,
    ).validate()


def drafter_config_to_hf(c: DrafterConfig) -> dict[str, Any]:
    """The z-lab config.json for a drafter (used by export and by tests)."""
    m, schema = c.layers, c.schema
    out: dict[str, Any] = {
        "architectures": [schema.architecture],
        "auto_map": {"AutoModel": f"{c.kind}.{schema.architecture}"},  # what z-lab's own loader expects
        "model_type": "qwen3",
        "attention_bias": m.attention_bias,
        "attention_dropout": 0.0,
        "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "dtype": "float32",
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "hidden_size": m.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": m.intermediate_size,
        "layer_types": list(c.layer_types),
        "max_position_embeddings": m.max_position_embeddings,
        "num_attention_heads": m.num_heads,
        "num_hidden_layers": m.num_layers,
        "num_key_value_heads": m.num_kv_heads,
        "num_target_layers": c.num_target_layers,
        "rms_norm_eps": m.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": m.rope.theta,
        "sliding_window": c.sliding_window,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": m.vocab_size,
    }
    if schema.to_hf is not None:
        schema.to_hf(c, out)
    if c.trained_widths:
        out["dflash_config"]["trained_widths"] = list(c.trained_widths)
    if m.rope.kind != "default":
        out["rope_scaling"] = {k: v for k, v in {
            "rope_type": m.rope.kind, "factor": m.rope.factor, "low_freq_factor": m.rope.low_freq_factor,
            "high_freq_factor": m.rope.high_freq_factor,
            "original_max_position_embeddings": m.rope.original_max_position_embeddings}.items() if v is not None}
    return out


def rope_attention_factor(r: RopeConfig) -> float:
    """YaRN's cos/sin magnitude scaling (1.0 for every other kind)."""
    if r.kind != "yarn":
        return 1.0
    if r.attention_factor is not None:
        return r.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if r.mscale and r.mscale_all_dim:
        return mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
    return mscale(r.factor)
