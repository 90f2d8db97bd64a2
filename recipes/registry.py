"""The recipe registry: named functions that return a complete `Recipe`.

    @register("my_run")
    def my_run() -> Recipe: ...

`spillway recipes` lists them; `spillway train NAME --set a.b=value` runs one.
The GPU-sized recipes build here (their configs validate and the planner can
compile them) even though they cannot train on a CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spillway.layers.execution import Execution
from spillway.models.llama import llama_config
from spillway.recipes.config import (CheckpointConfig, DataConfig, MeshConfig, OffloadConfig, OptimizerConfig, Recipe,
                                     TrainConfig, apply_overrides)

_RECIPES: dict[str, Callable[[], Recipe]] = {}


def register(name: str):
    def wrap(fn: Callable[[], Recipe]):
        if name in _RECIPES:
            raise ValueError(f"recipe {name!r} registered twice")
        _RECIPES[name] = fn
        return fn
    return wrap


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str, overrides: list[str] = ()) -> Recipe:
    try:
        fn = _RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {recipe_names()}") from None
    return apply_overrides(fn(), list(overrides))


@register("tiny")
def tiny() -> Recipe:
    """CPU-sized: trains a 4-layer Llama on the embedded stdlib corpus in minutes."""
    return Recipe(
        name="tiny",
        description="4-layer Llama (5M params) on the embedded stdlib corpus; the CPU main job",
        family="llama",
        model=llama_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6, num_kv_heads=2,
                           mlp_hidden=512, max_seq_len=128),
        execution=Execution(dtype="float32"),
        data=DataConfig(seq_len=128),
        optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=30, weight_decay=0.1, clip_norm=1.0),
        offload=OffloadConfig(activations="save_all"),
        checkpoint=CheckpointConfig(every_steps=100, keep=2),
        train=TrainConfig(steps=500, global_batch=16, log_every=10, eval_every=100, eval_batches=4,
                          sample_prompt="def ", sample_tokens=80),
    )


GPU_EXECUTION = Execution(dtype="bfloat16", param_dtype="bfloat16", attention_impl="flash")


def _gpu_recipe(name: str, preset: str, description: str, **model_overrides) -> Recipe:
    return Recipe(
        name=name,
        description=description,
        family="llama",
        model=llama_config(preset, **model_overrides),
        execution=GPU_EXECUTION,
        data=DataConfig(tokenizer=None, seq_len=8192, num_proc=16),
        optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0,
                                  master_weights=True),
        offload=OffloadConfig(activations="recompute_all", optimizer_state="device"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        checkpoint=CheckpointConfig(every_steps=1000, keep=3),
        train=TrainConfig(steps=100_000, global_batch=1, log_every=10, eval_every=1000, loss_chunk=1024),
    )


@register("llama3_1b")
def llama3_1b() -> Recipe:
    """Llama 3.2 1B architecture, sequence 8192, bf16 weights with fp32 master state."""
    return _gpu_recipe("llama3_1b", "llama3_2_1b", "Llama 3.2 1B, seq 8192, flash attention", max_seq_len=8192)


@register("llama3_8b")
def llama3_8b() -> Recipe:
    """Llama 3.1 8B, sequence 8192, everything on device, recompute every block."""
    return _gpu_recipe("llama3_8b", "llama3_1_8b", "Llama 3.1 8B, seq 8192, state on device", max_seq_len=8192)


@register("llama3_8b_offload")
def llama3_8b_offload() -> Recipe:
    """Llama 3.1 8B with matmul outputs offloaded to host and the optimizer state in host memory."""
    base = llama3_8b()
    return dataclasses.replace(
        base, name="llama3_8b_offload",
        description="Llama 3.1 8B, seq 8192, activations offloaded, optimizer state in pinned host memory",
        offload=OffloadConfig(activations="offload_dots", optimizer_state="host"))


# --- GPT-2 -----------------------------------------------------------------------
# Imported here rather than at the top so each family's recipes stay one appended section.
from spillway.models.gpt2 import gpt2_config  # noqa: E402


@register("gpt2_tiny")
def gpt2_tiny() -> Recipe:
    """CPU-sized GPT-2: the `tiny` recipe's data, optimizer and schedule with a 4-layer GPT-2."""
    return dataclasses.replace(
        tiny(), name="gpt2_tiny", family="gpt2", model=gpt2_config("tiny"),
        description="4-layer GPT-2 (2M params) on the embedded stdlib corpus")


