"""Losses against float64 NumPy re-implementations of reference §4.1 / §4.2 / §3.2, and the
1-device == 8-device (shard_map) equality of each loss and its gradient.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from changecap_jax.models import losses
from changecap_jax.models.base import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[1]


# ---- NumPy references (float64), written from the reference text -------------------------------


def np_barlow(y1: np.ndarray, y2: np.ndarray, alpha: float = 0.003, ddof: int = 1) -> float:
    d = y1.shape[-1]
    a, b = y1.reshape(-1, d).astype(np.float64), y2.reshape(-1, d).astype(np.float64)
    n = a.shape[0]
    za = (a - a.mean(0)) / a.std(0, ddof=ddof)
    zb = (b - b.mean(0)) / b.std(0, ddof=ddof)
    c = za.T @ zb / n
    off = c.copy()
    np.fill_diagonal(off, 0.0)
    return float(np.sum((np.diag(c) - 1.0) ** 2) + alpha * np.sum(off**2))


def np_ccr(t: np.ndarray, v: np.ndarray) -> float:
    t, v = t.astype(np.float64), v.astype(np.float64)
    s = t @ v.T
    logits = (s / 0.5 + s.T / 0.5) / 2  # the official form; equals S + S^T
    logits = logits - logits.max(1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    return float(-np.mean(np.diag(logp)))


def np_caption_ce(logits: np.ndarray, targets: np.ndarray) -> float:
    flat = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    tgt = targets.reshape(-1)
    keep = tgt != IGNORE_INDEX
    flat = flat - flat.max(1, keepdims=True)
    logp = flat - np.log(np.exp(flat).sum(1, keepdims=True))
    return float(-logp[keep, tgt[keep]].mean())


def _barlow_inputs(seed: int, dtype=np.float64):
    r = np.random.RandomState(seed)
    y1 = r.randn(6, 5, 16) * 2.0 + 0.3
    y2 = 0.6 * y1 + r.randn(6, 5, 16)  # correlated, so on- and off-diagonal terms both matter
    return y1.astype(dtype), y2.astype(dtype)


# ---- value tests ------------------------------------------------------------------------------


def test_barlow_matches_numpy_float64():
    y1, y2 = _barlow_inputs(0)
    with jax.enable_x64(True):
        got = float(losses.barlow_correlation_loss(jnp.asarray(y1), jnp.asarray(y2)))
    want = np_barlow(y1, y2)
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want))
    # The test can tell the Bessel correction apart from the biased std.
    assert abs(np_barlow(y1, y2, ddof=0) - want) > 1e-3


def test_barlow_float32_close_and_weight_used():
    # float32: every statistic is a sum of <= 30 terms of O(1) values, so the relative error of
    # the O(10) loss stays within a few float32 ulps times the depth: 2e-5 is tight for that.
    y1, y2 = _barlow_inputs(1, np.float32)
    got = float(losses.barlow_correlation_loss(jnp.asarray(y1), jnp.asarray(y2)))
    want = np_barlow(y1, y2)
    assert got == pytest.approx(want, rel=2e-5)
    got_w = float(
        losses.barlow_correlation_loss(jnp.asarray(y1), jnp.asarray(y2), off_diagonal_weight=0.5)
    )
    assert got_w == pytest.approx(np_barlow(y1, y2, alpha=0.5), rel=2e-5)


def test_ccr_matches_numpy_float64():
    r = np.random.RandomState(2)
    t, v = r.randn(9, 16), r.randn(9, 16)
    with jax.enable_x64(True):
        got = float(losses.ccr_infonce_loss(jnp.asarray(t), jnp.asarray(v)))
    want = np_ccr(t, v)
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want))
    # Not the plain one-directional InfoNCE on S.
    s = t @ v.T
    one_dir = float(-np.mean(np.diag(s - np.log(np.exp(s).sum(1, keepdims=True)))))
    assert abs(one_dir - want) > 1e-3


def test_caption_ce_matches_numpy_with_ignored_positions():
    r = np.random.RandomState(3)
    logits = (r.randn(4, 7, 11) * 3).astype(np.float32)
    targets = r.randint(0, 11, (4, 7)).astype(np.int32)
    targets[:, 5:] = IGNORE_INDEX
    targets[2, 1:] = IGNORE_INDEX
    got = float(losses.caption_cross_entropy(jnp.asarray(logits), jnp.asarray(targets)))
    assert got == pytest.approx(np_caption_ce(logits, targets), rel=1e-6)
    # Ignored positions really are ignored: changing their logits changes nothing.
    logits2 = logits.copy()
    logits2[targets == IGNORE_INDEX] += r.randn(int((targets == IGNORE_INDEX).sum()), 11) * 5
    got2 = float(losses.caption_cross_entropy(jnp.asarray(logits2), jnp.asarray(targets)))
    assert got2 == pytest.approx(got, rel=1e-6)
    # Mean over tokens, not over rows: differs from the per-row mean of per-row means.
    per_row = np.mean([np_caption_ce(logits[i : i + 1], targets[i : i + 1]) for i in range(4)])
    assert abs(per_row - got) > 1e-4


# ---- 8 simulated devices ----------------------------------------------------------------------

_SHARDED_SCRIPT = textwrap.dedent(
    """
    import functools, json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from changecap_jax.models import losses

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("data",))
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    r = np.random.RandomState(0)
    y1 = r.randn(16, 5, 24).astype(np.float32)
    y2 = (0.5 * y1 + r.randn(16, 5, 24)).astype(np.float32)
    t, v = r.randn(16, 24).astype(np.float32), r.randn(16, 24).astype(np.float32)
    logits = (2 * r.randn(16, 7, 11)).astype(np.float32)
    targets = r.randint(-1, 11, (16, 7)).astype(np.int32)
    cases = {
        "barlow": (losses.barlow_correlation_loss, (y1, y2), (0, 1)),
        "ccr": (losses.ccr_infonce_loss, (t, v), (0, 1)),
        "ce": (losses.caption_cross_entropy, (logits, targets), (0,)),
    }
    out = {}
    with jax.set_mesh(mesh):
        for name, (fn, args, argnums) in cases.items():
            sharded = jax.shard_map(
                functools.partial(fn, axis_name="data"),
                mesh=mesh, in_specs=(P("data"),) * len(args), out_specs=P(),
            )
            one = jax.jit(jax.value_and_grad(fn, argnums=argnums))
            many = jax.jit(jax.value_and_grad(sharded, argnums=argnums))
            v1, g1 = one(*map(jnp.asarray, args))
            v8, g8 = many(*map(shard, args))
            out[name] = {
                "single": float(v1),
                "sharded": float(v8),
                "grad_rel": max(
                    float(jnp.max(jnp.abs(a - np.asarray(b))) / jnp.max(jnp.abs(a)))
                    for a, b in zip(g1, g8)
                ),
            }

        # The model threads axis_name into both batch-wide losses (tiny DIRLCCR, eval mode).
        from changecap_jax.models.dirl import DIRLCCR
        model = DIRLCCR(vocab_size=12, max_len=8, hidden_dim=32, num_heads=4, word_dim=12,
                        ffn_dim=64, mlp_hidden_dim=64, pairs="semantic_only")
        caps = np.zeros((16, 8), np.int32)
        caps[:, 0], caps[:, 1:4], caps[::2, 4], caps[1::2, 6] = 2, 5, 3, 3
        batch = {"before": r.rand(16, 4, 4, 6).astype(np.float32),
                 "after_semantic": r.rand(16, 4, 4, 6).astype(np.float32),
                 "change_caption": caps}
        batch = {k: jnp.asarray(x) for k, x in batch.items()}
        # Random params from the param shapes (saves compiling the initialisers).
        shapes = jax.eval_shape(lambda b: model.init({"params": jax.random.key(0)}, b,
                                                     train=False), batch)
        variables = jax.tree.map(
            lambda s: jnp.asarray(r.randn(*s.shape) / np.sqrt(s.shape[0]), s.dtype), shapes
        )
        aux1 = jax.jit(lambda v, b: model.apply(v, b, train=False).aux_losses)(variables, batch)
        aux8 = jax.jit(jax.shard_map(
            lambda v, b: model.apply(v, b, train=False, axis_name="data").aux_losses,
            mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
        ))(variables, jax.tree.map(shard, batch))
        for name in ("dirl", "ccr"):
            out["model_" + name] = {"single": float(aux1[name]), "sharded": float(aux8[name])}
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sharded_results() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.mark.parametrize("name", ["barlow", "ccr", "ce"])
def test_loss_sharded_8_ways_equals_single_device(sharded_results, name):
    res = sharded_results[name]
    assert res["sharded"] == pytest.approx(res["single"], rel=1e-6)
    # Gradients through psum / all_gather match too (float32 rounding only).
    assert res["grad_rel"] < 1e-5


@pytest.mark.parametrize("name", ["model_dirl", "model_ccr"])
def test_dirlccr_aux_losses_sharded_8_ways_equal_single_device(sharded_results, name):
    res = sharded_results[name]
    assert res["sharded"] == pytest.approx(res["single"], rel=1e-6)
