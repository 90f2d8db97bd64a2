"""The recipe registry: named functions that return a complete `Recipe`, most of them rows of two tables.

    @register("my_run")
    def my_run() -> Recipe: ...

`spillway recipes` lists them; `spillway train NAME --set a.b=value` runs one.
The CPU recipes are `tiny` (the offline main job), `tiny_sft`, and one row of
`CPU_ROWS` per family: `tiny`'s data, optimizer and schedule with the family's
small model. The GPU pretraining recipes are the rows of `PRETRAINING_ROWS`:
each its model (a family's preset with fields replaced), corpus, tokenizer,
batch, budget and offload, and its `sources`, where each number comes from
and which are our choice. The planner's figures behind each row's offload
settings are in BENCHMARKS.md (the section each row names). The GPU recipes
build here (their configs validate and the planner can compile them) even
though they cannot train on a CPU.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping

from spillway.layers.execution import Execution
from spillway.models.registry import preset_config
from spillway.recipes.config import (AuxLossConfig, CheckpointConfig, DataConfig, LoraConfig, MeshConfig,
                                     OffloadConfig, OptimizerConfig, Recipe, TrainConfig, apply_overrides)

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
        close = difflib.get_close_matches(name.lower(), recipe_names(), n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown recipe {name!r}; {guess}known recipes: {recipe_names()}") from None
    return apply_overrides(fn(), list(overrides))


@register("tiny")
def tiny() -> Recipe:
    """CPU-sized: trains a 4-layer Llama on the embedded stdlib corpus in minutes."""
    return Recipe(
        name="tiny",
        description="4-layer Llama on the embedded stdlib corpus; the CPU main job",
        model=preset_config("llama", "tiny", vocab_size=2048, d_model=192, num_layers=4, num_heads=6,
                            num_kv_heads=2, mlp_hidden=512, max_seq_len=128),
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


# The load-balancing coefficient each MoE family was published with (config.json router_aux_loss_coef); no
# z-loss (neither defines one).
MIXTRAL_AUX_LOSS = AuxLossConfig(load_balancing=0.02)
QWEN3_MOE_AUX_LOSS = AuxLossConfig(load_balancing=0.001)

_SMALL = dict(vocab_size=2048, d_model=192, num_layers=4, num_heads=6, num_kv_heads=2, max_seq_len=128)


@dataclasses.dataclass(frozen=True)
class CpuRow:
    """A CPU recipe: `tiny`'s data, optimizer and schedule with another family's small model."""

    name: str
    family: str
    preset: str
    model_overrides: Mapping
    description: str
    aux_loss: AuxLossConfig = AuxLossConfig()

    def recipe(self) -> Recipe:
        return dataclasses.replace(tiny(), name=self.name, description=self.description, aux_loss=self.aux_loss,
                                   model=preset_config(self.family, self.preset, **self.model_overrides))


CPU_ROWS = (
    CpuRow("gpt2_tiny", "gpt2", "tiny", {}, "4-layer GPT-2 on the embedded stdlib corpus"),
    # A 64-position sliding window inside 128-token sequences, so the window matters.
    CpuRow("mistral_tiny", "mistral", "tiny", dict(_SMALL, mlp_hidden=512, sliding_window=64),
           "4-layer Mistral, sliding window 64 over 128 tokens, on the stdlib corpus"),
    CpuRow("qwen2_tiny", "qwen2", "tiny", dict(_SMALL, mlp_hidden=512),
           "4-layer Qwen2.5-shaped model (q/k/v biases) on the stdlib corpus"),
    # q/k norms, head_dim wider than d_model // num_heads, tied head.
    CpuRow("qwen3_tiny", "qwen3", "tiny", dict(_SMALL, head_dim=48, mlp_hidden=512),
           "4-layer Qwen3-shaped model (q/k norms) on the stdlib corpus"),
    CpuRow("gemma2_tiny", "gemma2", "tiny", {},
           "4-layer Gemma 2 (local/global layers, window 32 over 128 tokens, soft-capped attention and logits) on "
           "the stdlib corpus"),
    # 8 layers of five local and one global (one period and two more).
    CpuRow("gemma3_tiny", "gemma3", "tiny", {},
           "8-layer Gemma 3 (five local layers and one global, window 32 over 128 tokens, RoPE bases 10,000 and "
           "1,000,000) on the stdlib corpus"),
    # 8 experts: the default mesh splits them over fsdp (the test suite's 8 fake CPU devices), which must divide
    # the expert count.
    CpuRow("mixtral_tiny", "mixtral", "tiny", dict(_SMALL, mlp_hidden=128, num_experts=8, sliding_window=64),
           "4-layer Mixtral (top-2 of 8 experts a layer, dropless) on the stdlib corpus", MIXTRAL_AUX_LOSS),
    # Layer 1 a dense MLP among sparse ones: three runs of layers.
    CpuRow("qwen3_moe_tiny", "qwen3_moe", "tiny",
           dict(_SMALL, head_dim=48, mlp_hidden=512, num_experts=8, top_k=2, moe_hidden=128, mlp_only_layers=(1,)),
           "4-layer Qwen3-MoE (top-2 of 8 experts, layer 1 dense) on the stdlib corpus", QWEN3_MOE_AUX_LOSS),
)


# --- GPU pretraining recipes: what a practitioner would train on and with ------------------------------------
# Each names a real corpus (a Hub dataset, streamed; --set data.source=DIR for a local copy), the model's own
# tokenizer by path (data.tokenizer, a folder holding the tokenizer.json or tokenizer.model of the Hub
# repository in data.tokenizer_origin), the published or standard hyperparameters, and the GPUs its offload
# settings were planned for: `spillway plan NAME` picks them there (tests/recipes/test_gpu_recipes.py checks
# that in its slow test). Where a value is our choice and not a publication's, `sources` says so.
# Offline, `spillway train NAME` stops with one line naming what is missing (recipes/train/preflight.py).

# cuDNN's fused attention: faster than the blockwise JAX one at the same HBM (BENCHMARKS.md, "On a GPU: one
# H200"). The planner compiles the blockwise one in its place (it needs no cuDNN).
GPU_EXECUTION = Execution(dtype="bfloat16", param_dtype="bfloat16", attention_impl="cudnn")
# Soft-capped attention has no cuDNN kernel, and cuDNN takes no per-layer window: the Gemma recipes run the
# blockwise JAX attention (layers/flash_attention.py), which has both, forward and backward.
GEMMA_EXECUTION = dataclasses.replace(GPU_EXECUTION, attention_impl="flash")

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
# Karpathy's build-nanogpt train_gpt2.py (GPT-2 124M reproduced on FineWeb-Edu's 10B-token sample).
NANOGPT_OPTIMIZER = OptimizerConfig(learning_rate=6e-4, warmup_steps=715, min_lr_ratio=0.1, b1=0.9, b2=0.95,
                                    eps=1e-8, weight_decay=0.1, clip_norm=1.0, master_weights=True)

CORPUS_OURS = "the corpus (smaller than the budget: the loader passes over it again)"
MISTRAL_SOURCE = ("Mistral AI has not published the data, budget or optimizer settings of its 7B models, so all "
                  f"of these are our choice: {LLAMA2_SOURCE}, with Llama 2's 2T-token budget, and the corpus")
QWEN_SEQUENCE = ("sequence 4096 is the length of Qwen's main pretraining stage (the Qwen2.5 and Qwen3 technical "
                 "reports; they extend the context only at the end)")
QWEN_OPTIMIZER_SOURCE = ("the Qwen reports give no per-model learning rate or batch (they fit them with scaling "
                         f"laws), so the optimizer and 4M-token batch are {LLAMA2_SOURCE}: our choice")
GEMMA_OPTIMIZER_SOURCE = ("the Gemma reports publish no learning rate, schedule or batch (and the small models "
                          f"were distilled from a larger teacher, which this recipe does not do), so the optimizer "
                          f"and 4M-token batch are {LLAMA2_SOURCE}: our choice")
GEMMA3_SEQUENCE = ("sequence 32768 is Gemma 3's pretraining length (Gemma Team 2025, 'Gemma 3 Technical Report': "
                   "32K sequences, the 4B and larger extended to 128K at the end of pretraining, which this "
                   "recipe does not do)")
# The MoE dispatch (BENCHMARKS.md, "MoE dispatches, deviceless H200"): jax 0.10.2 lowers `jax.lax.ragged_dot`
# for GPUs as a dense product masked per expert, so neither MoE recipe uses it; dropless by blocks of rows and
# capacity execute the same FLOPs there.
MOE_SOURCE = ("the MoE papers and model cards publish no pretraining optimizer, batch or data for these models "
              f"(Mixtral: Jiang et al. 2024; Qwen3: its technical report), so the optimizer and 4M-token batch are "
              f"{LLAMA2_SOURCE}: our choice; the corpus, sequence 4096 and micro-batch are our choice too")


def steps_for(token_budget: float, tokens_per_step: int) -> int:
    """Optimizer steps that train on `token_budget` tokens (whole steps, rounded down)."""
    return int(token_budget // tokens_per_step)


def _on(gpu: str, devices: int = 1, activations: str = "save_dots", optimizer_state: str = "device",
        **more) -> OffloadConfig:
    """The offload settings a recipe was planned with on `devices` x `gpu`."""
    extra = {"target_devices": devices} if devices != 1 else {}
    return OffloadConfig(activations=activations, optimizer_state=optimizer_state, target_gpu=gpu, **extra, **more)


@dataclasses.dataclass(frozen=True)
class PretrainingRow:
    """A GPU pretraining recipe: `global_batch` sequences of `seq_len` per step (None: the 4M-token batch of
    Llama 2), `grad_accum` micro-batches, for `token_budget` tokens; `sources` says where each number comes
    from."""

    name: str
    family: str
    preset: str
    model_overrides: Mapping
    description: str
    sources: str
    tokenizer_origin: str
    seq_len: int
    grad_accum: int
    token_budget: float
    offload: OffloadConfig
    corpus: str = FINEWEB_EDU
    global_batch: int | None = None
    optimizer: OptimizerConfig = LLAMA2_OPTIMIZER
    execution: Execution = GPU_EXECUTION
    aux_loss: AuxLossConfig = AuxLossConfig()
    val_fraction: float = 0.001
    eval_every: int = 1000
    eval_batches: int = 4
    checkpoint_every: int = 1000

    def recipe(self) -> Recipe:
        global_batch = self.global_batch or LLAMA2_BATCH_TOKENS // self.seq_len
        return Recipe(
            name=self.name, description=self.description, sources=self.sources,
            model=preset_config(self.family, self.preset, **self.model_overrides), execution=self.execution,
            data=DataConfig(source=self.corpus, text_field="text",
                            tokenizer=f"{TOKENIZERS_DIR}/{self.tokenizer_origin}", tokenizer_origin=self.tokenizer_origin, seq_len=self.seq_len,
                            val_fraction=self.val_fraction, num_proc=16),
            optimizer=self.optimizer, offload=self.offload, aux_loss=self.aux_loss,
            mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
            checkpoint=CheckpointConfig(every_steps=self.checkpoint_every, keep=3),
            train=TrainConfig(steps=steps_for(self.token_budget, global_batch * self.seq_len),
                              global_batch=global_batch, grad_accum=self.grad_accum, log_every=10,
                              eval_every=self.eval_every, eval_batches=self.eval_batches, loss_chunk=1024,
                              sample_prompt="Hello, I'm a language model,", sample_tokens=64),
        )


PRETRAINING_ROWS = (
    PretrainingRow(
        "llama3_1b", "llama", "llama3_2_1b", dict(max_seq_len=8192),
        description="Llama 3.2 1B from scratch on FineWeb-Edu with the Llama 3 tokenizer, for 9T tokens",
        sources=("9T tokens is the Llama 3.2 model card's 'up to 9 trillion' (Meta also distilled from larger "
                 "Llama 3 models, which this recipe does not); sequence 8192 is Llama 3's pretraining length; the "
                 f"optimizer and batch are {LLAMA2_SOURCE}, our choice at 1B; {CORPUS_OURS} and micro-batch are "
                 "our choice"),
        tokenizer_origin="meta-llama/Llama-3.2-1B", seq_len=8192, grad_accum=128, token_budget=9e12,
        offload=_on("h200")),
    PretrainingRow(
        "llama3_8b", "llama", "llama3_1_8b", dict(max_seq_len=8192),
        description="Llama 3.1 8B from scratch on FineWeb-Edu with the Llama 3 tokenizer, for 15T tokens",
        sources=("15T tokens and sequence 8192 are the Llama 3 model card's ('15T+' tokens, 8k context); Meta has "
                 f"not published the 8B's optimizer settings, so these are {LLAMA2_SOURCE}; {CORPUS_OURS} is our "
                 "choice"),
        tokenizer_origin="meta-llama/Llama-3.1-8B", seq_len=8192, grad_accum=64, token_budget=15e12,
        offload=_on("h200", 8)),
    PretrainingRow(
        "gpt2_124m", "gpt2", "gpt2_124m", {},
        description=("GPT-2 124M from scratch on FineWeb-Edu sample-10BT with the GPT-2 tokenizer, one pass (10B "
                     "tokens)"),
        sources=("Karpathy's build-nanogpt train_gpt2.py (GPT-2 124M reproduced on this corpus): AdamW 0.9/0.95, "
                 "eps 1e-8, weight decay 0.1, clipping 1.0, peak lr 6e-4, 715 warmup steps (GPT-3's 375M tokens), "
                 "cosine to 10%, validation every 250 steps on about 10M tokens (20 batches), a checkpoint every "
                 "5000 steps, 1% of the documents held out (their first 100M-token shard); bf16 weights with fp32 "
                 "master copies instead of fp32 weights under bf16 autocast, and the published 50,257-row "
                 "vocabulary instead of the padded 50,304, are our choice"),
        corpus=FINEWEB_EDU_10BT, tokenizer_origin="openai-community/gpt2", seq_len=1024, global_batch=512,
        grad_accum=8, token_budget=10e9, val_fraction=0.01, eval_every=250, eval_batches=20, checkpoint_every=5000,
        optimizer=NANOGPT_OPTIMIZER, offload=_on("h200")),
    PretrainingRow(
        "mistral_7b", "mistral", "mistral_7b_v0_3", dict(max_seq_len=8192),
        description="Mistral 7B v0.3 from scratch on FineWeb-Edu with its own tokenizer, for 2T tokens",
        sources=MISTRAL_SOURCE, tokenizer_origin="mistralai/Mistral-7B-v0.3", seq_len=8192, grad_accum=64,
        token_budget=2e12, offload=_on("h200", 8)),
    # Sequence 8192 through its 4096-position sliding window.
    PretrainingRow(
        "mistral_7b_v0_1", "mistral", "mistral_7b_v0_1", dict(max_seq_len=8192),
        description=("Mistral 7B v0.1 (sequences longer than its sliding window) from scratch on FineWeb-Edu with "
                     "its own tokenizer, for 2T tokens"),
        sources=MISTRAL_SOURCE, tokenizer_origin="mistralai/Mistral-7B-v0.1", seq_len=8192, grad_accum=64,
        token_budget=2e12, offload=_on("h200", 8)),
    PretrainingRow(
        "qwen2_5_1_5b", "qwen2", "qwen2_5_1_5b", dict(max_seq_len=4096),
        description="Qwen2.5 1.5B from scratch on FineWeb-Edu with the Qwen2.5 tokenizer, for 18T tokens",
        sources=(f"18T tokens is Qwen2.5's pretraining budget (its technical report); {QWEN_SEQUENCE}; "
                 f"{QWEN_OPTIMIZER_SOURCE}; {CORPUS_OURS} and micro-batch are our choice"),
        tokenizer_origin="Qwen/Qwen2.5-1.5B", seq_len=4096, grad_accum=128, token_budget=18e12,
        offload=_on("h200")),
    PretrainingRow(
        "qwen3_0_6b", "qwen3", "qwen3_0_6b", dict(max_seq_len=4096),
        description="Qwen3 0.6B from scratch on FineWeb-Edu with the Qwen3 tokenizer, for 36T tokens",
        sources=(f"36T tokens is Qwen3's pretraining budget (its technical report); {QWEN_SEQUENCE}; "
                 f"{QWEN_OPTIMIZER_SOURCE}; {CORPUS_OURS} and micro-batch are our choice"),
        tokenizer_origin="Qwen/Qwen3-0.6B-Base", seq_len=4096, grad_accum=128, token_budget=36e12,
        offload=_on("h200")),
    PretrainingRow(
        "qwen3_8b", "qwen3", "qwen3_8b", dict(max_seq_len=4096),
        description="Qwen3 8B from scratch on FineWeb-Edu with the Qwen3 tokenizer, for 36T tokens",
        sources=(f"36T tokens is Qwen3's pretraining budget (its technical report); {QWEN_SEQUENCE}; "
                 f"{QWEN_OPTIMIZER_SOURCE}; {CORPUS_OURS} is our choice"),
        tokenizer_origin="Qwen/Qwen3-8B-Base", seq_len=4096, grad_accum=64, token_budget=36e12,
        offload=_on("h200", 8)),
    # The planner's pick on one H200 (BENCHMARKS.md, "The Gemma recipes re-planned with the calibrated compute"):
    # at the blockwise kernel's measured efficiency the offloaded matmul outputs cross the link under the
    # compute, so save_dots estimates the same step and the lower HBM wins.
    PretrainingRow(
        "gemma2_2b", "gemma2", "gemma2_2b", {},
        description="Gemma 2 2B from scratch on FineWeb-Edu with the Gemma tokenizer, for 2T tokens",
        sources=("2T tokens is the Gemma 2 model card's budget for 2B, and 8192 its context length (Gemma Team "
                 f"2024, 'Gemma 2: Improving Open Language Models at a Practical Size'); {GEMMA_OPTIMIZER_SOURCE}; "
                 "the corpus and micro-batch are our choice"),
        tokenizer_origin="google/gemma-2-2b", seq_len=8192, grad_accum=128, token_budget=2e12,
        execution=GEMMA_EXECUTION, offload=_on("h200", activations="offload_dots")),
    PretrainingRow(
        "gemma3_1b", "gemma3", "gemma3_1b", {},
        description="Gemma 3 1B from scratch on FineWeb-Edu with the Gemma 3 tokenizer, for 2T tokens",
        sources=(f"2T tokens is the Gemma 3 model card's budget for 1B; {GEMMA3_SEQUENCE}; {GEMMA_OPTIMIZER_SOURCE}; "
                 "the corpus and micro-batch are our choice"),
        tokenizer_origin="google/gemma-3-1b-pt", seq_len=32768, grad_accum=128, token_budget=2e12,
        execution=GEMMA_EXECUTION, offload=_on("h200")),
    # The planner's pick on 8 H200s (BENCHMARKS.md, as gemma2_2b): faster than save_dots:24,recompute_all with
    # the state in host memory.
    PretrainingRow(
        "gemma3_12b", "gemma3", "gemma3_12b", dict(max_seq_len=32768),
        description=("Gemma 3 12B's text tower from scratch on FineWeb-Edu with the Gemma 3 tokenizer, for 12T "
                     "tokens"),
        sources=(f"12T tokens is the Gemma 3 model card's budget for 12B; {GEMMA3_SEQUENCE}; "
                 f"{GEMMA_OPTIMIZER_SOURCE}; the corpus, text-only training (the published model is multimodal) and "
                 "micro-batch are our choice"),
        tokenizer_origin="google/gemma-3-12b-pt", seq_len=32768, grad_accum=16, token_budget=12e12,
        execution=GEMMA_EXECUTION, offload=_on("h200", 8, activations="offload_dots")),
    # The planner's pick on 8 H100s (BENCHMARKS.md, "The MoE recipes re-planned"): the first 16 layers' matmul
    # outputs offloaded, the rest recomputed, the state in host memory (on device it does not fit); keeping those
    # outputs in HBM estimates the same step, so the lower HBM wins.
    PretrainingRow(
        "mixtral_8x7b", "mixtral", "mixtral_8x7b",
        dict(max_seq_len=4096, moe_dispatch="capacity", moe_capacity_factor=1.25),
        description=("Mixtral 8x7B from scratch on FineWeb-Edu with the Mixtral tokenizer, for 2T tokens; the "
                     "capacity dispatch (factor 1.25): with the 8 experts split over the 8 GPUs (fsdp), it "
                     "exchanges tokens (all-to-all) instead of gathering every expert's weights each layer "
                     "as dropless does, and ragged_dot lowers densely on jax 0.10.2 (BENCHMARKS.md)"),
        sources=MOE_SOURCE + "; the 2T-token budget is Llama 2's, our choice",
        tokenizer_origin="mistralai/Mixtral-8x7B-v0.1", seq_len=4096, grad_accum=128, token_budget=2e12,
        aux_loss=MIXTRAL_AUX_LOSS,
        offload=_on("h100", 8, activations="moe_offload_dots:16,recompute_all", optimizer_state="host")),
    # The planner's pick on one H200 given 1300 GB of host RAM (BENCHMARKS.md, "The MoE recipes re-planned"):
    # everything recomputed, the state and the routed experts in host memory. One sequence a micro-batch streams
    # the experts 16x as often; with one GPU's share of a 2 TB node nothing fits.
    PretrainingRow(
        "qwen3_30b_a3b", "qwen3_moe", "qwen3_30b_a3b",
        dict(max_seq_len=4096, moe_grouped_matmul="blocked", moe_block_rows=128),
        description=("Qwen3-30B-A3B from scratch on FineWeb-Edu with the Qwen3 tokenizer, for 36T tokens; dropless "
                     "by blocks of 128 rows: on one GPU there is no token exchange, it drops no token and executes "
                     "the FLOPs of capacity 1.25 (BENCHMARKS.md), and ragged_dot lowers densely on jax 0.10.2. "
                     "Its full AdamW state fits one H200 only with the routed experts streamed from host memory "
                     "too, 16 sequences a micro-batch so that each stream serves 65,536 tokens; a checkpoint "
                     "save then peaks at 1136.5 GiB of host RAM, most of a 2 TB node's for this one GPU: "
                     "spillway plan qwen3_30b_a3b --host-ram-gb 1300"),
        sources=f"36T tokens is Qwen3's pretraining budget (its technical report); {QWEN_SEQUENCE}; {MOE_SOURCE}",
        tokenizer_origin="Qwen/Qwen3-30B-A3B-Base", seq_len=4096, grad_accum=64, token_budget=36e12,
        aux_loss=QWEN3_MOE_AUX_LOSS,
        offload=_on("h200", activations="recompute_all", optimizer_state="host", params="experts")),
)

for _row in CPU_ROWS + PRETRAINING_ROWS:
    register(_row.name)(_row.recipe)


@register("llama3_8b_offload")
def llama3_8b_offload() -> Recipe:
    """llama3_8b on a single 80 GB H100: its optimizer state cannot live in HBM.

    The planner's pick with the host peak over a run's phases (recipes/plan/host_peak.py): since checkpoints
    of host state are written in pieces (recipes/train/checkpoint_io.py), a streamed update's state fits one
    GPU's share of host memory with its save counted, and it is faster than the host CPU's update
    (BENCHMARKS.md, "Checkpoints of host-resident state written in pieces")."""
    base = get_recipe("llama3_8b")
    return dataclasses.replace(
        base, name="llama3_8b_offload",
        description=("llama3_8b (same model, data, tokenizer, optimizer, 15T-token budget) on ONE H100 80GB: its "
                     "fp32 optimizer state cannot live in HBM, so the planner puts it in pinned host memory, "
                     "streamed through HBM for the update"),
        sources="as llama3_8b; the single H100 is our choice, to show what offload makes possible",
        train=dataclasses.replace(base.train, grad_accum=512),
        offload=_on("h100", activations="save_qkv_offload_mlp", optimizer_state="host"))


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
# Both torchtune configs' AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0.01, no clipping), float32 masters.
TORCHTUNE_ADAMW = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, clip_norm=None, master_weights=True)
TORCHTUNE_SOURCE = "torchtune's llama3_1/8B_{kind}_single_device.yaml (pytorch/torchtune, recipes/configs)"


def _llama3_8b_sft_recipe(name: str, *, description: str, sources: str, corpus: str, global_batch: int,
                          grad_accum: int, steps: int, optimizer: OptimizerConfig, offload: OffloadConfig,
                          lora=None) -> Recipe:
    """Llama 3.1 8B Instruct fine-tuned on an Alpaca set (instruct records), answers only, packed at 2048."""
    return Recipe(
        name=name, description=description, sources=sources,
        model=preset_config("llama", "llama3_1_8b", max_seq_len=2048), execution=SFT_EXECUTION,
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
        optimizer=OptimizerConfig(learning_rate=2e-5, warmup_steps=0, min_lr_ratio=1.0, **TORCHTUNE_ADAMW),
        # The planner's pick on one L4 with 256 GB of host RAM (BENCHMARKS.md, "Fine-tuning Llama 3.1 8B"): the
        # block weights and the state in host memory, the matmul outputs offloaded; with the block weights in
        # HBM no plan fits the L4.
        offload=OffloadConfig(activations="offload_dots", optimizer_state="host", params="host", target_gpu="l4"))


@register("llama3_8b_lora_16gb")
def llama3_8b_lora_16gb() -> Recipe:
    """Llama 3.1 8B Instruct with rank-16 LoRA adapters on attention and MLP, on Alpaca; one 16 GB RTX 4080."""
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
        optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=100, min_lr_ratio=0.0, **TORCHTUNE_ADAMW),
        lora=LoraConfig(rank=16, alpha=32.0, dropout=0.0,
                        targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        # The planner's pick on one RTX 4080 (BENCHMARKS.md, "Fine-tuning Llama 3.1 8B"): the frozen base
        # streamed from host memory, the adapters and their state in HBM; with the base in HBM nothing fits
        # (its bfloat16 weights alone are more than the HBM the plan may use).
        offload=OffloadConfig(activations="offload_dots", optimizer_state="device", params="host",
                              target_gpu="rtx4080"))
