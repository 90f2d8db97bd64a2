"""The generic Hugging Face engine: safetensors in and out, tensor layouts, sharded placement.

    model = from_hf("/ckpt/Qwen2.5-0.5B")                   # config.json + *.safetensors; model_type picks the family
    model = from_hf(state_dict, config=hf_config_dict)       # in memory: {name: array}
    to_hf(model, "/out")                                     # config.json + model.safetensors transformers loads

Each family's file holds its own `HFTable`: which `model_type`s it reads, how
its config maps to and from config.json (a field it cannot honour is an
error, never dropped), and one `HFWeight` per tensor: Hugging Face name (with
`{i}` for the layer index of a per-layer tensor), spillway parameter path, and
layout. This module knows no family.

Layouts. A `Layout(split, transpose)` says how one spillway array is stored:
group its axes into (shape[:split], shape[split:]), flatten each group, then
transpose if `transpose`. So a Hugging Face `nn.Linear` weight [out, in] read
into spillway's [d, heads, head_dim] is `Layout(1, True)`, GPT-2's `Conv1D`
weight [in, out] is `Layout(1, False)`, a q bias [heads*head_dim] into
[heads, head_dim] is `Layout(0, False)`. A fused tensor (GPT-2's c_attn holds
q, k and v side by side) is several `HFWeight`s with a `part` (axis, index,
count): each reads its slice, and export concatenates them again.

Per-expert tensors (`{j}` in the name beside `{i}`: a mixture-of-experts layer's
experts stored one tensor each, as Mixtral's and Qwen3-MoE's checkpoints do) fill
the expert axis that follows the layer axis ([L, E, ...], layers/moe.py). A
table may also read another layout of the same weights (`HFTable.views`: each
checkpoint name as a slice of a fused tensor, transformers 5's in-memory
`experts.gate_up_proj`), so one table serves both.

Where tensors are read from (safetensors files, an in-memory state dict, a
base-model or tower checkpoint, another layout) is models/hf_sources.py.

Per-layer tensors are stacked along the leading layer axis (layers/stack.py),
filled one layer at a time from the memory-mapped files, so host memory peaks
near one stacked parameter, not a second copy of the checkpoint. With a mesh,
each parameter goes straight into its shards. Reading uses `safetensors` with
numpy, so torch is not needed; importing jax brings `ml_dtypes`, which teaches
numpy the bfloat16 dtype that safetensors needs for bf16 checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 — registers bfloat16 with numpy (see the module docstring)
import numpy as np
from flax import nnx

from spillway.layers.execution import Execution
from spillway.layers.sharding import state_shardings
from spillway.models.hf_sources import (SAFETENSORS_INDEX_FILE, HFCheckpointError, NoOutputHeadError,  # noqa: F401 — re-exported
                                       in_table_layout, indexed_shards, listed, open_source, with_base_prefix)

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
STACK_PATH = ("layers", "blocks")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a spillway array is stored in the checkpoint (see the module docstring)."""

    split: int
    transpose: bool = False

    def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        groups = tuple(math.prod(g) for g in (shape[:self.split], shape[self.split:]) if len(g))
        return groups[::-1] if self.transpose else groups

    def to_spillway(self, hf_array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        return (hf_array.T if self.transpose else hf_array).reshape(shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        groups = tuple(math.prod(g) for g in (array.shape[:self.split], array.shape[self.split:]) if len(g))
        flat = array.reshape(groups)
        return np.ascontiguousarray(flat.T) if self.transpose else flat


COPY = Layout(split=1)                  # same array (an embedding table, [vocab, d])
VECTOR = Layout(split=0)                # a norm scale or bias, flattened
LINEAR = Layout(split=1, transpose=True)         # nn.Linear [out, in] <-> [in, out]
IN_HEADS = Layout(split=1, transpose=True)       # nn.Linear [heads*hd, d] <-> [d, heads, hd]
OUT_HEADS = Layout(split=2, transpose=True)      # nn.Linear [d, heads*hd] <-> [heads, hd, d]


@dataclasses.dataclass(frozen=True)
class HFWeight:
    hf_name: str                        # "{i}" stands for the layer index of a per-layer tensor
    path: tuple[str, ...]               # spillway parameter path (inside the stacked blocks for per-layer ones)
    layout: Layout
    part: tuple[int, int, int] | None = None   # (axis, index, count) of a fused Hugging Face tensor
    # The model layers a per-layer tensor exists in; None: every layer whose run has the parameter. A family
    # whose dense and MoE layers share parameter names (mlp.w_up) says which is which.
    layers: frozenset[int] | None = None

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def per_expert(self) -> bool:
        """One tensor per expert (`{j}`): the parameter's axis after the layer axis is the expert axis."""
        return "{j}" in self.hf_name


@dataclasses.dataclass(frozen=True)
class HFTable:
    """A family's Hugging Face mapping (defined in the family's own file)."""

    model_types: tuple[str, ...]                         # config.json model_types read; export writes the first
    architecture: str                                    # config.json "architectures" that export writes
    config_from_hf: Callable[[Mapping[str, Any]], Any]    # config.json dict -> family config (or an error)
    fields_to_hf: Callable[[Any], dict]                  # family config -> config.json's other keys
    weights: Callable[[Any], list[HFWeight]]             # family config -> every tensor
    embed_name: str = "model.embed_tokens.weight"
    head_name: str = "lm_head.weight"
    # PEFT's default target_modules for the model type, taken for `lora.targets` left at its default
    # (q_proj, v_proj) on a model without those projections (GPT-2: c_attn). None: q_proj, v_proj.
    lora_default_targets: tuple[str, ...] | None = None
    # Buffers some checkpoints carry that are recomputed, never learned (RoPE frequencies, causal masks).
    ignored_suffixes: tuple[str, ...] = (".rotary_emb.inv_freq",)
    # transformers' `base_model_prefix` when the table's names carry it: a checkpoint saved from the
    # base model (GPT-2's published files) lacks it on every name and is read as if it had it.
    base_prefix: str = ""
    # A tower of a larger checkpoint (Gemma 3's text tower inside its multimodal model): (checkpoint prefix,
    # table prefix) pairs. A checkpoint with any name under a non-identical checkpoint prefix is read
    # through them, and its tensors under none of them (the vision tower) are left unread.
    tower_prefixes: tuple[tuple[str, str], ...] = ()
    # Another layout of the same weights: config -> {checkpoint name: (name in that layout, index)}, each
    # checkpoint tensor a slice of one there (transformers 5's fused experts). Read when the checkpoint holds
    # any of those names; never written.
    views: Callable[[Any], dict[str, tuple[str, tuple]]] | None = None

    def config_to_hf(self, config) -> dict:
        """config.json of `config`: its architecture and model_type, named here once, then the family's keys."""
        return {"architectures": [self.architecture], "model_type": self.model_types[0], **self.fields_to_hf(config)}


# --- config --------------------------------------------------------------------

def is_hf_checkpoint_folder(path: str | os.PathLike) -> bool:
    """Whether a folder holds a Hugging Face checkpoint: a config.json and *.safetensors."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


PEFT_ADAPTER_CONFIG = "adapter_config.json"
PEFT_ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_adapter_base(directory) -> str | None:
    """The base model a folder's PEFT adapter (adapter_config.json) names ("its base model" where it names
    none), or None where the folder holds no adapter."""
    config_file = Path(directory) / PEFT_ADAPTER_CONFIG
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text()).get("base_model_name_or_path") or "its base model"
    except (json.JSONDecodeError, AttributeError, OSError):
        return "its base model"


def read_hf_config(source) -> dict:
    """config.json of a checkpoint directory (or of the directory holding a .safetensors file)."""
    directory = Path(source)
    if not directory.exists():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {directory}: the path does not exist")
    directory = directory.parent if directory.is_file() else directory
    config_file = directory / CONFIG_FILE
    # an adapter's folder with its base's config.json copied beside it (as some trainers leave it) has no model
    # weights either: its tensors were read as the model's, a list of every tensor missing
    adapter_only = {p.name for p in directory.glob("*.safetensors")} <= {PEFT_ADAPTER_WEIGHTS}
    if (not config_file.exists() or adapter_only) and (base := peft_adapter_base(directory)):
        raise HFCheckpointError(f"{directory} is a PEFT adapter ({PEFT_ADAPTER_CONFIG}), not a model: it adapts "
                                f"{base}. Name that base model's folder, or merge the adapter into it first "
                                f"(peft: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()"
                                f".save_pretrained(OUT)) and name OUT")
    if not config_file.exists():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}: a Hugging Face checkpoint folder holds the "
                                f"{CONFIG_FILE} its model was saved with beside its *.safetensors; copy it there "
                                f"(from the checkpoint's Hub repository)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{config_file} is not valid JSON: {err}") from None


def family_config_from_hf(hf_config: Mapping[str, Any]):
    """(family, family config) for a Hugging Face config dict, dispatched on its model_type."""
    from spillway.models.registry import family_of_hf_model_type

    hf_config = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config)
    model_type = hf_config.get("model_type")
    if not model_type:
        raise HFCheckpointError("the Hugging Face config has no model_type; cannot tell which family it is")
    family = family_of_hf_model_type(model_type)
    # a GPTQ, AWQ, bitsandbytes or FP8 save: packed integers and scales under other names (a list of every
    # projection missing, "fix its config.json"), or transformers quantizing on load what the file holds
    quantized = hf_config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, Mapping) else quantized
        raise HFCheckpointError(f"the Hugging Face checkpoint is quantized (quantization_config, quant_method "
                                f"{method!r}): spillway reads unquantized weights (float32, bfloat16 or float16); "
                                f"take the model's unquantized checkpoint")
    return family, family.hf.config_from_hf(hf_config)


def _resolve(source, config) -> tuple[Any, Any]:
    from spillway.models.registry import family_of_config

    if config is None:
        if isinstance(source, Mapping):
            raise HFCheckpointError("an in-memory state dict needs config= (a Hugging Face config dict or a "
                                    "spillway family config)")
        try:
            config = read_hf_config(source)
        except FileNotFoundError as error:   # in Python, the config may also be given
            raise FileNotFoundError(f"{error}, or pass config= (a Hugging Face config dict or a spillway family "
                                    f"config)") from None
    # a transformers config object is read as its dict (family_config_from_hf): transformers 5's config classes
    # are dataclasses too, with a to_dict that a spillway family config has not
    if (dataclasses.is_dataclass(config) and not isinstance(config, type)
            and not callable(getattr(config, "to_dict", None))):
        return family_of_config(config), config
    return family_config_from_hf(config)


# --- weights -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Entry:
    weight: HFWeight
    path: tuple[str, ...]            # full spillway path
    hf_names: tuple[str, ...]        # one per layer (of its run) for per-layer weights (per layer and expert,
                                     # layer-major, for per-expert ones), else one
    shape: tuple[int, ...]           # spillway shape of one layer's worth (one expert's, for per-expert ones)
    first_layer: int = 0             # the model layer of hf_names[0]
    experts: int = 0                 # per-expert weights: the expert count (names per layer); else 0

    def layer_of(self, k: int) -> int:
        """The model layer of hf_names[k]."""
        return self.first_layer + (k // self.experts if self.experts else k)

    def hf_shape(self) -> tuple[int, ...]:
        shape = list(self.weight.layout.hf_shape(self.shape))
        if self.weight.part is not None:
            axis, _, count = self.weight.part
            shape[axis] *= count
        return tuple(shape)


def stack_runs(param_shapes: dict[tuple, tuple[int, ...]]) -> list[tuple[tuple, int]]:
    """(path of the stacked blocks, first layer) of each run of layers, first layers first.

    One run keeps its blocks at STACK_PATH; several (layers/stack.py) at
    ("layers", "runs", k), whose layer counts are their leading dimensions.
    """
    if any(p[:len(STACK_PATH)] == STACK_PATH for p in param_shapes):
        return [(STACK_PATH, 0)]
    runs = sorted({p[2] for p in param_shapes if p[:2] == ("layers", "runs") and len(p) > 2})
    out, first = [], 0
    for k in runs:
        prefix = ("layers", "runs", k)
        out.append((prefix, first))
        first += next(shape[0] for p, shape in param_shapes.items() if p[:3] == prefix)
    return out


def _entries(family, config, param_shapes: dict[tuple, tuple[int, ...]]) -> list[_Entry]:
    out = []
    runs = stack_runs(param_shapes)
    for w in family.hf.weights(config):
        if w.per_layer:
            found = False
            for prefix, first in runs:   # a per-layer tensor of every run whose blocks have the parameter
                path = prefix + w.path
                if path in param_shapes and w.layers is not None:
                    held = [first + i in w.layers for i in range(param_shapes[path][0])]
                    if any(held) and not all(held):
                        raise AssertionError(f"{family.name} HF table: {w.hf_name} exists in layers "
                                             f"{sorted(w.layers)}, which cover part of the run from layer {first}")
                    if not any(held):
                        continue
                if path in param_shapes and w.per_expert:
                    found = True
                    layers, experts = param_shapes[path][:2]
                    names = tuple(w.hf_name.format(i=first + i, j=j) for i in range(layers) for j in range(experts))
                    out.append(_Entry(w, path, names, param_shapes[path][2:], first, experts))
                elif path in param_shapes:
                    found = True
                    names = tuple(w.hf_name.format(i=first + i) for i in range(param_shapes[path][0]))
                    out.append(_Entry(w, path, names, param_shapes[path][1:], first))
            if not found:
                raise AssertionError(f"{family.name} HF table names {STACK_PATH + w.path}, which the model "
                                     f"does not have")
        else:
            if w.path not in param_shapes:
                raise AssertionError(f"{family.name} HF table names {w.path}, which the model does not have")
            out.append(_Entry(w, w.path, (w.hf_name,), param_shapes[w.path]))
    unmapped = set(param_shapes) - {e.path for e in out}
    if unmapped:  # a user's block with parameters of its own: fail rather than drop or invent values
        shown = ", ".join("/".join(str(part) for part in path) for path in sorted(unmapped)[:3])
        raise HFCheckpointError(f"the model has {len(unmapped)} parameter(s) that the {family.name} Hugging Face "
                                f"layout has no name for ({shown}{', ...' if len(unmapped) > 3 else ''}): a block "
                                f"of its own (not the family's) has no Hugging Face form")
    return out


def _check_names_and_shapes(source, entries: list[_Entry], family, config, *, contents: bool = True) -> None:
    """One error listing every missing, unexpected and misshapen tensor; `contents`: also that a tied head
    saved under its own name is the embedding (reads both tensors; without it, only names and shapes)."""
    table = family.hf
    expected = {name: e.hf_shape() for e in entries for name in e.hf_names}
    present = set(source.names())
    tied = not any(e.hf_names == (table.head_name,) for e in entries)
    missing = [n for n in expected if n not in present]
    unexpected = sorted(n for n in present - set(expected) if not n.endswith(table.ignored_suffixes)
                        and not (tied and n == table.head_name))
    mismatched = [f"{n}: checkpoint {source.shape(n)}, config expects {shape}"
                  for n, shape in expected.items() if n in present and source.shape(n) != shape]
    if missing == [table.head_name] and not mismatched:
        # A base model's save (LlamaModel) or another task's (a classifier's score.weight): transformers loads it
        # as a causal LM with a head of random numbers; "missing tensors" read as a damaged download.
        raise NoOutputHeadError(f"the Hugging Face checkpoint has no output head ({table.head_name}) and its "
                                f"config.json says tie_word_embeddings=false: it was saved from a model without "
                                f"one (a base model, or a classifier{': ' + ', '.join(unexpected[:3]) if unexpected else ''}"
                                f"); spillway reads a causal LM's checkpoint ({table.architecture}), or a base "
                                f"model's whose head is its tied embedding")
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing[:12]}{' ...' if len(missing) > 12 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected[:12]}"
                        f"{' ...' if len(unexpected) > 12 else ''}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): " + "; ".join(mismatched[:12]))
    if problems:
        raise HFCheckpointError(f"the Hugging Face checkpoint does not match the {family.name} config "
                                f"({config.num_layers} layers, vocab {config.vocab_size}):\n  " + "\n  ".join(problems))
    if contents and tied and table.head_name in present:
        # transformers' state_dict() lists a tied head under its own name; accept it only if it is the embedding.
        head, embed = table.head_name, table.embed_name
        if source.shape(head) != source.shape(embed) or not np.array_equal(source.get(head), source.get(embed)):
            raise HFCheckpointError(f"tie_word_embeddings is True but {head} differs from {embed}: the checkpoint "
                                    f"has a separate output head (its config.json should say tie_word_embeddings=false)")


def _read_one(source, entry: _Entry, name: str) -> np.ndarray:
    try:
        array = source.get(name)
    except Exception as err:   # safetensors raises its own error for a file cut short after its header
        where = getattr(source, "file_of", lambda _: None)(name) or "the checkpoint"
        raise HFCheckpointError(f"{where}: tensor {name!r} cannot be read ({type(err).__name__}: {err}); the "
                                f"file may be truncated: fetch it again") from None
    if np.issubdtype(np.asarray(array).dtype, np.floating) and not np.all(np.isfinite(array)):
        # training from these weights would diverge at once, and the NaN stop would blame the learning rate
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise HFCheckpointError(f"the Hugging Face checkpoint's tensor {name!r} holds {bad} NaN or infinite "
                                f"values (of {np.size(array)}): the checkpoint is damaged; fetch it again")
    if entry.weight.part is not None:
        axis, index, count = entry.weight.part
        array = np.split(array, count, axis=axis)[index]
    return entry.weight.layout.to_spillway(array, entry.shape)


def _load_param(source, entry: _Entry, dtype) -> np.ndarray:
    if len(entry.hf_names) == 1 and not entry.weight.per_layer:
        return np.asarray(_read_one(source, entry, entry.hf_names[0]), dtype)
    stacked = np.empty((len(entry.hf_names),) + entry.shape, dtype)
    for k, name in enumerate(entry.hf_names):   # a layer's (or a layer's expert's) tensor at a time
        stacked[k] = _read_one(source, entry, name)
    if entry.experts:
        return stacked.reshape((-1, entry.experts) + entry.shape)
    return stacked


def check_checkpoint_tensors(source, family, config, abstract_params: nnx.State) -> None:
    """HFCheckpointError naming every missing, unexpected or misshapen tensor, from names and shapes alone
    (the safetensors headers: no tensor is read), so a wrong checkpoint fails before anything costly runs;
    `load_hf_weights` checks the same again, and the contents of a tied head."""
    flat = dict(nnx.to_flat_state(abstract_params))
    entries = _entries(family, config, {path: tuple(v.get_value().shape) for path, v in flat.items()})
    with open_source(source) as tensors:
        tensors = in_table_layout(with_base_prefix(tensors, family.hf), family.hf, config)
        _check_names_and_shapes(tensors, entries, family, config, contents=False)


def load_hf_weights(source, family, config, abstract_params: nnx.State, shardings=None) -> nnx.State:
    """The parameters of `abstract_params` (an nnx.State of ShapeDtypeStructs) filled from a checkpoint.

    `shardings`: a matching tree of shardings; each parameter is put straight
    into them (device or host memory, whatever they say). Values are cast to
    the abstract parameters' dtypes.
    """
    flat = dict(nnx.to_flat_state(abstract_params))
    entries = _entries(family, config, {path: tuple(v.get_value().shape) for path, v in flat.items()})
    flat_shardings = None if shardings is None else dict(nnx.to_flat_state(shardings))
    loaded = []
    with open_source(source) as tensors:
        tensors = in_table_layout(with_base_prefix(tensors, family.hf), family.hf, config)
        _check_names_and_shapes(tensors, entries, family, config)
        for e in entries:
            dtype = np.dtype(flat[e.path].get_value().dtype)
            host = _load_param(tensors, e, dtype)
            placement = None if flat_shardings is None else flat_shardings[e.path].get_value()
            loaded.append((e.path, flat[e.path].replace(jax.device_put(host, placement))))
            del host  # one stacked parameter on the host at a time
    return nnx.from_flat_state(loaded)


# --- public API ----------------------------------------------------------------

def from_hf(source: str | os.PathLike | Mapping[str, Any], *, config: Any = None, dtype: str | None = None,
            param_dtype: str | None = None, execution: Execution | None = None, mesh=None,
            remat: Any = "recompute_all", **overrides):
    """A spillway model holding a Hugging Face checkpoint's weights.

    source: a checkpoint directory (config.json and model.safetensors, or
        shards with model.safetensors.index.json), a .safetensors file, or an
        in-memory {name: array} state dict (`{k: v.numpy() for k, v in
        torch_model.state_dict().items()}`).
    config: a Hugging Face config dict (or transformers config object), or a
        spillway family config used as is; read from config.json when omitted.
        Its `model_type` picks the family.
    dtype, param_dtype / execution: how the model runs (default float32
        compute and parameters); weights are cast to param_dtype.
    overrides: family config fields to replace (e.g. max_seq_len=4096).
    mesh: put each parameter straight into its shards (layers/sharding.py rules).

    Unknown model_type, a config field the family cannot honour, and every
    missing, unexpected or misshapen tensor are HFCheckpointError naming them.
    """
    family, cfg = _resolve(source, config)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    execution = execution or Execution()
    execution = dataclasses.replace(execution, **{k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype))
                                                  if v is not None})
    abstract = family.abstract(cfg, execution, remat=remat)
    graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
    shardings = None if mesh is None else state_shardings(abstract_params, mesh)
    params = load_hf_weights(source, family, cfg, abstract_params, shardings)
    return nnx.merge(graphdef, params, rest)


def export_hf_state_dict(model, dtype: Any = None) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and layouts (the inverse of `from_hf`).

    Tied models omit the head, as transformers' safetensors files do. `dtype`
    casts every tensor (default: the parameter dtype).
    """
    from spillway.models.registry import family_of_config

    family = family_of_config(model.config)
    if family.hf is None:
        raise HFCheckpointError(f"the {family.name} family has no Hugging Face mapping")
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    entries = _entries(family, model.config, {p: tuple(v.get_value().shape) for p, v in flat.items()})
    parts: dict[str, dict[int, np.ndarray]] = {}
    for e in entries:
        array = np.asarray(jax.device_get(flat[e.path].get_value()))
        if dtype is not None:
            array = array.astype(np.dtype(jnp.dtype(dtype)))
        layers = array.reshape((-1,) + e.shape) if e.weight.per_layer else [array]
        for name, one in zip(e.hf_names, layers, strict=True):
            index = 0 if e.weight.part is None else e.weight.part[1]
            parts.setdefault(name, {})[index] = e.weight.layout.to_hf(one)
    # transformers' order: the table's entries before its first per-layer one, then layer by
    # layer, then the rest (embedding, layers, final norm, head): easier to read and diff.
    first_layer = next((k for k, e in enumerate(entries) if e.weight.per_layer), len(entries))
    per_layer = [(e.layer_of(i), k, i, name) for k, e in enumerate(entries) if e.weight.per_layer
                 for i, name in enumerate(e.hf_names)]
    order = [n for e in entries[:first_layer] for n in e.hf_names]
    order += [name for *_, name in sorted(per_layer)]
    order += [n for e in entries[first_layer:] if not e.weight.per_layer for n in e.hf_names]
    order = list(dict.fromkeys(order))   # a fused tensor appears once
    axis_of = {n: e.weight.part[0] for e in entries if e.weight.part is not None for n in e.hf_names}
    out = {}
    for name in order:
        pieces = parts[name]
        out[name] = pieces[0] if name not in axis_of else np.concatenate(
            [pieces[i] for i in sorted(pieces)], axis=axis_of[name])
    return out


def to_hf(model, directory: str | os.PathLike, dtype: Any = None, *, config_name: str = CONFIG_FILE) -> Path:
    """Write config.json and model.safetensors that `transformers` (and `from_hf`) can load.

    A folder may already hold an earlier export (its model.safetensors is replaced), but not another
    checkpoint (a safetensors index and its shards, or other .safetensors files): readers would take one or
    the other, so that is an HFCheckpointError naming them. The weights are written first and config.json
    last, each whole: a write stopped midway leaves no folder that loads. `config_name`: write the config
    under another name (an export adds its ids to it before it becomes config.json).
    """
    from spillway.models.registry import family_of_config

    family = family_of_config(model.config)
    _check_the_familys_own_blocks(model, family)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    others = sorted(p for p in directory.glob("*.safetensors") if p.name != SAFETENSORS_FILE)
    if (directory / SAFETENSORS_INDEX_FILE).exists():
        others = [directory / SAFETENSORS_INDEX_FILE] + others
    if others:
        raise HFCheckpointError(f"{directory} already holds another checkpoint ({listed(others)}): export into "
                                f"an empty folder, or delete those files first")
    tensors = export_hf_state_dict(model, dtype=dtype)
    hf_config = family.hf.config_to_hf(model.config)
    # transformers 4.56 on reads "dtype" (and writes only it); earlier versions read "torch_dtype"
    hf_config["dtype"] = hf_config["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    save_safetensors(tensors, directory / SAFETENSORS_FILE)
    config = directory / (config_name + ".partial")
    config.write_text(json.dumps(hf_config, indent=2) + "\n")
    config.replace(directory / config_name)
    return directory


def config_refusal(model_config) -> str | None:
    """Why no config.json holds a model of `model_config` (its family's config_to_hf refuses it: a Gemma 3
    with a cap, a non-integer query_pre_attn_scalar), or None. A family with no Hugging Face table: None, as
    to_hf names that itself. Asked before the weights are written, and where a run starts."""
    from spillway.models.registry import family_of_config

    family = family_of_config(model_config)
    if family.hf is None:
        return None
    try:
        family.hf.config_to_hf(model_config)
    except HFCheckpointError as refusal:
        return str(refusal)
    return None


def _check_the_familys_own_blocks(model, family) -> None:
    """HFCheckpointError for a model built with a block class of its own (a user's block): the weights would
    load into the family's own layers in transformers, a different network. A block with no parameters of its
    own (the README's ParallelBlock) was written as a plain checkpoint that loaded without a word."""
    built = getattr(model.layers, "block_classes", None)
    if built is None:
        return
    runs = model.spec.runs or (None,)
    expected = tuple(getattr(run, "block_cls", None) or family.block_cls for run in runs)
    odd = sorted({f"{cls.__module__}:{cls.__qualname__}" for cls, own in zip(built, expected) if cls is not own})
    if odd:
        raise HFCheckpointError(f"the model's blocks are {', '.join(odd)}, not {family.name}'s own, and no Hugging "
                                f"Face model class computes them (transformers would load the weights into "
                                f"{family.name}'s own layers, a different model): to_hf writes models of the zoo's "
                                f"own blocks only")


def save_safetensors(tensors: dict, final: Path) -> None:
    """`tensors` as a safetensors file at `final`, put in place whole (never a half-written file under its
    name; the part written is removed when the write fails or is interrupted). A full disk is the OSError
    (ENOSPC) naming the file: safetensors' own error is a SafetensorError that names none."""
    import errno

    from safetensors.numpy import save_file

    partial = final.with_name(final.name + ".partial")
    try:
        # "format": "pt" is what transformers checks for before trusting a safetensors file.
        save_file(tensors, str(partial), metadata={"format": "pt"})
    except BaseException as error:
        partial.unlink(missing_ok=True)
        if "No space left on device" in str(error) or getattr(error, "errno", None) == errno.ENOSPC:
            raise OSError(errno.ENOSPC, "No space left on device", str(final)) from None
        raise
    put_in_place(partial, final)


def put_in_place(partial: Path, final: Path) -> None:
    """A finished file moved over its final name, with the permissions any file this process creates gets
    (safetensors writes its files 0600, so an export was unreadable to the other users of a shared
    machine while its config beside it was not)."""
    try:
        os.chmod(partial, 0o666 & ~_umask())
    except OSError:   # a file system that refuses modes (a CIFS or vfat mount under another owner): the file as made
        pass
    partial.replace(final)


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (setting it to read it, the only
    portable way, would give files other threads create meanwhile, a compile cache's, the wrong mode)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


# --- helpers the family tables share ---------------------------------------------

def rope_settings(hf_config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None), from either config generation.

    transformers < 5 writes `rope_theta` and `rope_scaling` at the top level;
    transformers >= 5 writes one `rope_parameters` dict holding both. Older
    files spell the scaling kind `type` instead of `rope_type`. A file holding
    both (a transformers 5 save with a `rope_scaling` added by hand, as model
    cards say to extend the context) is read as transformers 5 reads it: a
    non-empty `rope_scaling` replaces `rope_parameters` whole, its base too
    (its own `rope_theta`, else the top-level one); transformers 4 knew only it.
    """
    for key in ("rope_scaling", "rope_parameters"):   # a hand-edited "rope_scaling": "linear" was an internal error
        refuse(not isinstance(hf_config.get(key) or {}, Mapping),
               f"config.json's {key} is {hf_config.get(key)!r}, not a dict of RoPE settings (rope_type, factor, ...)")
    scaling = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    theta = scaling.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    require({"rope_theta": theta}, ("rope_theta",), "RoPE")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta), None
    scaling = dict(scaling, rope_type=kind)
    top, own = hf_config.get("original_max_position_embeddings"), scaling.get("original_max_position_embeddings")
    if top is not None and kind in ("llama3", "yarn", "longrope"):
        # transformers 5 takes a top-level original_max_position_embeddings (Phi-3's place for it) over the
        # scaling's own, transformers 4 the scaling's alone: the same where they agree, else neither is taken
        refuse(own is not None and own != top,
               f"config.json gives original_max_position_embeddings twice, {top} at its top level and {own} in "
               f"its rope scaling, which transformers 5 and 4 read apart: keep one of them")
        scaling["original_max_position_embeddings"] = top
    return float(theta), scaling


def require(hf_config: Mapping[str, Any], keys: Sequence[str], family: str) -> None:
    """The numbers (sizes, counts, factors) a family's config must give; one line naming any missing or not a
    number (a config.json edited by hand: "hidden_size": "192")."""
    missing = [k for k in keys if hf_config.get(k) is None]
    if missing:
        raise HFCheckpointError(f"the Hugging Face {family} config lacks {missing}")
    not_numbers = [f"{k}={hf_config[k]!r}" for k in keys
                   if isinstance(hf_config[k], bool) or not isinstance(hf_config[k], (int, float))]
    if not_numbers:
        raise HFCheckpointError(f"the Hugging Face {family} config's {', '.join(not_numbers)} "
                                f"{'are' if len(not_numbers) > 1 else 'is'} not a number")


def refuse(condition: bool, message: str) -> None:
    """A config field the family cannot honour: an error, never a silently different model."""
    if condition:
        raise HFCheckpointError(message)
