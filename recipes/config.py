"""The Recipe: frozen dataclasses for a whole run, `--set a.b=value` overrides, JSON round-trip.

A recipe is plain data: the model family and its config (models/), how the
model executes (dtypes, attention kernel), an optional block class, data,
optimizer, offload, mesh, checkpoint and train settings. Recipes are Python functions returning a
`Recipe` (recipes/registry.py); variants come from `dataclasses.replace` or
from `--set` on the command line, which is type-checked against the field's
annotation so a typo or a bad value fails before anything is built.

Each setting has one field (a value derived from another, `DERIVED_FIELDS`,
cannot be set), and every section checks its values when it is built: a value
that cannot work is a `ConfigError` naming the field (docs/DESIGN.md section 7).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import pathlib
import re
import types
import typing
from pathlib import Path
from typing import Any

from spillway.layers.errors import ConfigError, require_non_negative, require_positive
from spillway.layers.execution import Execution
from spillway.layers.memory import EXPERTS, MEMORIES, PARAM_PLACEMENTS, Memory
from spillway.layers.mesh import MeshConfig
from spillway.layers.offload import RematPlan
from spillway.layers.residency import (check_split_fits, host_layers, is_param_split, is_split,
                                      memory_of, parse_split)
from spillway.layers.rope import RopeScaling
from spillway.models.registry import family_names, family_of_config, get_family
from spillway.recipes.blocks import resolve_block_class
from spillway.recipes.optim.config import OptimizerConfig
from spillway.recipes.targets import get_target

# The largest seed that draws its own numbers: jax.random.key keeps a seed's low 32 bits in JAX's default
# 32-bit mode (seeds 2**32 apart drew the same init, dropout and samples; larger than 2**63 - 1 overflowed)
MAX_SEED = 2**32 - 1


TOKENIZER_TYPES = ("bpe", "unigram")
# When a host-resident optimizer state's streamed update runs: after the backward pass, or each block
# layer's just before that layer runs in the next step's forward pass (recipes/optim/update_in_forward.py).
AFTER_BACKWARD = "after_backward"
NEXT_FORWARD = "next_forward"
UPDATE_TIMES = (AFTER_BACKWARD, NEXT_FORWARD)


# The deferred update streams host state: the weights stay in HBM, the state is on host, whole or split
# (host:N: in the forward pass, each layer updated before it runs: the resident layers' from their state in
# HBM, the last N layers' streamed from host memory).
def next_forward_placement_needed(state: str, params: str) -> str:
    """The one-line ConfigError of offload.update=next_forward with a placement it cannot stream."""
    return ("offload.update=next_forward streams a host-resident optimizer state under the next forward pass: it "
            "needs offload.optimizer_state=host (or a split host:N with N >= 1) and offload.params=device "
            f"(got optimizer_state={state}, params={params})")


# Where the deferred update's pending gradients of the stacked block leaves wait between two steps (with
# offload.update=next_forward): pinned host memory, sent there as the backward pass makes them, or HBM
# (recipes/optim/update_in_forward.py pending_shardings).
PENDING_HOST = "host"
PENDING_DEVICE = "device"
PENDING_PLACES = (PENDING_HOST, PENDING_DEVICE)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "builtin:stdlib"        # see data/sources.py: builtin:stdlib, path, or a Hub name
    text_field: str = "text"
    # The source's split: a Hub dataset's, a save_to_disk DatasetDict's, or a folder's split-named files
    # (train.jsonl + test.jsonl, data/train-*.parquet: named as `datasets` names them, data/local_files.py).
    split: str = "train"
    tokenizer: str | None = None          # tokenizer.json, a sentencepiece .model, or a directory holding either;
                                          # None: the init_from=hf: checkpoint's, else one trained on the corpus
    tokenizer_origin: str | None = None   # the Hub repository `tokenizer` is a local copy of: named, with the
                                          # command that fetches it, when the file is missing (nothing else)
    tokenizer_type: str = "bpe"           # "bpe" | "unigram" when training
    # A BOS before every document: None as the tokenizer's family does (a tokenizer.json's post-processor or
    # tokenizer_config.json's add_bos_token; a tokenizer trained here adds none); true/false to choose.
    # A resumed run keeps what it started with (recipes/train/tokenization_record.py).
    add_bos: bool | None = None
    seq_len: int = 256
    val_fraction: float = 0.02
    cache_dir: str = ".cache/spillway"
    num_proc: int = 1                     # tokenizing processes (>1: a forkserver pool, safe beside JAX's threads)
    max_tokens: int | None = None         # optional cap on tokens taken from the source (its head), streamed or not;
                                          # in a mixture, from each source; chat/instruct: whole examples that fit
    shard_tokens: int = 1 << 22           # tokens per on-disk shard of the tokenized corpus (data/shards.py)
    mixture: str | None = None            # "name=weight:source,...": weighted sources instead of `source` (data/mixture.py)
    # Fine-tuning (data/sft_formats.py, data/sft_packing.py): "text" | "chat" (records with `messages`) |
    # "instruct" (records with `instruction`, `input`, `output`).
    format: str = "text"
    chat_template: str | None = None      # a built-in template's name or a template file; None: the tokenizer's
    train_on_prompt: bool = False         # chat/instruct: the loss on every token, not only the answers
    # Packed examples attend only to their own example, positions restarting at 0; None: on for chat and
    # instruct, off for text (where it cuts at every EOS, as Llama 3 trained).
    document_mask: bool | None = None
    packing: str = "pack"                 # chat/instruct: "pack" whole examples into rows | "pad": one a row
    overlong: str = "truncate"            # chat/instruct: an example longer than a row: "truncate" | "drop"

    @property
    def uses_document_mask(self) -> bool:
        return self.format != "text" if self.document_mask is None else self.document_mask

    @property
    def cache_path(self) -> Path:
        """`cache_dir` with `~` expanded (`--set data.cache_dir=~/cache` reaches here unexpanded by the shell)."""
        return Path(self.cache_dir).expanduser()

    def __post_init__(self):
        for name, allowed in (("format", ("text", "chat", "instruct")), ("packing", ("pack", "pad")),
                              ("overlong", ("truncate", "drop"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"data.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        require_positive("data", seq_len=self.seq_len, num_proc=self.num_proc, max_tokens=self.max_tokens)
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ConfigError(f"data.tokenizer_type must be one of {TOKENIZER_TYPES}, got {self.tokenizer_type!r}")
        for name in ("source", "text_field", "cache_dir", "split"):
            if not getattr(self, name).strip():
                raise ConfigError(f"data.{name} must not be empty")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    activations: str = "recompute_all"    # RematPlan spec: preset or "preset:K,preset" (layers/offload.py)
    # "device" | "host" | a split "host:N" / "host:F" (the last N block layers, or that fraction of them, on
    # host and the rest in HBM; layers/residency.py): where the optimizer state lives.
    optimizer_state: str = Memory.DEVICE.value
    # "device" | "host" | "experts": where the stacked block weights (and so their gradients) live;
    # "host" streams them through HBM a layer at a time (layers/host_weights.py); "experts" streams
    # only an MoE block's routed experts so, keeping attention, norms, router and shared experts in HBM.
    # Embedding, final norm and head stay on device.
    params: str = Memory.DEVICE.value
    # With the weights streamed (offload.params host, experts or a split): how many of the last streamed block
    # layers keep the device copy the forward pass fetched until the backward pass, which visits them first,
    # instead of fetching it again (layers/host_weights.py, "the weights across the turn"): K layers' weights
    # more in HBM from the forward pass to the backward pass, K layers' weights fewer over the host link per
    # micro-batch. 0: every streamed layer is fetched again.
    params_keep: int = 0
    # "after_backward" | "next_forward": when the streamed update of host optimizer state runs.
    # "next_forward" updates each block layer in the next step's forward pass, just before the layer
    # runs, so the state's copies move while the forward pass computes (same maths; a checkpoint,
    # validation or the end of training first finishes the update still pending).
    update: str = AFTER_BACKWARD
    # With offload.update=next_forward: where the pending gradients of the stacked block leaves wait for the
    # next step. "host": in pinned host memory (host memory S + Gp, the gradients cross the link twice a
    # step); "device": in HBM (about the HBM of after_backward, which holds the whole stacked gradient at the
    # end of the backward pass too; host memory S alone, and no gradient crosses the link).
    pending_gradients: str = PENDING_HOST
    # The GPUs the two settings above were planned for: `spillway plan RECIPE` picks them there, and
    # `spillway train RECIPE --plan auto` plans for that GPU by default. None: a recipe for no GPU in particular.
    target_gpu: str | None = None         # a recipes/targets.py name, e.g. "h200"
    target_devices: int = 1               # how many of them, on one host

    def __post_init__(self):
        if is_split(self.optimizer_state):
            parse_split(self.optimizer_state, "offload.optimizer_state")
        elif self.optimizer_state not in MEMORIES:
            raise ConfigError(f"offload.optimizer_state must be one of {MEMORIES} or a split host:N / host:F, "
                              f"got {self.optimizer_state!r}")
        if is_param_split(self.params):
            parse_split(self.params, "offload.params")
        elif self.params not in PARAM_PLACEMENTS:
            raise ConfigError(f"offload.params must be one of {PARAM_PLACEMENTS} or a split host:N / host:F / "
                              f"experts:N / experts:F, got {self.params!r}")
        if isinstance(self.params_keep, bool) or not isinstance(self.params_keep, int) or self.params_keep < 0:
            raise ConfigError(f"offload.params_keep must be a whole number of block layers, zero or more (how many "
                              f"of the last streamed layers keep their weights in HBM from the forward pass to the "
                              f"backward pass), got {self.params_keep!r}")
        if self.params_keep and self.params == Memory.DEVICE:
            raise ConfigError(f"offload.params_keep={self.params_keep} keeps streamed block weights in HBM across "
                              f"the turn, but offload.params=device streams none: set offload.params=host (or a "
                              f"split host:N, experts), or offload.params_keep=0")
        if self.update not in UPDATE_TIMES:
            raise ConfigError(f"offload.update must be one of {UPDATE_TIMES}, got {self.update!r}")
        if self.update == NEXT_FORWARD and ((self.optimizer_state != Memory.HOST and not is_split(self.optimizer_state))
                                            or self.params != Memory.DEVICE):
            raise ConfigError(next_forward_placement_needed(self.optimizer_state, self.params))
        if self.pending_gradients not in PENDING_PLACES:
            raise ConfigError(f"offload.pending_gradients must be one of {PENDING_PLACES}, "
                              f"got {self.pending_gradients!r}")
        if self.pending_gradients != PENDING_HOST and self.update != NEXT_FORWARD:
            raise ConfigError(f"offload.pending_gradients={self.pending_gradients} places the gradients the "
                              f"update in the next forward pass waits for, but offload.update={self.update} "
                              f"leaves none pending: set offload.update={NEXT_FORWARD}, or "
                              f"offload.pending_gradients={PENDING_HOST}")
        require_positive("offload", target_devices=self.target_devices)
        if self.target_gpu is not None:
            try:
                get_target(self.target_gpu)
            except ValueError as err:
                raise ConfigError(f"offload.target_gpu: {err}") from None
        try:
            RematPlan.parse(self.activations)  # the layer counts are checked against the model by Recipe
        except ValueError as err:
            raise ConfigError(f"offload.activations: {err}") from None


@dataclasses.dataclass(frozen=True)
class AuxLossConfig:
    """Coefficients of the auxiliary losses added to the training loss (recipes/train/aux_terms.py).

    They weight what the model's blocks emit through layers/aux_outputs.py; today the router
    statistics of an MoE layer (layers/router.py). Zero is off: no term is added and the program is
    the one without it. The defaults are off because every recipe has this section, dense ones too; an
    MoE recipe sets its model's published value (Mixtral's config.json router_aux_loss_coef 0.02,
    Qwen3-MoE's 0.001). A coefficient on a model whose blocks emit no router statistics is a
    ConfigError when the step is built (it would weight nothing).
    """

    # x E * sum_e f_e P_e over the step's layers (Switch Transformer; Hugging Face's load_balancing_loss_func)
    load_balancing: float = 0.0
    # x mean over tokens and layers of logsumexp(router logits)^2 (ST-MoE, which uses 1e-3). 0: Mixtral and
    # Qwen3-MoE were trained without one (their models define no z-loss); a recipe may set it for stability.
    router_z: float = 0.0

    def __post_init__(self):
        for name in ("load_balancing", "router_z"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"aux_loss.{name} must be a finite number >= 0 (a coefficient; 0 is off), "
                                  f"got {value!r}")

    @property
    def any_set(self) -> bool:
        return bool(self.load_balancing or self.router_z)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA fine-tuning (layers/lora.py, recipes/train/lora_state.py): rank 0 is off (every weight trains).

    With a rank, adapters go on the projections `targets` names (Hugging Face module names: q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; an MoE model's routed experts too, one adapter
    per expert: Mixtral's w1/w2/w3, or `experts`; recipes/lora_targets.py), the base weights
    are frozen (no gradients, no optimizer state; placeable in host memory with offload.params=host)
    and checkpoints hold the adapters, the base being checkpoint.init_from. Defaults are PEFT's
    LoraConfig (alpha 8, dropout 0, q_proj and v_proj for Llama-shaped models).
    """

    rank: int = 0
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        require_non_negative("lora", rank=self.rank)
        if not (isinstance(self.alpha, (int, float)) and 0 < self.alpha < float("inf")):
            raise ConfigError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.rank and not self.targets:
            raise ConfigError("lora.targets is empty: name the projections to adapt (e.g. q_proj,v_proj)")
        repeated = sorted({t for t in self.targets if self.targets.count(t) > 1})
        if repeated:   # one adapter a projection: a name twice is a typo, and the saved recipe would carry it
            raise ConfigError(f"lora.targets names {', '.join(repeated)} more than once: name each projection once")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None                # None: runs/<recipe name>
    every_steps: int = 100
    keep: int = 3
    async_save: bool = True
    init_from: str | None = None          # fine-tune: weights (only) of a run dir or step dir, or hf:DIR
                                          # (a Hugging Face checkpoint; recipes/train/init_weights.py)
    init_from_origin: str | None = None   # the Hub repository an hf: init_from is a local copy of: named, with the
                                          # command that fetches it, when the folder is missing (nothing else)
    init_from_digest: str | None = None   # a LoRA run's base as its files were when the run started
                                          # (recipes/train/base_digest.py): set by the run, not by a user
    init_from_relative: str | None = None  # a LoRA run's base seen from its run folder when it started, where
                                           # generate and export look when the project tree moved: set by the run

    def __post_init__(self):
        require_positive("checkpoint", every_steps=self.every_steps, keep=self.keep)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    global_batch: int = 16                # sequences per optimizer step
    grad_accum: int = 1                   # micro-batches per step (global_batch % grad_accum == 0)
    loss_chunk: int = 0                   # >0: apply the output head this many tokens at a time (saves HBM)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100                 # 0: no validation
    eval_batches: int = 4
    profile_steps: str | None = None      # "START:STOP": a jax.profiler trace of those steps
    sample_prompt: str = "def "
    sample_tokens: int = 64               # 0: no sample at the end
    resume: bool = True                   # continue from the latest checkpoint in checkpoint.dir
    resume_step: int | None = None        # resume from this step instead (newer ones are set aside)

    def __post_init__(self):
        require_positive("train", steps=self.steps, global_batch=self.global_batch, grad_accum=self.grad_accum,
                         log_every=self.log_every, eval_batches=self.eval_batches)
        require_non_negative("train", loss_chunk=self.loss_chunk, seed=self.seed, eval_every=self.eval_every,
                             sample_tokens=self.sample_tokens)
        if isinstance(self.seed, int) and self.seed > MAX_SEED:   # JAX keeps a seed's low 32 bits (MAX_SEED)
            raise ConfigError(f"train.seed must be at most {MAX_SEED} (2**32 - 1: JAX keeps a seed's low 32 "
                              f"bits, so larger seeds repeat smaller ones), got {self.seed}")
        if self.global_batch % self.grad_accum:
            raise ConfigError(f"train.grad_accum ({self.grad_accum}) does not divide "
                              f"train.global_batch ({self.global_batch})")
        self.profile_range()  # a malformed range fails here, not at the step it names

    def profile_range(self) -> tuple[int, int] | None:
        """(start, stop) of `profile_steps`, or None."""
        if not self.profile_steps:
            return None
        start, sep, stop = self.profile_steps.partition(":")
        if not sep or not start.isdigit() or not stop.isdigit() or int(stop) <= int(start):
            raise ConfigError(f"train.profile_steps must be 'START:STOP' with STOP > START, "
                              f"got {self.profile_steps!r}")
        return int(start), int(stop)


