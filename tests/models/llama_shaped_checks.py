"""Checks shared by the tests of the Llama-shaped families (Mistral, Qwen2, Qwen3): not a test module itself.

    perturbed_hf_model   a tiny random transformers model with every parameter moved off its init
    hf_logits            its float32 logits for a batch of tokens
    transformers_param_count   a published config's parameter count, counted by transformers on the meta device
    assert_every_plan_matches_no_remat   loss and gradients under every offload preset equal the no-remat run

The parity tests build the reference from transformers' own classes and
Hugging Face config dicts written out in the test, so the comparison never
goes through the spillway mapping it checks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from spillway.layers.offload import PRESETS
from spillway.layers.sharding import create_sharded

# Every preset, plus a two-segment plan (offload the first layer's matmul outputs, keep the next).
PLANS = sorted(PRESETS) + ["offload_dots:1,save_dots:1,recompute_all"]

# Jitted with the model as an argument: models with the same config share one compile.
forward = jax.jit(lambda model, tokens_bt: model(tokens_bt))


def perturbed_hf_model(transformers, config_cls: str, config: dict, seed: int = 0):
    """A float32 transformers model (eval mode, eager attention) whose every parameter is random.

    transformers initialises norm scales to one and biases to zero, so an
    untouched model cannot tell `w` from `1 + w` or a missing bias: norm scales
    become 1 + 0.1 N(0, 1), biases 0.5 N(0, 1), matrices N(0, 1) / sqrt(fan_in).
    """
    import torch

    hf_config = getattr(transformers, config_cls)(**config, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is the embedding, visited once
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(".bias"):
                param.copy_(0.5 * noise)
            elif param.ndim == 1:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model


def hf_logits(model, tokens_bt: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens_bt)).logits.numpy()


def numpy_state_dict(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


def transformers_param_count(transformers, hf_config: dict) -> int:
    """Parameters of the transformers model of `hf_config`, built on the meta device (nothing allocated)."""
    import torch

    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied head is counted once


def assert_every_plan_matches_no_remat(model_cls, config, tokens_bt: np.ndarray, *, rtol=1e-5, atol=1e-7):
    """Cross-entropy loss and gradients of `model_cls(config)` under each of PLANS equal the save_all run."""
    inputs_bt, targets_bt = jnp.asarray(tokens_bt[:, :-1]), jnp.asarray(tokens_bt[:, 1:])

    def loss_fn(model):
        logits_btv = model(inputs_bt).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits_btv, targets_bt).mean()

    def loss_and_grads(model):
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda state: nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state)))
        # What a plan saves, recomputes or offloads is decided by XLA's HLO passes, which run
        # at every level; LLVM's optimisation of the CPU code (two thirds of each compile
        # here) does not change it, so it is switched off to keep nine compiles quick.
        return step.lower(state).compile(compiler_options={"xla_backend_optimization_level": 0})(state)

    base = create_sharded(lambda: model_cls(config, rngs=nnx.Rngs(0), remat="save_all"))
    ref_loss, ref_grads = loss_and_grads(base)
    assert np.isfinite(float(ref_loss))
    for plan in PLANS:
        model = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0), remat=plan))
        nnx.update(model, nnx.state(base))
        loss, grads = loss_and_grads(model)
        np.testing.assert_allclose(loss, ref_loss, rtol=rtol, atol=atol, err_msg=plan)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=plan),
                     nnx.state(grads), nnx.state(ref_grads))
