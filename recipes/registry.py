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