# Fields a recipe.json or `--set` may name that are no settings of their own:
# they derive from another field, which is the one to set.
DERIVED_FIELDS = {
    "optimizer.total_steps": "the schedule's length derives from train.steps: set train.steps",
    "optimizer.state_memory": "where the optimizer state lives is offload.optimizer_state: set that",
    "model.remat": "the activation plan (what is saved, recomputed or offloaded) is offload.activations: set that",
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    model: Any                            # a models/ family's config (architecture only); its class is the family
    execution: Execution = Execution()    # dtypes, attention kernel, init scale: shared by all families
    block: str | None = None              # "package.module:Class": a TransformerBlock subclass (recipes/blocks.py)
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()   # hyperparameters (length: train, placement: offload)
    offload: OffloadConfig = OffloadConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    train: TrainConfig = TrainConfig()
    aux_loss: AuxLossConfig = AuxLossConfig()     # coefficients of the blocks' auxiliary losses (MoE routers)
    lora: LoraConfig = LoraConfig()       # rank > 0: LoRA adapters on a frozen base (checkpoint.init_from)
    description: str = ""                 # what the recipe is (`spillway recipes` lists it)
    sources: str = ""                     # where its numbers come from, and which are our choice

    def __post_init__(self):
        family_of_config(self.model)   # a ConfigError unless the model is a registered family's config
        # the run's folder is runs/<name> unless checkpoint.dir says otherwise: "" trained into runs/ itself,
        # among the other runs, and "../x" outside it ("team/x", a folder in runs/, stays allowed)
        parts = pathlib.PurePosixPath(self.name).parts if isinstance(self.name, str) else ()   # ("." dropped)
        if not parts or not self.name.strip() or "\0" in self.name or self.name.startswith("/") or ".." in parts:
            raise ConfigError(f"name must be a folder name inside runs/ (the run trains into runs/<name> unless "
                              f"checkpoint.dir is set), got {self.name!r}")
        sections = {"execution": Execution, "data": DataConfig, "optimizer": OptimizerConfig,
                    "offload": OffloadConfig, "mesh": MeshConfig, "checkpoint": CheckpointConfig,
                    "train": TrainConfig, "aux_loss": AuxLossConfig, "lora": LoraConfig}
        for name, cls in sections.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len "
                              f"({self.model.max_seq_len})")
        chunk = self.train.loss_chunk
        if 0 < chunk < self.data.seq_len and self.data.seq_len % chunk:
            raise ConfigError(f"train.loss_chunk ({chunk}) must divide data.seq_len ({self.data.seq_len}): "
                              f"the loss applies the head {chunk} tokens at a time (0 turns chunking off)")
        if self.train.eval_every and self.data.val_fraction == 0:
            raise ConfigError(f"data.val_fraction is 0, so there is no validation data, but train.eval_every is "
                              f"{self.train.eval_every}: set train.eval_every=0 or a positive data.val_fraction")
        try:
            segments = RematPlan.parse(self.offload.activations).resolve(self.model.num_layers)
        except ValueError as err:
            raise ConfigError(f"offload.activations: {err}") from None
        if self.offload.update == NEXT_FORWARD:
            if len(segments) > 1:
                raise ConfigError(f"offload.update=next_forward needs one activation policy for every layer; "
                                  f"offload.activations={self.offload.activations!r} has {len(segments)} segments")
            if self.train.grad_accum != 1 and self.offload.pending_gradients == PENDING_HOST:
                # the float32 running sum of the micro-batches lives in HBM; kept on the host side it would
                # cross the link twice per micro-batch (recipes/train/accumulate_in_forward.py)
                raise ConfigError(f"offload.update=next_forward with train.grad_accum={self.train.grad_accum} "
                                  f"keeps the pending gradients' float32 running sum in HBM, but "
                                  f"offload.pending_gradients={PENDING_HOST} puts them in host memory: set "
                                  f"offload.pending_gradients={PENDING_DEVICE}, or train.grad_accum=1")
            if self.optimizer.update_on_host:
                raise ConfigError("offload.update=next_forward streams the update through HBM; "
                                  "optimizer.update_on_host=true runs it on the host CPU instead: set one of them")
        if self.optimizer.update_on_host and memory_of(self.offload.optimizer_state) != Memory.HOST:
            # the host CPU updates state that lives in host memory; with the state in HBM there is nothing for
            # it to update, and a setting that silently does nothing is worse than none
            raise ConfigError("optimizer.update_on_host=true runs the update of host optimizer state on the host "
                              "CPU, but offload.optimizer_state=device keeps the state in HBM, where the GPU "
                              "updates it: set offload.optimizer_state=host, or optimizer.update_on_host=false")
        self._check_params_split()
        if self.offload.params != Memory.DEVICE and self.offload.optimizer_state != Memory.HOST \
                and not is_param_split(self.offload.params) and not self.lora.enabled:
            # Host weights with device state would bring the whole gradient and weights into HBM for the
            # update: the saving gone. Only host state is supported (frozen LoRA base weights need neither).
            if is_split(self.offload.optimizer_state):   # the state is not on device: the split is the mismatch
                on_host = host_layers(self.offload.optimizer_state, self.model.num_layers)
                what = "routed experts" if self.offload.params == EXPERTS else "weights"
                raise ConfigError(f"offload.params={self.offload.params} puts every block layer's {what} on host, but "
                                  f"offload.optimizer_state={self.offload.optimizer_state} is a split; a layer's "
                                  f"weights are updated where its state is: split them at the same layer "
                                  f"(offload.params={self.offload.params}:{on_host}), or set "
                                  f"offload.optimizer_state=host")
            raise ConfigError(f"offload.params={self.offload.params} needs offload.optimizer_state=host (the "
                              "update of host weights reads host gradients; with the state on device it would "
                              "need them all in HBM)")
        if self.lora.enabled:
            self._check_lora()
        check_split_fits(self.offload.optimizer_state, "offload.optimizer_state", self.model.num_layers,
                         len(self.decoder_spec().stack_runs()))
        check_split_fits(self.offload.params, "offload.params", self.model.num_layers,
                         len(self.decoder_spec().stack_runs()))
        self._check_params_keep()
        self._check_next_forward_stack()
        self._check_next_forward_split()
        if self.block is not None:
            resolve_block_class(self.block)   # a typo fails here, not after the data is prepared
        self.decoder_spec()   # the model with this execution (a layer pattern under cuDNN) fails here, by name

    def _check_next_forward_stack(self) -> None:
        """offload.update=next_forward runs each layer's update in the forward scan, just before the layer: one
        scan over one stack. A model whose blocks are runs of several structures (Qwen3-MoE's mlp_only_layers)
        failed at its first step, after the data was prepared, naming its stacked leaves' layer counts."""
        runs = len(self.decoder_spec().stack_runs())
        if self.offload.update == NEXT_FORWARD and runs != 1:
            raise ConfigError(f"offload.update=next_forward needs the block layers in one stack (each layer's "
                              f"update runs in the forward pass, just before the layer); this model has {runs} "
                              f"runs of layers: use offload.update={AFTER_BACKWARD}")

    def _check_next_forward_split(self) -> None:
        """offload.update=next_forward with a split state that keeps block layers resident: their update runs in
        HBM in the forward pass, before each layer, and reads their pending gradients there, so those wait in HBM (in
        host memory they would come back over the link with nothing to hide under). host:L (every block layer
        on host) takes either place. Runs after check_split_fits, which names a count above the model's layers."""
        state = self.offload.optimizer_state
        if self.offload.update != NEXT_FORWARD or not is_split(state):
            return
        on_host = host_layers(state, self.model.num_layers)
        if on_host == 0:   # every layer's state in HBM: nothing to stream
            raise ConfigError(next_forward_placement_needed(state, self.offload.params))
        resident = self.model.num_layers - on_host
        if resident and self.offload.pending_gradients == PENDING_HOST:
            raise ConfigError(f"offload.update=next_forward with offload.optimizer_state={state} updates the "
                              f"{resident} resident block layers in HBM in the forward pass, from "
                              f"pending gradients in HBM, but offload.pending_gradients={PENDING_HOST} puts them in "
                              f"host memory: set offload.pending_gradients={PENDING_DEVICE}, or "
                              f"offload.optimizer_state=host:{self.model.num_layers}")

    def _check_params_split(self) -> None:
        """A split of the weights (offload.params=host:N | experts:N) needs the state split at the same layer:
        a layer's weights are updated where its state is (host weights by the stream, HBM weights on device)."""
        params, state = self.offload.params, self.offload.optimizer_state
        if not is_param_split(params):
            return
        if self.lora.enabled:
            raise ConfigError(f"offload.params={params}: a split of the weights is not written for LoRA runs "
                              "(their frozen base goes whole to host: offload.params=host)")
        layers = self.model.num_layers
        if params.split(":", 1)[1].strip().lstrip("-").isdigit() and int(params.split(":", 1)[1]) > layers:
            return   # check_split_fits names it
        if host_layers(params, layers) != host_layers(state, layers):
            raise ConfigError(f"offload.params={params} puts the last {host_layers(params, layers)} of "
                              f"{layers} block layers' weights on host; the optimizer state must be split at the "
                              f"same layer (offload.optimizer_state=host:{host_layers(params, layers)}), got "
                              f"offload.optimizer_state={state}")

    def _check_params_keep(self) -> None:
        """offload.params_keep counts streamed layers: at most the host layers of offload.params, not for LoRA."""
        keep, params = self.offload.params_keep, self.offload.params
        if not keep:
            return
        if self.lora.enabled:
            raise ConfigError(f"offload.params_keep={keep}: keeping streamed weights across the turn is not written "
                              "for LoRA runs (their frozen base is streamed whole): use offload.params_keep=0")
        streamed = host_layers(params, self.model.num_layers)
        if keep > streamed:
            raise ConfigError(f"offload.params_keep={keep}: offload.params={params} streams {streamed} of the "
                              f"{self.model.num_layers} block layers; at most those {streamed} can keep their "
                              f"weights across the turn (0 to {streamed})")

    def _check_lora(self) -> None:
        """LoRA needs a base to adapt and adapts only stacked block weights the update streams none of."""
        spec = self.lora_spec()   # a target that names no projection of the model: ConfigError naming those it has
        if spec.expert_targets and self.offload.params != Memory.DEVICE.value:
            raise ConfigError(f"lora.targets adapts the routed experts, whose adapters are merged into the expert "
                              f"weights each pass; with offload.params={self.offload.params} (weights streamed from "
                              f"host memory) that is not supported in this version: use offload.params=device")
        if not self.checkpoint.init_from:
            raise ConfigError("lora.rank is set but checkpoint.init_from is not: LoRA adapts a trained base model; "
                              "name it (a spillway run, or hf:DIR)")
        if self.offload.update == NEXT_FORWARD:
            raise ConfigError("offload.update=next_forward defers the update of streamed host state; LoRA's "
                              "adapters have no host state to stream: use offload.update=after_backward")

    def without_adapters(self) -> Recipe:
        """The recipe's model without LoRA adapters (a merged export's; the base an hf: checkpoint is checked
        against), placed by default: a LoRA run's frozen base in host memory with the adapters' state on device
        is a placement only a LoRA run may take."""
        if not self.lora.enabled:
            return self
        return dataclasses.replace(self, lora=LoraConfig(), offload=OffloadConfig(activations=self.offload.activations),
                                   optimizer=dataclasses.replace(self.optimizer, update_on_host=False))

    def lora_spec(self):
        """The LoRA adapters' layers/lora.py LoraSpec, or None without LoRA (lora.rank 0)."""
        if not self.lora.enabled:
            return None
        from spillway.recipes.lora_targets import lora_spec
        return lora_spec(self.lora, self.model, self.execution.param_dtype)

    @property
    def family(self) -> str:
        """The model family (models/registry.py): the one whose config class the model is."""
        return family_of_config(self.model).name

    @property
    def run_dir(self) -> str:
        # `~` expanded here, once for every reader: `--set checkpoint.dir=~/ft` is not expanded by the shell
        # (the word starts with "checkpoint"), and the run made a folder named "~" in the working directory
        return os.path.expanduser(self.checkpoint.dir or f"runs/{self.name}")

    def decoder_spec(self):
        """The model's shapes (models/decoder.py DecoderSpec) with this recipe's execution settings."""
        return family_of_config(self.model).spec(self.model, self.execution)

    def num_params(self) -> int:
        """The model's parameters (a LoRA recipe's adapters, trained beside them, are not counted): the family's
        count from its shapes, or for a recipe's own block the parameters the model it builds holds."""
        if self.block is None:
            return self.decoder_spec().num_params()
        without_adapters = dataclasses.replace(self, lora=LoraConfig())
        return _built_param_count(without_adapters.to_json())

    def block_class(self) -> type:
        """The TransformerBlock subclass `block` names (the family's own block when None)."""
        return get_family(self.family).block_cls if self.block is None else resolve_block_class(self.block)

    def build_model(self, rngs):
        """The model with the recipe's activation plan and LoRA adapters (call under nnx.eval_shape for
        shapes only)."""
        from spillway.layers.lora import adapters_while_building
        with adapters_while_building(self.lora_spec()):
            return family_of_config(self.model).build(self.model, self.execution, rngs=rngs,
                                                      remat=self.offload.activations, block_cls=self.block_class())

    def step_summary(self) -> str:
        """What the fields make of a step and a run, worked out here rather than restated in prose:
        "4,194,304 tokens/step (512 x 8192, 128 micro-batches of 4); 2,145,767 steps, 9.00T tokens"
        (with a GPU target also the micro-batch per GPU and where the recipe was planned for)."""
        t, seq = self.train, self.data.seq_len
        micro = t.global_batch // t.grad_accum
        per_gpu = self.offload.target_devices if self.offload.target_gpu else 1
        micro_words = (f"{micro:,}" if per_gpu == 1 or micro % per_gpu else
                       f"{micro // per_gpu:,} sequence{'s' if micro // per_gpu > 1 else ''} per GPU")
        tokens = t.steps * t.global_batch * seq
        words = (f"{t.global_batch * seq:,} tokens/step ({t.global_batch:,} x {seq:,}, {t.grad_accum:,} "
                 f"micro-batch{'es' if t.grad_accum > 1 else ''} of {micro_words}); {t.steps:,} steps, "
                 + (f"{tokens / 1e12:.2f}T" if tokens >= 1e12 else f"{tokens / 1e9:.2f}B" if tokens >= 1e9
                    else f"{tokens:,}") + " tokens")
        if self.offload.target_gpu:
            words += f"; planned for {self.offload.target_devices} x {get_target(self.offload.target_gpu).display_name}"
        return words

    @property
    def schedule_steps(self) -> int:
        """The learning-rate schedule's length: train.steps, at least one step past the warmup.

        A short run (a smoke test of a recipe with a long warmup) still gets a
        valid schedule; it simply ends inside the warmup.
        """
        return max(self.train.steps, self.optimizer.warmup_steps + 1)

    # --- serialisation --------------------------------------------------------
    def to_dict(self) -> dict:
        """The fields, and `family` (derived, but what tells a reader which config class `model` is)."""
        return {"family": self.family, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        return _from_dict(cls, upgrade_legacy_recipe_dict(d), "")


_EXECUTION_FIELDS = ("dtype", "param_dtype", "attention_impl", "flash_block_size", "init_std")


@functools.lru_cache(maxsize=8)
def _built_param_count(recipe_json: str) -> int:
    """The parameters of the model a recipe (as JSON) builds, counted from its shapes (nnx.eval_shape: nothing
    allocated): what a recipe's own block holds, which the family's count from its shapes does not know."""
    import math

    import jax
    from flax import nnx

    recipe = Recipe.from_dict(json.loads(recipe_json))
    model = nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(0)))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def upgrade_legacy_recipe_dict(d: dict) -> dict:
    """A recipe.json written by an earlier version -> today's fields, with the same meaning.

    * Before families existed the model was a Llama whose config held dtypes and
      the activation plan: the family is Llama, the execution fields move to
      `execution`, and the plan (always overwritten by `offload.activations`) goes.
    * `optimizer.total_steps` and `optimizer.state_memory` were overwritten by
      train.steps and offload.optimizer_state before use (DERIVED_FIELDS): they
      are dropped, which changes nothing the run did.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"a recipe must be a JSON object, got {type(d).__name__}")
    d = dict(d)
    if isinstance(d.get("optimizer"), dict):
        d["optimizer"] = {k: v for k, v in d["optimizer"].items() if f"optimizer.{k}" not in DERIVED_FIELDS}
    if "family" in d or not isinstance(d.get("model"), dict):
        return d
    if not any(k in d["model"] for k in (*_EXECUTION_FIELDS, "remat")):
        # no family and none of the old format's fields: a family deleted by hand, not an old file (a Qwen3
        # recipe was read as Llama without its q/k norms)
        raise ConfigError(f"the recipe has no \"family\" (one of {', '.join(sorted(family_names()))}): add the "
                          f"family its model section is written for")
    model = dict(d["model"])
    execution = {k: model.pop(k) for k in _EXECUTION_FIELDS if k in model}
    model.pop("remat", None)
    model.pop("sliding_window", None) if model.get("sliding_window") is None else None
    d.update(family="llama", model=model, execution={**execution, **d.get("execution", {})})
    return d


def _model_config_class(tree: dict):
    family = tree.get("family")
    if not isinstance(family, str):
        raise ConfigError(f"family must be a model family name, got {family!r}")
    return get_family(family).config_cls


def _check_written_for_the_family(model: dict, config_class) -> None:
    """ConfigError for a model section that has none of its family's own fields (those Llama's config lacks):
    written for another family, under a "family" changed or mistyped ("mixtral" for "mistral"), it would build
    that family's model with its defaults (a Llama section became an 8-expert MoE model)."""
    base = {f.name for f in dataclasses.fields(get_family("llama").config_cls)}
    own = sorted({f.name for f in dataclasses.fields(config_class)} - base)
    if own and not set(own) & set(model):
        family = next(name for name in family_names() if get_family(name).config_cls is config_class)
        raise ConfigError(f"the model section has none of the {family} family's own fields ({', '.join(own)}): it "
                          f"is written for another family; correct \"family\", or add those fields")


