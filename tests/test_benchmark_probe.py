"""The linear probe of benchmarks/feature_probe.py (docs/ablations.md, "Why colour
and material changes are missed"): it finds classes a linear readout can separate, reports
chance for ones it cannot, and its AUC is the rank statistic."""

from __future__ import annotations

import numpy as np

from benchmarks import feature_probe as probe


def _blobs(rng: np.random.Generator, n: int, separated: bool) -> tuple[np.ndarray, np.ndarray]:
    y = np.arange(n) % 3
    centres = np.eye(3, 20) * (6.0 if separated else 0.0)
    return centres[y] + rng.standard_normal((n, 20)), y


def test_the_probe_separates_what_is_separable_and_not_the_rest():
    rng = np.random.default_rng(0)
    for separated, low, high in ((True, 0.95, 1.0), (False, 0.0, 0.6)):
        data = {s: _blobs(rng, 150, separated) for s in ("train", "val", "test")}
        lam, val, test = probe.run_probe(data, 3, [0.1, 1.0, 10.0])
        assert lam in (0.1, 1.0, 10.0) and test.shape == (3,)
        assert low <= test.mean() <= high, (separated, test)


def test_the_dual_solution_equals_the_primal_one():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((12, 30)), np.arange(12) % 2  # more features than examples
    w = probe.fit_ridge(x, y, 2, 5.0)
    xb = np.concatenate([x, np.ones((12, 1))], axis=1)  # balanced classes: unit weights
    primal = np.linalg.solve(xb.T @ xb + 5.0 * np.eye(31), xb.T @ np.eye(2)[y])
    np.testing.assert_allclose(w, primal, atol=1e-8)


def test_auc_is_the_chance_a_positive_outranks_a_negative():
    assert probe.auc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert probe.auc(np.array([1.0]), np.array([2.0])) == 0.0
    assert probe.auc(np.array([1.0, 3.0]), np.array([2.0, 0.0])) == 0.75
