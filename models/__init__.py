"""spillway's model families: one file each, a frozen Config with presets plus the model class."""

from models.llama import PRESETS, Llama, LlamaConfig, count_params, llama_config

__all__ = ["Llama", "LlamaConfig", "PRESETS", "count_params", "llama_config"]
