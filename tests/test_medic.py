"""MEDIC as a plug-in of DIRL (changecap_jax/models/medic.py): shapes, finite losses, a router
loss that a few gradient steps lower, the change-type label mapping, the one-line refusal of a
dataset without change types, DIRL unchanged without the plug-in, and 8 devices equal to 1
through the trunk. The comparison with the official code is tests/test_medic_official.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import assert_eight_devices_equal_one, tiny_run

from changecap_jax import models
from changecap_jax.data.synthetic import scenes
from changecap_jax.models import dirl, medic
from configs import dirl as dirl_config

B, H, W, C, L, V = 6, 4, 4, 6, 8, 12
TINY = dict(hidden_dim=16, num_heads=2, word_dim=8, ffn_dim=32, mlp_hidden_dim=32,
            encoder_layers=1, decoder_layers=1, dropout_rate=0.0)


def _model(with_medic: bool = True) -> dirl.DIRLCCR:
    config = dirl_config.get_config("synthetic/medic" if with_medic else "synthetic")
    config.model.update(TINY)
    if with_medic:
        config.model.medic.update(memory_size=6, classifier_hidden=8)
    return models.build(config.model, vocab_size=V, max_len=L)


def _batch(seed: int = 0) -> dict[str, jax.Array]:
    r = np.random.default_rng(seed)
    f = lambda: jnp.asarray(r.normal(size=(B, H, W, C)), jnp.float32)
    ids = lambda: jnp.asarray(np.concatenate(
        [np.full((B, 1), 2), r.integers(4, V, (B, L - 2)), np.full((B, 1), 3)], 1), jnp.int32)
    return {"before": f(), "after_semantic": f(), "after_distractor": f(),
            "change_caption": ids(), "no_change_caption": ids(),
            "change_type": jnp.asarray([0, 1, 2, 3, 4, -1], jnp.int32)}


def test_plugin_shapes_and_routing_outputs():
    plugin = medic.MEDIC(dim=16, memory_size=6, classifier_hidden=8)
    r = np.random.default_rng(0)
    d1, d2 = (jnp.asarray(r.normal(size=(B, H * W, 16)), jnp.float32) for _ in range(2))
    labels = jnp.asarray([0, 1, 2, 3, 4, 5], jnp.int32)
    params = plugin.init(jax.random.PRNGKey(0), d1, d2, (H, W), labels, train=True)
    out = plugin.apply(params, d1, d2, (H, W), labels, train=True)
    assert out.features.shape == (B, H * W, 32)
    assert out.change_logits.shape == (B, 2) and out.type_logits.shape == (B, 5)
    assert set(out.losses) == set(medic.LOSSES)
    assert all(np.isfinite(float(v)) for v in out.losses.values())
    # Without labels (decoding): routing outputs, no losses.
    assert plugin.apply(params, d1, d2, (H, W)).losses == {}


def test_label_mapping_by_name():
    ct = jnp.asarray([0, 1, 2, 3, 4, -1], jnp.int32)
    got = medic.medic_labels(ct, scenes.CHANGE_TYPES, no_change=False)
    assert got.tolist() == [0, 1, 2, 3, 4, -1]  # the CLEVR types are MEDIC's, in its order
    assert medic.medic_labels(ct, scenes.CHANGE_TYPES, no_change=True).tolist() == [5] * 6
    shuffled = ("move", "add", "color", "drop", "material")
    assert medic.medic_labels(ct, shuffled, no_change=False).tolist() == [4, 2, 0, 3, 1, -1]


class _Meta:
    def __init__(self, change_types):
        self.change_types = change_types


def test_dataset_without_change_types_is_refused_in_one_line():
    model = _model()
    with pytest.raises(medic.NoChangeTypesError) as err:
        model.check_dataset(_Meta([]))
    assert "\n" not in str(err.value) and "change-type labels" in str(err.value)
    with pytest.raises(medic.NoChangeTypesError, match="no expert"):
        medic.check_change_types(["add", "style"], ["add", "style"])
    model.check_dataset(_Meta(list(scenes.CHANGE_TYPES)))  # accepted
    _model(with_medic=False).check_dataset(_Meta([]))  # DIRL alone needs none


def test_router_change_loss_lowered_by_gradient_steps():
    """Plain gradient steps on the router's change loss (smooth in the parameters: routing is
    discrete but ``change_cls`` does not depend on it) lower it on a fixed batch, each step, and
    the other losses stay finite. The plug-in alone, so the check is cheap and deterministic."""
    plugin = medic.MEDIC(dim=16, memory_size=6, classifier_hidden=8)
    r = np.random.default_rng(0)
    d1, d2 = (jnp.asarray(r.normal(size=(B, H * W, 16)), jnp.float32) for _ in range(2))
    labels = jnp.asarray([0, 1, 2, 5, 5, -1], jnp.int32)
    params = plugin.init(jax.random.PRNGKey(0), d1, d2, (H, W), labels, train=True)

    def loss(p):
        losses = plugin.apply(p, d1, d2, (H, W), labels, train=True).losses
        return losses["change_cls"], losses

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    values = []
    for _ in range(4):
        (value, losses), grads = grad_fn(params)
        assert all(np.isfinite(float(v)) for v in losses.values()), losses
        values.append(float(value))
        params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads)
    assert all(b < a for a, b in zip(values[:-1], values[1:], strict=True)), values


def test_dirl_without_medic_is_unchanged():
    plain = dirl.DIRLCCR(vocab_size=V, max_len=L, use_coordinates=False, **TINY)
    off = dirl.DIRLCCR(vocab_size=V, max_len=L, use_coordinates=False, medic=None, **TINY)
    batch = _batch()
    p = plain.init(jax.random.PRNGKey(0), batch, train=False)
    assert "medic" not in p["params"]
    a, b = (m.apply(p, batch, train=False) for m in (plain, off))
    assert set(a.aux_losses) == {"dirl", "ccr"}
    np.testing.assert_array_equal(a.caption_logits["semantic"], b.caption_logits["semantic"])
    assert set(dirl_config.get_config("synthetic").loss_weights) == {"dirl", "ccr"}


def test_presets_carry_the_official_weights():
    c = dirl_config.get_config("clevr_change/medic")
    assert dict(c.loss_weights) == {"dirl": 0.03, "ccr": 0.05, "change_cls": 0.1,
                                    "change_type_cls": 0.1, "expert_disentangle": 0.1,
                                    "expert_consistency": 0.1}
    assert (c.batch_size, c.num_train_steps, c.model.variant) == (64, 30_000, "clevr_dc")
    dc = dirl_config.get_config("clevr_dc/medic")
    assert dc.loss_weights["expert_consistency"] == 0.01 and dc.num_train_steps == 50_000
    std = dirl_config.get_config("spot_the_diff/medic")
    assert std.loss_weights["expert_disentangle"] == 0.01
    dirl_config.get_config("image_editing_request/medic")


def test_eight_devices_equal_one_through_the_trunk(tmp_path):
    """A train step of DIRL+MEDIC through the trunk on 1 and on 8 devices: MEDIC's losses are
    means over the GLOBAL batch (its sums and counts psum-ed over the data axis), so every
    loss, gradient and updated parameter agrees; each of its losses is logged, finite."""
    config = dirl_config.get_config("synthetic/medic")
    config.model.update(TINY)
    config.model.medic.update(memory_size=6, classifier_hidden=8)
    config = tiny_run(config, str(tmp_path / "data"), num_train_steps=2)
    metrics = assert_eight_devices_equal_one(config, tmp_path)
    for name in medic.LOSSES:
        assert np.isfinite(metrics[f"loss/{name}"]), (name, sorted(metrics))


def test_router_accuracy_in_the_trainers_evaluation(tmp_path, monkeypatch):
    """The trainer's evaluation of val with DIRL+MEDIC: its metrics (and the metrics file)
    carry the router's change accuracy over every pair of both streams and its type accuracy
    over the semantic pairs, equal to the router applied by hand; DIRL without the plug-in
    has no router evaluator. (The Java caption scorers are stubbed: test_evaluation.py's.)"""
    import json

    from changecap_jax.evaluators import captions, common
    from changecap_jax.models import contract
    from changecap_jax.trainers import captioning

    config = dirl_config.get_config("synthetic/medic")
    config.model.update(TINY)
    config.model.medic.update(memory_size=6, classifier_hidden=8)
    config = tiny_run(config, str(tmp_path / "data"), spice="off")
    monkeypatch.setattr(captions, "evaluate_pairs", lambda records, spice: {"CIDEr": 0.0})
    trainer = captioning.Trainer(config, tmp_path / "run")
    state = trainer.init_state()
    metrics = trainer.evaluate(state, "val", 0)
    router = metrics["router"]
    assert router == json.loads((tmp_path / "run" / "metrics" / "val_0.json").read_text()
                                )["router"]
    val = trainer.dataset.split("val")
    records = [val[i] for i in range(len(val))]
    stack = lambda key: jnp.asarray(np.stack([r[key] for r in records]), jnp.float32)
    model = trainer.model
    correct, typed, typed_correct = 0, 0, 0
    for after, label in (("after_semantic", 1), ("after_distractor", 0)):
        change, types = model.apply({"params": state.params}, stack("before"), stack(after),
                                    method=model.classify_change)
        correct += int(np.sum(np.argmax(change, -1) == label))
        if label:
            ct = np.asarray([int(r["change_type"]) for r in records])
            typed = int(np.sum(ct >= 0))
            typed_correct = int(np.sum((np.argmax(types, -1) == ct)[ct >= 0]))
    assert router["num_pairs"] == 2 * len(records) and router["num_typed_pairs"] == typed > 0
    assert router["change_accuracy"] == pytest.approx(100.0 * correct / (2 * len(records)))
    assert router["type_accuracy"] == pytest.approx(100.0 * typed_correct / typed)
    plain = _model(with_medic=False)
    assert contract.change_router(plain) is None
    assert not any(isinstance(e, common.ChangeRouterAccuracy) for e in common.choose(
        config, trainer.dataset, plain, jnp.float32, ("semantic", "distractor")))


def _plugin_inputs(seed: int = 0):
    r = np.random.default_rng(seed)
    d1, d2 = (jnp.asarray(r.normal(size=(B, H * W, 16)), jnp.float32) for _ in range(2))
    return d1, d2, jnp.asarray([0, 1, 2, 3, 4, 5], jnp.int32)


def test_feature_routing_by_the_router_keeps_the_losses_and_routes_as_at_test():
    d1, d2, labels = _plugin_inputs()
    official = medic.MEDIC(dim=16, memory_size=6, classifier_hidden=8)
    by_router = medic.MEDIC(dim=16, memory_size=6, classifier_hidden=8, feature_routing="router")
    params = official.init(jax.random.PRNGKey(0), d1, d2, (H, W), labels, train=True)
    out = official.apply(params, d1, d2, (H, W), labels, train=True)
    got = by_router.apply(params, d1, d2, (H, W), labels, train=True)
    at_test = official.apply(params, d1, d2, (H, W))
    # The same losses (label-routed masks), the features of the label-free path.
    for name in medic.LOSSES:
        np.testing.assert_allclose(got.losses[name], out.losses[name], rtol=1e-6)
    np.testing.assert_allclose(got.features, at_test.features, rtol=1e-6)
    # Official routing zeroes the pairs where the router and the label disagree; the router
    # alone does not, so with such a pair the two differ.
    is_change = np.asarray(jnp.argmax(out.change_logits, -1) == 1)
    disagree = is_change != (np.asarray(labels) != 5)
    assert disagree.any(), "pick inputs with a misrouted pair"
    assert np.all(np.asarray(out.features)[disagree] == 0)
    assert np.all(np.abs(np.asarray(got.features)[disagree]).sum(axis=(1, 2)) > 0)
    with pytest.raises(ValueError, match="feature_routing"):
        medic.MEDIC(dim=16, feature_routing="label").apply(params, d1, d2, (H, W))


def test_detached_host_features_get_no_gradient_from_medic():
    d1, d2, labels = _plugin_inputs(1)
    plugin = medic.MEDIC(dim=16, memory_size=6, classifier_hidden=8)
    detached = medic.MEDIC(dim=16, memory_size=6, classifier_hidden=8, detach_host_features=True)
    params = plugin.init(jax.random.PRNGKey(0), d1, d2, (H, W), labels, train=True)

    def total(module, p, a, b):
        out = module.apply(p, a, b, (H, W), labels, train=True)
        return sum(out.losses.values()) + jnp.sum(out.features)

    grads = jax.grad(lambda a, b: total(plugin, params, a, b), argnums=(0, 1))(d1, d2)
    assert all(float(jnp.abs(g).max()) > 0 for g in grads)
    grads = jax.grad(lambda a, b: total(detached, params, a, b), argnums=(0, 1))(d1, d2)
    assert all(float(jnp.abs(g).max()) == 0 for g in grads)
    # The plug-in's own parameters still learn, with the same gradient as without detaching.
    g_on = jax.grad(lambda p: total(plugin, p, d1, d2))(params)
    g_off = jax.grad(lambda p: total(detached, p, d1, d2))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), g_on, g_off)
