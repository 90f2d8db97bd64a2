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
        description="4-layer Llama on the embedded stdlib corpus; the CPU main job",
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


@register("tiny_sft")
def tiny_sft() -> Recipe:
    """CPU-sized instruction fine-tune of the `tiny` run (runs/tiny, from `make train`) on the shipped set."""
    from spillway.data.instruct_tiny import INSTRUCT_TINY

    base = tiny()
    return dataclasses.replace(
        base, name="tiny_sft",
        description="the tiny run fine-tuned on 280 instructions asking for short Python functions (answers only)",
        data=DataConfig(source=str(INSTRUCT_TINY), format="instruct", chat_template="spillway", seq_len=128,
                        val_fraction=0.1),
        optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=10, weight_decay=0.0, clip_norm=1.0),
        checkpoint=CheckpointConfig(every_steps=100, keep=2, init_from="runs/tiny"),
        train=TrainConfig(steps=150, global_batch=8, log_every=10, eval_every=50, eval_batches=2,
                          sample_prompt="def ", sample_tokens=0),
    )


# --- GPU pretraining recipes: what a practitioner would train on and with ------------------------------------
# Each names a real corpus (a Hub dataset, streamed; --set data.source=DIR for a local copy), the model's own
# tokenizer by path (data.tokenizer, a folder holding the tokenizer.json or tokenizer.model of the Hub
# repository in data.tokenizer_origin), the published or standard hyperparameters, and the GPUs its offload
# settings were planned for: `spillway plan NAME` picks them there (tests/recipes/test_gpu_recipes.py checks
# that in its slow test). Where a value is our choice and not a publication's, the description says so.
# Offline, `spillway train NAME` stops with one line naming what is missing (recipes/train/preflight.py).

# cuDNN's fused attention: 3.6x faster than the blockwise JAX one for the Llama 3.2 1B step on an H200, at the
# same HBM (BENCHMARKS.md, "On a GPU"). The planner compiles the blockwise one in its place (it needs no cuDNN).
GPU_EXECUTION = Execution(dtype="bfloat16", param_dtype="bfloat16", attention_impl="cudnn")

FINEWEB_EDU = "hf:HuggingFaceFW/fineweb-edu"            # all of FineWeb-Edu (about 1.3T tokens at release)
FINEWEB_EDU_10BT = "hf:HuggingFaceFW/fineweb-edu:sample-10BT"   # its 10B-token sample
TOKENIZERS_DIR = "tokenizers"                           # data.tokenizer = TOKENIZERS_DIR/<Hub repository>

# Llama 2 (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models", section 2.2 and
# Table 1): AdamW with b1 0.9, b2 0.95, eps 1e-5, weight decay 0.1, gradient clipping 1.0, a cosine schedule
# with 2000 warmup steps down to 10% of the peak, global batches of 4M tokens, peak learning rate 3e-4 at 7B.
LLAMA2_OPTIMIZER = OptimizerConfig(learning_rate=3e-4, warmup_steps=2000, min_lr_ratio=0.1, b1=0.9, b2=0.95,
                                   eps=1e-5, weight_decay=0.1, clip_norm=1.0, master_weights=True)
LLAMA2_BATCH_TOKENS = 4 * 2**20                         # "4M tokens": 512 x 8192 or 1024 x 4096
LLAMA2_SOURCE = ("Llama 2's published pretraining settings (Touvron et al. 2023, section 2.2, Table 1: AdamW "
                 "0.9/0.95, eps 1e-5, weight decay 0.1, clipping 1.0, 2000 warmup steps, cosine to 10%, "
                 "4M-token batches, peak lr 3e-4 at 7B)")


