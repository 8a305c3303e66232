"""Converter of DIRL+CCR snapshots (tuyunbin/DIRL) into :mod:`changecap_jax.models.dirl`.

The key table is docs/official/ Appendix B for both decoder variants (§4.2 / §4.5):
``"clevr_change"`` (decoder ``models/CCR_no_init.py``) and ``"clevr_dc"`` (``models/CCR.py``,
which adds the LayerNorms ``core.fc.1`` and ``core.embed_fc.1``). Encoder keys come from
``change_detector_state`` and go under ``params['encoder']``; decoder keys from
``speaker_state`` (prefix ``core.`` dropped) under ``params['decoder']``; every
``nn.MultiheadAttention`` is split into ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``
(``changecap_jax/convert/tables.py``). ``python -m changecap_jax convert --print_table`` prints
the whole table for a config.

DIRL+MEDIC (``VisualAIKHU/MEDIC``, a fork of tuyunbin/DIRL; ``config.model.medic``,
``configs/dirl.py:PRESET/medic``): its ``train/train_*_final.py`` saves the same dict
(``change_detector_state``, ``speaker_state``, ``model_cfg``; also ``optimizer_state``,
``lr_scheduler_state``, ``scaler_state``, ``iteration``, ``epoch``, not converted). Its
``models/model.py`` DIRL holds the plug-in beside the encoder, in ``change_detector_state``:
``expert_modules_change.{k}.key_memory`` / ``value_memory`` (memory slots, 2 x hidden) ->
``medic/experts_{k}/...`` unchanged, ``expert_module_no_change.*`` -> ``medic/no_change_expert/``,
the 3x3 convs ``change_classifier.{0,2}`` / ``type_classifier.{0,2}`` ->
``medic/{change,type}_classifier/conv_{0,2}`` (kernel transposed to (kh, kw, in, out)). Its
decoder (``models/CCR_expert.py``) is the CLEVR-DC one with ``core.embed_fc.0`` reading
4 x hidden (cat(diff, experts)).
"""

from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np

from changecap_jax.convert.errors import WrongModelError
from changecap_jax.convert.model_converter import ModelConverter, zero_batch
from changecap_jax.convert.models import tuyunbin
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.convert.tables import (
    Dim,
    Entry,
    Sizes,
    Source,
    States,
    conv1x1,
    conv2d,
    embedding,
    layer_norm,
    linear,
    mha,
    param,
)
from changecap_jax.models import losses, medic

MEDIC_KEY = "change_classifier.0.weight"  # in change_detector_state: a DIRL+MEDIC snapshot


def check_identity(model: ml_collections.ConfigDict, states: States, model_cfg: Any) -> None:
    """A DIRL snapshot of the config's decoder variant and number of heads."""
    found = tuyunbin.check_family(states, "dirl", "DIRL+CCR")
    has_medic = MEDIC_KEY in states.get(ENCODER, {})
    if has_medic != medic.enabled(_medic_field(model)):
        raise WrongModelError(
            "the snapshot is DIRL+MEDIC (VisualAIKHU/MEDIC) but config.model has no medic; "
            "convert it with --config=configs/dirl.py:PRESET/medic" if has_medic else
            "config.model.medic is on but the snapshot has no MEDIC modules (no "
            f"{ENCODER}:{MEDIC_KEY}); convert it without the /medic preset")
    if found.variant != model.variant:
        raise WrongModelError(
            f"the snapshot is {found.description}, but config.model.variant is "
            f"{model.variant!r}; convert it with the matching preset, "
            f"--config=configs/dirl.py:{found.variant}")
    tuyunbin.check_num_heads(model, model_cfg)


def _encoder(model: ml_collections.ConfigDict, d: tuyunbin.Dims) -> list[Entry]:
    mlp = Dim(model.mlp_hidden_dim, "DIRL MLP width (config.model.mlp_hidden_dim)")
    t = conv1x1(ENCODER, "img.0", "encoder/img", d.cin, d.hid)
    t += tuyunbin.grid_embeddings(d)
    t += linear(ENCODER, "mlp.0", "encoder/mlp_0", d.hid, mlp)
    t += linear(ENCODER, "mlp.3", "encoder/mlp_3", mlp, d.hid)
    for layer in range(model.encoder_layers):
        t += mha(ENCODER, f"transformer.{layer}.attention",
                 f"encoder/transformer_{layer}/attention", d.hid)
        t += layer_norm(ENCODER, f"transformer.{layer}.norm1",
                        f"encoder/transformer_{layer}/norm1", d.hid)
    return t


def _medic_field(model: Any) -> Any:
    return getattr(model, "medic", None)