def _from_dict(cls, d: dict, where: str):
    if cls is Recipe:
        # `family` names the class of the `model` mapping (Recipe.to_dict); the recipe derives it from that.
        config_class = _model_config_class(d) if isinstance(d.get("model"), dict) else None
        d = {k: v for k, v in d.items() if k != "family"}
        if config_class is not None:
            _check_written_for_the_family(d["model"], config_class)
            d["model"] = _from_dict(config_class, d["model"], "model.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        hint = "; ".join(DERIVED_FIELDS[f"{where}{k}"] for k in sorted(unknown) if f"{where}{k}" in DERIVED_FIELDS)
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in {where.rstrip('.') or cls.__name__}"
                          + (f" ({hint})" if hint else ""))
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = required - set(d)
    if missing:
        raise ConfigError(f"missing field(s) {sorted(missing)} in {where.rstrip('.') or cls.__name__}")
    kwargs = {}
    for key, value in d.items():
        kwargs[key] = _coerce(hints[key], value, f"{where}{key}")
    return cls(**kwargs)


def _coerce(annotation, value, where: str):
    """Convert a JSON value (or a --set string) to the annotated type, or explain why not."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in options:
                return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, where)
            except (ValueError, TypeError) as err:
                errors.append(str(err))
        raise ConfigError(f"{where}: {value!r} fits none of {annotation}: {'; '.join(errors)}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if isinstance(value, dict):
            return _from_dict(annotation, value, where + ".")
        raise ConfigError(f"{where}: expected a mapping for {annotation.__name__}, got {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value   # exact: through a float, 99999999999999999999999 became 99999999999999991611392
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if abs(as_float) >= 2**53:   # 1e30 is a float whose integer value is not what was written
            raise ConfigError(f"{where}: expected an integer, got {value!r} (too large to be exact as written)")
        return int(as_float)
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if annotation is Any:
        return value
    if origin is tuple and len(typing.get_args(annotation)) == 2 and typing.get_args(annotation)[1] is Ellipsis:
        # A JSON list, or on the command line "1,3" / "[1, 3]" / "" (Qwen3-MoE's mlp_only_layers).
        items = [value] if isinstance(value, int) and not isinstance(value, bool) else value   # "--set x=3"
        if isinstance(value, str):
            items = [part for part in value.strip().strip("[]()").split(",") if part.strip()]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(typing.get_args(annotation)[0], item, f"{where}[{i}]") for i, item in enumerate(items))
    if annotation is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `--set data.source=2024` means the string
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported field type {annotation}")


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply ["a.b=value", ...]; unknown fields and bad values raise ValueError naming them.

    All overrides are applied before the recipe is validated, so changing
    several coupled fields at once (d_model and num_heads, say) works.
    """
    if not overrides:
        return recipe
    tree = recipe.to_dict()
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        path = path.strip()
        if path in DERIVED_FIELDS:
            raise ConfigError(f"--set {item}: {path} cannot be set: {DERIVED_FIELDS[path]}")
        _set_path(tree, Recipe, path.split("."), raw.strip(), path)
    try:
        recipe = Recipe.from_dict(tree)
    except (ValueError, TypeError) as err:
        # Name the settings the message is about (the validation names its fields), not every --set given.
        named = ([item for item in overrides if item.partition("=")[0].strip() in str(err)]
                 or [item for item in overrides   # "MistralConfig.sliding_window must be positive": by field
                     if re.search(rf"\b{re.escape(item.partition('=')[0].strip().rsplit('.', 1)[-1])}\b", str(err))])
        raise ConfigError(f"--set {' '.join(named or overrides)}: {err}") from None
    _refuse_lora_settings_without_a_rank(recipe, overrides)
    return recipe


