"""Hugging Face Llama checkpoints into spillway's `Llama`, and back out.

    model = load_hf_llama("/ckpt/Llama-3.2-1B")                  # config.json + *.safetensors
    model = load_hf_llama(state_dict, config=hf_config_dict)       # in memory: {name: np.ndarray}
    tensors = export_hf_state_dict(model)                          # HF names and layouts again
    save_hf_llama(model, "/out")                                   # config.json + model.safetensors

Layouts. A Hugging Face `nn.Linear` stores [out, in] and computes x @ W.T;
spillway stores [in, out], with the heads split out of the projection axis:

    q_proj / k_proj / v_proj  [heads*head_dim, d]  ->  wq / wk / wv  [d, heads, head_dim]
    o_proj                    [d, heads*head_dim]  ->  wo            [heads, head_dim, d]
    gate_proj / up_proj       [f, d]               ->  w_gate / w_up [d, f]
    down_proj                 [d, f]               ->  w_down        [f, d]
    lm_head                   [vocab, d]           ->  head.w        [d, vocab]
    embed_tokens, norms                            ->  unchanged

and the per-layer tensors are stacked along a new leading layer axis
(layers/stack.py). No RoPE permutation is needed: HF checkpoints already use the
rotate-half layout of layers/rope.py (HF's conversion script permutes Meta's
interleaved layout into it; Meta's original consolidated.*.pth files are not
read here).

Reading uses `safetensors` with numpy, so torch is not needed at run time.
Importing this module imports jax and with it `ml_dtypes`, which teaches numpy
the bfloat16 dtype that safetensors' numpy loader needs for bf16 checkpoints.
Each stacked parameter is filled one layer at a time from the memory-mapped
files, so host memory peaks near one stacked parameter, not a second copy of
the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 — registers bfloat16 with numpy (see the module docstring)
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from layers.rope import RopeScaling
from layers.sharding import state_shardings
from models.llama import Llama, LlamaConfig

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_PREFIX = "model.layers.{}."

# How one spillway parameter is stored in a HF checkpoint (see the module docstring):
#   "copy"       same array
#   "linear"     transposed: HF [out, in] <-> spillway [in, out]
#   "in_heads"   HF [heads*head_dim, d] <-> spillway [d, heads, head_dim]
#   "out_heads"  HF [d, heads*head_dim] <-> spillway [heads, head_dim, d]
# (HF name, spillway parameter path, layout)
GLOBAL_WEIGHTS = (
    (EMBED, ("embed", "table"), "copy"),
    (FINAL_NORM, ("final_norm", "scale"), "copy"),
    (LM_HEAD, ("head", "w"), "linear"),
)
# (HF name after "model.layers.{i}.", spillway path inside the stacked blocks, layout)
LAYER_WEIGHTS = (
    ("self_attn.q_proj.weight", ("attn", "wq"), "in_heads"),
    ("self_attn.k_proj.weight", ("attn", "wk"), "in_heads"),
    ("self_attn.v_proj.weight", ("attn", "wv"), "in_heads"),
    ("self_attn.o_proj.weight", ("attn", "wo"), "out_heads"),
    ("mlp.gate_proj.weight", ("mlp", "w_gate"), "linear"),
    ("mlp.up_proj.weight", ("mlp", "w_up"), "linear"),
    ("mlp.down_proj.weight", ("mlp", "w_down"), "linear"),
    ("input_layernorm.weight", ("attn_norm", "scale"), "copy"),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), "copy"),
)
STACK_PATH = ("layers", "blocks")

# Buffers that older transformers versions saved next to the weights; they are
# recomputed from the config, never learned, so they are skipped on import.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# --- config ------------------------------------------------------------------

def _rope_settings(hf_config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None), from either config generation.

    transformers < 5 writes `rope_theta` and `rope_scaling` at the top level;
    transformers >= 5 writes one `rope_parameters` dict holding both. Older
    files spell the scaling kind `type` instead of `rope_type`.
    """
    params = hf_config.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = hf_config.get("rope_theta", 10000.0)
        scaling = hf_config.get("rope_scaling")
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    return float(theta), None if kind in (None, "default") else dict(scaling, rope_type=kind)


