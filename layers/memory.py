"""Where an array lives: the one spelling of "device" and "host" that every package uses.

`Memory` names the two places a parameter, its gradient or its optimizer state
can live (`offload.optimizer_state`, `offload.params`, a parameter's
`optimizer_memory` / `param_memory` metadata, layers/params.py). It is a
`str` enum, so recipe fields and JSON keep plain strings and compare equal to
its members. `PINNED_HOST` is the XLA memory kind that holds host-resident
arrays (`sharding.with_memory_kind(PINNED_HOST)`).

`offload.params` names one more placement than a memory: `EXPERTS`, the
routed experts' stacked weights in host memory and every other parameter
(attention, norms, router, shared experts) on device (layers/host_weights.py
`stacked_weight_memory` says which leaf goes where).
"""

from __future__ import annotations

import enum


class Memory(enum.StrEnum):
    DEVICE = "device"   # HBM on a GPU
    HOST = "host"       # pinned host memory


MEMORIES = tuple(m.value for m in Memory)   # ("device", "host"): what a setting may name
PINNED_HOST = "pinned_host"                 # the XLA memory kind of host-resident arrays
EXPERTS = "experts"                         # offload.params: only the routed experts' weights on host
PARAM_PLACEMENTS = (*MEMORIES, EXPERTS)     # what offload.params may name
