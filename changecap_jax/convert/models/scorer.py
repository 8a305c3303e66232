"""Converter of SCORER+CBR snapshots (tuyunbin/SCORER) into :mod:`changecap_jax.models.scorer`.

The key table is docs/official/ Appendix A: the encoder ``models/SCORER.py``
(``change_detector_state``, under ``params['encoder']``), the decoder
``models/transformer_decoder.py`` (``speaker_state``, prefix ``core.`` dropped, under
``params['decoder']``) and CBR ``models/CBR.py`` (source :data:`GENERATOR`, under
``params['cbr']``). The official ``train.py`` never saves CBR (reference S-Q1): the converter
reads it from ``--extra_params`` (``generator.state_dict()``) or, with ``--missing=init``,
initialises it as the trainer does. 1x1 convolutions become a Dense over the channels, 0-d
``logit_scale`` stays 0-d, CBR's attention has no biases (``changecap_jax/convert/tables.py``).
Rows 0..C-1 of ``encoder/img_0/kernel`` read the feature channels, C and C + 1 the x and y
coordinates; rows 0-511 of ``cbr/conv1/kernel`` read X0_bef and 512-1023 the sentence vector.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from changecap_jax.convert.model_converter import ModelConverter, zero_batch
from changecap_jax.convert.models import tuyunbin
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.convert.tables import (
    Entry,
    Sizes,
    Source,
    States,
    conv1x1,
    embedding,
    layer_norm,
    linear,
    mha,
    scalar,
)
from changecap_jax.models import losses

GENERATOR = "generator"  # CBR: never in the official snapshot (S-Q1)


def check_identity(model: ml_collections.ConfigDict, states: States, model_cfg: Any) -> None:
    """A SCORER snapshot with the config's number of heads."""
    tuyunbin.check_family(states, "scorer", "SCORER+CBR")
    tuyunbin.check_num_heads(model, model_cfg)


def _encoder(model: ml_collections.ConfigDict, d: tuyunbin.Dims) -> list[Entry]:
    t = conv1x1(ENCODER, "img.0", "encoder/img_0", d.cin, d.hid)
    t += tuyunbin.grid_embeddings(d)
    for layer in range(model.encoder_layers):
        src, dst = f"scorer.{layer}.attention", f"encoder/scorer_{layer}/attention"
        t += scalar(ENCODER, f"{src}.logit_scale", f"{dst}/logit_scale")
        for proj in ("query", "key", "value"):
            t += linear(ENCODER, f"{src}.{proj}", f"{dst}/{proj}", d.hid, d.hid)
        t += layer_norm(ENCODER, f"{src}.layer_norm", f"{dst}/layer_norm", d.hid)
    t += linear(ENCODER, "embed_fc.0", "encoder/embed_fc_0", d.two_hid, d.hid)
    return t


def _decoder(model: ml_collections.ConfigDict, d: tuyunbin.Dims) -> list[Entry]:
    t = embedding(DECODER, "core.embed.weight", "decoder/embed/embedding", d.vocab, d.word)
    t += tuyunbin.position_buffer(d)
    t += linear(DECODER, "core.fc.0", "decoder/fc_0", d.word, d.hid)
    t += layer_norm(DECODER, "core.fc.2", "decoder/fc_2", d.hid)
    for layer in range(model.decoder_layers):
        src, dst = f"core.layer.{layer}", f"decoder/layer_{layer}"
        for att in ("self_attention", "dec_enc_attention"):
            for proj in ("query", "key", "value"):
                t += linear(DECODER, f"{src}.{att}.{proj}", f"{dst}/{att}/{proj}", d.hid, d.hid)
        t += layer_norm(DECODER, f"{src}.norm1", f"{dst}/norm1", d.hid)
        t += linear(DECODER, f"{src}.hidden_intermediate.dense",
                    f"{dst}/hidden_intermediate/dense", d.hid, d.hid)
        t += layer_norm(DECODER, f"{src}.norm2", f"{dst}/norm2", d.hid)
        t += linear(DECODER, f"{src}.output.dense", f"{dst}/output/dense", d.hid, d.hid)
        t += layer_norm(DECODER, f"{src}.output.LayerNorm", f"{dst}/output/LayerNorm", d.hid)
    t += linear(DECODER, "logit", "decoder/logit", d.hid, d.vocab)
    return t


def _cbr(d: tuyunbin.Dims) -> list[Entry]:
    t = conv1x1(GENERATOR, "conv1", "cbr/conv1", d.two_hid, d.hid)
    t += mha(GENERATOR, "mh_att", "cbr/mh_att", d.hid, bias=False)
    t += conv1x1(GENERATOR, "conv2.0", "cbr/conv2_0", d.hid, d.hid)
    t += scalar(GENERATOR, "contra.logit_scale", "cbr/contra/logit_scale")
    t += linear(GENERATOR, "contra.query", "cbr/contra/query", d.hid, d.hid)
    t += linear(GENERATOR, "contra.key", "cbr/contra/key", d.hid, d.hid)
    return t


def table(model: ml_collections.ConfigDict, sizes: Sizes) -> list[Entry]:
    """Appendix A (``models/SCORER.py``, the Speaker, CBR), for any sizes."""
    d = tuyunbin.dims(model, sizes)
    t = _encoder(model, d) + _decoder(model, d)
    return t + _cbr(d) if model.get("use_cbr", True) else t


def example_batch(model: Any, sizes: Sizes) -> dict[str, np.ndarray]:
    """Zeros in the layout of the SCORER model's streams."""
    return zero_batch(model, sizes)


def stream_aux(model: Any, out: dict[str, np.ndarray]) -> dict[str, Any]:
    """SCORER: the last layer's S1 / S2 (B, B) and L_sim per stream; L_cbr per stream is the
    output of the ``cbr`` call of that stream (``cbr/{stream}``)."""
    aux: dict[str, Any] = {}
    for stream in model.streams:
        prefix = f"encoder/{stream}/matching"
        sims = []
        for i, name in enumerate(("sim_before", "sim_after")):
            q, k = out[f"{prefix}/{i}/query"], out[f"{prefix}/{i}/key"]
            scale = out[f"{prefix}/{i}/logit_scale"]
            aux[f"encoder/{stream}/{name}"] = jnp.exp(scale) * losses.token_matching_similarity(
                jnp.asarray(q), jnp.asarray(k))
            sims.append(losses.matching_contrastive_loss(jnp.asarray(q), jnp.asarray(k),
                                                         jnp.asarray(scale)))
        if model.use_sim:
            aux[f"aux/sim/{stream}"] = 0.5 * (sims[0] + sims[1])
        if model.use_cbr:
            aux[f"aux/cbr/{stream}"] = out[f"cbr/{stream}"]
    return aux


CONVERTER = ModelConverter(
    name="scorer",
    title="SCORER+CBR (tuyunbin/SCORER)",
    sources=(
        Source(ENCODER, True, "encoder SCORER (models/SCORER.py)"),
        Source(DECODER, True, "decoder Speaker (models/transformer_decoder.py)"),
        Source(GENERATOR, False, "CBR generator (models/CBR.py; never in the official "
               "snapshot, reference S-Q1)"),
    ),
    table=table,
    sizes_from_states=tuyunbin.sizes_from_states,
    check_identity=check_identity,
    example_batch=example_batch,
    vocab_size_of_params=tuyunbin.vocab_size_of_params,
    output_fields={"decoder": ("logits", "sentence")},
    stream_aux=stream_aux,
)
