"""method_config: a bad value raises naming the parameter, unknown methods and parameters (and those a method
does not use) are refused, configs are frozen, and every method's parameters and defaults are the ones written
out here by hand (DEFAULTS), not read from the method table."""

import dataclasses
import math
import re

import pytest

from dgpo_ops import method_config

METHODS = ["grpo", "cispo", "dispo", "gppo", "ce_gppo", "aspo", "dgpo", "dcpo", "sapo", "gpg", "dppo_tv", "dppo_kl",
           "vespo"]

# Every method's parameters and their defaults, written by hand (not read from the method table).
DEFAULTS = {
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None, "delta": None},  # delta: TRL's (GRPOConfig: None)
    "cispo": {"eps_low": 1.0, "eps_high": 4.0},
    "dispo": {"eps_low_pos": 0.2, "eps_high_pos": 10.0, "eps_low_neg": 1.0, "eps_high_neg": 100.0},
    "gppo": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0},
    "ce_gppo": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0, "beta1": 0.75, "beta2": 1.0},
    "aspo": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0},
    "dgpo": {"eps_low": 0.2, "eps_high": 0.2, "n": 1.0, "m": 2.0},
    "dcpo": {"eps_low": 0.16, "eps_high": 0.2, "r_max": 10.0},
    "sapo": {"gate": "sigmoid", "tau_pos": 1.0, "tau_neg": 1.05},
    # verl 0.9.1's: clip_ratio_low/high (0.2) are DPPO's thresholds and clip_ratio_c (3.0) its cap; gpg reads nothing
    "gpg": {},
    "dppo_tv": {"delta_low": 0.2, "delta_high": 0.2, "is_cap": 3.0},
    "dppo_kl": {"delta_low": 0.2, "delta_high": 0.2, "is_cap": 3.0},
    # TRL 1.16's GRPOConfig: vespo_k_pos 2, vespo_lambda_pos 3, vespo_k_neg 3, vespo_lambda_neg 2
    "vespo": {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
}

NAN, INF = math.nan, math.inf
NONFINITE = [NAN, INF, -INF]

# Bad values per field kind.
BAD = {
    "eps_low": [-0.1, 1.5, -1e-9, 1.0 + 1e-9] + NONFINITE,  # outside [0, 1]
    "eps_high": [-0.1, -1e-9] + NONFINITE,  # < 0
    "dual_clip": [1.0, 0.5, 0.0, -2.0] + NONFINITE,  # must be > 1
    "r_max": [1.0, 0.5, 0.0, -3.0] + NONFINITE,  # must be > 1
    "n": [-1.0, -1e-9] + NONFINITE,  # n >= 0
    "m": [0.5, 0.0, 1.0 - 1e-9, -2.0] + NONFINITE,  # m >= 1
    "tau": [0.0, -1.0] + NONFINITE,  # > 0
    "beta": NONFINITE,
    "gate": ["tanh", "", "relu", "sigmoid2"],
    "threshold": [-0.1, -1e-9] + NONFINITE,  # >= 0
    "positive": [0.0, -1.0] + NONFINITE,  # > 0
}
KIND = {
    "eps_low": "eps_low",
    "eps_low_pos": "eps_low",
    "eps_low_neg": "eps_low",
    "eps_high": "eps_high",
    "eps_high_pos": "eps_high",
    "eps_high_neg": "eps_high",
    "dual_clip": "dual_clip",
    "r_max": "r_max",
    "n": "n",
    "m": "m",
    "tau_pos": "tau",
    "tau_neg": "tau",
    "beta1": "beta",
    "beta2": "beta",
    "gate": "gate",
    "delta": "positive",
    "delta_low": "threshold",
    "delta_high": "threshold",
    "is_cap": "positive",
    "k_pos": "threshold",
    "k_neg": "threshold",
    "lambda_pos": "threshold",
    "lambda_neg": "threshold",
}

BAD_CASES = [(method, field, value) for method, fields in DEFAULTS.items() for field in fields
             for value in BAD[KIND[field]]]


def assert_names(error: ValueError, field: str) -> None:
    # the field must be named as a whole word (plain substring would be vacuous for "n" and "m")
    assert re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", str(error)), str(error)


# One case per branch of ParamSpec.check (dgpo_ops/methods/base.py): (method, field, a value that takes it)
BRANCH_CASES = {
    "none_where_not_optional": ("grpo", "eps_low", None),
    "not_a_choice": ("sapo", "gate", "tanh"),
    "nan": ("dgpo", "n", NAN),
    "inf": ("grpo", "eps_high", INF),
    "bool": ("dgpo", "m", True),
    "not_a_number": ("grpo", "eps_low", "0.2"),
    "beyond_float32": ("cispo", "eps_high", 1e39),
    "below_a_closed_low": ("dgpo", "n", -1e-9),
    "at_an_open_low": ("grpo", "dual_clip", 1.0),
    "above_high": ("grpo", "eps_low", 1.0 + 1e-9),
}