def _refuse_lora_settings_without_a_rank(recipe: Recipe, overrides: list[str]) -> None:
    """`--set lora.targets=...` (alpha, dropout) on a recipe whose lora.rank is 0 trained every weight, the LoRA
    settings unused, without a word: the rank was forgotten. `--set lora.rank=0` beside them turns LoRA off."""
    paths = [item.partition("=")[0].strip() for item in overrides]
    unused = [item for item, path in zip(overrides, paths) if path.startswith("lora.") and path != "lora.rank"]
    if unused and not recipe.lora.enabled and "lora.rank" not in paths:
        raise ConfigError(f"--set {' '.join(unused)}: lora.rank is 0, so LoRA is off and this run would train every "
                          f"weight, the setting unused: set the adapters' rank too (--set lora.rank=16, say)")


def _set_path(tree: dict, cls, keys: list[str], raw: str, full: str) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    key = keys[0]
    if cls is Recipe and key == "family" and len(keys) == 1:
        raise ConfigError("family cannot be changed with --set (the model config is the family's): "
                         "pick a recipe of that family (`spillway recipes` lists them)")
    if key not in fields:
        close = difflib.get_close_matches(key, sorted(fields), n=1)
        guess = f"did you mean {'.'.join(full.split('.')[:-len(keys)] + close)!r}? " if close else ""
        sections = _sections_holding(key) if cls is Recipe and len(keys) == 1 else []
        if sections:   # `--set val_fraction=0`, as a message that says the field's name alone suggests it
            guess = f"did you mean {' or '.join(repr(f'{s}.{key}') for s in sections)}? "
        raise ConfigError(f"unknown field {full!r}: {cls.__name__} has no field {key!r} ({guess}fields: "
                          f"{sorted(fields)})")
    annotation = typing.get_type_hints(cls)[key]
    if cls is Recipe and key == "model":
        annotation = _model_config_class(tree)   # the family decides what `model.*` holds
    nested = [a for a in (typing.get_args(annotation) or (annotation,)) if dataclasses.is_dataclass(a)]
    if len(keys) == 1:
        if nested and not (raw.lower() in ("none", "null") and type(None) in typing.get_args(annotation)):
            names = sorted(f.name for f in dataclasses.fields(nested[0]))
            raise ConfigError(f"{full!r} is a group of fields; set one of them, e.g. {full}.{names[0]}=... "
                              f"(its fields: {', '.join(names)})")
        tree[key] = _coerce(annotation, _parse_scalar(raw), full)
        return
    if not nested:
        raise ConfigError(f"unknown field {full!r}: {key!r} is not a group of fields")
    if tree.get(key) is None:
        tree[key] = dataclasses.asdict(nested[0]())  # e.g. model.rope_scaling.factor on a model without scaling
    _set_path(tree[key], nested[0], keys[1:], raw, full)


def _sections_holding(key: str) -> list[str]:
    """The recipe sections with a field `key` (`data` for val_fraction): a bare field name meant one of them."""
    hints = typing.get_type_hints(Recipe)
    return [field.name for field in dataclasses.fields(Recipe) if dataclasses.is_dataclass(hints[field.name])
            and key in {f.name for f in dataclasses.fields(hints[field.name])}]


def _parse_scalar(raw: str) -> Any:
    # JSON literals for numbers/bools/null; anything else stays a string.
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


__all__ = ["Recipe", "AuxLossConfig", "DataConfig", "OffloadConfig", "MeshConfig", "CheckpointConfig", "TrainConfig",
           "OptimizerConfig", "Execution", "RopeScaling", "apply_overrides", "resolve_block_class"]
