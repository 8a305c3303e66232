"""MEDIC on SCORER+CBR (changecap_jax/models/scorer.py, docs/models.md "MEDIC on SCORER+CBR"):
a tiny training step through the trunk with every loss present and finite and gradients
reaching MEDIC's parameters, the experts joining the fusion, the router on (X1, X2), the
presets, and SCORER unchanged without the plug-in."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import _one_step, tiny_run

from changecap_jax.models import medic, scorer
from changecap_jax.trainers import captioning
from configs import scorer as scorer_config

TINY = dict(hidden_dim=16, num_heads=2, word_dim=8, encoder_layers=1, decoder_layers=1,
            dropout_rate=0.0)


def test_a_training_step_through_the_trunk(tmp_path):
    config = scorer_config.get_config("synthetic/medic")
    config.model.update(TINY)
    config.model.medic.update(memory_size=6, classifier_hidden=8)
    config = tiny_run(config, str(tmp_path / "data"), num_train_steps=1)
    trainer = captioning.Trainer(config, tmp_path / "x")
    batch = next(iter(trainer.train_loader()))
    params, grads, metrics = _one_step(config, tmp_path / "run", 1, batch)
    for name in ("sim", "cbr", *medic.LOSSES):
        assert np.isfinite(metrics[f"loss/{name}"]), (name, sorted(metrics))
    flat = flax.traverse_util.flatten_dict(grads, sep="/")
    reached = [k for k, g in flat.items() if k.startswith("medic/") and np.abs(g).max() > 0]
    # The classifiers (router losses) and the experts (through the memory and the expert losses)
    assert any("classifier" in k for k in reached) and any("memory" in k for k in reached), \
        sorted(flat)
    # The fusion reads cat(X1, X2, expert_bef, expert_aft): 4 x hidden.
    assert params["encoder"]["embed_fc_0"]["kernel"].shape == (4 * 16, 16)
    assert "medic" not in params.get("cbr", {})  # CBR (frozen) is untouched


def _batch(b: int = 4, seed: int = 0) -> dict[str, jax.Array]:
    r = np.random.default_rng(seed)
    f = lambda: jnp.asarray(r.normal(size=(b, 4, 4, 6)), jnp.float32)
    ids = lambda: jnp.asarray(np.concatenate(
        [np.full((b, 1), 2), r.integers(4, 12, (b, 5)), np.full((b, 1), 3)], 1), jnp.int32)
    return {"before": f(), "after_semantic": f(), "after_distractor": f(),
            "change_caption": ids(), "no_change_caption": ids(),
            "change_type": jnp.asarray([0, 2, 4, -1][:b], jnp.int32)}


def test_router_reads_the_last_scorer_layer_and_the_off_path_is_unchanged():
    batch = _batch()
    fields = dict(vocab_size=12, max_len=7, use_coordinates=False, **TINY)
    on = scorer.SCORERCBR(**fields, medic={"dataset_types": list(medic.TYPE_NAMES),
                                           "memory_size": 6, "classifier_hidden": 8})
    params = on.init(jax.random.PRNGKey(0), batch, train=False)["params"]
    change, types = on.apply({"params": params}, batch["before"], batch["after_semantic"],
                             method=on.classify_change)
    assert change.shape == (4, 2) and types.shape == (4, 5)

    def by_hand(m: scorer.SCORERCBR) -> tuple[jax.Array, jax.Array]:
        # The router on the last SCORER layer's outputs X1, X2 (the layer run again here).
        x1_0 = m.encoder.embed(batch["before"])
        x2_0 = m.encoder.embed(batch["after_semantic"])
        (x1, _), (x2, _) = (m.encoder.scorer[0](x1_0, x2_0), m.encoder.scorer[0](x2_0, x1_0))
        return m.plugin.route(x1, x2, (4, 4))

    want = on.apply({"params": params}, method=by_hand)
    np.testing.assert_allclose(change, want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(types, want[1], rtol=1e-6, atol=1e-6)

    plain, off = scorer.SCORERCBR(**fields), scorer.SCORERCBR(**fields, medic=None)
    p = plain.init(jax.random.PRNGKey(0), batch, train=False)
    assert "medic" not in p["params"]
    assert p["params"]["encoder"]["embed_fc_0"]["kernel"].shape == (2 * 16, 16)
    a, b = (m.apply(p, batch, train=False) for m in (plain, off))
    assert set(a.aux_losses) == {"sim", "cbr"} == set(b.aux_losses)
    np.testing.assert_array_equal(a.caption_logits["semantic"], b.caption_logits["semantic"])


def test_presets_reuse_medics_table_and_keep_scorers_schedule():
    synthetic = scorer_config.get_config("synthetic/medic")
    assert dict(synthetic.loss_weights) == {
        "sim": 0.1, "cbr": 0.001, "change_cls": 0.1, "change_type_cls": 0.1,
        "expert_disentangle": 0.1, "expert_consistency": 0.1}
    assert synthetic.model.medic.memory_size == 20 and synthetic.optim.frozen == ("cbr",)
    assert scorer_config.get_config("synthetic_extreme/medic").model.medic
    dc, plain_dc = scorer_config.get_config("clevr_dc/medic"), scorer_config.get_config("clevr_dc")
    assert dc.loss_weights["expert_consistency"] == 0.01 and dc.model.medic.memory_size == 100
    assert (dc.batch_size, dc.num_train_steps) == (plain_dc.batch_size, plain_dc.num_train_steps)
    assert dc.loss_weights["sim"] == plain_dc.loss_weights["sim"]
    assert scorer_config.get_config("spot_the_diff/medic").loss_weights[
        "expert_disentangle"] == 0.01
    scorer_config.get_config("image_editing_request/medic")
    assert "medic" not in scorer_config.get_config("clevr_change").model
    with pytest.raises(ValueError, match="no MEDIC preset"):
        scorer_config.get_config("birds_to_words/medic")


def test_the_presets_route_the_features_in_training_as_at_test():
    """SCORER+MEDIC's presets route the expert features by the router alone in training
    (docs/ablations.md "Why SCORER+MEDIC lost"); a pair the router misroutes then keeps its
    features, where the official routing (DIRL+MEDIC's presets) zeroes them."""
    preset = dict(scorer_config.get_config("synthetic/medic").model.medic)
    assert preset["feature_routing"] == "router"
    from configs import dirl as dirl_config
    assert dirl_config.get_config("synthetic/medic").model.medic.feature_routing == "labels"
    preset.update(memory_size=6, classifier_hidden=8)
    batch = _batch(4, seed=3)
    fields = dict(vocab_size=12, max_len=7, use_coordinates=False, **TINY)
    ours = scorer.SCORERCBR(**fields, medic=preset)
    official = scorer.SCORERCBR(**fields, medic={**preset, "feature_routing": "labels"})
    params = {"params": ours.init(jax.random.PRNGKey(1), batch, train=False)["params"]}
    a, b = (m.apply(params, batch, train=True) for m in (ours, official))
    misrouted = 0
    for stream, changed in (("semantic", True), ("distractor", False)):
        change, _ = ours.apply(params, batch["before"], batch[f"after_{stream}"],
                               method=ours.classify_change)
        wrong = np.asarray(jnp.argmax(change, -1) == 1) != changed
        misrouted += wrong.sum()
        diff = np.abs(np.asarray(a.caption_logits[stream] - b.caption_logits[stream]))
        assert np.all(diff.max(axis=(1, 2))[~wrong] == 0), stream
        assert np.all(diff.max(axis=(1, 2))[wrong] > 1e-6), stream
    assert misrouted > 0, "pick a batch with a misrouted pair"
