"""Checks shared by the tests of the Llama-shaped families (Mistral, Qwen2, Qwen3): not a test module itself.

    forward              spillway logits, jitted with the model as an argument
    perturbed_hf_model   a tiny random transformers model with every parameter moved off its init
    hf_logits            its float32 logits for a batch of tokens
    numpy_state_dict     its tensors as numpy arrays, by Hugging Face name
    transformers_param_count   a published config's parameter count, counted by transformers on the meta device

(The offload-plan check every family shares is tests/no_remat_reference.py; the
`transformers` fixture is tests/models/conftest.py's.)

The parity tests build the reference from transformers' own classes and
Hugging Face config dicts written out in the test, so the comparison never
goes through the spillway mapping it checks.
"""

import jax
import numpy as np

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