def _rope_scaling_from_hf(scaling: dict | None) -> RopeScaling | None:
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r} in the Hugging Face config: spillway's Llama "
                         f"implements only 'default' (no scaling) and 'llama3' RoPE")
    needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in needed if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_type 'llama3' needs {list(needed)}; the Hugging Face config lacks {missing}")
    return RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                       high_freq_factor=float(scaling["high_freq_factor"]),
                       original_max_position=int(scaling["original_max_position_embeddings"]))


def llama_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> LlamaConfig:
    """A LlamaConfig from a Hugging Face LlamaConfig dict (config.json or `LlamaConfig.to_dict()`).

    `overrides` set spillway-only fields (dtype, param_dtype, remat, attention_impl, ...)
    or replace mapped ones. Features spillway's Llama lacks are errors, never dropped.
    """
    hf_config = dict(hf_config)
    model_type = hf_config.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"model_type {model_type!r} is not 'llama'; this importer reads Llama checkpoints only")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if hf_config.get(k) is None]
    if missing:
        raise ValueError(f"Hugging Face Llama config lacks {missing}")
    if hf_config.get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported: spillway's Llama has no q/k/v/o projection biases")
    if hf_config.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported: spillway's Llama MLP has no biases")
    hidden_act = hf_config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported: spillway's Llama MLP is SwiGLU ('silu')")

    d_model, num_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and num_heads and d_model % num_heads == 0 and head_dim == d_model // num_heads:
        head_dim = None  # the default; left unset so configs compare equal to the presets
    rope_theta, scaling = _rope_settings(hf_config)
    fields = dict(
        vocab_size=hf_config["vocab_size"],
        d_model=d_model,
        num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        mlp_hidden=hf_config["intermediate_size"],
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling_from_hf(scaling),
        # transformers' own LlamaConfig defaults, for keys a config.json omits.
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        max_seq_len=int(hf_config.get("max_position_embeddings", 2048)),
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def hf_config_from_llama(cfg: LlamaConfig) -> dict[str, Any]:
    """The Hugging Face config.json dict for a spillway LlamaConfig.

    Written in the transformers < 5 spelling (`rope_theta`, `rope_scaling`),
    which transformers 5 still reads, so either generation can load it.
    """
    if cfg.sliding_window is not None:
        raise ValueError("a sliding_window model has no Hugging Face Llama equivalent")
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.mlp_hidden,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": cfg.param_dtype,
    }


# --- tensor sources ----------------------------------------------------------

class _TensorSource:
    """Names, shapes and (lazily) values of checkpoint tensors."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        raise NotImplementedError


class _DictSource(_TensorSource):
    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(np.shape(self.tensors[name]))

    def get(self, name):
        return np.asarray(self.tensors[name])


class _SafetensorsSource(_TensorSource):
    def __init__(self, files: dict[str, Any]):
        self.files = files  # name -> open safe_open handle

    def names(self):
        return list(self.files)

    def shape(self, name):
        return tuple(self.files[name].get_slice(name).get_shape())

    def get(self, name):
        return self.files[name].get_tensor(name)


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / SAFETENSORS_INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
        hint = f" (found {others}: only safetensors checkpoints are read)" if others else ""
        raise FileNotFoundError(f"no *.safetensors files in {path}{hint}")
    return files


@contextlib.contextmanager
def _open_source(source) -> Iterator[_TensorSource]:
    if isinstance(source, Mapping):
        yield _DictSource(source)
        return
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        by_name: dict[str, Any] = {}
        for file in _safetensors_files(Path(source)):
            handle = stack.enter_context(safe_open(str(file), framework="numpy"))
            for name in handle.keys():
                if name in by_name:
                    raise ValueError(f"tensor {name!r} appears in more than one safetensors file under {source}")
                by_name[name] = handle
        yield _SafetensorsSource(by_name)


def _resolve_config(source, config, overrides: dict) -> LlamaConfig:
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(config, LlamaConfig):
        return dataclasses.replace(config, **overrides)
    if config is None:
        if isinstance(source, Mapping):
            raise ValueError("load_hf_llama needs config= (a HF config dict or a LlamaConfig) "
                             "when given an in-memory state dict")
        directory = Path(source)
        directory = directory.parent if directory.is_file() else directory
        config_file = directory / CONFIG_FILE
        if not config_file.exists():
            raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}; pass config= explicitly")
        config = json.loads(config_file.read_text())
    elif hasattr(config, "to_dict"):  # a transformers.LlamaConfig object
        config = config.to_dict()
    return llama_config_from_hf(config, **overrides)


# --- layouts -----------------------------------------------------------------

def _hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a tensor whose spillway (one-layer) shape is `shape`."""
    if layout == "copy":
        return shape
    if layout == "linear":
        return shape[::-1]
    if layout == "in_heads":
        d, n, h = shape
        return (n * h, d)
    if layout == "out_heads":
        n, h, d = shape
        return (d, n * h)
    raise AssertionError(layout)


