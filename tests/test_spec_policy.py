"""The switch-off rule (spec_decode/policy.py) and the draft model's cost model (spec_decode/drafting_cost.py), worked
by hand: draft caps per row, whether a step speculates, the depth that maximizes the net gain, prior and measured
drafting costs. The engine-level tests of the same rules are in tests/test_spec_decode.py and
tests/test_spec_step_timing.py."""
from __future__ import annotations

import numpy as np
import pytest

from tokenfab.spec_decode.config import parse_speculative_config


def test_policy_draft_caps_follow_the_cost_rule():
    """Caps = #{j in 1..k : a^j > r B / (1 + r B)}; the step speculates only when (B + G) / B > 1 + (r C + o) /
    (1 + r B); every probe_interval-th step probes. Worked by hand for r = 0.035, o = 0.1, k = 4."""
    from types import SimpleNamespace

    from tokenfab.spec_decode.policy import SpecPolicy
    pol = SpecPolicy(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "probe_interval": 3}))
    seqs = [SimpleNamespace(seq_id=i, params=SimpleNamespace(temperature=0.0)) for i in range(4)]
    for s, a in zip(seqs, (0.43, 0.67, 0.1, None)):  # None: no history yet, prior 0.6
        if a is not None:
            pol.rows[s.seq_id] = [a, 0]
    # B = 4: threshold 0.14 / 1.14 = 0.1228 -> caps 2 (0.43^3 = 0.080), 4, 0, 4 (0.6^4 = 0.13);
    # G = 0.43 + 0.185 + (0.67 + 0.449 + 0.301 + 0.202) + (0.6 + 0.36 + 0.216 + 0.130) = 3.54, C = 10:
    # (4 + 3.54) / 4 = 1.89 > 1 + (0.35 + 0.1) / 1.14 = 1.39 -> speculate
    assert pol.threshold(4) == pytest.approx(0.14 / 1.14)
    assert pol.draft_caps(seqs, 4).tolist() == [2, 4, 0, 4]
    # B = 16: threshold 0.359 -> caps 1, 2, 0, 2; G = 2.51, C = 5: 18.51 / 16 = 1.157 <= 1 + 0.275 / 1.56 = 1.176
    assert pol.draft_caps(seqs, 16).tolist() == [0, 0, 0, 0]
    assert pol.draft_caps(seqs, 16).tolist() == [1, 2, 1, 2]  # the third step is a probe: everyone drafts
    # B = 4 at temperature 1: cost 1 + (0.35 + 0.1 + 4 x 0.02) / 1.14 = 1.46 < 1.89: still speculates; with
    # random_row_cost 0.2 it is 1 + 1.25 / 1.14 = 2.10 > 1.89: a plain step
    hot = [SimpleNamespace(seq_id=s.seq_id, params=SimpleNamespace(temperature=1.0)) for s in seqs]
    assert pol.draft_caps(hot, 4).tolist() == [2, 4, 0, 4]
    pol.cfg.random_row_cost = 0.2
    assert pol.draft_caps(hot, 4).tolist() == [0, 0, 0, 0]
    pol.update(seqs[:1], [4], [1])  # 1 accepted of 4: positions examined 2 -> rate 0.5
    assert pol.ema(seqs[0]) == pytest.approx(0.7 * 0.43 + 0.3 * 0.5)
    pol.update(seqs[3:], [3], [3])  # all 3 accepted: rate 1 (the first observation sets the EMA)
    assert pol.ema(seqs[3]) == 1.0


def _net_by_hand(a, caps, B, kk, f, K, L, r=0.035, o=0.1):
    """Rule 3's net(kk) (policy.py) by a plain loop over rows and positions (T = 0 rows)."""
    G = C = catch = 0.0
    for ai, ci, Ki, Li in zip(a, caps, K, L):
        c = min(ci, kk)
        g = sum(ai ** j for j in range(1, c + 1))
        G, C = G + g, C + c
        if c > 0:
            catch += Ki * min(1.0, (1 + g) / Li)
    return G / B - (r * C + o) / (1 + r * B) - kk * f - catch


