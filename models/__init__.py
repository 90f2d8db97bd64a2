"""spillway's model zoo: one file per family, each registering a `Family` (models/registry.py).

    registry   the family spec: FAMILIES, get_family, lookups by config and HF model_type
    decoder    DecoderSpec and DecoderLM, the decoder-only model the dense families build
    hf         the generic Hugging Face engine: from_hf, to_hf
    llama_shaped   the config base and Hugging Face fields shared by Llama, Mistral and Qwen
    llama, gpt2, mistral, qwen   the families
"""

from spillway.models.decoder import DecoderLM, DecoderSpec, count_params
from spillway.models.hf import from_hf, to_hf
from spillway.models.registry import FAMILIES, Family, family_names, get_family

__all__ = ["DecoderLM", "DecoderSpec", "FAMILIES", "Family", "count_params", "family_names", "from_hf",
           "get_family", "to_hf"]