def _to_spillway(layout: str, hf_array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout == "copy":
        return hf_array
    return hf_array.T.reshape(shape)  # linear, in_heads and out_heads alike: transpose, then split heads


def _to_hf(layout: str, array: np.ndarray) -> np.ndarray:
    if layout == "copy":
        return array
    if layout == "in_heads":
        array = array.reshape(array.shape[0], -1)
    elif layout == "out_heads":
        array = array.reshape(-1, array.shape[-1])
    return np.ascontiguousarray(array.T)


@dataclasses.dataclass(frozen=True)
class _Mapping:
    path: tuple[str, ...]        # spillway parameter path
    hf_names: tuple[str, ...]    # one per layer for stacked parameters, else one
    layout: str
    shape: tuple[int, ...]       # spillway shape of one HF tensor's worth (one layer)
    stacked: bool


def _mappings(cfg: LlamaConfig, param_shapes: dict[tuple[str, ...], tuple[int, ...]]) -> list[_Mapping]:
    out = []
    for hf_name, path, layout in GLOBAL_WEIGHTS:
        if path in param_shapes:  # no head when the embeddings are tied
            out.append(_Mapping(path, (hf_name,), layout, param_shapes[path], stacked=False))
    for suffix, sub_path, layout in LAYER_WEIGHTS:
        path = STACK_PATH + sub_path
        hf_names = tuple(LAYER_PREFIX.format(i) + suffix for i in range(cfg.num_layers))
        out.append(_Mapping(path, hf_names, layout, param_shapes[path][1:], stacked=True))
    unmapped = set(param_shapes) - {m.path for m in out}
    if unmapped:  # the model grew a parameter this importer does not know: fail rather than keep random values
        raise AssertionError(f"spillway Llama parameters with no Hugging Face mapping: {sorted(unmapped)}")
    return out


def _check_names_and_shapes(source: _TensorSource, mappings: list[_Mapping], cfg: LlamaConfig) -> None:
    """One error listing every missing, unexpected and misshapen tensor."""
    expected = {name: _hf_shape(m.layout, m.shape) for m in mappings for name in m.hf_names}
    present = set(source.names())
    missing = [n for n in expected if n not in present]
    unexpected = sorted(n for n in present - set(expected) if not n.endswith(IGNORED_SUFFIXES)
                        and not (cfg.tie_embeddings and n == LM_HEAD))
    mismatched = [f"{n}: checkpoint {source.shape(n)}, config expects {shape}"
                  for n, shape in expected.items() if n in present and source.shape(n) != shape]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): " + "; ".join(mismatched))
    if problems:
        raise ValueError("Hugging Face checkpoint does not match the Llama config "
                         f"({cfg.num_layers} layers, d_model {cfg.d_model}, tie_embeddings={cfg.tie_embeddings}):\n  "
                         + "\n  ".join(problems))
    if cfg.tie_embeddings and LM_HEAD in present:
        # transformers' state_dict() lists the tied head under its own name; accept it only if it is the embedding.
        if source.shape(LM_HEAD) != source.shape(EMBED) or not np.array_equal(source.get(LM_HEAD), source.get(EMBED)):
            raise ValueError(f"tie_word_embeddings is True but {LM_HEAD} differs from {EMBED}; "
                             "the checkpoint has a separate output head (set tie_word_embeddings=False)")


