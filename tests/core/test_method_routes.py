"""The layout grids (tests/layouts, the fused-linear and fused-parity option grids) run one method variant per route
(helpers.ROUTE_VARIANTS): every method of the table has a representative of its route there, and what the ops read
of a call's options to choose their path is the same for a method as for its route's representative."""

from __future__ import annotations

from helpers import METHOD_VARIANTS, ROUTE_VARIANTS, for_method, method_route, variant_id

import dgpo_ops

# The options that move a call between the ops' paths: the token-local epilogue, a sequence statistic (GSPO's),
# the responses' scores (the positive-example NLL)
OPTION_SETS = {"plain": {}, "sequence": {"importance_sampling_level": "sequence"},
               "positive_nll": {"positive_nll_coef": 0.1}}


def test_every_method_has_a_representative_of_its_route():
    represented = {method_route(name): name for name, _ in ROUTE_VARIANTS}
    assert len(represented) == len(ROUTE_VARIANTS), "two representatives of one route"
    missing = [name for name in dgpo_ops.METHODS if method_route(name) not in represented]
    assert not missing, f"methods whose route no layout grid runs: {missing}"
    for name in dgpo_ops.METHODS:  # each route's representative is its first variant in table order
        first = next(variant for variant in METHOD_VARIANTS if method_route(variant[0]) == method_route(name))
        assert first in ROUTE_VARIANTS


def paths(variant, options) -> tuple:
    name, params = variant
    built = dgpo_ops.LossOptions.build(name, **params, **for_method(name, options))
    return (built.token_local, built.sequence_level, built.sequence_statistic, built.folds_rollout_weights,
            built.needs_scores, dgpo_ops.METHODS[name].token_selection)


def test_a_method_takes_its_route_representatives_paths():
    for variant in METHOD_VARIANTS:
        representative = next(v for v in ROUTE_VARIANTS if method_route(v[0]) == method_route(variant[0]))
        for options in OPTION_SETS.values():
            assert paths(variant, options) == paths(representative, options), (variant_id(variant), options)


def test_the_routes_tell_the_paths_apart():
    # two routes on one path would be one route run twice
    assert len({paths(variant, {}) for variant in ROUTE_VARIANTS}) == len(ROUTE_VARIANTS)