def steps_for(token_budget: float, tokens_per_step: int) -> int:
    """Optimizer steps that train on `token_budget` tokens (whole steps, rounded down)."""
    return int(token_budget // tokens_per_step)


def _pretraining_recipe(name: str, *, model, description: str, sources: str, corpus: str, tokenizer_origin: str,
                        seq_len: int, global_batch: int, grad_accum: int, token_budget: float,
                        optimizer: OptimizerConfig, offload: OffloadConfig, val_fraction: float = 0.001,
                        eval_every: int = 1000, eval_batches: int = 4, checkpoint_every: int = 1000,
                        execution: Execution = GPU_EXECUTION) -> Recipe:
    """A GPU pretraining recipe; `global_batch` sequences of `seq_len` per step, `grad_accum` micro-batches."""
    return Recipe(
        name=name, description=description, sources=sources, model=model, execution=execution,
        data=DataConfig(source=corpus, text_field="text", tokenizer=f"{TOKENIZERS_DIR}/{tokenizer_origin}",
                        tokenizer_origin=tokenizer_origin, seq_len=seq_len, val_fraction=val_fraction, num_proc=16),
        optimizer=optimizer,
        offload=offload,
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        checkpoint=CheckpointConfig(every_steps=checkpoint_every, keep=3),
        train=TrainConfig(steps=steps_for(token_budget, global_batch * seq_len), global_batch=global_batch,
                          grad_accum=grad_accum, log_every=10, eval_every=eval_every, eval_batches=eval_batches,
                          loss_chunk=1024, sample_prompt="Hello, I'm a language model,", sample_tokens=64),
    )


@register("llama3_1b")
def llama3_1b() -> Recipe:
    """Llama 3.2 1B from scratch on FineWeb-Edu with its own tokenizer; one H200."""
    return _pretraining_recipe(
        "llama3_1b", model=llama_config("llama3_2_1b", max_seq_len=8192),
        description="Llama 3.2 1B from scratch on FineWeb-Edu with the Llama 3 tokenizer, for 9T tokens",
        sources=(
            "9T tokens is the Llama 3.2 model card's 'up to 9 trillion' (Meta also distilled from larger Llama 3 models, which this recipe does not); sequence 8192 is Llama 3's "
            f"pretraining length; the optimizer and batch are {LLAMA2_SOURCE}, our choice at 1B; the corpus "
            "(smaller than the budget: the loader passes over it again) and micro-batch are our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="meta-llama/Llama-3.2-1B",
        seq_len=8192, global_batch=LLAMA2_BATCH_TOKENS // 8192, grad_accum=128,
        token_budget=9e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200"))


@register("llama3_8b")
def llama3_8b() -> Recipe:
    """Llama 3.1 8B from scratch on FineWeb-Edu with its own tokenizer; one node of 8 H200s."""
    return _pretraining_recipe(
        "llama3_8b", model=llama_config("llama3_1_8b", max_seq_len=8192),
        description="Llama 3.1 8B from scratch on FineWeb-Edu with the Llama 3 tokenizer, for 15T tokens",
        sources=(
            "15T tokens and sequence 8192 are the Llama 3 model card's ('15T+' tokens, 8k context); Meta has not published the 8B's optimizer settings, so "
            f"these are {LLAMA2_SOURCE}; the corpus (smaller than the budget: the loader passes over it again) is "
            "our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="meta-llama/Llama-3.1-8B",
        seq_len=8192, global_batch=LLAMA2_BATCH_TOKENS // 8192, grad_accum=64,
        token_budget=15e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200",
                              target_devices=8))


@register("llama3_8b_offload")
def llama3_8b_offload() -> Recipe:
    """llama3_8b on a single 80 GB H100: its 96 GB of optimizer state cannot live in HBM.

    The planner's pick with the host peak over a run's phases (recipes/plan/host_peak.py): since
    checkpoints of host state are written in pieces (recipes/train/checkpoint_io.py), a streamed
    update's state fits a 238.4 GiB host with its save counted, and it is faster than the host CPU's
    update (BENCHMARKS.md, "Checkpoints of host-resident state written in pieces")."""
    base = llama3_8b()
    return dataclasses.replace(
        base, name="llama3_8b_offload",
        description=("llama3_8b (same model, data, tokenizer, optimizer, 15T-token budget) on ONE H100 80GB: its "
                     "fp32 optimizer state cannot live in HBM, so the planner puts it in pinned host memory, "
                     "streamed through HBM for the update"),
        sources="as llama3_8b; the single H100 is our choice, to show what offload makes possible",
        train=dataclasses.replace(base.train, grad_accum=512),
        offload=OffloadConfig(activations="save_qkv_offload_mlp", optimizer_state="host", target_gpu="h100"))


# --- GPT-2 -----------------------------------------------------------------------
# Imported here rather than at the top so each family's recipes stay one appended section.
from spillway.models.gpt2 import gpt2_config  # noqa: E402


@register("gpt2_tiny")
def gpt2_tiny() -> Recipe:
    """CPU-sized GPT-2: the `tiny` recipe's data, optimizer and schedule with a 4-layer GPT-2."""
    return dataclasses.replace(
        tiny(), name="gpt2_tiny", model=gpt2_config("tiny"),
        description="4-layer GPT-2 on the embedded stdlib corpus")


@register("gpt2_124m")
def gpt2_124m() -> Recipe:
    """GPT-2 124M on FineWeb-Edu's 10B-token sample: Karpathy's build-nanogpt baseline; one H200."""
    return _pretraining_recipe(
        "gpt2_124m", model=gpt2_config("gpt2_124m"),
        description="GPT-2 124M from scratch on FineWeb-Edu sample-10BT with the GPT-2 tokenizer, one pass (10B tokens)",
        sources=(
            "Karpathy's build-nanogpt train_gpt2.py (GPT-2 124M reproduced on this corpus): AdamW 0.9/0.95, eps 1e-8, "
            "weight decay 0.1, clipping 1.0, peak lr 6e-4, 715 warmup steps (GPT-3's 375M tokens), cosine to "
            "10%, validation every 250 steps on about 10M tokens (20 batches), a checkpoint every 5000 steps, "
            "1% of the documents held out (their first 100M-token shard); bf16 weights with fp32 master copies "
            "instead of fp32 weights under bf16 autocast, and the published 50,257-row vocabulary instead of "
            "the padded 50,304, are our choice"),
        corpus=FINEWEB_EDU_10BT, tokenizer_origin="openai-community/gpt2", seq_len=1024, global_batch=512,
        grad_accum=8, token_budget=10e9, val_fraction=0.01, eval_every=250, eval_batches=20, checkpoint_every=5000,
        optimizer=OptimizerConfig(learning_rate=6e-4, warmup_steps=715, min_lr_ratio=0.1, b1=0.9, b2=0.95,
                                  eps=1e-8, weight_decay=0.1, clip_norm=1.0, master_weights=True),
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200"))


# --- helper for the CPU recipes below: another family's small model with `tiny`'s setup

def _cpu_recipe(name: str, model, description: str) -> Recipe:
    """A CPU recipe with `tiny`'s data, optimizer and schedule for another family's small model."""
    return dataclasses.replace(tiny(), name=name, model=model, description=description)


# --- Mistral ---------------------------------------------------------------------
from spillway.models.mistral import mistral_config  # noqa: E402


@register("mistral_tiny")
def mistral_tiny() -> Recipe:
    """CPU-sized Mistral: a 64-position sliding window inside 128-token sequences, so the window matters."""
    return _cpu_recipe("mistral_tiny",
                       mistral_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                      num_kv_heads=2, mlp_hidden=512, sliding_window=64, max_seq_len=128),
                       "4-layer Mistral, sliding window 64 over 128 tokens, on the stdlib corpus")


MISTRAL_SOURCE = ("Mistral AI has not published the data, budget or optimizer settings of its 7B models, so all "
                  f"of these are our choice: {LLAMA2_SOURCE}, with Llama 2's 2T-token budget, and the corpus")


@register("mistral_7b")
def mistral_7b() -> Recipe:
    """Mistral 7B v0.3 (no sliding window) from scratch on FineWeb-Edu with its own tokenizer; 8 H200s."""
    return _pretraining_recipe(
        "mistral_7b", model=mistral_config("mistral_7b_v0_3", max_seq_len=8192),
        description="Mistral 7B v0.3 from scratch on FineWeb-Edu with its own tokenizer, for 2T tokens",
        sources=MISTRAL_SOURCE,
        corpus=FINEWEB_EDU, tokenizer_origin="mistralai/Mistral-7B-v0.3",
        seq_len=8192, global_batch=LLAMA2_BATCH_TOKENS // 8192, grad_accum=64,
        token_budget=2e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200",
                              target_devices=8))


@register("mistral_7b_v0_1")
def mistral_7b_v0_1() -> Recipe:
    """Mistral 7B v0.1: sequence 8192 through its 4096-position sliding window; 8 H200s."""
    return _pretraining_recipe(
        "mistral_7b_v0_1", model=mistral_config("mistral_7b_v0_1", max_seq_len=8192),
        description=("Mistral 7B v0.1 (sequences longer than its sliding window) from scratch on FineWeb-Edu with "
                     "its own tokenizer, for 2T tokens"),
        sources=MISTRAL_SOURCE,
        corpus=FINEWEB_EDU, tokenizer_origin="mistralai/Mistral-7B-v0.1",
        seq_len=8192, global_batch=LLAMA2_BATCH_TOKENS // 8192, grad_accum=64,
        token_budget=2e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200",
                              target_devices=8))


# --- Qwen ------------------------------------------------------------------------
from spillway.models.qwen import qwen2_config, qwen3_config  # noqa: E402


@register("qwen2_tiny")
def qwen2_tiny() -> Recipe:
    """CPU-sized Qwen2.5-shaped model: q/k/v biases, tied head."""
    return _cpu_recipe("qwen2_tiny",
                       qwen2_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                    num_kv_heads=2, mlp_hidden=512, max_seq_len=128),
                       "4-layer Qwen2.5-shaped model (q/k/v biases) on the stdlib corpus")


