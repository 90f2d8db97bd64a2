"""The train step opens the auxiliary-output channel: MoE router losses in the objective, emitted values in metrics.

Oracles: the model's own emitted RouterStats turned into losses by hand here
(E * sum_e f_e P_e of the layer-pooled sums, as Hugging Face's
load_balancing_loss_func; the mean of logsumexp^2), a float32 cross-entropy
from optax, and a plain optax AdamW step; for the train-step variants (chunked
loss, remat and offload, host optimizer state, the deferred update, host
weights) the plain step's parameters. The MoE block is Llama's with an MoE MLP
(benchmarks/moe_blocks.py's top-2 of 5 experts, named by the recipe's `block`).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spillway.layers import aux_outputs
from spillway.layers.errors import ConfigError
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.optim.schedule import make_schedule
from spillway.recipes.registry import get_recipe
from spillway.recipes.train import aux_terms
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch
from spillway.recipes.train.step import make_loss_fn

from benchmarks.moe_blocks import TINY_EXPERTS, block_path

E = TINY_EXPERTS["num_experts"]
DROPLESS = block_path("tiny", "dropless")
EMITS = "aux_test_blocks:EmitsResidualScale"
LB, Z = 0.02, 0.001
STEPS = 3
BASE = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=32", "data.seq_len=16",
        "train.global_batch=8", "train.steps=20", "optimizer.warmup_steps=1", "optimizer.learning_rate=1e-2",
        "optimizer.weight_decay=0"]


def one_device():
    return make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])


def recipe(block: str | None = DROPLESS, *extra):
    return get_recipe("tiny", BASE + ([f"block={block}"] if block else []) + list(extra))


def with_aux(*extra):
    return (f"aux_loss.load_balancing={LB}", f"aux_loss.router_z={Z}", *extra)


def batches(n=STEPS, vocab=64):
    keys = jax.random.split(jax.random.key(3), n)
    return [jax.random.randint(k, (8, 17), 0, vocab, jnp.int32) for k in keys]


def run_steps(r, n=STEPS):
    """setup(r)'s train step run n times: (params as NumPy before each step and after the last, the last
    step's metrics, the TrainSetup)."""
    s = step_lib.setup(r, one_device())
    params, opt_state = s.params, s.optimizer.init(s.params)
    pending = s.nothing_pending(params)
    history = [jax.tree.map(np.array, params)]
    for tokens in batches(n):
        params, opt_state, pending, metrics = s.train_step(params, opt_state, pending, Batch(tokens=tokens))
        history.append(jax.tree.map(np.array, params))
    # the last update may still be pending (offload.update=next_forward): what the run applies before a save
    params, opt_state, pending = s.flush(params, opt_state, pending)
    history[-1] = jax.tree.map(np.array, params)
    return history, metrics, s