def test_policy_charges_the_proposers_cost_hand_worked():
    """A draft model's cost (f = 0.37 plain steps per forward: SmolLM2-135M's Q4_1 draft's weight-bytes prior;
    r = 0.035, o = 0.1, k = 4, a = 0.9, T = 0): a gain at B = 1, a loss at B = 16 while each row's 300-token prompt
    is still to be caught up with 64 tokens to go, probes there charged (a plain step), a shallower depth when
    forwards cost more."""
    from types import SimpleNamespace

    from tokenfab.spec_decode.drafting_cost import DraftingCost
    from tokenfab.spec_decode.policy import SpecPolicy
    pol = SpecPolicy(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4,
                                               "probe_interval": 1000}))
    rows = [SimpleNamespace(seq_id=i, params=SimpleNamespace(temperature=0.0)) for i in range(16)]
    for s in rows:
        pol.rows[s.seq_id] = [0.9, 0]
    # B = 1, caught up: net(kk) = (0.9, 1.71, 2.439, 3.0951) - (0.035 kk + 0.1) / 1.035 - 0.37 kk
    #   = 0.3996, 0.8057, 1.1309, 1.3832: depth 4
    one = rows[:1]
    free = DraftingCost(0.37, np.zeros(1))
    assert _net_by_hand([0.9], [4], 1, 4, 0.37, [0.0], [64]) == pytest.approx(1.3832, abs=1e-4)
    assert pol.draft_caps(one, 1, free, np.array([64])).tolist() == [4]
    # B = 1 with the prompt to catch up: K = 298 x 0.37 x 0.035 / 1.035 = 3.7285, spread over 64 / 4.0951 steps:
    # net(4) = 1.3832 - 3.7285 x 4.0951 / 64 = 1.1446 > 0: still depth 4
    K1 = 298 * 0.37 * 0.035 / 1.035
    assert _net_by_hand([0.9], [4], 1, 4, 0.37, [K1], [64]) == pytest.approx(1.1446, abs=1e-4)
    assert pol.draft_caps(one, 1, DraftingCost(0.37, np.array([K1])), np.array([64])).tolist() == [4]
    # B = 16, threshold 0.359 (caps 4); every row's prompt still to catch up: K_i = 298 x 0.37 x 0.035 / 1.56 = 2.474;
    # net(1..4) = -1.068, -1.488, -1.939, -2.418: no speculation (without the cost: net(4) = 3.0951 - 1.5 > 0)
    K16 = np.full(16, 298 * 0.37 * 0.035 / 1.56)
    L = np.full(16, 64)
    nets = [_net_by_hand([0.9] * 16, [4] * 16, 16, kk, 0.37, K16, L) for kk in (1, 2, 3, 4)]
    assert nets == pytest.approx([-1.068, -1.488, -1.939, -2.418], abs=2e-3)
    assert pol.draft_caps(rows, 16).tolist() == [4] * 16
    assert pol.draft_caps(rows, 16, DraftingCost(0.37, K16), L).tolist() == [0] * 16
    # a probe at B = 16 is charged: even at a = 1 (caps 4) net(1..4) = -1.02, -1.37, -1.72, -2.07 -> a plain step
    assert max(_net_by_hand([1.0] * 16, [4] * 16, 16, kk, 0.37, K16, L) for kk in (1, 2, 3, 4)) < 0
    pol.steps_since_probe = pol.cfg.probe_interval - 1
    assert pol.draft_caps(rows, 16, DraftingCost(0.37, K16), L).tolist() == [0] * 16
    pol.steps_since_probe = pol.cfg.probe_interval - 1  # the same probe without a proposer cost: every row drafts
    assert pol.draft_caps(rows, 16).tolist() == [4] * 16
    # dearer forwards pick a shallower depth: B = 1, f = 0.7: marginals 0.9 - 0.0338 - 0.7, 0.81 - 0.734 > 0,
    # 0.729 - 0.734 < 0: depth 2, net(2) = 1.71 - 0.17 / 1.035 - 1.4 = 0.1457
    assert _net_by_hand([0.9], [4], 1, 2, 0.7, [0.0], [64]) == pytest.approx(0.1457, abs=1e-4)
    assert pol.best_depth(np.array([0.9]), np.array([4]), 1, 0, DraftingCost(0.7, np.zeros(1)),
                          np.array([64]))[0] == 2
    assert pol.draft_caps(one, 1, DraftingCost(0.7, np.zeros(1)), np.array([64])).tolist() == [2]
    # a row without history starts at a = 1 with a proposer cost (0.6 without): tried at once at B = 1
    new = [SimpleNamespace(seq_id=99, params=SimpleNamespace(temperature=0.0))]
    assert pol.draft_caps(new, 1, DraftingCost(0.37, np.array([K1])), np.array([64])).tolist() == [4]


def test_draft_cost_model_prior_and_measured():
    """drafting_cost.py: the prior scales the target's cost by the weight-bytes ratio; measured seconds replace it
    once the target's plain step is measured."""
    from tokenfab.spec_decode.drafting_cost import DraftCostModel
    m = DraftCostModel(0.37, 0.035)
    c = m.estimate(16, 16, True, np.array([298, 0]), None)
    assert c.forward == pytest.approx(0.37 * 1.56 / 1.56) and c.catch_up.tolist() == pytest.approx(
        [298 * 0.37 * 0.035 / 1.56, 0.0])
    assert m.estimate(4, 16, True, np.zeros(4), None).forward == pytest.approx(0.37 * 1.14 / 1.56)
    m.record(16, True, 20, 0.02, 0.06, 4)          # steady catch-up (<= 2N tokens): (0.02 + 0.06) / 4 per forward
    assert m.forward_s[(16, True)] == pytest.approx(0.02)
    assert m.estimate(16, 16, True, np.zeros(16), None).forward == pytest.approx(0.37)  # no plain step measured
    assert m.estimate(16, 16, True, np.zeros(16), 0.05).forward == pytest.approx(0.4)
    assert m.estimate(16, 16, False, np.zeros(16), 0.05).forward == pytest.approx(0.37)  # random rows: not yet
    m.record(16, True, 4800, 2.0, 0.09, 4)         # a prompt catch-up: forwards 0.09 / 3 = 0.03 (EMA 0.023)
    f = 0.7 * 0.02 + 0.3 * 0.03
    assert m.forward_s[(16, True)] == pytest.approx(f)
    assert m.token_s == pytest.approx((2.0 - f) / (4800 - 16))
    assert m.last_catch_up_s == pytest.approx(2.0 - f)  # what the clock leaves out of that step's time
    c = m.estimate(16, 16, True, np.array([100.0] * 16), 0.05)
    assert c.catch_up[0] == pytest.approx(100 * (2.0 - f) / 4784 / 0.05)
    m.record(16, True, 16, 0.02, 0.06, 4)
    assert m.last_catch_up_s == 0.0
    with pytest.raises(ValueError, match="ratio"):
        DraftCostModel(0.0, 0.035)
