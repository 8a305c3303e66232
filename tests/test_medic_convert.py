"""The converter of DIRL+MEDIC snapshots (changecap_jax/convert/models/dirl.py) without the
official code: a snapshot laid out as MEDIC's train script saves it (the official key names),
made from our own parameters by the inverse of the key table, converts back bit-identically;
a missing or an extra key is refused with one line naming it; a MEDIC snapshot under a config
without the plug-in (and the reverse) is refused. The comparison with the official modules is
tests/test_medic_official.py."""

from __future__ import annotations

from pathlib import Path

import flax
import numpy as np
import pytest

from changecap_jax.convert import converter, tables
from changecap_jax.convert.errors import KeyMismatchError, WrongModelError
from changecap_jax.convert.models import dirl as dirl_converter
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.convert.torch_checkpoint import OfficialSnapshot
from changecap_jax.models.layers import sinusoid_table
from configs import dirl as dirl_config

SIZES = tables.Sizes(vocab_size=11, max_len=7, feature_channels=6, grid_height=4, grid_width=4,
                     origin="test")


def _config(tmp_path: Path, with_medic: bool = True):
    config = dirl_config.get_config("clevr_dc/medic" if with_medic else "clevr_dc")
    config.model.update(hidden_dim=16, num_heads=2, encoder_layers=1, decoder_layers=1,
                        word_dim=8, ffn_dim=32, mlp_hidden_dim=32, dropout_rate=0.0)
    if with_medic:
        config.model.medic.update(memory_size=6, classifier_hidden=8)
    config.dataset.data_dir = str(tmp_path / "no_data")
    return config


def _inverse(entry: tables.Entry, flat: dict[str, np.ndarray]) -> np.ndarray:
    """The torch tensor of ``entry`` from our parameters (the table's transforms inverted)."""
    if not entry.targets:  # the sinusoid buffer
        return sinusoid_table(SIZES.max_len, entry.shape[1]).astype(np.float32)
    parts = [np.asarray(flat[t.path]) for t in entry.targets]
    name = entry.targets[0].transform.name
    if name.startswith("rows"):  # in_proj_weight: the q/k/v kernels, transposed and stacked
        return np.concatenate([p.T for p in parts])
    if name.startswith("[") and name != tables.CONV1X1.name:  # in_proj_bias: q/k/v stacked
        return np.concatenate(parts)
    inverse = {tables.COPY.name: lambda x: x, tables.TRANSPOSE.name: lambda x: x.T,
               tables.CONV1X1.name: lambda x: x.T[:, :, None, None],
               tables.CONV_KERNEL.name: lambda x: x.transpose(3, 2, 0, 1)}
    return inverse[name](parts[0])


def _snapshot(tmp_path: Path, config) -> tuple[OfficialSnapshot, dict[str, np.ndarray]]:
    model = converter.build_model(config, SIZES)
    params = converter.init_params(config, model, dirl_converter.CONVERTER, SIZES, abstract=False)
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    states: dict[str, dict[str, np.ndarray]] = {ENCODER: {}, DECODER: {}}
    for entry in dirl_converter.table(config.model, SIZES):
        states[entry.source][entry.key] = _inverse(entry, flat)
    cfg = {"model": {"transformer_encoder": {"att_head": 2}}}
    return OfficialSnapshot(tmp_path / "medic_checkpoint_7.pt", states, cfg, 7, ()), flat


def test_official_keys_convert_back_bit_identically(tmp_path):
    config = _config(tmp_path)
    snapshot, flat = _snapshot(tmp_path, config)
    encoder = snapshot.states[ENCODER]
    assert {"expert_modules_change.4.value_memory", "expert_module_no_change.key_memory",
            "change_classifier.2.weight", "type_classifier.0.bias"} <= set(encoder)
    assert encoder["type_classifier.0.weight"].shape == (8, 32, 3, 3)
    assert snapshot.states[DECODER]["core.embed_fc.0.weight"].shape == (16, 64)
    dirl_converter.check_identity(config.model, snapshot.states, snapshot.model_cfg)
    converted = flax.traverse_util.flatten_dict(
        converter.convert_params(config, snapshot, SIZES), sep="/")
    assert set(converted) == set(flat)
    for path, value in flat.items():
        np.testing.assert_array_equal(np.asarray(converted[path]), value, err_msg=path)


@pytest.mark.parametrize("edit", ["missing", "extra"])
def test_a_missing_or_extra_key_is_refused_in_one_line(tmp_path, edit):
    config = _config(tmp_path)
    snapshot, _ = _snapshot(tmp_path, config)
    encoder = dict(snapshot.states[ENCODER])
    if edit == "missing":
        del encoder["expert_modules_change.2.key_memory"]
        line = ("missing key change_detector_state:expert_modules_change.2.key_memory: the model "
                "needs shape (6, 32)")
    else:
        encoder["expert_modules_change.5.key_memory"] = np.zeros((6, 32), np.float32)
        line = ("unexpected key change_detector_state:expert_modules_change.5.key_memory with "
                "shape (6, 32): the model has no such tensor")
    edited = OfficialSnapshot(snapshot.path, {**snapshot.states, ENCODER: encoder},
                              snapshot.model_cfg, 7, ())
    with pytest.raises(KeyMismatchError) as info:
        converter.convert_params(config, edited, SIZES)
    assert info.value.problems == [line]


def test_medic_and_plain_dirl_snapshots_need_their_config(tmp_path):
    snapshot, _ = _snapshot(tmp_path, _config(tmp_path))
    with pytest.raises(WrongModelError, match=r"DIRL\+MEDIC .*configs/dirl.py:PRESET/medic"):
        dirl_converter.check_identity(_config(tmp_path, with_medic=False).model,
                                      snapshot.states, None)
    plain, _ = _snapshot(tmp_path, _config(tmp_path, with_medic=False))
    with pytest.raises(WrongModelError, match="no MEDIC modules"):
        dirl_converter.check_identity(_config(tmp_path).model, plain.states, None)