@pytest.mark.parametrize("branch", list(BRANCH_CASES))
def test_bad_value_raises_naming_field(branch):
    method, field, value = BRANCH_CASES[branch]
    with pytest.raises(ValueError) as excinfo:
        method_config(method, **{field: value})
    assert_names(excinfo.value, field)


def test_every_fields_hand_written_bad_values_are_refused():
    # the bounds of each field (DEFAULTS x BAD), checked against the hand-written table in one case: they share
    # the branches above
    for method, field, value in BAD_CASES:
        with pytest.raises(ValueError) as excinfo:
            method_config(method, **{field: value})
        assert_names(excinfo.value, field)


def _valid_value(param):
    # a value that would be valid for the parameter in a method that uses it
    return {"gate": "erf", "dual_clip": 3.0, "r_max": 10.0, "m": 2.0, "n": 1.0}.get(param, 0.5)


# method_config's two refusals of a parameter the method does not take (what it takes:
# test_defaults_match_contract): another method's, a loss option's (temperature travels as an option, never
# as a method parameter), and any, where the method takes none
@pytest.mark.parametrize("method, param, message", [("grpo", "n", "it takes eps_low"),
                                                     ("dgpo", "temperature", "it takes eps_low"),
                                                     ("gpg", "eps_low", "it takes no parameters")])
def test_unused_parameter_is_rejected(method, param, message):
    with pytest.raises(ValueError, match=message) as excinfo:
        method_config(method, **{param: _valid_value(param)})
    assert_names(excinfo.value, param)


def test_a_parameter_of_another_method_is_refused():  # dgpo's n, ce_gppo's beta1
    with pytest.raises(ValueError):
        method_config("grpo", n=1)
    with pytest.raises(ValueError):
        method_config("gppo", beta1=0.5)


@pytest.mark.parametrize("name", ["ppo", "GRPO", "", "gspo"])  # "dapo" is an alias: tests/methods/test_readme_methods.py
def test_unknown_method_lists_known_names(name):
    with pytest.raises(ValueError) as excinfo:
        method_config(name)
    msg = str(excinfo.value)
    for known in METHODS:
        assert known in msg


@pytest.mark.parametrize("method", METHODS)
def test_defaults_match_contract(method):
    cfg = method_config(method)
    assert dataclasses.is_dataclass(cfg)
    fields = {f.name for f in dataclasses.fields(cfg)}
    assert fields == set(DEFAULTS[method])
    for name, expected in DEFAULTS[method].items():
        got = getattr(cfg, name)
        if expected is None or isinstance(expected, str):
            assert got == expected, name
        else:
            assert got == pytest.approx(expected, rel=1e-15, abs=0.0), name


# MethodConfig is frozen, so every method's config class is (a dataclass may not unfreeze a frozen base)
@pytest.mark.parametrize("method", ["grpo", "gpg"])
def test_config_is_frozen(method):
    cfg = method_config(method)
    name = next(iter(DEFAULTS[method]), "eps_low")  # gpg has no field: adding one is refused too
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, name, getattr(cfg, name, 0.2))


def test_non_default_values_are_stored():
    assert method_config("dgpo", n=2, m=3).n == 2
    assert method_config("dgpo", n=2, m=3).m == 3
    assert method_config("grpo", eps_high=0.28).eps_high == 0.28
    assert method_config("sapo", gate="softsign", tau_pos=10, tau_neg=12).tau_neg == 12
    cfg = method_config("ce_gppo", beta1=0.5, beta2=0.9)
    assert (cfg.beta1, cfg.beta2) == (0.5, 0.9)


@pytest.mark.parametrize(
    "method,params",
    [
        ("grpo", {"eps_low": 0.0, "eps_high": 0.0}),
        ("grpo", {"eps_low": 1.0}),
        ("grpo", {"dual_clip": 1.5}),
        ("grpo", {"dual_clip": None}),
        ("gppo", {"dual_clip": None}),
        ("ce_gppo", {"dual_clip": None}),
        ("cispo", {"eps_high": 100.0}),
        ("dispo", {"eps_low_pos": 0.0, "eps_low_neg": 1.0, "eps_high_pos": 0.0, "eps_high_neg": 0.0}),
        ("dgpo", {"n": 0, "m": 1}),
        ("dgpo", {"n": 2.5, "m": 7}),
        ("dcpo", {"r_max": 1.5}),
        ("aspo", {"dual_clip": 1.01}),
        ("sapo", {"gate": "erf", "tau_pos": 1e-3, "tau_neg": 12.0}),
        ("sapo", {"gate": "arctan"}),
        ("sapo", {"gate": "softsign"}),
        ("sapo", {"gate": "sigmoid"}),
    ],
)
def test_valid_edge_values_accepted(method, params):
    cfg = method_config(method, **params)
    for k, v in params.items():
        assert getattr(cfg, k) == v
