"""Every preset of every registered family: the spec's parameter count is the built model's.

`DecoderSpec.num_params` counts from the shapes (summed layer by layer, runs
and post-norms included); the oracle is the model itself, built abstractly
(`nnx.eval_shape`: nothing allocated), so a count that drifts from what the
layers create fails here for the family and preset it belongs to.
"""

import pytest
from flax import nnx

from spillway.models.decoder import count_params
from spillway.models.registry import family_names, get_family

PRESETS = [(family, preset) for family in family_names() for preset in sorted(get_family(family).presets)]


@pytest.mark.parametrize("family, preset", PRESETS, ids=[f"{f}-{p}" for f, p in PRESETS])
def test_the_counted_parameters_are_the_built_models(family, preset):
    fam = get_family(family)
    cfg = fam.presets[preset]
    assert count_params(lambda: fam.build(cfg, rngs=nnx.Rngs(0))) == fam.spec(cfg).num_params()
