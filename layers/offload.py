"""OffloadPolicy: where each named activation of a block lives for the backward pass.

The trade, for every value a block tags (layers/names.py):

    device     kept in HBM from forward to backward. Fastest; costs HBM for the
               whole step (one copy per layer).
    host       copied to pinned host memory during the forward pass and brought
               back for the backward pass. Costs no HBM between the passes and
               no recompute FLOPs, but moves bytes over the host link; it is free
               only when the copy overlaps compute.
    recompute  dropped after the forward pass and recomputed from the saved
               inputs in the backward pass. Costs FLOPs, no memory, no link.

Values nobody tagged follow `default`. Without remat (`OffloadPolicy.no_remat()`,
preset "save_all") XLA keeps every residual the backward pass needs; that is a
distinct setting, never spelled `None`, so "no remat" and "recompute everything"
cannot be confused.

A `RematPlan` applies policies to consecutive segments of the layer stack: for
example offload the first 8 layers' matmul outputs and recompute the rest
("offload_dots:8,recompute_all"). The stack checks at build time that every name
a policy mentions is tagged by its block (layers/stack.py); a policy that would
silently do nothing is an error.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

import jax
from jax.ad_checkpoint import Offloadable

from spillway.layers import names
from spillway.layers.memory import PINNED_HOST, Memory


class Placement(str, enum.Enum):
    DEVICE = Memory.DEVICE.value      # the two memories (layers/memory.py), and a third choice
    HOST = Memory.HOST.value
    RECOMPUTE = "recompute"


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """Per-name placement of a block's tagged activations.

    `remat=False` means no rematerialisation at all (everything the backward pass
    needs stays on device); then `placements` must be empty.
    """

    placements: tuple[tuple[str, Placement], ...] = ()
    default: Placement = Placement.RECOMPUTE
    remat: bool = True

    def __post_init__(self):
        seen = set()
        for name, placement in self.placements:
            if not isinstance(placement, Placement):
                raise TypeError(f"placement for {name!r} must be a Placement, got {placement!r}")
            if name in seen:
                raise ValueError(f"OffloadPolicy names {name!r} twice")
            seen.add(name)
        if not self.remat and self.placements:
            raise ValueError("OffloadPolicy without remat cannot place names; use remat=True")
        if self.default == Placement.HOST:
            raise ValueError("default placement 'host' is not supported: only tagged names can be offloaded")

    @classmethod
    def of(cls, mapping: Mapping[str, str | Placement], default: str | Placement = Placement.RECOMPUTE):
        """Build a policy from {name: "device" | "host" | "recompute"}."""
        try:
            placements = tuple((n, Placement(p)) for n, p in mapping.items())
            default = Placement(default)
        except ValueError as err:
            raise ValueError(f"{err}; placements are {[p.value for p in Placement]}") from None
        return cls(placements=placements, default=default)

    @classmethod
    def no_remat(cls) -> "OffloadPolicy":
        return cls(remat=False)

    def names(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.placements)

    def names_with(self, placement: Placement) -> list[str]:
        return [n for n, p in self.placements if p == placement]

    @property
    def offloads(self) -> bool:
        return bool(self.names_with(Placement.HOST))

    def to_jax(self):
        """The `jax.checkpoint` policy. Only valid when `remat` is True."""
        if not self.remat:
            raise ValueError("a no-remat policy has no jax.checkpoint policy; do not wrap in remat")
        cp = jax.checkpoint_policies
        saved = self.names_with(Placement.DEVICE)
        offloaded = self.names_with(Placement.HOST)
        if self.default == Placement.DEVICE:
            # Save everything except what is explicitly recomputed or offloaded.
            excluded = set(self.names_with(Placement.RECOMPUTE)) | set(offloaded)
            base = cp.save_anything_except_these_names(*excluded)
            if not offloaded:
                return base
            offload = cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=offloaded,
                offload_src=Memory.DEVICE.value, offload_dst=PINNED_HOST)

            def save_or_offload(prim, *args, **params):
                # the offloaded names go to host, the rest as `base` says; jax's save_from_both_policies takes
                # booleans only, and the first gradient of such a policy was a ValueError from inside the scan
                placed = offload(prim, *args, **params)
                return placed if isinstance(placed, Offloadable) else base(prim, *args, **params)

            return save_or_offload
        if offloaded:
            return cp.save_and_offload_only_these_names(
                names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
                offload_src=Memory.DEVICE.value, offload_dst=PINNED_HOST)
        return cp.save_only_these_names(*saved)

    def describe(self) -> str:
        if not self.remat:
            return "no remat"
        parts = [f"{n}->{p.value}" for n, p in self.placements]
        return ", ".join(parts + [f"rest->{self.default.value}"])


def _all(placement: Placement, which) -> OffloadPolicy:
    return OffloadPolicy(placements=tuple((n, placement) for n in which))


PRESETS: dict[str, OffloadPolicy] = {
    "save_all": OffloadPolicy.no_remat(),
    "recompute_all": OffloadPolicy(),
    "offload_inputs": _all(Placement.HOST, [names.BLOCK_INPUT]),
    "save_dots": _all(Placement.DEVICE, names.DOT_NAMES),
    "offload_dots": _all(Placement.HOST, names.DOT_NAMES),
    "save_qkv_offload_mlp": OffloadPolicy(placements=(
        (names.QKV, Placement.DEVICE), (names.ATTN_CONTEXT, Placement.DEVICE),
        (names.MLP_HIDDEN, Placement.HOST), (names.MLP_OUT, Placement.HOST))),
    "offload_all": _all(Placement.HOST, names.ACTIVATION_NAMES),
}


# Presets for blocks whose MLP is a mixture-of-experts layer (layers/moe.py). Apart from PRESETS
# because they name the MoE tags, which a dense block never makes (the stack refuses a plan naming
# a tag its block lacks). The dense presets that name no MLP tag (save_all, recompute_all,
# offload_inputs) apply to MoE blocks as they are; those naming MLP tags apply where the MoE layer
# has shared experts (a dense MLP). Attention is treated as in the dense presets.
_ATTENTION_SAVED = tuple((n, Placement.DEVICE) for n in names.ATTENTION_DOT_NAMES)
MOE_PRESETS: dict[str, OffloadPolicy] = {
    # Every matmul output in HBM: attention, router and experts (the dispatch gathers are recomputed).
    "moe_save_dots": _all(Placement.DEVICE, names.ATTENTION_DOT_NAMES + names.MOE_DOT_NAMES),
    # Attention and expert matmul outputs and the dispatched tokens to host; the router's logits stay.
    "moe_offload_dots": OffloadPolicy(placements=(
        (names.ROUTER_LOGITS, Placement.DEVICE),
        *((n, Placement.HOST) for n in names.ATTENTION_DOT_NAMES),
        *((n, Placement.HOST) for n in (names.EXPERT_INPUT, names.EXPERT_HIDDEN, names.EXPERT_OUT)))),
    # Attention kept in HBM, the expert activations (most of an MoE block's bytes) to host.
    "moe_offload_experts": OffloadPolicy(placements=(
        *_ATTENTION_SAVED, (names.ROUTER_LOGITS, Placement.DEVICE),
        *((n, Placement.HOST) for n in (names.EXPERT_INPUT, names.EXPERT_HIDDEN, names.EXPERT_OUT)))),
    # Attention kept, the experts (and their dispatch) recomputed in the backward pass.
    "moe_recompute_experts": OffloadPolicy(placements=(
        *_ATTENTION_SAVED, (names.ROUTER_LOGITS, Placement.DEVICE))),
}


def presets_for(tagged: frozenset[str]) -> list[str]:
    """The presets (dense and MoE) that name only activations of `tagged`: those a block tagging them serves."""
    return [name for name, policy in {**PRESETS, **MOE_PRESETS}.items() if policy.names() <= tagged]


def preset(name: str) -> OffloadPolicy:
    if name in PRESETS:
        return PRESETS[name]
    try:
        return MOE_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown offload preset {name!r}; known presets: {sorted(PRESETS)}, "
                         f"for mixture-of-experts blocks: {sorted(MOE_PRESETS)}") from None


@dataclasses.dataclass(frozen=True)
class Segment:
    """`num_layers` consecutive layers under one policy; None means 'all remaining'."""

    policy: OffloadPolicy
    num_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """Policies for consecutive segments of a layer stack, first layers first."""

    segments: tuple[Segment, ...]

    @classmethod
    def uniform(cls, policy: OffloadPolicy) -> "RematPlan":
        return cls((Segment(policy),))

    @classmethod
    def parse(cls, spec: "str | OffloadPolicy | RematPlan") -> "RematPlan":
        """Parse "preset" or "preset:K,preset:K,...,preset" (last without count = rest)."""
        if isinstance(spec, RematPlan):
            return spec
        if isinstance(spec, OffloadPolicy):
            return cls.uniform(spec)
        segments = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                raise ValueError(f"empty segment in remat plan {spec!r}")
            name, _, count = part.partition(":")
            if count:
                try:
                    n = int(count)
                except ValueError:
                    raise ValueError(f"segment {part!r} in remat plan {spec!r}: layer count must be an integer") from None
                if n <= 0:
                    raise ValueError(f"segment {part!r} in remat plan {spec!r}: layer count must be positive")
                segments.append(Segment(preset(name), n))
            else:
                segments.append(Segment(preset(name), None))
        return cls(tuple(segments))

    def resolve(self, num_layers: int) -> list[tuple[int, int, OffloadPolicy]]:
        """[(start, stop, policy)] covering exactly `num_layers` layers."""
        out, start = [], 0
        for i, seg in enumerate(self.segments):
            if seg.num_layers is None:
                if i != len(self.segments) - 1:
                    raise ValueError("only the last segment of a remat plan may omit its layer count")
                stop = num_layers
            else:
                stop = start + seg.num_layers
            if stop > num_layers:
                raise ValueError(
                    f"remat plan segment boundary {stop} is beyond the stack's {num_layers} layers")
            if stop > start:
                out.append((start, stop, seg.policy))
            start = stop
        if start != num_layers:
            raise ValueError(
                f"remat plan covers {start} of {num_layers} layers; end it with a segment without a count")
        return out

    def names(self) -> frozenset[str]:
        return frozenset().union(*(s.policy.names() for s in self.segments))

    def describe(self) -> str:
        return " | ".join(
            f"{'rest' if s.num_layers is None else s.num_layers} layers: {s.policy.describe()}"
            for s in self.segments)
