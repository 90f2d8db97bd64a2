"""What the train step makes of the values a model's blocks emit (layers/aux_outputs.py): loss terms and metrics.

The step's objective opens the collector around the model (recipes/train/step.py
`make_objective`); what it receives is {key: pytree}, every leaf stacked over the
layers that emitted it ([layers, ...]). Each key becomes metrics, and router
statistics also become loss terms:

    RouterStats (an MoE layer)   loss: aux_loss.load_balancing x load-balancing loss
                                       + aux_loss.router_z x router z-loss, each added only when its
                                       coefficient is not 0 (layers/router.py has the formulas: the
                                       statistics of all layers pooled, as Hugging Face's Mixtral and
                                       Qwen3-MoE load_balancing_loss_func pools them)
                                 metrics: KEY/lb_loss, KEY/z_loss (unweighted), KEY/dropped (the fraction
                                       of token-choices a capacity dispatch dropped), KEY/load (each
                                       expert's share of the top-k choices, per layer [layers, E] in the
                                       step, averaged over the layers [E] in metrics.jsonl) and
                                       KEY/load_max (the largest share of any expert in any layer, times E:
                                       1 is perfectly balanced, E/k everything on k experts)
    anything else                metrics only: KEY (or KEY/field for a pytree), each leaf's mean over
                                 the layers

Micro-batches (train.grad_accum > 1). Each micro-batch's objective is formed
from its own statistics and the step's is their mean, as Hugging Face's Trainer
and Megatron-LM's default do with gradient accumulation: the cross-entropy and
the z-loss (means over equal micro-batches) then equal the whole batch's, but
the load-balancing loss, a product of two means, is the mean of the
micro-batches' losses, not the loss of the pooled batch (pooling would need
every micro-batch's expert counts before the first backward pass). The step's
metrics are the means of the micro-batches' metrics, which for the loads and the
dropped fraction (equal token counts per micro-batch) are the pooled figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spillway.layers.errors import ConfigError
from spillway.layers.router import RouterStats, load_balancing_loss, router_z_loss

AUX_METRICS = "aux"          # the step's metrics hold the emitted values' metrics under this key
LB_LOSS, Z_LOSS, DROPPED, LOAD, LOAD_MAX = "lb_loss", "z_loss", "dropped", "load", "load_max"


def _is_router_stats(value) -> bool:
    return isinstance(value, RouterStats)


def batch_terms(values: Mapping[str, Any], coefficients) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """(the weighted auxiliary loss of one batch, or None when no coefficient weights anything; its metrics).

    `values`: what one batch's collector received. `coefficients`: an AuxLossConfig.
    """
    weighted, metrics = [], {}
    for key, value in values.items():
        if not _is_router_stats(value):
            for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                name = key + "".join(f"/{_path_part(p)}" for p in path)
                metrics[name] = jnp.mean(jnp.asarray(leaf, jnp.float32), axis=0) if jnp.ndim(leaf) else leaf
            continue
        lb, z = load_balancing_loss(value), router_z_loss(value)
        if coefficients.load_balancing:
            weighted.append(coefficients.load_balancing * lb)
        if coefficients.router_z:
            weighted.append(coefficients.router_z * z)
        layers = value.expert_choices.reshape(-1, value.expert_choices.shape[-1])   # [layers, E]
        metrics[f"{key}/{LB_LOSS}"] = lb
        metrics[f"{key}/{Z_LOSS}"] = z
        metrics[f"{key}/{DROPPED}"] = jnp.sum(value.dropped) / jnp.sum(layers)
        metrics[f"{key}/{LOAD}"] = layers / jnp.sum(layers, axis=-1, keepdims=True)
    total = None
    for term in weighted:
        total = term if total is None else total + term
    return total, metrics


def _path_part(entry) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def check_emitted(values: Mapping[str, Any], coefficients) -> None:
    """ConfigError when a coefficient is set but nothing the model emits is router statistics.

    `values`: the emitted values' structure (jax.eval_shape of the collector's contents is enough).
    """
    if not coefficients.any_set or any(_is_router_stats(v) for v in values.values()):
        return
    set_ = [f"aux_loss.{name}={getattr(coefficients, name)}" for name in ("load_balancing", "router_z")
            if getattr(coefficients, name)]
    emitted = f"it emits only {sorted(values)}" if values else "its blocks emit nothing"
    raise ConfigError(f"{' and '.join(set_)} weights router statistics, but this model has no MoE layer "
                      f"({emitted}): the coefficient would weight nothing; set it to 0")


def router_keys(metrics: Mapping[str, Any]) -> list[str]:
    """The keys whose metrics are router statistics' (those with a KEY/lb_loss)."""
    return [name.rsplit("/", 1)[0] for name in metrics if name.endswith(f"/{LB_LOSS}")]


def logged(aux_metrics: Mapping[str, Any]) -> dict[str, float | list]:
    """The step's aux metrics as metrics.jsonl values: scalars as floats, arrays as lists; each router
    key's per-layer loads [layers, E] become their mean over the layers and KEY/load_max."""
    row: dict[str, float | list] = {}
    routers = set(router_keys(aux_metrics))
    for name, value in aux_metrics.items():
        value = np.asarray(value, np.float64)
        key, _, field = name.rpartition("/")
        if key in routers and field == LOAD:
            row[name] = [float(v) for v in value.mean(axis=0)]
            row[f"{key}/{LOAD_MAX}"] = float(value.max() * value.shape[-1])
        else:
            row[name] = float(value) if value.ndim == 0 else value.tolist()
    return row


def progress(row: Mapping[str, Any]) -> dict[str, str]:
    """A few short fields for the progress line: per router key its load-balancing loss, its worst
    load (x the fair share) and, when some were dropped, the dropped fraction."""
    fields = {}
    routers = router_keys(row)
    for key in routers:
        prefix = "" if len(routers) == 1 else f"{key}."
        fields[f"{prefix}lb"] = f"{row[f'{key}/{LB_LOSS}']:.3f}"
        fields[f"{prefix}load"] = f"{row[f'{key}/{LOAD_MAX}']:.2f}x"
        if row[f"{key}/{DROPPED}"] > 0:
            fields[f"{prefix}drop"] = f"{row[f'{key}/{DROPPED}']:.1%}"
    return fields