def _medic(model: ml_collections.ConfigDict, d: tuyunbin.Dims) -> list[Entry]:
    """The plug-in's keys (module docstring); none when ``config.model.medic`` is off."""
    plugin = medic.from_config(_medic_field(model), d.hid.size)
    if plugin is None:
        return []
    slots = Dim(plugin.memory_size, "MEDIC memory slots (config.model.medic.memory_size)")
    width = Dim(plugin.classifier_hidden,
                "MEDIC classifier width (config.model.medic.classifier_hidden)")
    outputs = {"change": Dim(2, "no change / change"),
               "type": Dim(len(plugin.type_names), "change types (MEDIC's type_names)")}
    experts = [(f"expert_modules_change.{k}", f"medic/experts_{k}")
               for k in range(len(plugin.type_names))]
    t = []
    for src, dst in [*experts, ("expert_module_no_change", "medic/no_change_expert")]:
        for leaf in ("key_memory", "value_memory"):
            t += param(ENCODER, f"{src}.{leaf}", f"{dst}/{leaf}", (slots, d.two_hid))
    for name, n_out in outputs.items():
        src, dst = f"{name}_classifier", f"medic/{name}_classifier"
        t += conv2d(ENCODER, f"{src}.0", f"{dst}/conv_0", d.two_hid, width, 3)
        t += conv2d(ENCODER, f"{src}.2", f"{dst}/conv_2", width, n_out, 3)
    return t


def _decoder(model: ml_collections.ConfigDict, d: tuyunbin.Dims) -> list[Entry]:
    dc = model.variant == "clevr_dc"
    ffn = Dim(model.ffn_dim, "FFN width (config.model.ffn_dim)")
    t = embedding(DECODER, "core.embed.weight", "decoder/embed/embedding", d.vocab, d.word)
    t += linear(DECODER, "core.fc.0", "decoder/fc_0", d.word, d.hid)
    if dc:
        t += layer_norm(DECODER, "core.fc.1", "decoder/fc_1", d.hid)
    fused = d.two_hid if not medic.enabled(_medic_field(model)) else Dim(
        4 * d.hid.size, "4 x hidden size: cat(diff, MEDIC experts) (config.model.medic)")
    t += linear(DECODER, "core.embed_fc.0", "decoder/embed_fc_0", fused, d.hid)
    if dc:
        t += layer_norm(DECODER, "core.embed_fc.1", "decoder/embed_fc_1", d.hid)
    t += tuyunbin.position_buffer(d)
    for layer in range(model.decoder_layers):
        src, dst = f"core.layer.{layer}", f"decoder/layer_{layer}"
        t += mha(DECODER, f"{src}.self_att", f"{dst}/self_att", d.hid)
        t += mha(DECODER, f"{src}.cross_att", f"{dst}/cross_att", d.hid)
        for norm in ("norm1", "norm2", "norm3"):
            t += layer_norm(DECODER, f"{src}.{norm}", f"{dst}/{norm}", d.hid)
        t += linear(DECODER, f"{src}.linear1", f"{dst}/linear1", d.hid, ffn)
        t += linear(DECODER, f"{src}.linear2", f"{dst}/linear2", ffn, d.hid)
    t += linear(DECODER, "logit", "decoder/logit", d.hid, d.vocab)
    return t


def table(model: ml_collections.ConfigDict, sizes: Sizes) -> list[Entry]:
    """Appendix B (CLEVR-Change) and the CLEVR-DC differences, for any sizes."""
    if model.variant not in ("clevr_change", "clevr_dc"):
        raise ValueError(f"unknown DIRL variant {model.variant!r}")
    d = tuyunbin.dims(model, sizes)
    return _encoder(model, d) + _medic(model, d) + _decoder(model, d)


def example_batch(model: Any, sizes: Sizes) -> dict[str, np.ndarray]:
    """Zeros in the layout of the DIRL model's streams."""
    return zero_batch(model, sizes)


def stream_aux(model: Any, out: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per stream, L_dirl from the MLP outputs and L_ccr from the CCR sequence means t and v
    (the model returns only their means over the streams)."""
    aux = {}
    for stream in model.streams:
        aux[f"aux/dirl/{stream}"] = losses.barlow_correlation_loss(
            out[f"encoder/{stream}/mlp_before"], out[f"encoder/{stream}/mlp_after"],
            off_diagonal_weight=model.off_diagonal_weight)
        aux[f"aux/ccr/{stream}"] = losses.ccr_infonce_loss(
            out[f"decoder/{stream}/t"], out[f"decoder/{stream}/v"])
    return aux


CONVERTER = ModelConverter(
    name="dirl",
    title="DIRL+CCR (tuyunbin/DIRL)",
    sources=(
        Source(ENCODER, True, "encoder DIRL (models/DIRL.py; MEDIC's models/model.py)"),
        Source(DECODER, True, "decoder CCR (models/CCR_no_init.py or models/CCR.py; MEDIC's "
                              "models/CCR_expert.py)"),
    ),
    table=table,
    sizes_from_states=tuyunbin.sizes_from_states,
    check_identity=check_identity,
    example_batch=example_batch,
    vocab_size_of_params=tuyunbin.vocab_size_of_params,
    output_fields={"decoder": ("logits", "t", "v")},
    stream_aux=stream_aux,
)
