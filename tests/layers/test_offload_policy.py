"""OffloadPolicy and RematPlan: every preset gives the no-remat loss and gradients, copies what it names to
host memory in the jaxpr; bad specs fail loudly.

On CPU, memory kinds lower to no-ops: a CPU run cannot see where a value
lives, only that the numbers are right. Placement is asserted where it shows:
in the jaxpr here (the `device_put` to host that remat's partial evaluation
inserts for each offloaded residual), and in the compiled HLO of the
deviceless GPU compiles (tests/recipes/plan/test_aot.py, test_planner.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from no_remat_reference import NoRematReference
from spillway.layers import names
from spillway.layers.offload import PRESETS, OffloadPolicy, Placement, RematPlan, preset
from spillway.layers.stack import host_offloaded_names
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config


@pytest.fixture(scope="module")
def no_remat():
    tokens_bt = np.random.default_rng(1).integers(0, preset_config("llama", "tiny_odd").vocab_size, (2, 19))
    return NoRematReference(DecoderLM, preset_config("llama", "tiny_odd"), tokens_bt)


CUSTOM = OffloadPolicy.of({names.QKV: "host", names.MLP_HIDDEN: "device", names.BLOCK_INPUT: "host"})
# every other value saved, QKV to host: its first gradient was a ValueError from jax.checkpoint_policies'
# save_from_both_policies, which takes booleans only (a new user's finding)
SAVE_REST_OFFLOAD_QKV = OffloadPolicy.of({names.QKV: "host", names.MLP_OUT: "recompute"}, default="device")


@pytest.mark.parametrize("remat", sorted(PRESETS) + [CUSTOM, "offload_dots:1,save_dots:1,recompute_all",
                                                     OffloadPolicy.of({names.MLP_OUT: "recompute"}, default="device"),
                                                     SAVE_REST_OFFLOAD_QKV],
                         ids=str)
def test_every_policy_gives_the_no_remat_loss_and_gradients(remat, no_remat):
    no_remat.check(remat)


def offloaded_in_jaxpr(remat) -> dict[str, int]:
    cfg = preset_config("llama", "tiny_odd")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0), remat=remat)))
    tokens = jnp.zeros((2, 9), jnp.int32)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(tokens).astype(jnp.float32) ** 2)
    return dict(host_offloaded_names(jax.make_jaxpr(jax.grad(loss))(state)))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_copies_to_host_exactly_the_names_it_offloads(name):
    """What the backward pass reads and the policy sends to host is copied there; nothing else is.

    MLP_OUT is never read back (the backward of a residual add needs no values), so offloading it
    copies nothing. The MLP's hidden activation is two tagged values (gate and up).
    """
    policy = PRESETS[name]
    wanted = set(policy.names_with(Placement.HOST)) - {names.MLP_OUT} if policy.remat else set()
    found = offloaded_in_jaxpr(name)
    assert set(found) == wanted, (name, found)
    expected_counts = {names.BLOCK_INPUT: 1, names.QKV: 3, names.ATTN_CONTEXT: 1, names.ATTN_OUT: 1,
                       names.MLP_HIDDEN: 2}
    assert found == {n: expected_counts[n] for n in wanted}


def test_segments_offload_only_their_layers_names():
    """Two segments, two scans: the first offloads dots, the second nothing."""
    assert offloaded_in_jaxpr("offload_dots:1,recompute_all") == offloaded_in_jaxpr("offload_dots")
    assert offloaded_in_jaxpr("recompute_all:1,offload_inputs") == {names.BLOCK_INPUT: 1}


def test_no_remat_is_not_recompute_all():
    assert not preset("save_all").remat and preset("recompute_all").remat
    with pytest.raises(ValueError, match="no jax.checkpoint policy"):
        preset("save_all").to_jax()


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown offload preset 'offload_everything'"):
        RematPlan.parse("offload_everything")


def test_bad_placement_is_named():
    with pytest.raises(ValueError, match="'nowhere'"):
        OffloadPolicy.of({names.QKV: "nowhere"})


def test_policy_naming_untagged_activation_fails_at_build():
    with pytest.raises(ValueError, match=r"names \['router_logits'\].*never tags"):
        nnx.eval_shape(lambda: DecoderLM(preset_config("llama", "tiny_odd"), rngs=nnx.Rngs(0),
                                     remat=OffloadPolicy.of({"router_logits": "host"})))


def test_segment_boundary_beyond_layers():
    with pytest.raises(ValueError, match="boundary 5 is beyond the stack's 3 layers"):
        nnx.eval_shape(lambda: DecoderLM(preset_config("llama", "tiny_odd"), rngs=nnx.Rngs(0), remat="offload_dots:5,recompute_all"))


def test_segments_resolve_in_order():
    plan = RematPlan.parse("offload_dots:2,save_dots:1,recompute_all")
    spans = [(a, b, p) for a, b, p in plan.resolve(6)]
    assert [(a, b) for a, b, _ in spans] == [(0, 2), (2, 3), (3, 6)]
    assert spans[0][2].names_with(Placement.HOST) and spans[2][2] == preset("recompute_all")


def test_plan_must_cover_all_layers():
    with pytest.raises(ValueError, match="covers 2 of 4 layers"):
        RematPlan.parse("offload_dots:2").resolve(4)


def test_a_policy_that_saves_the_rest_copies_its_host_names_to_host():
    # (how many of the three tagged q, k, v values the backward pass reads depends on what else is saved: with
    # every untagged value kept, two of them here)
    assert set(offloaded_in_jaxpr(SAVE_REST_OFFLOAD_QKV)) == {names.QKV}
