"""The plans `spillway plan` compiles: each an `OffloadConfig` (plus whether the host CPU runs the update).

A candidate is the offload section a recipe would train with (activation
plan, where the optimizer state and the block weights live, when the update
runs) and `update_on_host`, the one optimizer setting the planner varies:
host state updated by the host CPU instead of streamed through HBM. What the
user sees names recipe fields and their values only (`settings`, `label`,
`set_arguments`: the `--set` line that trains the plan); `state_word`, which
calls that placement "host_compute", is a key for code and tests, never
printed. `applied_to` gives the recipe the candidate stands for. Which
candidates a recipe gets: `candidates` (docs/DESIGN.md section 9).

A model with mixture-of-experts layers (Mixtral, Qwen3-MoE) gets the MoE
presets (layers/offload.py MOE_PRESETS) and the dense presets that name only
tags its blocks make: the stack refuses a plan naming a tag no block has, so
an all-MoE model's dense save_dots would be an error, not a plan.
"""

from __future__ import annotations

import dataclasses

import jax

from spillway.layers import names
from spillway.layers.memory import EXPERTS, MEMORIES, Memory
from spillway.layers.offload import MOE_PRESETS, PRESETS, RematPlan
from spillway.layers.residency import memory_of
from spillway.recipes.config import (AFTER_BACKWARD, NEXT_FORWARD, PENDING_DEVICE, PENDING_HOST, PENDING_PLACES,
                                     OffloadConfig, Recipe)

# The key (`Candidate.state_word`) of host state updated by the host CPU (OptimizerConfig.update_on_host);
# never printed: the table names the recipe fields.
HOST_COMPUTE = "host_compute"
# The recipe fields a candidate sets, in the order `--set` lines and labels name them.
SETTING_FIELDS = ("offload.activations", "offload.optimizer_state", "offload.params", "offload.params_keep",
                  "offload.update", "offload.pending_gradients", "optimizer.update_on_host")
# The host CPU's update is tried with the activation plans that need the least HBM, where it can matter;
# priced at the host's update rate (recipes/plan/host_update.py).
HOST_COMPUTE_PLANS = ("recompute_all", "offload_dots")
# Block weights (and their gradients) in pinned host memory too (offload.params=host), for models this
# large only, with the state on host (the only combination the step supports) and the activation plans
# that need the least HBM: the last resort of a small GPU.
HOST_PARAMS_MIN_PARAMS = 3e9
# Single-policy plans, in the order the table shows them: every preset of layers/offload.py but
# offload_all (offload_dots with the block inputs offloaded too), which the planner has never tried.
PRESET_PLANS = tuple(name for name in PRESETS if name != "offload_all")


def _offload_field(name: str) -> property:
    return property(lambda candidate: getattr(candidate.offload, name), doc=f"offload.{name}")


