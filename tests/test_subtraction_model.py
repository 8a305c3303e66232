"""The Subtraction baseline (changecap_jax/models/subtraction.py): outputs, parameter tree,
the memory is a function of the difference (plus the position embedding), cached decoding, and a
few trainer steps on the tiny synthetic dataset.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_scorer_model import (
    SMALL,
    TINY,
    B,
    L,
    V,
    W,
    check_cached_greedy,
    make_batch,
    random_params,
    set_param,
)

from changecap_jax import parallel
from changecap_jax.data import pipeline
from changecap_jax.data.streams import make_caption_targets
from changecap_jax.models.subtraction import Subtraction
from changecap_jax.trainers import captioning
from configs import subtraction as subtraction_config

SUB_TINY = dict(TINY)


@pytest.fixture(scope="module")
def model() -> Subtraction:
    return Subtraction(**SUB_TINY)


@pytest.fixture(scope="module")
def batch() -> dict[str, jnp.ndarray]:
    return make_batch(1)


@pytest.fixture(scope="module")
def variables(model, batch):
    return random_params(model, batch, 0)


def _evaluate(m: Subtraction, batch: dict):
    out = m(batch, train=False)
    # Same image twice: the difference is zero, only the position embedding remains.
    same = m.encode(batch["before"], batch["before"])
    other = m.encode(batch["after_semantic"], batch["after_semantic"])
    real = m.encode(batch["before"], batch["after_semantic"])
    return out, same, other, real


@pytest.fixture(scope="module")
def eval_apply(model):
    return jax.jit(lambda v, b: model.apply(v, b, method=_evaluate))


def test_outputs_and_no_aux_losses(eval_apply, variables, batch):
    out = eval_apply(variables, batch)[0]
    assert set(out.caption_logits) == {"semantic", "distractor"}
    for stream, key in (("semantic", "change_caption"), ("distractor", "no_change_caption")):
        assert out.caption_logits[stream].shape == (B, L, V)
        np.testing.assert_array_equal(out.caption_targets[stream],
                                      make_caption_targets(batch[key]))
    assert out.aux_losses == {}


def test_memory_depends_on_the_difference_and_keeps_positions(eval_apply, variables, batch):
    _, same, other, real = eval_apply(variables, batch)
    # Zero difference: the memory no longer depends on the image ...
    np.testing.assert_allclose(same, other, rtol=1e-6, atol=1e-6)
    assert not np.allclose(real, same, atol=1e-3)
    # ... but still on the position (the grid embedding is added after the subtraction).
    assert not np.allclose(same[:, 0], same[:, 5], atol=1e-3)
    moved = set_param(variables["params"], "encoder/pos_embedding/w_embedding",
                      np.zeros((W, 16), np.float32))
    assert not np.allclose(eval_apply({"params": moved}, batch)[1], same, atol=1e-3)


def test_param_tree_shares_scorer_paths():
    def shapes(**fields) -> dict:
        m = Subtraction(vocab_size=76, max_len=24, **fields)
        grid = jax.ShapeDtypeStruct((2, 14, 14, 1024), jnp.float32)
        caps = jax.ShapeDtypeStruct((2, 24), jnp.int32)
        b = {"before": grid, "after_semantic": grid, "after_distractor": grid,
             "change_caption": caps, "no_change_caption": caps}
        tree = jax.eval_shape(lambda b: m.init({"params": jax.random.key(0)}, b, train=False),
                              b)["params"]
        return flax.traverse_util.flatten_dict(tree, sep="/")

    flat = shapes()
    assert sum(math.prod(s.shape) for k, s in flat.items() if k.startswith("decoder/")) == \
        4_425_564  # SCORER's Speaker, Appendix A
    assert {k for k in flat if k.startswith("encoder/")} == {
        "encoder/img_0/kernel", "encoder/img_0/bias", "encoder/pos_embedding/w_embedding",
        "encoder/pos_embedding/h_embedding", "encoder/embed_fc_0/kernel",
        "encoder/embed_fc_0/bias"}
    assert flat["encoder/img_0/kernel"].shape == (1026, 512)
    assert flat["encoder/embed_fc_0/kernel"].shape == (512, 512)
    assert shapes(fusion="concat")["encoder/embed_fc_0/kernel"].shape == (1536, 512)
    with pytest.raises(ValueError, match="fusion"):
        shapes(fusion="sum")


# Seeds whose random decoders give rows of different lengths (checked by the helper).
@pytest.mark.parametrize("seed", [1, 5])
def test_cached_greedy_equals_full_recompute(seed):
    check_cached_greedy(Subtraction(**SUB_TINY, pairs="semantic_only"), seed)


def test_trains_a_few_steps_with_the_trainer(small_synthetic, tmp_path):
    config = subtraction_config.get_config("synthetic")
    config.dataset.data_dir = str(small_synthetic.directory.parents[2])
    config.dataset.options = dict(SMALL)
    config.model.update(hidden_dim=32, num_heads=4, word_dim=16, decoder_layers=1,
                        pairs="semantic_only")
    config.update(batch_size=16, eval_batch_size=8)
    trainer = captioning.Trainer(config, tmp_path, mesh=parallel.make_mesh(1))
    state = trainer.init_state()
    before = jax.device_get(state.params)
    loader = iter(trainer.train_loader())
    for _ in range(3):
        state, metrics = trainer.train_step(
            state, pipeline.to_global(next(loader), trainer.data_sharding))
        metrics = jax.device_get(metrics)
        assert np.isfinite(metrics["loss"])
        assert metrics["loss"] == metrics["loss/caption"]  # no auxiliary losses
        assert not any(k in metrics for k in ("loss/sim", "loss/cbr"))
    after = jax.device_get(state.params)
    flat0 = flax.traverse_util.flatten_dict(before, sep="/")
    flat1 = flax.traverse_util.flatten_dict(after, sep="/")
    changed = {k for k in flat0 if not np.array_equal(flat0[k], flat1[k])}
    # The projection bias cancels in after - before: it never gets a gradient.
    assert {k for k in flat0 if k.startswith("encoder/")} - changed == {"encoder/img_0/bias"}
    assert any(k.startswith("decoder/") for k in changed)
    emb0, emb1 = before["decoder"]["embed"]["embedding"], after["decoder"]["embed"]["embedding"]
    np.testing.assert_array_equal(emb1[0], emb0[0])  # padding_idx row: zero gradient


def test_presets():
    for preset in ("synthetic", "clevr_change", "clevr_dc", "spot_the_diff",
                   "image_editing_request"):
        config = subtraction_config.get_config(preset)
        assert config.model.name == "subtraction" and dict(config.loss_weights) == {}
        assert config.model.pairs == ("both" if preset in ("synthetic", "clevr_change")
                                      else "semantic_only")
    with pytest.raises(ValueError, match="unknown preset"):
        subtraction_config.get_config("clevr")