def reference_objective(graphdef):
    """(params, tokens, lb_coef, z_coef) -> (objective, (cross-entropy, load-balancing loss, z-loss,
    per-layer loads)), by hand. The coefficients are arguments, so every call of one jitted objective (with
    and without the auxiliary terms) is one compile."""
    def objective(params, tokens_bt, lb_coef, z_coef):
        with aux_outputs.collecting() as collected:
            logits = nnx.merge(graphdef, params)(tokens_bt[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens_bt[:, 1:]).mean()
        stats = collected.values["moe"]                    # RouterStats, every leaf [layers, ...]
        tokens = stats.tokens.sum()
        fraction = stats.expert_choices.sum(0) / tokens    # pooled over the layers, as Hugging Face pools
        mean_prob = stats.router_prob_sum.sum(0) / tokens
        lb = E * jnp.sum(fraction * mean_prob)
        z = stats.z_loss_sum.sum() / tokens
        load = stats.expert_choices / stats.expert_choices.sum(-1, keepdims=True)
        return ce + lb_coef * lb + z_coef * z, (ce, lb, z, load)
    return objective


def optax_steps(r, start, grads_of, n=STEPS):
    """n plain optax steps (clip, AdamW with the recipe's schedule, no weight decay) from `start`."""
    cfg = r.optimizer
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(make_schedule(cfg, r.schedule_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=0.0))
    @jax.jit   # one compile, not one per eager optax op and leaf shape (about 150 of them)
    def apply(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = start
    state = tx.init(params)
    for tokens in batches(n):
        params, state = apply(params, state, grads_of(params, tokens))
    return jax.tree.map(np.asarray, params)


def assert_trees_close(a, b, **tolerance):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, **tolerance)


def max_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def aux_run():
    return run_steps(recipe(DROPLESS, *with_aux()))


def test_objective_with_aux_equals_hand_computation_and_plain_optax(aux_run):
    history, metrics, s = aux_run
    objective = jax.jit(jax.value_and_grad(reference_objective(s.graphdef), has_aux=True))
    expected = optax_steps(s.recipe, history[0], lambda p, t: objective(p, t, LB, Z)[1])
    assert_trees_close(history[-1], expected, rtol=2e-5, atol=2e-6)
    # The auxiliary terms moved the weights: the cross-entropy alone gives other parameters.
    ce_only = optax_steps(s.recipe, history[0], lambda p, t: objective(p, t, 0.0, 0.0)[1])
    assert max_difference(history[-1], ce_only) > 1e-4
    # The last step's metrics: the cross-entropy as "loss", the unweighted terms and the loads of its batch,
    # at the weights it started from.
    (_, (ce, lb, z, load)), _ = objective(history[-2], batches()[-1], LB, Z)
    aux = metrics[aux_terms.AUX_METRICS]
    np.testing.assert_allclose(metrics["loss"], ce, rtol=1e-6)
    np.testing.assert_allclose(aux["moe/lb_loss"], lb, rtol=1e-6)
    np.testing.assert_allclose(aux["moe/z_loss"], z, rtol=1e-6)
    np.testing.assert_allclose(aux["moe/load"], load, rtol=1e-6)
    assert float(aux["moe/dropped"]) == 0.0              # dropless


def test_micro_batches_average_their_own_objectives():
    """grad_accum=2: each micro-batch's load-balancing loss is its own (aux_terms.py), the step's objective
    their mean; the cross-entropy, the z-loss and the loads are the whole batch's."""
    history, metrics, s = run_steps(recipe(DROPLESS, *with_aux("train.grad_accum=2")))
    objective = jax.jit(jax.value_and_grad(reference_objective(s.graphdef), has_aux=True))

    def mean_grads(p, tokens_bt):   # micro-batch m is rows m, m + 2, ... (recipes/train/step.py)
        grads = [objective(p, tokens_bt[m::2], LB, Z)[1] for m in range(2)]
        return jax.tree.map(lambda a, b: (a + b) / 2, *grads)

    assert_trees_close(history[-1], optax_steps(s.recipe, history[0], mean_grads), rtol=2e-5, atol=2e-6)

    last = batches()[-1]
    (_, (ce, lb, z, load)), _ = objective(history[-2], last, LB, Z)
    micro_lb = [float(objective(history[-2], last[m::2], LB, Z)[0][1][1]) for m in range(2)]
    aux = metrics[aux_terms.AUX_METRICS]
    np.testing.assert_allclose(metrics["loss"], ce, rtol=1e-5)
    np.testing.assert_allclose(aux["moe/z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(aux["moe/load"], load, rtol=1e-5)
    np.testing.assert_allclose(aux["moe/lb_loss"], np.mean(micro_lb), rtol=1e-5)
    assert abs(np.mean(micro_lb) - float(lb)) > 1e-6   # which is not the pooled batch's


# Each variant compiles its own step (about 20 s of CPU here): the deferred update, the path whose objective
# runs under a layer hook, runs by default; the rest with the slow tests.
SLOW = pytest.mark.slow
VARIANTS = [
    pytest.param(("offload.optimizer_state=host", "offload.update=next_forward"), id="update in the next forward"),
    pytest.param(("train.loss_chunk=8",), id="chunked loss", marks=SLOW),
    pytest.param(("offload.activations=recompute_all",), id="recompute_all", marks=SLOW),
    pytest.param(("offload.activations=moe_offload_experts",), id="expert activations offloaded", marks=SLOW),
    pytest.param(("offload.optimizer_state=host",), id="host optimizer state", marks=SLOW),
]


@pytest.mark.parametrize("settings", VARIANTS)
def test_every_step_variant_gives_the_same_parameters(aux_run, settings):
    (*_, expected), expected_metrics, _ = aux_run
    (*_, params), metrics, _ = run_steps(recipe(DROPLESS, *with_aux(*settings)))
    assert_trees_close(params, expected, rtol=2e-5, atol=2e-6)
    for name, value in expected_metrics[aux_terms.AUX_METRICS].items():
        np.testing.assert_allclose(metrics[aux_terms.AUX_METRICS][name], value, rtol=1e-5, err_msg=name)


@pytest.mark.slow   # two steps compiled, about 40 s of CPU here
def test_host_weights_with_micro_batches_give_the_same_parameters():
    (*_, on_device), metrics_device, _ = run_steps(recipe(DROPLESS, *with_aux("train.grad_accum=2")))
    (*_, on_host), metrics_host, _ = run_steps(recipe(DROPLESS, *with_aux(
        "train.grad_accum=2", "offload.optimizer_state=host", "offload.params=host")))
    assert_trees_close(on_host, on_device, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(metrics_host["aux"]["moe/lb_loss"], metrics_device["aux"]["moe/lb_loss"], rtol=1e-6)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_model_that_emits_nothing_compiles_the_step_it_compiled_before(grad_accum):
    """The dense recipe's step, lowered, is the text of the step as written before the channel was opened:
    value_and_grad of the plain loss, (a scan summing the micro-batches' gradients,) the optimizer update."""
    s = step_lib.abstract_setup(recipe(None, f"train.grad_accum={grad_accum}"), one_device(), platform="cpu")
    loss_fn = make_loss_fn(s.graphdef, s.recipe.train.loss_chunk, s.mesh)
    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(params, opt_state, pending, batch):
        if grad_accum == 1:
            loss, grads = grad_fn(params, batch)
        else:
            tokens_bt = batch.tokens
            micro_mbt = tokens_bt.reshape(-1, grad_accum, tokens_bt.shape[-1]).swapaxes(0, 1)

            def accumulate(grad_sum, micro_bt):
                loss, grads = grad_fn(params, Batch(tokens=micro_bt))
                return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), grad_sum, grads), loss

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            grad_sum, losses = jax.lax.scan(accumulate, zeros, micro_mbt)
            grads = jax.tree.map(lambda g: g / grad_accum, grad_sum)
            loss = jnp.mean(losses)
        params, opt_state, stats = s.optimizer.update(grads, opt_state, params)
        return params, opt_state, pending, {"loss": loss, **stats}

    args = step_lib.abstract_step_arguments(s)
    before = jax.jit(train_step, in_shardings=(s.param_shardings, s.opt_state_shardings, None, s.batch_sharding),
                     out_shardings=(s.param_shardings, s.opt_state_shardings, None,
                                    NamedSharding(s.mesh, PartitionSpec())),
                     donate_argnums=(0, 1))
    assert s.train_step.lower(*args).as_text() == before.lower(*args).as_text()


def test_any_emitted_value_reaches_the_metrics():
    """A block emitting a value no loss knows (aux_test_blocks.EmitsResidualScale): its mean over the layers
    is in the step's metrics and in the logged row."""
    history, metrics, s = run_steps(recipe(EMITS), n=1)
    with aux_outputs.collecting() as collected:
        nnx.merge(s.graphdef, history[0])(batches(1)[0][:, :-1])
    per_layer = np.asarray(collected.values["resid_scale"])
    assert per_layer.shape == (2,)
    np.testing.assert_allclose(metrics["aux"]["resid_scale"], per_layer.mean(), rtol=1e-6)
    assert aux_terms.logged(metrics["aux"]) == {"resid_scale": pytest.approx(float(per_layer.mean()), rel=1e-6)}
    assert aux_terms.progress(aux_terms.logged(metrics["aux"])) == {}


@pytest.mark.parametrize("block, says", [(None, "its blocks emit nothing"),
                                         (EMITS, "it emits only ['resid_scale']")])
def test_a_coefficient_on_a_model_without_router_statistics_is_an_error(block, says, tmp_path):
    """Raised once, before data is prepared or the run directory taken, by the train loop and the planner
    (both call check_aux_loss on the recipe alone); the MoE block with the same coefficient passes."""
    from spillway.recipes.train.loop import train

    bad = recipe(block, "aux_loss.router_z=0.001", f"checkpoint.dir={tmp_path / 'run'}")
    message = (r"aux_loss.router_z=0.001 weights router statistics, but this model has no MoE layer "
               rf"\({re.escape(says)}\)")
    said = []
    with pytest.raises(ConfigError, match=message):
        train(bad, echo=said.append, progress=False)
    assert said == [] and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=message):
        step_lib.check_aux_loss(bad)
    step_lib.check_aux_loss(recipe(DROPLESS, "aux_loss.router_z=0.001"))


@pytest.mark.parametrize("value", ["-0.01", "NaN", "inf"])
def test_a_bad_coefficient_is_one_line(value):
    with pytest.raises(ConfigError, match=r"aux_loss.load_balancing must be a finite number >= 0") as error:
        recipe(DROPLESS, f"aux_loss.load_balancing={value}")
    assert "\n" not in str(error.value)


def test_logged_and_progress_by_hand():
    aux = {"moe/lb_loss": 2.1, "moe/z_loss": 0.5, "moe/dropped": 0.0125,
           "moe/load": np.asarray([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]])}
    row = aux_terms.logged(aux)
    assert row["moe/load"] == [0.375, 0.25, 0.25, 0.125]      # mean over the layers
    assert row["moe/load_max"] == 2.0                          # 0.5 of the choices, in layer 0, of 4 experts
    assert aux_terms.progress(row) == {"lb": "2.100", "load": "2.00x", "drop": "1.2%"}
    assert "drop" not in aux_terms.progress({**row, "moe/dropped": 0.0})

