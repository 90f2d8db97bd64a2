"""The Recipe: frozen dataclasses for a whole run, `--set a.b=value` overrides, JSON round-trip.

A recipe is plain data: the model family and its config (models/), how the
model executes (dtypes, attention kernel), an optional block class, data,
optimizer, offload, mesh, checkpoint and train settings. Recipes are Python functions returning a
`Recipe` (recipes/registry.py); variants come from `dataclasses.replace` or
from `--set` on the command line, which is type-checked against the field's
annotation so a typo or a bad value fails before anything is built.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from spillway.layers.execution import Execution
from spillway.layers.offload import RematPlan
from spillway.layers.rope import RopeScaling
from spillway.models.registry import get_family
from spillway.recipes.train.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "builtin:stdlib"        # see data/sources.py: builtin:stdlib, path, or a Hub name
    text_field: str = "text"
    tokenizer: str | None = None          # path to a sentencepiece .model; None trains one on the corpus
    tokenizer_type: str = "bpe"           # "bpe" | "unigram" when training
    seq_len: int = 256
    val_fraction: float = 0.02
    cache_dir: str = ".cache/spillway"
    num_proc: int = 1                     # tokenizing processes; >1 forks after JAX has started threads (warns)
    max_tokens: int | None = None         # cap on tokens taken from the source; required for streamed Hub sources


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    activations: str = "recompute_all"    # RematPlan spec: preset or "preset:K,preset" (layers/offload.py)
    optimizer_state: str = "device"       # "device" | "host"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1                        # -1: all remaining devices
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None                # None: runs/<recipe name>
    every_steps: int = 100
    keep: int = 3
    async_save: bool = True
    init_from: str | None = None          # fine-tune: load weights (only) from this checkpoint dir or step dir


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    global_batch: int = 16                # sequences per optimizer step
    grad_accum: int = 1                   # micro-batches per step (global_batch % grad_accum == 0)
    loss_chunk: int = 0                   # >0: apply the output head this many tokens at a time (saves HBM)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    profile_steps: str | None = None      # "START:STOP": a jax.profiler trace of those steps
    sample_prompt: str = "def "
    sample_tokens: int = 64
    resume: bool = True                   # continue from the latest checkpoint in checkpoint.dir
    resume_step: int | None = None        # resume from this step instead (newer ones are set aside)


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    family: str                           # a models/ family name (spillway recipes lists them)
    model: Any                            # that family's config (architecture only)
    execution: Execution = Execution()    # dtypes, attention kernel, init scale: shared by all families
    block: str | None = None              # "package.module:Class" or "package.module.Class": a TransformerBlock subclass
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    offload: OffloadConfig = OffloadConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    train: TrainConfig = TrainConfig()
    description: str = ""

    def __post_init__(self):
        family = get_family(self.family)
        if not isinstance(self.model, family.config_cls):
            raise ValueError(f"model is a {type(self.model).__name__}, but family {self.family!r} takes a "
                             f"{family.config_cls.__name__}")
        if self.train.global_batch % self.train.grad_accum:
            raise ValueError(f"train.grad_accum ({self.train.grad_accum}) does not divide "
                             f"train.global_batch ({self.train.global_batch})")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        try:
            RematPlan.parse(self.offload.activations).resolve(self.model.num_layers)
        except ValueError as err:
            raise ValueError(f"offload.activations: {err}") from None
        if self.offload.optimizer_state not in ("device", "host"):
            raise ValueError(f"offload.optimizer_state must be 'device' or 'host', got {self.offload.optimizer_state!r}")

    @property
    def run_dir(self) -> str:
        return self.checkpoint.dir or f"runs/{self.name}"

    def decoder_spec(self):
        """The model's shapes (models/decoder.py DecoderSpec) with this recipe's execution settings."""
        return get_family(self.family).spec(self.model, self.execution)

    def num_params(self) -> int:
        return self.decoder_spec().num_params()

    def block_class(self) -> type:
        """The TransformerBlock subclass `block` names (the base class when None)."""
        from spillway.layers.block import TransformerBlock
        return TransformerBlock if self.block is None else resolve_block_class(self.block)

    def build_model(self, rngs):
        """The model with the recipe's activation plan (call under nnx.eval_shape for shapes only)."""
        return get_family(self.family).build(self.model, self.execution, rngs=rngs,
                                             remat=self.offload.activations, block_cls=self.block_class())

    def optimizer_config(self) -> OptimizerConfig:
        """The optimizer config with the recipe's state placement and step count applied."""
        return dataclasses.replace(self.optimizer, state_memory=self.offload.optimizer_state,
                                   total_steps=max(self.train.steps, self.optimizer.warmup_steps + 1))

    # --- serialisation --------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        return _from_dict(cls, upgrade_legacy_recipe_dict(d), "")


