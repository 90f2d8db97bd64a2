"""The loss on the answers equals transformers' loss with labels = -100 on the masked positions.

A tiny random LlamaForCausalLM and the spillway Llama that imports its weights
see the same tokens; spillway's loss is the train step's (recipes/train/step.py
make_loss_fn on a TrainBatch with a loss mask), transformers' its own
`model(input_ids, labels=...)` with every non-target label set to -100.
Both are the mean over the target tokens only.
"""

import numpy as np
import pytest
from flax import nnx

from spillway.models.hf import from_hf
from spillway.recipes.train.sft_batch import TrainBatch
from spillway.recipes.train.step import make_loss_fn

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
              max_position_embeddings=64, hidden_act="silu", attention_bias=False, model_type="llama")


@pytest.mark.parametrize("loss_chunk", [0, 8], ids=["whole", "chunked"])
def test_masked_loss_equals_transformers_with_ignored_labels(transformers, loss_chunk):
    import torch

    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="eager")).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape) / (param.shape[-1] ** 0.5 if param.ndim > 1 else 10.0) + (param.ndim == 1))
    model = from_hf({k: v.detach().numpy() for k, v in reference.state_dict().items()}, config=CONFIG,
                    dtype="float32", param_dtype="float32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG["vocab_size"], (3, 17)).astype(np.int32)
    mask = (rng.random((3, 16)) < 0.3).astype(np.float32)   # which targets (tokens[:, 1:]) count
    labels = np.where(np.concatenate([np.zeros((3, 1)), mask], axis=1) > 0, tokens, -100)

    graphdef, params = nnx.split(model)
    ours = float(make_loss_fn(graphdef, loss_chunk)(params, TrainBatch(tokens, mask)))
    with torch.no_grad():
        theirs = float(reference(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                                 labels=torch.from_numpy(labels.astype(np.int64))).loss)
    assert ours == pytest.approx(theirs, rel=1e-5)
