"""GRPO group advantages, DCPO smooth advantage standardisation and advantages on the token grid
(dgpo_ops.trainer.advantages)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from dgpo_ops.trainer.advantages import (
    TRL_STD_EPS,
    SmoothAdvantageStandardizer,
    group_advantages,
    per_token_advantages,
    prompt_key,
)


def loop_group_advantages(rewards, group_size, scale=True, eps=TRL_STD_EPS):
    values = [float(r) for r in rewards]
    out = []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        mean = sum(group) / len(group)
        std = statistics.stdev(group) if len(group) > 1 else 0.0  # unbiased (n - 1), like TRL
        for r in group:
            out.append((r - mean) / (std + eps) if scale else r - mean)
    return torch.tensor(out, dtype=torch.float64)


def population_stats(values):
    values = [float(v) for v in values]
    mean = statistics.fmean(values)
    return len(values), mean, statistics.pvariance(values, mu=mean)


# ---------------------------------------------------------------------------------------------------------
# group_advantages


@pytest.mark.parametrize("group_size", [1, 2, 3, 8])
@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_matches_loop(group_size, scale):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(5 * group_size, generator=gen, dtype=torch.float64)
    rewards[:group_size] = 0.5  # an all-equal group
    got = group_advantages(rewards, group_size, scale=scale)
    expected = loop_group_advantages(rewards, group_size, scale=scale)
    # TRL (and so group_advantages) computes the Bessel factor n / (n - 1) in float32: ~1e-8 relative.
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-12)
    assert torch.equal(got[:group_size], torch.zeros(group_size, dtype=torch.float64))
    if group_size == 1:
        assert torch.equal(got, torch.zeros_like(got))


def test_group_advantages_custom_eps_and_binary_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    got = group_advantages(rewards, 4, eps=1e-6)
    torch.testing.assert_close(got, loop_group_advantages(rewards, 4, eps=1e-6), rtol=1e-7, atol=1e-12)
    # unbiased std of [1, 0, 0, 0] is 0.5, of [1, 1, 0, 0] is sqrt(1/3)
    assert got[0].item() == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-7)
    assert got[4].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-6), rel=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("group_size", [1, 4, 16])
def test_group_advantages_bit_identical_to_trl(dtype, group_size):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(6 * group_size, generator=gen) * 3).round().to(dtype) + torch.randn(
        6 * group_size, generator=gen
    ).to(dtype) * 0.1
    # TRL 1.16 GRPOTrainer._generate_and_score_completions, scale_rewards="group" and "none"
    mean = torch.nanmean(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0)
    if group_size > 1:
        std = trl_utils.nanstd(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0)
    else:
        std = torch.zeros_like(rewards)
    trl_scaled = (rewards - mean) / (std + 1e-4)
    trl_unscaled = rewards - mean
    assert torch.equal(group_advantages(rewards, group_size), trl_scaled)
    assert torch.equal(group_advantages(rewards, group_size, scale=False), trl_unscaled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_group_advantages_keeps_dtype_and_shape(dtype):
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=dtype)
    got = group_advantages(rewards, 2)
    assert got.dtype == dtype and got.shape == rewards.shape
    assert group_advantages(torch.empty(0), 4).shape == (0,)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rewards": [1.0, 0.0], "group_size": 2}, "rewards"),
        ({"rewards": torch.zeros(2, 2), "group_size": 2}, "rewards"),
        ({"rewards": torch.tensor([1, 0]), "group_size": 2}, "rewards"),
        ({"rewards": torch.tensor([1.0, float("nan")]), "group_size": 2}, "rewards"),
        ({"rewards": torch.tensor([1.0, float("inf")]), "group_size": 2}, "rewards"),
        ({"rewards": torch.zeros(6), "group_size": 4}, "group_size"),
        ({"rewards": torch.zeros(6), "group_size": 0}, "group_size"),
        ({"rewards": torch.zeros(6), "group_size": 2.0}, "group_size"),
        ({"rewards": torch.zeros(6), "group_size": True}, "group_size"),
        ({"rewards": torch.zeros(6), "group_size": 2, "eps": -1.0}, "eps"),
    ],
)
def test_group_advantages_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        group_advantages(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# SmoothAdvantageStandardizer


def test_merge_equals_statistics_of_concatenated_rewards():
    gen = torch.Generator().manual_seed(1)
    sas = SmoothAdvantageStandardizer()
    seen = {"a": [], "b": [], "c": []}
    schedule = [(["a", "b"], 4), (["c", "a"], 3), (["b"], 8), (["a", "c", "b"], 5), (["a"], 1), (["c", "a"], 16)]
    for step, (keys, group_size) in enumerate(schedule, start=1):
        rewards = torch.randn(len(keys) * group_size, generator=gen, dtype=torch.float64) * step + step
        sas(keys, rewards, group_size)
        for g, key in enumerate(keys):
            seen[key].extend(rewards[g * group_size:(g + 1) * group_size].tolist())
        state = sas.state_dict()
        for key, values in seen.items():
            if not values:
                assert key not in state
                continue
            count, mean, var = population_stats(values)
            s_count, s_mean, s_m2, _ = state[key]
            assert s_count == count
            assert s_mean == pytest.approx(mean, rel=1e-13, abs=1e-13)
            assert s_m2 / s_count == pytest.approx(var, rel=1e-12)
    assert [state[k][3] for k in "abc"] == [5, 3, 3]


def test_merge_matches_paper_eq_29_30_for_equal_group_sizes():
    """sigma_total^2 = (sigma_new^2 + (i-1) sigma_old^2 + (i-1)/i (mu_old - mu_new)^2) / i."""
    gen = torch.Generator().manual_seed(2)
    sas = SmoothAdvantageStandardizer()
    G = 6
    history = []
    for i in range(1, 6):
        rewards = torch.randint(0, 3, (G,), generator=gen).double()
        if history:
            _, mu_old, var_old = population_stats(history)
            _, mu_new, var_new = population_stats(rewards.tolist())
            mu_total = (mu_new + (i - 1) * mu_old) / i
            var_total = (var_new + (i - 1) * var_old + (i - 1) / i * (mu_old - mu_new) ** 2) / i
        sas(["p"], rewards, G)
        history.extend(rewards.tolist())
        count, mean, m2, participations = sas.state_dict()["p"]
        assert (count, participations) == (G * i, i)
        if i > 1:
            assert mean == pytest.approx(mu_total, rel=1e-13, abs=1e-13)
            assert m2 / count == pytest.approx(var_total, rel=1e-12, abs=1e-13)


def test_first_participation_is_population_standardisation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.9, 0.6], dtype=torch.float64)
    for eps in (1e-6, 0.0):
        sas = SmoothAdvantageStandardizer(eps=eps)
        got = torch.cat([sas(["x"], rewards[:4], 4), sas(["y"], rewards[4:], 3)])
        expected = []
        for group in (rewards[:4].tolist(), rewards[4:].tolist()):
            mean = statistics.fmean(group)
            std = statistics.pstdev(group)
            expected += [(r - mean) / (std + eps) for r in group]
        # i = 1: SA_new = A_total, SA_total = A_new, and A_total == A_new, so A equals both.
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=1e-14)
    # with one call holding both prompts the result is the same
    sas = SmoothAdvantageStandardizer()
    both = sas(["x"] * 4 + ["z"] * 4, torch.cat([rewards[:4], rewards[:4]]), 4)
    assert torch.equal(both[:4], both[4:])
    assert torch.equal(both[:4], SmoothAdvantageStandardizer()(["x"], rewards[:4], 4))


def test_hand_computed_second_and_third_participation():
    sas = SmoothAdvantageStandardizer(eps=0.0)
    # step 1: [1, 0, 0, 0] -> mu = 0.25, sigma = sqrt(0.1875); plain standardisation
    a1 = sas(["p"], torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), 4)
    s1 = math.sqrt(0.1875)
    torch.testing.assert_close(a1, torch.tensor([0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1],
                                                dtype=torch.float64), rtol=1e-14, atol=0)

    # step 2 (i = 2): [1, 1, 0, 0] -> mu_new = 0.5, sigma_new = 0.5
    # cumulative 8 rewards, three ones: mu_total = 0.375, sigma_total^2 = 0.375 * 0.625 = 0.234375
    a2 = sas(["p"], torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64), 4)
    st2 = math.sqrt(0.234375)
    a_new = {1.0: 0.5 / 0.5, 0.0: -0.5 / 0.5}
    a_tot = {1.0: 0.625 / st2, 0.0: -0.375 / st2}
    # i = 2: SA_new = 1/2 A_new + 1/2 A_total = SA_total; the choice is moot
    sa = {r: 0.5 * a_new[r] + 0.5 * a_tot[r] for r in (1.0, 0.0)}
    torch.testing.assert_close(a2, torch.tensor([sa[1.0], sa[1.0], sa[0.0], sa[0.0]], dtype=torch.float64),
                               rtol=1e-14, atol=0)
    assert sa[1.0] == pytest.approx(1.1454972243679027) and sa[0.0] == pytest.approx(-0.8872983346207417)

    # step 3 (i = 3): [1, 1, 1, 0] -> mu_new = 0.75, sigma_new = sqrt(0.1875)
    # cumulative 12 rewards, six ones: mu_total = 0.5, sigma_total = 0.5
    a3 = sas(["p"], torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64), 4)
    s3 = math.sqrt(0.1875)
    a_new = {1.0: 0.25 / s3, 0.0: -0.75 / s3}  # 0.57735, -1.73205
    a_tot = {1.0: 0.5 / 0.5, 0.0: -0.5 / 0.5}  # 1, -1
    sa_new = {r: (2 / 3) * a_new[r] + (1 / 3) * a_tot[r] for r in (1.0, 0.0)}  # 0.71823, -1.48803
    sa_tot = {r: (1 / 3) * a_new[r] + (2 / 3) * a_tot[r] for r in (1.0, 0.0)}  # 0.85912, -1.24402
    # reward 1: |SA_new| = 0.718 < |SA_total| = 0.859 -> SA_new; reward 0: |-1.488| >= |-1.244| -> SA_total
    assert abs(sa_new[1.0]) < abs(sa_tot[1.0]) and not abs(sa_new[0.0]) < abs(sa_tot[0.0])
    expected = [sa_new[1.0]] * 3 + [sa_tot[0.0]]
    torch.testing.assert_close(a3, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=0)
    assert a3[0].item() == pytest.approx(0.7182335127930839) and a3[3].item() == pytest.approx(-1.2440169358562927)
    assert sas.state_dict()["p"] == [12, 0.5, 3.0, 3]


def test_eps_is_added_to_the_std():
    eps = 1e-3
    sas = SmoothAdvantageStandardizer(eps=eps)
    sas(["p"], torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), 4)
    got = sas(["p"], torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64), 4)
    st = math.sqrt(0.234375)
    expected_one = 0.5 * (0.5 / (0.5 + eps)) + 0.5 * (0.625 / (st + eps))
    assert got[0].item() == pytest.approx(expected_one, rel=1e-14)


def test_all_equal_rewards():
    sas = SmoothAdvantageStandardizer()
    # first-time all-equal prompt: zeros (both stds are zero), no NaN
    first = sas(["fresh", "seen"], torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 4)
    assert torch.equal(first[:4], torch.zeros(4))
    assert torch.all(first[4:] != 0)
    # later all-equal step: A_new = 0, but A_total != 0 since the cumulative std is not
    later = sas(["seen", "fresh"], torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4)
    mu_total, sigma_total = 0.75, math.sqrt(0.1875)
    a_total = (1.0 - mu_total) / (sigma_total + 1e-6)
    # i = 2: A = 1/2 * 0 + 1/2 * A_total
    torch.testing.assert_close(later[:4], torch.full((4,), 0.5 * a_total), rtol=1e-6, atol=0)
    assert torch.all(later[:4] > 0)
    # a prompt that was always all-equal stays at exactly zero
    assert torch.equal(later[4:], torch.zeros(4))
    # the same with eps = 0 (the paper's formulas, std == 0 -> 0)
    sas0 = SmoothAdvantageStandardizer(eps=0.0)
    for _ in range(3):  # 0.7 is not exact in binary: the statistics must still give exactly zero std
        assert torch.equal(sas0(["q"], torch.full((7,), 0.7, dtype=torch.float64), 7), torch.zeros(7).double())
    assert sas0.state_dict()["q"] == [21, 0.7, 0.0, 3]
    sas0(["r"], torch.tensor([0.0, 1.0]), 2)
    out = sas0(["r"], torch.tensor([0.0, 0.0]), 2)
    assert torch.isfinite(out).all() and torch.all(out < 0)


def _random_schedule(seed, steps=8):
    gen = torch.Generator().manual_seed(seed)
    pool = [prompt_key(f"prompt {k}") for k in range(5)]
    schedule = []
    for _ in range(steps):
        group_size = int(torch.randint(1, 6, (1,), generator=gen))
        chosen = torch.randperm(len(pool), generator=gen)[: int(torch.randint(1, 5, (1,), generator=gen))]
        keys = [pool[int(c)] for c in chosen]
        rewards = torch.randint(0, 2, (len(keys) * group_size,), generator=gen).float()
        rewards += torch.randn(rewards.shape, generator=gen) * 0.1 * (torch.rand(1, generator=gen) < 0.5)
        schedule.append((keys, rewards, group_size))
    return schedule


def test_state_dict_json_round_trip_resumes_identically():
    schedule = _random_schedule(3, steps=10)
    uninterrupted = SmoothAdvantageStandardizer()
    reference = [uninterrupted(*step) for step in schedule]

    first = SmoothAdvantageStandardizer()
    for step in schedule[:6]:
        first(*step)
    blob = json.dumps(first.state_dict())
    resumed = SmoothAdvantageStandardizer()
    resumed.load_state_dict(json.loads(blob))
    assert resumed.state_dict() == first.state_dict()
    for step, expected in zip(schedule[6:], reference[6:]):
        assert torch.equal(resumed(*step), expected)
    assert resumed.state_dict() == uninterrupted.state_dict()
    # load_state_dict replaces, it does not merge
    resumed.load_state_dict({})
    assert len(resumed) == 0


def test_prompts_keep_independent_statistics():
    schedule = _random_schedule(4, steps=12)
    mixed = SmoothAdvantageStandardizer()
    per_prompt: dict[str, SmoothAdvantageStandardizer] = {}
    for keys, rewards, group_size in schedule:
        got = mixed(keys, rewards, group_size)
        for g, key in enumerate(keys):
            solo = per_prompt.setdefault(key, SmoothAdvantageStandardizer())
            chunk = slice(g * group_size, (g + 1) * group_size)
            assert torch.equal(solo([key], rewards[chunk], group_size), got[chunk])
    assert mixed.state_dict() == {k: s.state_dict()[k] for k, s in per_prompt.items()}


def test_order_within_a_step_does_not_matter():
    keys = ["a", "b", "c"]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    warm = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    forward, backward = SmoothAdvantageStandardizer(), SmoothAdvantageStandardizer()
    forward(keys, warm, 3)
    backward(keys[::-1], warm.view(3, 3).flip(0).reshape(-1), 3)
    out_f = forward(keys, rewards, 3)
    out_b = backward(keys[::-1], rewards.view(3, 3).flip(0).reshape(-1), 3)
    assert torch.equal(out_f, out_b.view(3, 3).flip(0).reshape(-1))
    assert forward.state_dict() == backward.state_dict()


def test_per_completion_keys_and_repeated_key_in_one_step():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    per_group, per_completion = SmoothAdvantageStandardizer(), SmoothAdvantageStandardizer()
    a = per_group(["a", "b"], rewards, 3)
    b = per_completion(["a"] * 3 + ["b"] * 3, rewards, 3)
    assert torch.equal(a, b) and per_group.state_dict() == per_completion.state_dict()

    # a key in two groups of one call: one participation, one pooled sample of 2 * G rewards
    repeated, pooled = SmoothAdvantageStandardizer(), SmoothAdvantageStandardizer()
    for step_rewards in (rewards, rewards.flip(0), torch.ones(6, dtype=torch.float64)):
        got = repeated(["p", "p"], step_rewards, 3)
        assert torch.equal(got, pooled(["p"], step_rewards, 6))
    assert repeated.state_dict()["p"][3] == 3 and repeated.state_dict() == pooled.state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_smooth_keeps_dtype_and_shape(dtype):
    sas = SmoothAdvantageStandardizer()
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=dtype)
    out = sas(["a", "b"], rewards, 2)
    assert out.dtype == dtype and out.shape == rewards.shape and out.device == rewards.device
    assert sas([], torch.empty(0), 4).shape == (0,)
    assert isinstance(sas.state_dict()["a"][1], float) and isinstance(sas.state_dict()["a"][0], int)


@pytest.mark.parametrize(
    "args, name",
    [
        ((["a"], [1.0, 0.0], 2), "rewards"),
        ((["a"], torch.zeros(1, 2), 2), "rewards"),
        ((["a"], torch.tensor([1, 0]), 2), "rewards"),
        ((["a"], torch.tensor([1.0, float("nan")]), 2), "rewards"),
        ((["a"], torch.tensor([float("-inf"), 0.0]), 2), "rewards"),
        ((["a"], torch.zeros(3), 2), "group_size"),
        ((["a"], torch.zeros(2), 0), "group_size"),
        ((["a"], torch.zeros(2), 2.0), "group_size"),
        ((["a", "b"], torch.zeros(2), 2), "prompt_keys"),
        ((["a", "b", "c"], torch.zeros(4), 2), "prompt_keys"),
        ((["a", "a", "a", "b"], torch.zeros(4), 2), "prompt_keys"),
        (("a", torch.zeros(2), 2), "prompt_keys"),
        (([1], torch.zeros(2), 2), "prompt_keys"),
    ],
)
def test_smooth_validation(args, name):
    sas = SmoothAdvantageStandardizer()
    sas(["a"], torch.tensor([1.0, 0.0]), 2)
    before = sas.state_dict()
    with pytest.raises(ValueError, match=name):
        sas(*args)
    assert sas.state_dict() == before


@pytest.mark.parametrize(
    "state",
    [
        [],
        {1: [1, 0.0, 0.0, 1]},
        {"a": [1, 0.0, 0.0]},
        {"a": [0, 0.0, 0.0, 1]},
        {"a": [1, float("nan"), 0.0, 1]},
        {"a": [1, 0.0, -1.0, 1]},
        {"a": [1, 0.0, 0.0, 0]},
        {"a": [1.0, 0.0, 0.0, 1]},
    ],
)
def test_load_state_dict_validation(state):
    sas = SmoothAdvantageStandardizer()
    sas(["a"], torch.tensor([1.0, 0.0]), 2)
    before = sas.state_dict()
    with pytest.raises(ValueError, match="state_dict"):
        sas.load_state_dict(state)
    assert sas.state_dict() == before


def test_constructor_and_prompt_key():
    with pytest.raises(ValueError, match="eps"):
        SmoothAdvantageStandardizer(eps=-1e-6)
    with pytest.raises(ValueError, match="eps"):
        SmoothAdvantageStandardizer(eps=float("inf"))
    assert prompt_key("What is 2+2?") == prompt_key("What is 2+2?") != prompt_key("What is 2+3?")
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert prompt_key(chat) == prompt_key([{"content": "What is 2+2?", "role": "user"}])
    assert len(prompt_key(chat)) == 64


def test_per_token_advantages_broadcast_a_response_value_over_its_tokens():
    per_response = torch.tensor([1.0, -2.0])
    column = per_token_advantages(per_response)
    assert column.shape == (2, 1)
    assert torch.equal(column * torch.ones(2, 3), torch.tensor([[1.0] * 3, [-2.0] * 3]))
    per_token = torch.randn(2, 3)
    assert per_token_advantages(per_token) is per_token
