"""Target families: one module per family, each building its :class:`~dflash_jax.families.registry.Family`
record(s); the lines below register them. Adding a family is one module and one line here
(``docs/port-a-model.md`` walks through it)."""

from dflash_jax.families import gpt_oss, llama, mistral, qwen3_5, qwen3_moe
from dflash_jax.families.registry import Family, get, names, of, register

register(*llama.FAMILIES)
register(*qwen3_moe.FAMILIES)
register(*qwen3_5.FAMILIES)
register(*gpt_oss.FAMILIES)
register(*mistral.FAMILIES)

__all__ = ["Family", "get", "names", "of", "register"]