@dataclasses.dataclass(frozen=True)
class Candidate:
    offload: OffloadConfig      # activations, optimizer_state, params, update, as a recipe sets them
    update_on_host: bool = False   # optimizer.update_on_host: the host CPU updates the host state

    def __post_init__(self):
        # on host whole or split (host:N: the host CPU updates the last N layers, the GPU the others)
        if self.update_on_host and memory_of(self.offload.optimizer_state) != Memory.HOST:
            raise ValueError("a plan whose host CPU runs the update needs its optimizer state on host")

    @classmethod
    def of(cls, activations: str, optimizer_state: str = Memory.DEVICE.value, params: str = Memory.DEVICE.value,
           update: str = AFTER_BACKWARD, *, update_on_host: bool = False, params_keep: int = 0,
           pending_gradients: str = PENDING_HOST) -> Candidate:
        # Plain strings, as a recipe's fields hold them (a Memory member compares equal but prints otherwise).
        return cls(OffloadConfig(activations=activations, optimizer_state=str(optimizer_state), params=str(params),
                                 params_keep=params_keep, update=update, pending_gradients=str(pending_gradients)),
                   update_on_host)

    # The offload fields, read through: candidate.activations is candidate.offload.activations.
    activations = _offload_field("activations")
    optimizer_state = _offload_field("optimizer_state")
    params = _offload_field("params")
    update = _offload_field("update")
    params_keep = _offload_field("params_keep")
    pending_gradients = _offload_field("pending_gradients")

    @property
    def state_word(self) -> str:
        """A key for code and tests (never printed): device, host, or host_compute (updated by the host CPU)."""
        return HOST_COMPUTE if self.update_on_host else self.optimizer_state

    def settings(self) -> dict[str, str]:
        """The recipe fields this plan sets and their values as `--set` writes them (SETTING_FIELDS)."""
        return {"offload.activations": self.activations, "offload.optimizer_state": self.optimizer_state,
                "offload.params": self.params, "offload.params_keep": str(self.params_keep),
                "offload.update": self.update, "offload.pending_gradients": self.pending_gradients,
                "optimizer.update_on_host": "true" if self.update_on_host else "false"}

    def set_arguments(self, recipe: Recipe) -> list[str]:
        """`FIELD=VALUE` for each field where this plan differs from `recipe`: the `--set` arguments that make
        `recipe` train this plan ([] when it already does)."""
        own = Candidate.of_recipe(recipe).settings()
        if recipe.optimizer.update_on_host and not self.update_on_host:
            own["optimizer.update_on_host"] = "true"   # set in the recipe, though of_recipe reads it as off
        return [f"{field}={value}" for field, value in self.settings().items() if own[field] != value]

    @property
    def label(self) -> str:
        """The plan in recipe words: its activations, then `field=value` for the optimizer state and for each
        other field not at its default ("offload_dots / optimizer_state=host / update_on_host=true")."""
        words = [self.activations, f"optimizer_state={self.optimizer_state}"]
        if self.update_on_host:
            words.append("update_on_host=true")
        if self.params != Memory.DEVICE:
            words.append(f"params={self.params}")
        if self.params_keep:
            words.append(f"params_keep={self.params_keep}")
        if self.update == NEXT_FORWARD:
            words.append(f"update={self.update}")
        if self.pending_gradients != PENDING_HOST:
            words.append(f"pending_gradients={self.pending_gradients}")
        return " / ".join(words)

    @property
    def placement_label(self) -> str:
        """`label` without the activations: where the state and weights live, who updates, when."""
        return self.label.split(" / ", 1)[1]

    @property
    def offloads_activations(self) -> bool:
        return any(segment.policy.offloads for segment in RematPlan.parse(self.activations).segments)

    @property
    def no_offload(self) -> bool:
        """Nothing in host memory: the baseline a GPU without offload support would run."""
        return (self.optimizer_state == Memory.DEVICE and self.params == Memory.DEVICE
                and not self.offloads_activations)

    def to_dict(self) -> dict:
        return {"activations": self.activations, "optimizer_state": self.optimizer_state, "params": self.params,
                "params_keep": self.params_keep, "update": self.update, "pending_gradients": self.pending_gradients,
                "update_on_host": self.update_on_host}

    @classmethod
    def from_dict(cls, data: dict) -> Candidate:
        return cls.of(data["activations"], data["optimizer_state"], data.get("params", Memory.DEVICE.value),
                      data.get("update", AFTER_BACKWARD), update_on_host=data.get("update_on_host", False),
                      params_keep=data.get("params_keep", 0),
                      pending_gradients=data.get("pending_gradients", PENDING_HOST))

    @classmethod
    def of_recipe(cls, recipe: Recipe) -> Candidate:
        """The candidate a recipe's own settings stand for."""
        offload = recipe.offload
        on_host = memory_of(offload.optimizer_state) == Memory.HOST   # whole, or a split (host:N)
        return cls.of(offload.activations, offload.optimizer_state, offload.params, offload.update,
                      update_on_host=recipe.optimizer.update_on_host and on_host,
                      params_keep=offload.params_keep, pending_gradients=offload.pending_gradients)

    def applied_to(self, recipe: Recipe) -> Recipe:
        """The recipe with this plan's offload section and optimizer.update_on_host."""
        return dataclasses.replace(recipe, offload=self.offload,
                                   optimizer=dataclasses.replace(recipe.optimizer, update_on_host=self.update_on_host))