def resolve_block_class(path: str) -> type:
    """Import "package.module:Class" (or "package.module.Class") and check it is a TransformerBlock subclass."""
    import importlib

    from spillway.layers.block import TransformerBlock
    module_name, sep, class_name = path.partition(":")
    if not sep:
        module_name, _, class_name = path.rpartition(".")
    if not module_name or not class_name:
        raise ValueError(f"block: {path!r} is not a dotted path 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"block: cannot import module {module_name!r} ({err})") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, TransformerBlock)):
        raise ValueError(f"block: {path!r} is not a TransformerBlock subclass")
    return cls


_EXECUTION_FIELDS = ("dtype", "param_dtype", "attention_impl", "flash_block_size", "init_std")


def upgrade_legacy_recipe_dict(d: dict) -> dict:
    """A recipe.json written before families existed (a Llama whose config held dtypes and remat) -> today's.

    Runs saved by earlier versions stay loadable: the family is Llama, the
    execution fields move to `execution`, and the activation plan the model
    config carried was always overwritten by `offload.activations`.
    """
    if "family" in d or not isinstance(d.get("model"), dict):
        return d
    d = dict(d)
    model = dict(d["model"])
    execution = {k: model.pop(k) for k in _EXECUTION_FIELDS if k in model}
    model.pop("remat", None)
    model.pop("sliding_window", None) if model.get("sliding_window") is None else None
    d.update(family="llama", model=model, execution={**execution, **d.get("execution", {})})
    return d


def _model_config_class(tree: dict):
    family = tree.get("family")
    if not isinstance(family, str):
        raise ValueError(f"family must be a model family name, got {family!r}")
    return get_family(family).config_cls


def _from_dict(cls, d: dict, where: str):
    if cls is Recipe and isinstance(d.get("model"), dict):
        d = dict(d, model=_from_dict(_model_config_class(d), d["model"], "model."))
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} in {where or cls.__name__}")
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
        raise ValueError(f"{where}: {value!r} fits none of {annotation}: {'; '.join(errors)}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if isinstance(value, dict):
            return _from_dict(annotation, value, where + ".")
        raise ValueError(f"{where}: expected a mapping for {annotation.__name__}, got {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return int(as_float)
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if annotation is Any:
        return value
    if annotation is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `--set data.source=2024` means the string
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
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
            raise ValueError(f"--set expects key=value, got {item!r}")
        path = path.strip()
        _set_path(tree, Recipe, path.split("."), raw.strip(), path)
    try:
        return Recipe.from_dict(tree)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--set {' '.join(overrides)}: {err}") from None


def _set_path(tree: dict, cls, keys: list[str], raw: str, full: str) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    key = keys[0]
    if key not in fields:
        raise ValueError(f"unknown field {full!r}: {cls.__name__} has no field {key!r} (fields: {sorted(fields)})")
    annotation = typing.get_type_hints(cls)[key]
    if cls is Recipe and key == "model":
        annotation = _model_config_class(tree)   # the family decides what `model.*` holds
    if cls is Recipe and key == "family" and len(keys) == 1:
        raise ValueError("family cannot be changed with --set (the model config is the family's): "
                         "pick a recipe of that family (`spillway recipes` lists them)")
    nested = [a for a in (typing.get_args(annotation) or (annotation,)) if dataclasses.is_dataclass(a)]
    if len(keys) == 1:
        if nested and not (raw.lower() in ("none", "null") and type(None) in typing.get_args(annotation)):
            raise ValueError(f"{full!r} is a group of fields; set one of them, e.g. {full}.<field>=...")
        tree[key] = _coerce(annotation, _parse_scalar(raw), full)
        return
    if not nested:
        raise ValueError(f"unknown field {full!r}: {key!r} is not a group of fields")
    if tree.get(key) is None:
        tree[key] = dataclasses.asdict(nested[0]())  # e.g. model.rope_scaling.factor on a model without scaling
    _set_path(tree[key], nested[0], keys[1:], raw, full)


def _parse_scalar(raw: str) -> Any:
    # JSON literals for numbers/bools/null; anything else stays a string.
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


__all__ = ["Recipe", "DataConfig", "OffloadConfig", "MeshConfig", "CheckpointConfig", "TrainConfig",
           "OptimizerConfig", "Execution", "RopeScaling", "apply_overrides", "resolve_block_class"]
