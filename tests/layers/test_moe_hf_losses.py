"""The load-balancing loss (layers/router.py) equals Hugging Face's on the same router logits.

The reference is `load_balancing_loss_func` of transformers' Mixtral and
Qwen3-MoE modelling files: E * sum_e f_e * P_e with the statistics of every
layer pooled before the product, f_e counting top-k choices per token. Needs
torch + transformers (the `parity` extra), hence `needs_torch`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers.router import load_balancing_loss, route, router_stats

pytestmark = pytest.mark.needs_torch

WHY_SKIPPED = "needs torch and transformers (the `parity` extra) for the Hugging Face reference"


@pytest.fixture(scope="module")
def torch():
    module = pytest.importorskip("torch", reason=WHY_SKIPPED)
    pytest.importorskip("transformers", reason=WHY_SKIPPED)
    module.set_num_threads(1)
    return module


def stacked_stats(logits_lne, top_k, renormalize=True):
    per_layer = [router_stats(route(jnp.asarray(layer), top_k, renormalize)) for layer in logits_lne]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("layers, tokens, experts, top_k", [(1, 21, 5, 2), (3, 17, 5, 2), (2, 9, 7, 3)])
def test_load_balancing_loss_equals_transformers(torch, family, layers, tokens, experts, top_k):
    import importlib
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    # Scaled logits make the routing uneven, so the loss is far from its balanced value (k).
    logits_lne = 3.0 * np.random.default_rng(layers * 100 + experts).standard_normal((layers, tokens, experts),
                                                                                      dtype=np.float32)
    want = float(hf.load_balancing_loss_func(tuple(torch.from_numpy(layer) for layer in logits_lne),
                                             num_experts=experts, top_k=top_k))
    # Renormalising the combine weights does not touch the statistics the loss reads.
    for renormalize in (True, False):
        got = float(load_balancing_loss(stacked_stats(logits_lne, top_k, renormalize)))
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert abs(want - top_k) > 1e-3