# Their counterparts for a model with MoE layers: the MoE presets beside the dense ones its blocks can take.
MOE_HOST_COMPUTE_PLANS = ("recompute_all", "moe_offload_dots")


def activation_plans(num_layers: int, presets: tuple[str, ...] = PRESET_PLANS) -> list[str]:
    """The presets, and per-segment mixes over the first half of the layers (MoE models: the MoE dot presets')."""
    plans = list(presets)
    half = num_layers // 2
    moe = "moe_offload_dots" in presets
    if 0 < half < num_layers:   # of the dot presets the model's blocks serve (a user's block may tag fewer)
        plans += [f"{dots}:{half},recompute_all" for dots in (f"{'moe_' if moe else ''}offload_dots",
                                                              f"{'moe_' if moe else ''}save_dots") if dots in presets]
    return plans


def tagged_names(recipe: Recipe) -> frozenset[str] | None:
    """The activation tags the recipe's blocks make, or None for a dense model of the zoo's blocks (every dense
    preset applies). A user's block (recipe `block`) tags what it tags: read from its traced stack."""
    if recipe.block is not None:
        return _users_block_names(recipe)
    runs = recipe.decoder_spec().stack_runs()
    if all(run.block.moe is None for run in runs):
        return None
    tags = {names.BLOCK_INPUT, *names.ATTENTION_DOT_NAMES}
    for run in runs:
        moe = run.block.moe
        if moe is None or moe.shared_expert_hidden:   # a dense MLP (or the MoE layer's shared experts)
            tags |= {names.MLP_HIDDEN, names.MLP_OUT}
        if moe is not None:
            tags |= set(names.MOE_ACTIVATION_NAMES)
    return frozenset(tags)


def _users_block_names(recipe: Recipe) -> frozenset[str]:
    """The names a user's block tags, from its stack built under eval_shape (shapes only) with no remat plan
    (the recipe's may name what the block never tags: that is what this finds out)."""
    from flax import nnx

    plain = dataclasses.replace(recipe, offload=dataclasses.replace(recipe.offload, activations="save_all"))
    model = nnx.eval_shape(lambda: plain.build_model(nnx.Rngs(0)))
    return frozenset(model.layers.block_names)


