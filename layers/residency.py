"""Per-layer residency: a placement setting that keeps the last N block layers in host memory, the rest in HBM.

`offload.optimizer_state` names where the optimizer state lives: "device", "host", or a split

    host:20     the state of the last 20 block layers in pinned host memory, the first L - 20 in HBM
    host:0.25   the last quarter of the block layers (round(0.25 x L), at least 1 when the fraction is
                above 0) in host memory

Only the host layers are streamed through HBM for the update; the resident ones are updated on the
device in the same step. The split counts the entries of a stacked leaf's leading "layers" axis, so
it needs a model whose blocks are one stack (every published recipe's); the recipe checks the count
against model.num_layers. The last layers go to host because item 3 of issue 29 (the weights across
the forward/backward turn) wants the first layers' weights resident.

`offload.params` takes the same split for the block weights (`host:N`: the last N layers' stacked weights in
host memory, streamed through HBM a layer at a time, the first L - N in HBM for good), and `experts:N` for an
MoE model's routed experts only; the optimizer state must then be split at the same layer (the update of a
layer's weights runs where its state is).

Pure Python (no JAX): recipes/config.py validates the spelling before anything is built.
"""

from __future__ import annotations

import dataclasses
import re

from spillway.layers.errors import ConfigError
from spillway.layers.memory import EXPERTS, Memory

SPLIT_PREFIX = f"{Memory.HOST}:"
EXPERTS_SPLIT_PREFIX = f"{EXPERTS}:"
SPELLING = "'device', 'host', 'host:N' (the last N block layers on host, N a whole number) or 'host:F' (a fraction 0 < F < 1)"
PARAM_SPELLING = ("'device', 'host', 'experts', 'host:N' / 'experts:N' (the last N block layers' weights, or "
                  "only their routed experts, on host) or 'host:F' / 'experts:F' (a fraction 0 < F < 1)")


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """A parsed `host:N` / `host:F`: how many of a stack's layers (the last ones) live in host memory."""
    count: int | None = None
    fraction: float | None = None

    def host_layers(self, num_layers: int) -> int:
        """Layers on host out of `num_layers` (the last ones); a fraction rounds to the nearest layer,
        and a fraction above 0 puts at least one layer on host."""
        if self.count is not None:
            return self.count
        return min(num_layers, max(1, int(self.fraction * num_layers + 0.5)))

    def spelled(self) -> str:
        return f"{SPLIT_PREFIX}{self.count if self.count is not None else self.fraction:g}"


def is_split(setting: str) -> bool:
    return isinstance(setting, str) and setting.startswith(SPLIT_PREFIX)


def is_param_split(setting: str) -> bool:
    """Whether an offload.params setting is a split: `host:...` or `experts:...`."""
    return is_split(setting) or (isinstance(setting, str) and setting.startswith(EXPERTS_SPLIT_PREFIX))


def whole_placement(setting: str) -> str:
    """The placement a split applies to its host layers ("host" or "experts"); any other setting as it is."""
    return setting.split(":", 1)[0] if is_param_split(setting) else setting


def parse_split(setting: str, name: str) -> LayerSplit:
    """The LayerSplit of a `host:...` (or `experts:...`) setting; ConfigError naming `name` (e.g.
    offload.optimizer_state) otherwise."""
    text = setting.split(":", 1)[1].strip()
    spelling = PARAM_SPELLING if setting.startswith(EXPERTS_SPLIT_PREFIX) or name == "offload.params" else SPELLING
    problem = f"{name}={setting!r}: a split must be {spelling}"
    if re.fullmatch(r"[+-]?[0-9]+", text):
        count = int(text)
        if count < 0:
            raise ConfigError(f"{problem}; a layer count cannot be negative")
        return LayerSplit(count=count)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(problem) from None
    if not 0 < value < 1:   # also refuses nan and inf, which float() reads but no split can mean
        raise ConfigError(f"{problem}; {text} is neither a whole count of layers nor a fraction between 0 and 1")
    return LayerSplit(fraction=value)


def host_layers(setting: str, num_layers: int) -> int:
    """How many of a stack of `num_layers` layers a placement setting puts in host memory (the last ones)."""
    if setting in (Memory.HOST, EXPERTS):
        return num_layers
    if is_param_split(setting):
        return parse_split(setting, "the split").host_layers(num_layers)
    return 0


def memory_of(setting: str) -> str:
    """The whole-model memory a setting stands for where only one can be named: "host" if any layer is on host."""
    return Memory.HOST if is_split(setting) else setting


def check_split_fits(setting: str, name: str, num_layers: int, stacks: int) -> None:
    """ConfigError when a split names more layers than the model's block stack has, or the model's blocks
    are not one stack (`stacks` runs of layers)."""
    if not is_param_split(setting):
        return
    split = parse_split(setting, name)
    if stacks != 1:
        raise ConfigError(f"{name}={setting}: a split needs the block layers in one stack; this model has "
                          f"{stacks} runs of layers (use 'device' or 'host')")
    if split.count is not None and split.count > num_layers:
        raise ConfigError(f"{name}={setting}: the model has {num_layers} block layers; a split may put 0 to "
                          f"{num_layers} of them on host")