@register("gpt2_124m")
def gpt2_124m() -> Recipe:
    """GPT-2 124M at its whole context (1024 learned positions), bf16 weights with fp32 master state."""
    return Recipe(
        name="gpt2_124m",
        description="GPT-2 124M, seq 1024 (its position limit), flash attention, bf16",
        family="gpt2",
        model=gpt2_config("gpt2_124m"),
        execution=GPU_EXECUTION,
        data=DataConfig(tokenizer=None, seq_len=1024, num_proc=16),
        # nanoGPT's GPT-2 124M settings: peak 6e-4, 0.1 weight decay, betas (0.9, 0.95).
        optimizer=OptimizerConfig(learning_rate=6e-4, warmup_steps=2000, weight_decay=0.1,
                                  clip_norm=1.0, master_weights=True),
        # `spillway plan gpt2_124m --gpu h200` picks this: as fast as saving everything (no recompute)
        # at about half its HBM (17 vs 32 GiB for 32 x 1024 tokens).
        offload=OffloadConfig(activations="save_dots", optimizer_state="device"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        checkpoint=CheckpointConfig(every_steps=1000, keep=3),
        train=TrainConfig(steps=100_000, global_batch=32, log_every=10, eval_every=1000, loss_chunk=1024),
    )


# --- helpers for the recipes below: another family's model with an existing recipe's setup

def _like_llama3_8b(name: str, family: str, model, description: str) -> Recipe:
    """A GPU recipe with llama3_8b's setup (bf16, flash attention, seq 8192, fp32 master state) for another model."""
    return dataclasses.replace(llama3_8b(), name=name, family=family, model=model, description=description)


def _cpu_recipe(name: str, family: str, model, description: str) -> Recipe:
    """A CPU recipe with `tiny`'s data, optimizer and schedule for another family's small model."""
    return dataclasses.replace(tiny(), name=name, family=family, model=model, description=description)


# --- Mistral ---------------------------------------------------------------------
from spillway.models.mistral import mistral_config  # noqa: E402


@register("mistral_tiny")
def mistral_tiny() -> Recipe:
    """CPU-sized Mistral: a 64-position sliding window inside 128-token sequences, so the window matters."""
    return _cpu_recipe("mistral_tiny", "mistral",
                       mistral_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                      num_kv_heads=2, mlp_hidden=512, sliding_window=64, max_seq_len=128),
                       "4-layer Mistral, sliding window 64 over 128 tokens, on the stdlib corpus")


@register("mistral_7b")
def mistral_7b() -> Recipe:
    """Mistral 7B v0.3 (no window), sequence 8192."""
    return _like_llama3_8b("mistral_7b", "mistral", mistral_config("mistral_7b_v0_3", max_seq_len=8192),
                           "Mistral 7B v0.3, seq 8192, state on device")


@register("mistral_7b_v0_1")
def mistral_7b_v0_1() -> Recipe:
    """Mistral 7B v0.1: sequence 8192 through its 4096-position sliding window."""
    return _like_llama3_8b("mistral_7b_v0_1", "mistral", mistral_config("mistral_7b_v0_1", max_seq_len=8192),
                           "Mistral 7B v0.1, seq 8192, sliding window 4096, state on device")


# --- Qwen ------------------------------------------------------------------------
from spillway.models.qwen import qwen2_config, qwen3_config  # noqa: E402


@register("qwen2_tiny")
def qwen2_tiny() -> Recipe:
    """CPU-sized Qwen2.5-shaped model: q/k/v biases, tied head."""
    return _cpu_recipe("qwen2_tiny", "qwen2",
                       qwen2_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                    num_kv_heads=2, mlp_hidden=512, max_seq_len=128),
                       "4-layer Qwen2.5-shaped model (q/k/v biases) on the stdlib corpus")


@register("qwen3_tiny")
def qwen3_tiny() -> Recipe:
    """CPU-sized Qwen3-shaped model: q/k norms, head_dim wider than d_model // num_heads, tied head."""
    return _cpu_recipe("qwen3_tiny", "qwen3",
                       qwen3_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                    num_kv_heads=2, head_dim=48, mlp_hidden=512, max_seq_len=128),
                       "4-layer Qwen3-shaped model (q/k norms) on the stdlib corpus")


@register("qwen2_5_1_5b")
def qwen2_5_1_5b() -> Recipe:
    """Qwen2.5 1.5B, sequence 8192."""
    return _like_llama3_8b("qwen2_5_1_5b", "qwen2", qwen2_config("qwen2_5_1_5b", max_seq_len=8192),
                           "Qwen2.5 1.5B, seq 8192, state on device")


@register("qwen3_0_6b")
def qwen3_0_6b() -> Recipe:
    """Qwen3 0.6B, sequence 8192."""
    return _like_llama3_8b("qwen3_0_6b", "qwen3", qwen3_config("qwen3_0_6b", max_seq_len=8192),
                           "Qwen3 0.6B, seq 8192, state on device")


@register("qwen3_8b")
def qwen3_8b() -> Recipe:
    """Qwen3 8B, sequence 8192."""
    return _like_llama3_8b("qwen3_8b", "qwen3", qwen3_config("qwen3_8b", max_seq_len=8192),
                           "Qwen3 8B, seq 8192, state on device")