def preset_plans(recipe: Recipe) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(single-policy plans, host-compute plans) for the recipe's model: PRESET_PLANS and HOST_COMPUTE_PLANS for
    a dense one; with MoE layers, the presets whose tags its blocks make and the MoE presets."""
    tags = tagged_names(recipe)
    if tags is None:
        return PRESET_PLANS, HOST_COMPUTE_PLANS
    presets = {**PRESETS, **MOE_PRESETS}
    usable = tuple(p for p in (*PRESET_PLANS, *MOE_PRESETS) if presets[p].names() <= tags)
    host_compute = MOE_HOST_COMPUTE_PLANS if tags & set(names.MOE_ACTIVATION_NAMES) else HOST_COMPUTE_PLANS
    return usable, tuple(p for p in host_compute if p in usable)


def candidates(recipe: Recipe) -> list[Candidate]:
    """Every activation plan with the state on device and on host; the host CPU's update for the plans
    with the least HBM; the update in the next forward pass (single-policy plans; the state on host, and
    host:L with the non-stacked leaves' state in HBM: `deferred_state_placements`), its pending gradients
    in host memory and in HBM (pruning compiles the first only where the second does not fit:
    recipes/plan/pruning.py; with grad_accum > 1 in HBM only, `pending_placements`); for models with MoE blocks the routed experts' weights on host (`has_expert_weights`, from
    the abstract model: a tenth of a second); for large models the block weights on host too (for a LoRA
    recipe also with the adapters' state on device, and no deferred update)."""
    single, host_compute = preset_plans(recipe)
    found = [Candidate.of(plan, state) for state in MEMORIES
             for plan in activation_plans(recipe.model.num_layers, single)]
    found += [Candidate.of(plan, Memory.HOST, update_on_host=True) for plan in host_compute]
    lora = recipe.lora.enabled   # LoRA: no host state to defer; a frozen base on host needs no host state
    if not lora:   # the update in the next forward pass (with grad_accum > 1 its running sum in HBM only)
        found += [Candidate.of(plan, state, Memory.DEVICE, NEXT_FORWARD, pending_gradients=pending)
                  for state in deferred_state_placements(recipe)
                  for pending in pending_placements(recipe) for plan in single]
    # Only the routed experts' weights on host (offload.params=experts) for any model with MoE blocks, with
    # the same state placements and plans as the whole stack: the experts are most of such a model's
    # weights and a small part of its compute per token, so they are the first weights to leave HBM.
    # Pruning skips them where the weights fit on device, and the whole stack where they fit.
    weight_placements = ([EXPERTS] if has_expert_weights(recipe) else []) + (
        [Memory.HOST] if recipe.num_params() >= HOST_PARAMS_MIN_PARAMS else [])
    found += [Candidate.of(plan, Memory.HOST, params, update_on_host=on_host_cpu)
              for params in weight_placements for on_host_cpu in (False, True) for plan in host_compute]
    if lora:   # the frozen base streamed from host, the adapters' small state in HBM (recipes/train/lora_state.py)
        found += [Candidate.of(plan, Memory.DEVICE, params) for params in weight_placements for plan in host_compute]
    return found


def every_layer_on_host(recipe: Recipe) -> str:
    """offload.optimizer_state=host:L, L the recipe's block layers: every block layer's state on host, the
    non-stacked leaves' (embedding, final norm, head) in HBM."""
    return f"{Memory.HOST}:{recipe.model.num_layers}"


def deferred_state_placements(recipe: Recipe) -> tuple[str, ...]:
    """The optimizer state placements the update in the next forward pass is tried with: host:L first (the
    non-stacked leaves' state stays in HBM, so their update before the forward pass moves nothing over the
    link: never slower, and pruning skips `host` where it fits), then host (less HBM). None for blocks in
    several stacks: the update in the next forward pass runs in one scan over one stack (recipes/config.py)."""
    if len(recipe.decoder_spec().stack_runs()) != 1:
        return ()
    return (every_layer_on_host(recipe), Memory.HOST.value)


def pending_placements(recipe: Recipe) -> tuple[str, ...]:
    """Where the deferred update's pending gradients may wait for `recipe`: host memory or HBM with one batch
    per step; HBM alone with grad_accum > 1, whose float32 running sum is there (recipes/config.py)."""
    return PENDING_PLACES if recipe.train.grad_accum == 1 else (PENDING_DEVICE,)


def has_expert_weights(recipe: Recipe) -> bool:
    """Whether the recipe's model has routed expert weights (an MoE block), from its abstract parameters."""
    from flax import nnx

    from spillway.layers.host_weights import is_expert_weight
    from spillway.recipes.train.step import abstract_model

    _, state = abstract_model(recipe)
    return any(is_expert_weight(var.get_metadata().get("logical_axes"))
               for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def planned_recipe(recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The recipe as it is compiled (attention cudnn -> flash), and warnings to show."""
    impl = recipe.execution.attention_impl
    if impl == "cudnn":
        return (dataclasses.replace(recipe, execution=dataclasses.replace(recipe.execution, attention_impl="flash")),
                ["attention: the recipe uses cuDNN attention, which cannot be compiled without cuDNN; "
                 "planned with 'flash' (layers/flash_attention.py, also memory-linear in the sequence). "
                 "On an H200 the two measured within 0.5% of each other in HBM, cuDNN 3.6x faster "
                 "(Llama 3.2 1B, BENCHMARKS.md)."])
    if impl == "xla":
        return recipe, ["attention: 'xla' materialises the [seq, seq] scores per head (memory quadratic "
                        "in the sequence); --set execution.attention_impl=flash for long sequences."]
    return recipe, []
