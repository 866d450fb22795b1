"""Advantage estimators against explicit per-group loops (independent of the vectorised code)."""
import statistics

import pytest
import torch

from megadiv.config import ConfigError, from_dict
from megadiv.divergence import ADVANTAGES, AdvantageConfig, compute_advantages

G = 4
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.3, 0.9, 0.1, 0.5]]  # group 2: all equal


def loop_reference(name, groups, eps=1e-6):
    out = []
    for g in groups:
        mean = sum(g) / len(g)
        if name == "grpo":
            out.append([(r - mean) / (statistics.stdev(g) + eps) for r in g])
        elif name == "dr_grpo":
            out.append([r - mean for r in g])
        elif name == "rloo":
            out.append([r - (sum(g) - r) / (len(g) - 1) for r in g])
    if name == "reinforce_pp_baseline":
        centred = [r - sum(g) / len(g) for g in groups for r in g]
        mu, sd = sum(centred) / len(centred), statistics.stdev(centred)
        flat = [(a - mu) / (sd + eps) for a in centred]
        out = [flat[i:i + len(groups[0])] for i in range(0, len(flat), len(groups[0]))]
    return out


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_matches_loop_reference_in_both_layouts(name):
    cfg = AdvantageConfig(estimator=name, group_size=G)
    want = torch.tensor(loop_reference(name, REWARDS), dtype=torch.float64)
    grouped = compute_advantages(cfg, torch.tensor(REWARDS, dtype=torch.float64))
    flat = compute_advantages(cfg, torch.tensor(REWARDS, dtype=torch.float64).flatten())
    torch.testing.assert_close(grouped, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flat, want.flatten(), rtol=1e-12, atol=1e-12)
    assert torch.equal(grouped[1], torch.zeros(G, dtype=torch.float64)) or name == "reinforce_pp_baseline"


def test_every_estimator_has_a_reference():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}, \
        "add the new estimator to loop_reference"


def test_integer_rewards_and_shape_errors():
    cfg = AdvantageConfig(estimator="dr_grpo", group_size=G)
    adv = compute_advantages(cfg, torch.tensor([1, 0, 0, 1]))
    assert adv.dtype == torch.float32 and adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="do not split into groups"):
        compute_advantages(cfg, torch.zeros(6))
    with pytest.raises(ValueError, match="rewards must be"):
        compute_advantages(cfg, torch.zeros(2, 3))


def test_config_validation():
    with pytest.raises(ValueError, match="estimator must be one of"):
        AdvantageConfig(estimator="gae")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        AdvantageConfig(estimator="rloo", group_size=1)
    assert AdvantageConfig(estimator="dr_grpo", group_size=1).group_size == 1
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=0.0)
    with pytest.raises(ConfigError, match="group_size"):
        from_dict(AdvantageConfig, {"group_size": "eight"})