@register("qwen3_tiny")
def qwen3_tiny() -> Recipe:
    """CPU-sized Qwen3-shaped model: q/k norms, head_dim wider than d_model // num_heads, tied head."""
    return _cpu_recipe("qwen3_tiny",
                       qwen3_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                    num_kv_heads=2, head_dim=48, mlp_hidden=512, max_seq_len=128),
                       "4-layer Qwen3-shaped model (q/k norms) on the stdlib corpus")


QWEN_SEQUENCE = ("sequence 4096 is the length of Qwen's main pretraining stage (the Qwen2.5 and Qwen3 technical "
                 "reports; they extend the context only at the end)")
QWEN_OPTIMIZER_SOURCE = ("the Qwen reports give no per-model learning rate or batch (they fit them with scaling "
                         f"laws), so the optimizer and 4M-token batch are {LLAMA2_SOURCE}: our choice")


@register("qwen2_5_1_5b")
def qwen2_5_1_5b() -> Recipe:
    """Qwen2.5 1.5B from scratch on FineWeb-Edu with its own tokenizer; one H200."""
    return _pretraining_recipe(
        "qwen2_5_1_5b", model=qwen2_config("qwen2_5_1_5b", max_seq_len=4096),
        description="Qwen2.5 1.5B from scratch on FineWeb-Edu with the Qwen2.5 tokenizer, for 18T tokens",
        sources=(
            "18T tokens is Qwen2.5's pretraining budget (its "
            f"technical report); {QWEN_SEQUENCE}; {QWEN_OPTIMIZER_SOURCE}; the corpus (smaller than the budget: "
            "the loader passes over it again) and micro-batch are our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="Qwen/Qwen2.5-1.5B",
        seq_len=4096, global_batch=LLAMA2_BATCH_TOKENS // 4096, grad_accum=128,
        token_budget=18e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200"))


@register("qwen3_0_6b")
def qwen3_0_6b() -> Recipe:
    """Qwen3 0.6B from scratch on FineWeb-Edu with its own tokenizer; one H200."""
    return _pretraining_recipe(
        "qwen3_0_6b", model=qwen3_config("qwen3_0_6b", max_seq_len=4096),
        description="Qwen3 0.6B from scratch on FineWeb-Edu with the Qwen3 tokenizer, for 36T tokens",
        sources=(
            "36T tokens is Qwen3's pretraining budget (its technical "
            f"report); {QWEN_SEQUENCE}; {QWEN_OPTIMIZER_SOURCE}; the corpus (smaller than the budget: the loader "
            "passes over it again) and micro-batch are our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="Qwen/Qwen3-0.6B-Base",
        seq_len=4096, global_batch=LLAMA2_BATCH_TOKENS // 4096, grad_accum=128,
        token_budget=36e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200"))


@register("qwen3_8b")
def qwen3_8b() -> Recipe:
    """Qwen3 8B from scratch on FineWeb-Edu with its own tokenizer; 8 H200s."""
    return _pretraining_recipe(
        "qwen3_8b", model=qwen3_config("qwen3_8b", max_seq_len=4096),
        description="Qwen3 8B from scratch on FineWeb-Edu with the Qwen3 tokenizer, for 36T tokens",
        sources=(
            "36T tokens is Qwen3's pretraining budget (its "
            f"technical report); {QWEN_SEQUENCE}; {QWEN_OPTIMIZER_SOURCE}; the corpus (smaller than the budget: "
            "the loader passes over it again) is our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="Qwen/Qwen3-8B-Base",
        seq_len=4096, global_batch=LLAMA2_BATCH_TOKENS // 4096, grad_accum=64,
        token_budget=36e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200",
                              target_devices=8))


# --- Gemma -----------------------------------------------------------------------
from spillway.models.gemma import gemma2_config, gemma3_config  # noqa: E402


@register("gemma2_tiny")
def gemma2_tiny() -> Recipe:
    """CPU-sized Gemma 2: alternating 32-token sliding-window and global layers over 128 tokens, soft-caps."""
    return _cpu_recipe("gemma2_tiny", gemma2_config("tiny"),
                       "4-layer Gemma 2 (local/global layers, window 32 over 128 tokens, soft-capped attention "
                       "and logits) on the stdlib corpus")


@register("gemma3_tiny")
def gemma3_tiny() -> Recipe:
    """CPU-sized Gemma 3: 8 layers of five local and one global (one period and two more), two RoPE bases."""
    return _cpu_recipe("gemma3_tiny", gemma3_config("tiny"),
                       "8-layer Gemma 3 (five local layers and one global, window 32 over 128 tokens, RoPE bases "
                       "10,000 and 1,000,000) on the stdlib corpus")


# Soft-capped attention has no cuDNN kernel, and cuDNN takes no per-layer window: the Gemma recipes run the
# blockwise JAX attention (layers/flash_attention.py), which has both, forward and backward.
GEMMA_EXECUTION = dataclasses.replace(GPU_EXECUTION, attention_impl="flash")
GEMMA_OPTIMIZER_SOURCE = ("the Gemma reports publish no learning rate, schedule or batch (and the small models "
                          f"were distilled from a larger teacher, which this recipe does not do), so the optimizer "
                          f"and 4M-token batch are {LLAMA2_SOURCE}: our choice")


def _gemma_recipe(name: str, **kwargs) -> Recipe:
    """A GPU pretraining recipe (`_pretraining_recipe`) running the blockwise JAX attention."""
    return _pretraining_recipe(name, execution=GEMMA_EXECUTION, **kwargs)


@register("gemma2_2b")
def gemma2_2b() -> Recipe:
    """Gemma 2 2B from scratch on FineWeb-Edu with its own tokenizer; one H200."""
    return _gemma_recipe(
        "gemma2_2b", model=gemma2_config("gemma2_2b"),
        description="Gemma 2 2B from scratch on FineWeb-Edu with the Gemma tokenizer, for 2T tokens",
        sources=(
            "2T tokens is the Gemma 2 model card's budget for 2B, and 8192 its context length (Gemma Team 2024, 'Gemma 2: Improving Open Language Models at a "
            f"Practical Size'); {GEMMA_OPTIMIZER_SOURCE}; the corpus and micro-batch are our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="google/gemma-2-2b",
        seq_len=8192, global_batch=LLAMA2_BATCH_TOKENS // 8192, grad_accum=128,
        token_budget=2e12, optimizer=LLAMA2_OPTIMIZER,
        # The planner's pick on one H200: the matmul outputs offloaded to host memory, the state on device
        # (59.9 GiB). At the blockwise kernel's measured 13.5% of peak their transfers hide under the compute,
        # so keeping them (save_dots, 109.5 GiB) estimates the same step and the lower HBM wins.
        offload=OffloadConfig(activations="offload_dots", optimizer_state="device", target_gpu="h200"))


GEMMA3_SEQUENCE = ("sequence 32768 is Gemma 3's pretraining length (Gemma Team 2025, 'Gemma 3 Technical Report': "
                   "32K sequences, the 4B and larger extended to 128K at the end of pretraining, which this "
                   "recipe does not do)")


@register("gemma3_1b")
def gemma3_1b() -> Recipe:
    """Gemma 3 1B from scratch on FineWeb-Edu with its own tokenizer; one H200."""
    return _gemma_recipe(
        "gemma3_1b", model=gemma3_config("gemma3_1b"),
        description="Gemma 3 1B from scratch on FineWeb-Edu with the Gemma 3 tokenizer, for 2T tokens",
        sources=(
            "2T tokens is the Gemma 3 model "
            f"card's budget for 1B; {GEMMA3_SEQUENCE}; {GEMMA_OPTIMIZER_SOURCE}; the corpus and micro-batch are "
            "our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="google/gemma-3-1b-pt",
        seq_len=32768, global_batch=LLAMA2_BATCH_TOKENS // 32768, grad_accum=128,
        token_budget=2e12, optimizer=LLAMA2_OPTIMIZER,
        offload=OffloadConfig(activations="save_dots", optimizer_state="device", target_gpu="h200"))


@register("gemma3_12b")
def gemma3_12b() -> Recipe:
    """Gemma 3 12B (text tower) from scratch on FineWeb-Edu with its own tokenizer; 8 H200s."""
    return _gemma_recipe(
        "gemma3_12b", model=gemma3_config("gemma3_12b", max_seq_len=32768),
        description="Gemma 3 12B's text tower from scratch on FineWeb-Edu with the Gemma 3 tokenizer, for 12T tokens",
        sources=(
            f"12T tokens is the Gemma 3 model card's budget for 12B; {GEMMA3_SEQUENCE}; {GEMMA_OPTIMIZER_SOURCE}; "
            "the corpus, text-only training (the published model is multimodal) and micro-batch are our choice"),
        corpus=FINEWEB_EDU, tokenizer_origin="google/gemma-3-12b-pt",
        seq_len=32768, global_batch=LLAMA2_BATCH_TOKENS // 32768, grad_accum=16,
        token_budget=12e12, optimizer=LLAMA2_OPTIMIZER,
        # The planner's pick on 8 H200s: the matmul outputs offloaded to host memory, the state on device
        # (46.0 GiB HBM, 148.6 GiB of host memory per GPU; 320.1 s a step, its compute at the blockwise
        # kernel's measured efficiency, against 357.8 s for save_dots:24,recompute_all with the state on host).
        offload=OffloadConfig(activations="offload_dots", optimizer_state="device",
                              target_gpu="h200", target_devices=8))


# --- Mixture of experts: Mixtral and Qwen3-MoE ------------------------------------
from spillway.models.mixtral import mixtral_config  # noqa: E402
from spillway.models.qwen3_moe import qwen3_moe_config  # noqa: E402
from spillway.recipes.config import AuxLossConfig  # noqa: E402

# The load-balancing coefficient each family was published with (config.json router_aux_loss_coef); no z-loss
# (neither defines one).
MIXTRAL_AUX_LOSS = AuxLossConfig(load_balancing=0.02)
QWEN3_MOE_AUX_LOSS = AuxLossConfig(load_balancing=0.001)


@register("mixtral_tiny")
def mixtral_tiny() -> Recipe:
    """CPU-sized Mixtral: top-2 of 8 experts in every layer, a 64-position window inside 128-token sequences.

    8 experts: the default mesh splits them over fsdp (the test suite's 8 fake CPU devices), which must divide
    the expert count."""
    return dataclasses.replace(_cpu_recipe("mixtral_tiny",
                       mixtral_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                      num_kv_heads=2, mlp_hidden=128, num_experts=8, sliding_window=64,
                                      max_seq_len=128),
                       "4-layer Mixtral (top-2 of 8 experts a layer, dropless) on the stdlib corpus"),
                               aux_loss=MIXTRAL_AUX_LOSS)


@register("qwen3_moe_tiny")
def qwen3_moe_tiny() -> Recipe:
    """CPU-sized Qwen3-MoE: top-2 of 8 experts, layer 1 a dense MLP among sparse ones (three runs of layers)."""
    return dataclasses.replace(_cpu_recipe("qwen3_moe_tiny",
                       qwen3_moe_config("tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                                        num_kv_heads=2, head_dim=48, mlp_hidden=512, num_experts=8, top_k=2,
                                        moe_hidden=128, mlp_only_layers=(1,), max_seq_len=128),
                       "4-layer Qwen3-MoE (top-2 of 8 experts, layer 1 dense) on the stdlib corpus"),
                               aux_loss=QWEN3_MOE_AUX_LOSS)


# The dispatch (BENCHMARKS.md, "MoE dispatches"): jax 0.10.2 lowers `jax.lax.ragged_dot` for GPUs as a dense
# product masked per expert (a Qwen3-MoE layer's forward and backward: 98 GiB of temp, 128x the expert FLOPs),
# so neither recipe uses it. Dropless by blocks of 128 rows and capacity (factor 1.25) execute the same FLOPs
# there (0.777 TFLOP for 0.623 active) at 4.9 and 3.3 GiB of HBM.
MOE_SOURCE = ("the MoE papers and model cards publish no pretraining optimizer, batch or data for these models "
              f"(Mixtral: Jiang et al. 2024; Qwen3: its technical report), so the optimizer and 4M-token batch are "
              f"{LLAMA2_SOURCE}: our choice; the corpus, sequence 4096 and micro-batch are our choice too")


@register("mixtral_8x7b")
def mixtral_8x7b() -> Recipe:
    """Mixtral 8x7B from scratch on FineWeb-Edu with its own tokenizer; one node of 8 H100s."""
    return dataclasses.replace(_pretraining_recipe(
        "mixtral_8x7b",
        model=mixtral_config("mixtral_8x7b", max_seq_len=4096, moe_dispatch="capacity", moe_capacity_factor=1.25),
        description=("Mixtral 8x7B from scratch on FineWeb-Edu with the Mixtral tokenizer, for 2T tokens; the "
                     "capacity dispatch (factor 1.25): with the 8 experts split over the 8 GPUs (fsdp), it "
                     "exchanges tokens (all-to-all) instead of gathering every expert's weights each layer "
                     "as dropless does, and ragged_dot lowers densely on jax 0.10.2 (BENCHMARKS.md)"),
        sources=MOE_SOURCE + "; the 2T-token budget is Llama 2's, our choice",
        corpus=FINEWEB_EDU, tokenizer_origin="mistralai/Mixtral-8x7B-v0.1",
        seq_len=4096, global_batch=LLAMA2_BATCH_TOKENS // 4096, grad_accum=128,
        token_budget=2e12, optimizer=LLAMA2_OPTIMIZER,
        # The planner's pick on 8 H100s (BENCHMARKS.md): the first 16 layers' matmul outputs offloaded to host
        # memory, the rest recomputed, the optimizer state in host memory (on device it needs 110.8 GiB per GPU
        # at least). Keeping those outputs in HBM instead estimates the same step (the transfers hide under the
        # compute) at 70.0 against 57.3 GiB, so the lower HBM wins.
        offload=OffloadConfig(activations="moe_offload_dots:16,recompute_all", optimizer_state="host",
                              target_gpu="h100", target_devices=8)), aux_loss=MIXTRAL_AUX_LOSS)


@register("qwen3_30b_a3b")
def qwen3_30b_a3b() -> Recipe:
    """Qwen3-30B-A3B from scratch on FineWeb-Edu with its own tokenizer; one H200."""
    return dataclasses.replace(_pretraining_recipe(
        "qwen3_30b_a3b",
        model=qwen3_moe_config("qwen3_30b_a3b", max_seq_len=4096, moe_grouped_matmul="blocked", moe_block_rows=128),
        description=("Qwen3-30B-A3B from scratch on FineWeb-Edu with the Qwen3 tokenizer, for 36T tokens; dropless "
                     "by blocks of 128 rows: on one GPU there is no token exchange, it drops no token and executes "
                     "the FLOPs of capacity 1.25 (BENCHMARKS.md), and ragged_dot lowers densely on jax 0.10.2. "
                     "Its full AdamW state fits one H200 only with the routed experts streamed from host memory "
                     "too, 16 sequences a micro-batch so that each stream serves 65,536 tokens; a checkpoint "
                     "save then peaks at 1136.5 GiB of host RAM, most of a 2 TB node's for this one GPU: "
                     "spillway plan qwen3_30b_a3b --host-ram-gb 1300"),
        sources=("36T tokens is Qwen3's pretraining budget (its technical report); " + QWEN_SEQUENCE + "; "
                 + MOE_SOURCE),
        corpus=FINEWEB_EDU, tokenizer_origin="Qwen/Qwen3-30B-A3B-Base",
        seq_len=4096, global_batch=LLAMA2_BATCH_TOKENS // 4096, grad_accum=64,
        token_budget=36e12, optimizer=LLAMA2_OPTIMIZER,
        # The planner's pick on one H200 given 1300 GB of host RAM (BENCHMARKS.md): everything recomputed, the
        # optimizer state and the routed experts in host memory (41.7 GiB of HBM; 329.7 s a step against
        # 290.1 s of compute). One sequence a micro-batch (grad_accum 1024) streams the experts 16x as often:
        # 5048 s. With the per-GPU share of a 2 TB node (238.4 GiB) nothing fits.
        offload=OffloadConfig(activations="recompute_all", optimizer_state="host", params="experts",
                              target_gpu="h200")), aux_loss=QWEN3_MOE_AUX_LOSS)


# --- Fine-tuning Llama 3.1 8B on instructions: full on one L4, LoRA on one 16 GB GPU ----------------------------
# torchtune's single-device configs for the 8B (recipes/configs/llama3_1/8B_full_single_device.yaml and
# 8B_lora_single_device.yaml): the Instruct model and its tokenizer (whose chat template renders each example),
# an Alpaca set, 2 sequences a micro-batch, no gradient clipping. torchtune's README measures the pair packed
# at 2048 tokens on one RTX 4090 (full with 8-bit paged AdamW: 18.9 GiB; LoRA 16.2 GiB); here the full
# fine-tune keeps float32 AdamW state, in host memory. Packed examples attend only to their own example
# (data.document_mask, on for instruct data), which cuDNN's attention cannot do here (layers/segment_mask.py):
# both run the blockwise JAX kernel, the one the planner compiles.
SFT_EXECUTION = dataclasses.replace(GPU_EXECUTION, attention_impl="flash")
MODELS_DIR = "models"                                   # checkpoint.init_from = hf:MODELS_DIR/<Hub repository>
LLAMA31_8B_INSTRUCT = "meta-llama/Llama-3.1-8B-Instruct"
TORCHTUNE_SOURCE = "torchtune's llama3_1/8B_{kind}_single_device.yaml (pytorch/torchtune, recipes/configs)"


def _llama3_8b_sft_recipe(name: str, *, description: str, sources: str, corpus: str, global_batch: int,
                          grad_accum: int, steps: int, optimizer: OptimizerConfig, offload: OffloadConfig,
                          lora=None) -> Recipe:
    """Llama 3.1 8B Instruct fine-tuned on an Alpaca set (instruct records), answers only, packed at 2048."""
    from spillway.recipes.config import LoraConfig

    return Recipe(
        name=name, description=description, sources=sources,
        model=llama_config("llama3_1_8b", max_seq_len=2048), execution=SFT_EXECUTION,
        data=DataConfig(source=corpus, format="instruct", tokenizer=f"{TOKENIZERS_DIR}/{LLAMA31_8B_INSTRUCT}",
                        tokenizer_origin=LLAMA31_8B_INSTRUCT, seq_len=2048, val_fraction=0.02, num_proc=8),
        optimizer=optimizer, offload=offload, lora=lora or LoraConfig(),
        checkpoint=CheckpointConfig(every_steps=500, keep=2, init_from=f"hf:{MODELS_DIR}/{LLAMA31_8B_INSTRUCT}",
                                    init_from_origin=LLAMA31_8B_INSTRUCT),
        train=TrainConfig(steps=steps, global_batch=global_batch, grad_accum=grad_accum, log_every=10,
                          eval_every=250, eval_batches=8, loss_chunk=1024, sample_prompt="", sample_tokens=0),
    )


@register("llama3_8b_sft_l4")
def llama3_8b_sft_l4() -> Recipe:
    """Llama 3.1 8B Instruct, every weight trained on Alpaca with float32 AdamW state; one 24 GB L4."""
    return _llama3_8b_sft_recipe(
        "llama3_8b_sft_l4",
        description=("Llama 3.1 8B Instruct fully fine-tuned on Alpaca (the loss on the answers) with float32 "
                     "AdamW state in host memory, on one 24 GB L4; plan it with --host-ram-gb 256 (one L4 "
                     "with 256 GiB of RAM, AWS g6.16xlarge): the state alone is 89.7 GiB"),
        sources=(f"{TORCHTUNE_SOURCE.format(kind='full')}: tatsu-lab/alpaca, batch 2, gradient accumulation 1, "
                 "lr 2e-5 held constant (no scheduler), no clipping; its PagedAdamW8bit's defaults (betas "
                 "0.9/0.999, eps 1e-8, weight decay 0.01) with float32 moments instead of 8-bit; packing at "
                 "2048 tokens (torchtune's README memory figures; the config leaves packing off), validation "
                 "on 2% of the records and the 1000 steps (4.1M tokens) are our choice"),
        corpus="hf:tatsu-lab/alpaca", global_batch=2, grad_accum=1, steps=1000,
        optimizer=OptimizerConfig(learning_rate=2e-5, warmup_steps=0, min_lr_ratio=1.0, b1=0.9, b2=0.999,
                                  eps=1e-8, weight_decay=0.01, clip_norm=None, master_weights=True),
        # The planner's pick on one L4 with 256 GB of host RAM (BENCHMARKS.md): the block weights and the state
        # in host memory, the matmul outputs offloaded (9.53 GiB of HBM, 132.3 GiB of host at its peak; 16.85 s
        # a step estimated, 243 tokens/s). With the block weights in HBM the leanest plan needs 23.8 GiB.
        offload=OffloadConfig(activations="offload_dots", optimizer_state="host", params="host", target_gpu="l4"))


@register("llama3_8b_lora_16gb")
def llama3_8b_lora_16gb() -> Recipe:
    """Llama 3.1 8B Instruct with rank-16 LoRA adapters on attention and MLP, on Alpaca; one 16 GB RTX 4080."""
    from spillway.recipes.config import LoraConfig

    return _llama3_8b_sft_recipe(
        "llama3_8b_lora_16gb",
        description=("Llama 3.1 8B Instruct with rank-16 LoRA adapters (q, v, o and the MLP projections) "
                     "fine-tuned on Alpaca-cleaned (the loss on the answers) on one 16 GB RTX 4080: the "
                     "frozen bfloat16 base (15 GiB) streams from host memory a layer at a time"),
        sources=(f"{TORCHTUNE_SOURCE.format(kind='lora')}: yahma/alpaca-cleaned, adapters on q_proj, v_proj, "
                 "output_proj and the MLP, dropout 0, batch 2, gradient accumulation 8, AdamW lr 3e-4 "
                 "(betas 0.9/0.999, eps 1e-8, weight decay 0.01), cosine to 0 after 100 warmup steps, no "
                 "clipping; rank 16 (torchtune's is 8) with alpha 32 (its 'alpha = 2 x rank'); packing at 2048 "
                 "tokens, validation on 2% of the records and the 400 steps (13.1M tokens) are our choice"),
        corpus="hf:yahma/alpaca-cleaned", global_batch=16, grad_accum=8, steps=400,
        optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=100, min_lr_ratio=0.0, b1=0.9, b2=0.999,
                                  eps=1e-8, weight_decay=0.01, clip_norm=None, master_weights=True),
        lora=LoraConfig(rank=16, alpha=32.0, dropout=0.0,
                        targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        # The planner's pick on one RTX 4080 (BENCHMARKS.md): the frozen base streamed from host memory, the
        # adapters and their state in HBM (5.18 GiB; 39.5 GiB of host at the restore). With the base in HBM
        # nothing fits: its weights alone are 15.0 GiB of the 13.9 the plan may use.
        offload=OffloadConfig(activations="offload_dots", optimizer_state="device", params="host",
                              target_gpu="rtx4080"))
