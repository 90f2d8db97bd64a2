"""Stacks whose layers differ: per-layer values scanned beside the weights, and runs of one structure.

Two kinds of difference between the layers of one model, handled two ways
(docs/DESIGN.md section 2):

    values     the sliding window, the RoPE base and a linear RoPE position
               scale (Gemma 2's alternating local and global layers, Gemma 3's
               five local and one global). Each layer has its `LayerSettings`;
               the stack turns them into `LayerValues` arrays [L]
               (layers/layer_values.py) and scans them as data beside the
               stacked weights, so the layers keep one weight stack and one
               compiled body however deep the model.
    structure  a different block (a mixture-of-experts layer among dense ones,
               another MLP width): a `StackRun` is consecutive layers of one
               structure, with a weight stack and a scan of its own.

`runs_of` checks that a list of runs covers the stack; `values_of` turns the
settings of some layers into the arrays the scan reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from spillway.layers.block import BlockConfig
from spillway.layers.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LayerSettings:
    """The values one layer may differ in from the others of its stack (scanned, not structural)."""

    sliding_window: int | None = None      # None: global attention
    rope_theta: float = 10000.0
    rope_scale: float = 1.0                # linear position scaling: RoPE sees positions / rope_scale

    def __post_init__(self):
        if self.sliding_window is not None and not self.sliding_window > 0:
            raise ConfigError(f"a layer's sliding_window must be positive (or None for global attention), "
                              f"got {self.sliding_window}")
        for name in ("rope_theta", "rope_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"a layer's {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def of_block(cls, block: BlockConfig) -> "LayerSettings":
        """The settings a block config holds statically (every layer of a uniform stack)."""
        return cls(sliding_window=block.sliding_window, rope_theta=block.rope_theta)


@dataclasses.dataclass(frozen=True)
class StackRun:
    """Consecutive layers of one structure: one stack of weights, one scan (per remat segment)."""

    block: BlockConfig
    num_layers: int
    block_cls: type | None = None          # None: the stack's (the family's, or the recipe's) block class

    def __post_init__(self):
        if not self.num_layers > 0:
            raise ConfigError(f"a run of layers needs at least one layer, got {self.num_layers}")


def check_runs(runs: Sequence[StackRun], num_layers: int) -> tuple[StackRun, ...]:
    """`runs` as a tuple, checked to cover exactly `num_layers` layers."""
    runs = tuple(runs)
    if not runs:
        raise ConfigError("a block stack needs at least one run of layers")
    covered = sum(r.num_layers for r in runs)
    if covered != num_layers:
        raise ConfigError(f"the runs of layers cover {covered} layers ({[r.num_layers for r in runs]}), "
                          f"but the stack has {num_layers}")
    return runs


def run_bounds(runs: Sequence[StackRun]) -> tuple[tuple[int, int], ...]:
    """[(first layer, stop)] of each run."""
    out, start = [], 0
    for r in runs:
        out.append((start, start + r.num_layers))
        start += r.num_layers
    return tuple(out)


def values_of(settings: Sequence[LayerSettings]):
    """The LayerValues arrays [len(settings)] of these layers: window 0 for global attention."""
    from spillway.layers.layer_values import LayerValues

    return LayerValues(
        sliding_window=np.asarray([s.sliding_window or 0 for s in settings], np.int32),
        rope_theta=np.asarray([s.rope_theta for s in settings], np.float32),
        rope_scale=np.asarray([s.rope_scale for s in settings], np.float32))


def needs_values(settings: Sequence[LayerSettings] | None, runs: Sequence[StackRun]) -> bool:
    """Whether these layers must scan per-layer values: some layer differs from its run's static block."""
    if settings is None:
        return False
    for (start, stop), run in zip(run_bounds(runs), runs, strict=True):
        static = LayerSettings.of_block(run.block)
        if any(s != static for s in settings[start:stop]):
            return True
    return False
