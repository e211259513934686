"""dflash_jax: lossless DFlash speculative decoding in JAX.

Public API::

    from dflash_jax import load_target, load_drafter, load_pair, speculative_generate, generate
    from dflash_jax import speculative_stream, stream_generate  # the same, chunk by chunk
"""

from dflash_jax.config import ConfigError, DrafterConfig, ModelConfig
from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.generation import GenerationOutput, compile_count, generate, speculative_generate
from dflash_jax.loading import (Drafter, Target, load_drafter, load_pair, load_target, quantize, random_drafter,
                               restrict_draft_vocab, shard)
from dflash_jax.sharding import ShardingError, make_mesh
from dflash_jax.streaming import StreamChunk, TokenStream, speculative_stream, stream_generate
from dflash_jax.tokenizer import TokenizerMissingError

__all__ = [
    "CheckpointError", "ConfigError", "Drafter", "DrafterConfig", "GenerationOutput", "ModelConfig", "Target",
    "TokenizerMissingError", "compile_count", "generate", "load_drafter", "load_pair", "load_target",
    "quantize", "random_drafter", "restrict_draft_vocab", "speculative_generate", "make_mesh", "shard", "ShardingError",
    "StreamChunk", "TokenStream", "speculative_stream", "stream_generate",
]