def _load_param(source: _TensorSource, m: _Mapping, dtype) -> np.ndarray:
    if not m.stacked:
        return np.asarray(_to_spillway(m.layout, source.get(m.hf_names[0]), m.shape), dtype)
    stacked = np.empty((len(m.hf_names),) + m.shape, dtype)
    for layer, name in enumerate(m.hf_names):
        stacked[layer] = _to_spillway(m.layout, source.get(name), m.shape)
    return stacked


# --- public API ----------------------------------------------------------------

def load_hf_llama(source: str | os.PathLike | Mapping[str, Any], *, config: Any = None,
                  dtype: str | None = None, param_dtype: str | None = None, remat: str | None = None,
                  mesh: Mesh | None = None, **config_overrides) -> Llama:
    """A spillway Llama holding a Hugging Face Llama checkpoint's weights.

    source: a checkpoint directory (config.json and model.safetensors, or shards
        with model.safetensors.index.json), a single .safetensors file, or an
        in-memory {HF name: array} state dict (numpy arrays, or anything
        np.asarray accepts: `{k: v.numpy() for k, v in torch_model.state_dict().items()}`).
    config: a HF config dict or `transformers.LlamaConfig` (mapped by
        `llama_config_from_hf`), or a `LlamaConfig` used as is. Read from the
        directory's config.json when omitted; required for a state dict or file.
    dtype, param_dtype, remat, config_overrides: LlamaConfig fields to set;
        None keeps the config's (LlamaConfig's defaults: bfloat16 compute,
        float32 parameters). Weights are cast to param_dtype.
    mesh: place each parameter straight into its shard (layers/sharding.py rules);
        without one, parameters go to the default device.

    Raises ValueError naming every missing, unexpected or misshapen tensor.
    """
    overrides = dict(config_overrides, dtype=dtype, param_dtype=param_dtype, remat=remat)
    cfg = _resolve_config(source, config, overrides)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
    flat_params = dict(nnx.to_flat_state(abstract_params))
    mappings = _mappings(cfg, {path: tuple(var.get_value().shape) for path, var in flat_params.items()})
    shardings = None if mesh is None else dict(nnx.to_flat_state(state_shardings(abstract_params, mesh)))
    param_dtype_np = np.dtype(jnp.dtype(cfg.param_dtype))

    loaded = []
    with _open_source(source) as tensors:
        _check_names_and_shapes(tensors, mappings, cfg)
        for m in mappings:
            host = _load_param(tensors, m, param_dtype_np)
            placement = None if shardings is None else shardings[m.path].get_value()
            loaded.append((m.path, flat_params[m.path].replace(jax.device_put(host, placement))))
            del host  # one stacked parameter on the host at a time
    return nnx.merge(graphdef, nnx.from_flat_state(loaded), rest)


def export_hf_state_dict(model: Llama, dtype: Any = None) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and layouts (the inverse of `load_hf_llama`).

    Tied models omit lm_head.weight, as transformers' safetensors files do.
    `dtype` casts every tensor (default: the parameter dtype).
    """
    cfg = model.cfg
    flat_params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    shapes = {path: tuple(var.get_value().shape) for path, var in flat_params.items()}
    out: dict[str, np.ndarray] = {}
    for m in _mappings(cfg, shapes):
        array = np.asarray(jax.device_get(flat_params[m.path].get_value()))
        if dtype is not None:
            array = array.astype(np.dtype(jnp.dtype(dtype)))
        layers = array if m.stacked else [array]
        for name, one in zip(m.hf_names, layers, strict=True):
            out[name] = _to_hf(m.layout, one)
    # transformers' order (embedding, layer by layer, final norm, head): easier to read and diff.
    order = [EMBED] + [LAYER_PREFIX.format(i) + suffix for i in range(cfg.num_layers)
                       for suffix, _, _ in LAYER_WEIGHTS] + [FINAL_NORM, LM_HEAD]
    return {name: out[name] for name in order if name in out}


def save_hf_llama(model: Llama, directory: str | os.PathLike, dtype: Any = None) -> Path:
    """Write config.json and model.safetensors that `transformers` (and `load_hf_llama`) can load."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = export_hf_state_dict(model, dtype=dtype)
    hf_config = hf_config_from_llama(model.cfg)
    hf_config["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    # "format": "pt" is what transformers checks for before trusting a safetensors file.
    save_file(tensors, str(directory / SAFETENSORS_FILE), metadata={"format": "pt"})
    return directory
