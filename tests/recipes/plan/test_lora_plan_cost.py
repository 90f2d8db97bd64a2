"""The planner's price of a LoRA step: the frozen base's FLOPs and link bytes, not a full fine-tune's.

A LoRA step (recipes/train/lora_step.py) forms no gradient of the frozen base: with the base in host memory
it is read in the forward and again in the backward pass, and nothing of it goes back (the compiled 8B step,
BENCHMARKS.md "Fine-tuning Llama 3.1 8B": per micro-batch the block weights in, twice, and no gradient out);
the optimizer updates the adapters only. The FLOPs are models/lora_flops.py's (tests/models/test_lora_flops.py
checks them against XLA).
"""

import jax
import pytest
from flax import nnx

from spillway.models import lora_flops
from spillway.recipes.plan import cost_model
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe
from spillway.recipes.targets import get_target
from spillway.recipes.train.step import abstract_model

ONE_GPU = {"data": 1, "fsdp": 1, "tensor": 1}
SMALL = ["model.num_layers=4", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
         "model.mlp_hidden=1024", "model.vocab_size=1024", "model.max_seq_len=1024", "execution.dtype=bfloat16",
         "execution.param_dtype=bfloat16", "execution.attention_impl=flash", "execution.flash_block_size=128",
         "data.seq_len=512", "train.global_batch=4", "train.grad_accum=2"]
LORA = ["lora.rank=8", "lora.alpha=16", "lora.targets=q_proj,v_proj,down_proj", "checkpoint.init_from=/nowhere"]
HOST_BASE = Candidate.of("offload_dots", "device", "host")   # the adapters' state in HBM, the base on host


@pytest.fixture(scope="module")
def recipes():
    return get_recipe("tiny", SMALL), get_recipe("tiny", SMALL + LORA)


def block_weight_bytes(recipe) -> int:
    """The bytes of the stacked block weights (every [layers, ...] leaf but the adapters), from the model."""
    _, state = abstract_model(recipe)
    return sum(v.get_value().size * v.get_value().dtype.itemsize
               for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
               if not isinstance(v, nnx.LoRAParam) and v.get_value().shape[:1] == (recipe.model.num_layers,))


def test_a_frozen_base_on_host_is_read_twice_a_micro_batch_and_sends_nothing_back(recipes):
    full, lora = recipes
    weights = block_weight_bytes(lora)
    traffic = cost_model.param_traffic(HOST_BASE, lora, ONE_GPU)
    assert traffic.host_weights == weights
    assert traffic.weights_in_forward == traffic.weights_in_backward == 2 * weights   # grad_accum 2
    assert traffic.gradients_out == traffic.sums_in == traffic.update_in == traffic.update_out == 0
    # The same weights trained: their float32 gradient sums (2 micro-batches, bf16 weights: about twice
    # the weights' bytes each) cross in the backward pass, and the update moves them again.
    trained = cost_model.param_traffic(Candidate.of("offload_dots", "host", "host"), full, ONE_GPU)
    assert trained.host_weights == weights
    assert trained.gradients_out == trained.sums_in > 3 * weights
    assert trained.update_out > weights


def test_the_lora_step_is_priced_without_the_base_gradients_or_its_update(recipes):
    full, lora = recipes
    weights = block_weight_bytes(lora)
    target = get_target("rtx4080")
    # What the compiled LoRA step moves (the 8B's pattern): the weights in, twice; no update traffic.
    report = {"device_to_host_bytes": 0, "host_to_device_bytes": 4 * weights, "host_argument_bytes": weights,
              "overlapped_transfer_bytes": 0}
    row = cost_model.plan_row(HOST_BASE, {"report": report}, lora, target, ONE_GPU)
    spec = lora.decoder_spec()
    counted = lora_flops.lora_step_flops(spec, 4, 512, lora.lora_spec(), remat="offload_dots")
    assert row.flops == counted.to_dict()
    assert row.update_s == 0
    link = target.host_link_bytes_per_s
    assert row.backward_s == pytest.approx(max((counted.backward + counted.recompute) * row.compute_s / counted.total,
                                               2 * weights / link))
    # A full fine-tune of the same model counts more than the adapters' step does.
    assert cost_model.step_flops(full, "offload_dots").total > 1.3 * counted.total


def test_the_host_cpu_updates_the_adapters_only(recipes):
    full, lora = recipes
    # rank 8 on q (256 -> 256), v (256 -> 128) and down (1024 -> 256), 4 layers: A [8, in] and B [out, 8].
    adapters = 4 * 8 * ((256 + 256) + (256 + 128) + (1024 + 256))
    assert cost_model.params_per_gpu(lora, ONE_GPU) == adapters
    assert cost_model.params_per_gpu(full, ONE_GPU) == full.num_params()
