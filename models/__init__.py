"""spillway's model zoo: one file per family, each registering a `Family` (models/registry.py).

    registry   the family spec: FAMILY_MODULES (one row a family), get_family, preset_config,
               lookups by config and HF model_type
    decoder    DecoderSpec and DecoderLM, the decoder-only model every family builds
    hf         the generic Hugging Face engine: from_hf, to_hf; hf_rows the tensor rows tables share
    llama_shaped   the config base and Hugging Face fields shared by Llama, Mistral, Qwen and the MoE families
    moe_shaped     what Mixtral and Qwen3-MoE share (MoERunFields, the MoE layer, expert tensors)
    llama, gpt2, mistral, qwen, gemma (gemma_hf), mixtral, qwen3_moe   the families
"""

from spillway.models.decoder import DecoderLM, DecoderSpec, count_params
from spillway.models.hf import from_hf, to_hf
from spillway.models.registry import FAMILIES, Family, family_names, get_family, preset_config

__all__ = ["DecoderLM", "DecoderSpec", "FAMILIES", "Family", "count_params", "family_names", "from_hf",
           "get_family", "preset_config", "to_hf"]
