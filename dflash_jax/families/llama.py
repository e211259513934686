"""LLaMA (``llama``: LLaMA 2/3, SmolLM2, …) and dense Qwen3 (``qwen3``: LLaMA's layers plus q/k RMSNorms).

Both are the shared :class:`~dflash_jax.models.target.TargetModel` with the shared parser and checkpoint names;
they differ only in ``qk_norm``.
"""

from dflash_jax.config import FamilySchema
from dflash_jax.families.registry import Family

LLAMA = Family(FamilySchema("llama", ("llama",)))
QWEN3 = Family(FamilySchema("qwen3", ("qwen3",), qk_norm=True))

FAMILIES = (LLAMA, QWEN3)
