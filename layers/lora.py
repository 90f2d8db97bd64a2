"""LoRA adapters on a block's projections: frozen base weight W, trainable low-rank A and B beside it.

    y = x @ W  +  (alpha / r) * (dropout(x) @ A^T) @ B^T        A: [r, in] random, B: [out, r] zero

as PEFT writes it (Hu et al. 2021): A is drawn as PEFT's default
(kaiming-uniform with a = sqrt(5), i.e. uniform(-1/sqrt(in), 1/sqrt(in))), B
is zero, so a fresh adapter changes nothing. `in` and `out` are the weight's
input and output axes flattened (an attention weight [d, heads, head_dim] is
in = d, out = heads * head_dim), the layout of a Hugging Face `nn.Linear`
[out, in], so an adapter is PEFT's `lora_A.weight` / `lora_B.weight` as is.

How adapters get into a model. `adapters_while_building(spec)` puts a
`LoraSpec` in force while a model is built; the block stack builds each block
and then calls `attach` (layers/stack.py), which gives the block's modules a
`LoraAdapter` per targeted weight, as the attribute `lora_<weight name>` of the
module holding the weight (attn.lora_wq beside attn.wq). Blocks are built
stacked (nnx.vmap, or a scan for host weights), so the adapters are stacked
[L, r, in] and [L, out, r] like every block weight, scanned with them, and
rematerialised and sharded by the same rules. A module that computes a
projection asks `adapter_delta(module, name, x, ...)` for the adapter's term
(None where the weight has no adapter: the program is unchanged).

The adapters are `nnx.LoRAParam`s (a subclass of nnx.Param: the optimizer,
sharding and checkpoints see them as parameters) with `param_memory="device"`:
with the frozen base weights in host memory (offload.params=host), the
adapters stay in HBM. What is trainable is decided by the train step
(recipes/train/lora_state.py), not here.

A Hugging Face projection that is several block weights fused in one tensor
(GPT-2's `c_attn`, q | k | v along its output axis) is adapted as PEFT adapts
it, one matrix: a `FusedLoraAdapter` with one A [r, in] shared by the parts and
B [sum of outs, r], held as `lora_wq_wk_wv` beside them; each part's term is
its rows of B (one dropout mask for the shared input, as PEFT draws one).

Routed experts ([E, in, out] stacks) get an `ExpertLoraAdapter` each: one
PEFT adapter per expert, merged into the layer's expert weights where the MoE
layer hands them to its dispatch (layers/moe.py `expert_weights`), so every
dispatch runs it as it runs the weights (docs/DESIGN.md section 13).

Dropout on the adapter's input needs a key: the train step puts one in force
(`dropout_key`) while it traces the loss; without one (validation, generation,
export) the adapter runs without dropout. Inside the block scan every layer
sees the same key, so the layers draw the same mask pattern for inputs of the
same shape (a known simplification: docs/DESIGN.md section 13); the
projections of one layer draw their own masks.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from spillway.layers import names
from spillway.layers.errors import ConfigError, require_positive

ADAPTER_PREFIX = "lora_"

_BUILDING: contextvars.ContextVar[LoraSpec | None] = contextvars.ContextVar("spillway_lora_spec", default=None)
_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("spillway_lora_key", default=None)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which block weights get adapters, and their rank, scale and dropout.

    `targets`: (module attribute, weight attribute) pairs inside a block, e.g.
    ("attn", "wq"); the recipe turns Hugging Face module names into them
    (recipes/lora_targets.py), so this layer needs no family's names.
    """

    rank: int
    alpha: float
    targets: frozenset[tuple[str, str]]
    dropout: float = 0.0
    param_dtype: str = "float32"
    # Routed experts' stacked weights ([E, in, out]: ("mlp", "w_up")) with an adapter per expert, merged into
    # the weights each forward pass (`ExpertLoraAdapter`).
    expert_targets: frozenset[tuple[str, str]] = frozenset()
    # Weights of one module adapted as one matrix (GPT-2's c_attn: ("attn", ("wq", "wk", "wv"))), their
    # outputs joined in the order given: one `FusedLoraAdapter`.
    fused_targets: frozenset[tuple[str, tuple[str, ...]]] = frozenset()

    def __post_init__(self):
        require_positive("lora", rank=self.rank, alpha=self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets and not self.expert_targets and not self.fused_targets:
            raise ConfigError("lora: no target weights")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(nnx.Module):
    """A [r, in] and B [out, r] of one weight; `delta(x_in)` is (alpha / r) * x_in @ A^T @ B^T."""

    def __init__(self, in_features: int, out_features: int, spec: LoraSpec, *, in_axis: str | None,
                 out_axis: str | None, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(in_features)
        dtype = jnp.dtype(spec.param_dtype)
        a = jax.random.uniform(rngs.params(), (spec.rank, in_features), dtype, -bound, bound)
        # param_memory: the adapters stay in HBM when the frozen base weights live in host memory.
        self.a = nnx.LoRAParam(a, logical_axes=(None, in_axis), param_memory="device")
        self.b = nnx.LoRAParam(jnp.zeros((out_features, spec.rank), dtype), logical_axes=(out_axis, None),
                               param_memory="device")
        self.scale = spec.scale
        self.dropout = spec.dropout

    def delta(self, x_bti: jax.Array, dtype, salt: int = 0) -> jax.Array:
        """The adapter's term for inputs [..., in] (flattened): [..., out], in `dtype`. `salt` tells the
        projections of one input apart (q, k and v draw their own dropout masks, as PEFT's do)."""
        return self._up(self._down(x_bti, dtype, salt), self.b[...], dtype)

    def _down(self, x_bti: jax.Array, dtype, salt: int) -> jax.Array:
        """dropout(x) @ A^T: [..., r]."""
        key = _DROPOUT_KEY.get()
        if self.dropout > 0 and key is not None:
            key = jax.random.fold_in(key, salt)
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x_bti.shape)
            x_bti = jnp.where(keep, x_bti / (1.0 - self.dropout), 0).astype(x_bti.dtype)
        return x_bti @ self.a[...].astype(dtype).T

    def _up(self, low: jax.Array, b: jax.Array, dtype) -> jax.Array:
        """(alpha / r) * low @ B^T: [..., out] (B: these rows of the adapter's)."""
        return (low @ b.astype(dtype).T) * jnp.asarray(self.scale, dtype)


class FusedLoraAdapter(LoraAdapter):
    """One adapter of several weights of a module fused in one Hugging Face tensor (GPT-2's c_attn): A [r, in]
    shared, B [sum of the parts' outs, r], the parts' rows in `parts` order. PEFT's adapter of the fused tensor
    as is; `deltas(names, ...)` are the parts' terms."""

    def __init__(self, parts: tuple[str, ...], in_features: int, part_features: tuple[int, ...], spec: LoraSpec, *,
                 in_axis: str | None, rngs: nnx.Rngs):
        # The joined output axis has no single logical axis name: B's rows stay unsharded (the adapter is small).
        super().__init__(in_features, sum(part_features), spec, in_axis=in_axis, out_axis=None, rngs=rngs)
        self.parts = tuple(parts)
        self.part_features = tuple(part_features)

    def deltas(self, names: tuple[str, ...], x_bti: jax.Array, dtype) -> dict[str, jax.Array]:
        """{part: its term [..., that part's out]} for inputs [..., in], of the parts in `names`: x A^T once for
        all of them (so its gradient is one product too), then each part's rows of B (not the whole product
        sliced, which XLA would compute whole for each part). One dropout mask for all parts: PEFT drops the
        fused tensor's input once."""
        low = self._down(x_bti, dtype, salt=zlib.crc32(fused_adapter_name(self.parts).encode()))
        found = {}
        for index, name in enumerate(self.parts):
            if name in names:
                start = sum(self.part_features[:index])
                found[name] = self._up(low, self.b[start:start + self.part_features[index]], dtype)
        return found


def fused_adapter_name(parts: tuple[str, ...]) -> str:
    """The attribute a fused adapter of `parts` is held as (`lora_wq_wk_wv`)."""
    return ADAPTER_PREFIX + "_".join(parts)


class ExpertLoraAdapter(nnx.Module):
    """A [E, r, in] and B [E, out, r] of a routed experts' weight [E, in, out]: one PEFT adapter per expert.

    `merged(w)` is W_e + (alpha / r) A_e^T B_e^T for every expert e, computed where the dispatch takes the
    layer's weights (layers/moe.py `expert_weights`): x W_e + (alpha / r) x A_e^T B_e^T for each token routed
    to e, through every dispatch and sharding as they are. The per-expert delta costs E * in * out * r * 2
    FLOPs a projection per pass (Mixtral 8x7B, rank 16: 15 GFLOP against 962 for 4,096 tokens' top-2 matmul);
    with no input of its own per token it takes no dropout (refused by the recipe)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, spec: LoraSpec, *,
                 in_axis: str | None, out_axis: str | None, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(in_features)
        dtype = jnp.dtype(spec.param_dtype)
        a = jax.random.uniform(rngs.params(), (num_experts, spec.rank, in_features), dtype, -bound, bound)
        self.a = nnx.LoRAParam(a, logical_axes=(names.EXPERT, None, in_axis), param_memory="device")
        self.b = nnx.LoRAParam(jnp.zeros((num_experts, out_features, spec.rank), dtype),
                               logical_axes=(names.EXPERT, out_axis, None), param_memory="device")
        self.scale = spec.scale

    def merged(self, w_eio: jax.Array) -> jax.Array:
        """The weight [E, in, out] (in its dtype) with each expert's adapter added."""
        dtype = w_eio.dtype
        delta = jnp.einsum("eri,eor->eio", self.a[...].astype(dtype), self.b[...].astype(dtype))
        return w_eio + delta * jnp.asarray(self.scale, dtype)


def merged_expert_weight(module, weight_name: str, w_eio: jax.Array) -> jax.Array:
    """`w_eio` (the module's `weight_name`, in the compute dtype) with its experts' adapters, if it has any."""
    adapter = getattr(module, ADAPTER_PREFIX + weight_name, None)
    return w_eio if adapter is None else adapter.merged(w_eio)


@contextlib.contextmanager
def adapters_while_building(spec: LoraSpec | None) -> Iterator[None]:
    """Blocks built inside get the adapters `spec` names (None: none)."""
    token = _BUILDING.set(spec)
    try:
        yield
    finally:
        _BUILDING.reset(token)


@contextlib.contextmanager
def dropout_key(key: jax.Array | None) -> Iterator[None]:
    """Adapters traced inside apply their dropout with `key` (the train step's)."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def attach(block: nnx.Module, rngs: nnx.Rngs) -> None:
    """Give `block` the adapters of the LoraSpec in force (nothing outside `adapters_while_building`).

    A target the block lacks is a ConfigError naming what the block has: the
    recipe checks targets against the family's table first, so this catches a
    user's block that builds its sublayers differently.
    """
    spec = _BUILDING.get()
    if spec is None:
        return
    for module_name, weight_name in sorted(spec.targets):
        module = getattr(block, module_name, None)
        weight = getattr(module, weight_name, None) if module is not None else None
        if not isinstance(weight, nnx.Param):
            raise ConfigError(f"lora: block {type(block).__name__} has no weight {module_name}.{weight_name} to "
                              f"adapt")
        if _holds_routed_experts(weight):
            continue   # an MoE layer's mlp.w_gate beside a dense layer's: the dense target, not this one
        in_features, out_features, in_axis, out_axis = _in_out(module, weight_name, weight)
        setattr(module, ADAPTER_PREFIX + weight_name,
                LoraAdapter(in_features, out_features, spec, in_axis=in_axis, out_axis=out_axis, rngs=rngs))
    for module_name, parts in sorted(spec.fused_targets):
        module = getattr(block, module_name, None)
        weights = [getattr(module, part, None) if module is not None else None for part in parts]
        if not all(isinstance(w, nnx.Param) for w in weights):
            raise ConfigError(f"lora: block {type(block).__name__} has no weights {module_name}."
                              f"{'/'.join(parts)} to adapt as one")
        sizes = [_in_out(module, part, w) for part, w in zip(parts, weights, strict=True)]
        if len({size[0] for size in sizes}) != 1:
            raise ConfigError(f"lora: {module_name}.{'/'.join(parts)} take different inputs; they cannot share "
                              f"one adapter")
        setattr(module, fused_adapter_name(parts),
                FusedLoraAdapter(parts, sizes[0][0], tuple(size[1] for size in sizes), spec, in_axis=sizes[0][2],
                                 rngs=rngs))
    for module_name, weight_name in sorted(spec.expert_targets):
        module = getattr(block, module_name, None)
        weight = getattr(module, weight_name, None) if module is not None else None
        if not isinstance(weight, nnx.Param) or not _holds_routed_experts(weight):
            continue   # a dense layer of an MoE model (Qwen3-MoE's mlp_only_layers): no experts here
        num_experts, in_features, out_features = weight.get_value().shape
        axes = tuple(weight.get_metadata().get("logical_axes"))
        setattr(module, ADAPTER_PREFIX + weight_name,
                ExpertLoraAdapter(num_experts, in_features, out_features, spec, in_axis=axes[1], out_axis=axes[2],
                                  rngs=rngs))


def _holds_routed_experts(weight: nnx.Param) -> bool:
    """Whether the weight is a routed experts' stack ([E, ...], first logical axis "expert")."""
    axes = tuple(weight.get_metadata().get("logical_axes") or ())
    return axes[:1] == (names.EXPERT,)


def _in_out(module, weight_name: str, weight: nnx.Param) -> tuple[int, int, str | None, str | None]:
    """(in, out, in axis name, out axis name): the weight's leading `in_ndim` axes are its input."""
    shape = weight.get_value().shape
    axes = tuple(weight.get_metadata().get("logical_axes") or (None,) * len(shape))
    split = in_ndim(module, weight_name)
    return math.prod(shape[:split]), math.prod(shape[split:]), axes[0], axes[split]


def in_ndim(module, weight_name: str) -> int:
    """How many leading axes of a weight are its input: the module's class says (`LORA_IN_NDIM`), else 1."""
    return getattr(type(module), "LORA_IN_NDIM", {}).get(weight_name, 1)


def adapter_delta(module, weight_name: str, x: jax.Array, in_axes: int, dtype) -> jax.Array | None:
    """The LoRA term of `module.<weight_name>` for input `x` whose last `in_axes` axes are the weight's input,
    shaped [..., out] flattened (the caller reshapes), or None where the weight has no adapter."""
    return adapter_deltas(module, (weight_name,), x, in_axes, dtype)[weight_name]


def adapter_deltas(module, weight_names: tuple[str, ...], x: jax.Array, in_axes: int,
                   dtype) -> dict[str, jax.Array | None]:
    """`adapter_delta` of several weights of `module` that take the same input (q, k and v): a fused adapter
    over them (GPT-2's c_attn) computes its shared product once for all."""
    flat = x.reshape(x.shape[:x.ndim - in_axes] + (-1,))
    found: dict[str, jax.Array | None] = dict.fromkeys(weight_names)
    for value in vars(module).values():
        if isinstance(value, FusedLoraAdapter) and set(value.parts) & set(weight_names):
            found.update(value.deltas(weight_names, flat, dtype))
    for name in weight_names:
        adapter = getattr(module, ADAPTER_PREFIX + name, None)
        if isinstance(adapter, LoraAdapter) and not isinstance(adapter, FusedLoraAdapter):
            found[name] = adapter.delta(flat, dtype, salt=zlib.crc32(name.encode()))
    return found


def adapter_names(module) -> list[str]:
    """The weights of `module` that have an adapter (each part of a fused one)."""
    found = []
    for name, value in vars(module).items():
        if isinstance(value, FusedLoraAdapter):
            found += value.parts
        elif name.startswith(ADAPTER_PREFIX) and isinstance(value, (LoraAdapter, ExpertLoraAdapter)):
            found.append(name[len(ADAPTER_PREFIX):])
    return sorted(found)
