"""The snapshot layout that tuyunbin/DIRL and tuyunbin/SCORER share, for their two converters.

Both official ``train.py`` save ``{"change_detector_state": ..., "speaker_state": ...,
"model_cfg": cfg}`` (docs/official/ §3.6, §4.5): the encoder and decoder state_dicts
(:data:`ENCODER`, :data:`DECODER`) and the config, whose ``att_head`` is the one size the
weights cannot tell. Here: which of the two models a snapshot holds (from signature keys), the
sizes both read from the same keys, the checks both make, and the axes and entries both key
tables share (docs/official/ Appendix A and B).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import ml_collections
import numpy as np

from changecap_jax.convert.errors import KeyMismatchError, WrongModelError
from changecap_jax.convert.tables import (
    Dim,
    Entry,
    Sizes,
    States,
    buffer,
    find_config_values,
    fmt_shape,
    param,
    require_shape,
    sinusoid_check,
)

ENCODER = "change_detector_state"  # official snapshot keys (§3.6, §4.5)
DECODER = "speaker_state"


class Identity(NamedTuple):
    model: str | None  # config.model.name of the family, None if unknown
    variant: str | None
    description: str


def identify_checkpoint(states: States) -> Identity:
    """Which official model a snapshot's state_dicts belong to, from signature keys."""
    enc = states.get(ENCODER, {})
    dec = states.get(DECODER, {})
    if "scorer.0.attention.query.weight" in enc or "core.layer.0.dec_enc_attention.query.weight" \
            in dec:
        return Identity("scorer", None, "SCORER+CBR (tuyunbin/SCORER, Appendix A)")
    if "mlp.0.weight" in enc or "core.layer.0.self_att.in_proj_weight" in dec:
        if "core.fc.1.weight" in dec or "core.embed_fc.1.weight" in dec:
            return Identity("dirl", "clevr_dc",
                            "DIRL+CCR CLEVR-DC (decoder models/CCR.py, with the LayerNorms "
                            "core.fc.1 / core.embed_fc.1)")
        return Identity("dirl", "clevr_change",
                        "DIRL+CCR CLEVR-Change (decoder models/CCR_no_init.py, without "
                        "core.fc.1 / core.embed_fc.1)")
    keys = sorted(enc)[:4] + sorted(dec)[:4]
    return Identity(None, None, f"unrecognised model (keys such as {keys})")


def check_family(states: States, name: str, label: str) -> Identity:
    """The snapshot's :class:`Identity`; WrongModelError unless it is of model ``name``."""
    found = identify_checkpoint(states)
    if found.model != name:
        raise WrongModelError(
            f"the snapshot holds a {found.description} checkpoint, but the config builds model "
            f"'{name}' ({label}); use the config of that model")
    return found


def check_num_heads(model: ml_collections.ConfigDict, model_cfg: Any) -> None:
    """The snapshot's ``model_cfg`` ``att_head`` must be ``config.model.num_heads``: the
    weights cannot tell the number of heads (in_proj (3E, E) and q/k/v (E, E) fit any split)."""
    heads = {int(h) for h in find_config_values(model_cfg, "att_head")
             if isinstance(h, int | np.integer)}
    if heads and heads != {int(model.num_heads)}:
        raise WrongModelError(
            f"the snapshot's model_cfg says att_head = {sorted(heads)}, but config.model."
            f"num_heads is {model.num_heads}; set --config.model.num_heads={min(heads)}")


def sizes_from_states(model: ml_collections.ConfigDict, states: States) -> Sizes:
    """Vocabulary, PE rows, input channels and grid of a DIRL or SCORER snapshot."""
    img = require_shape(states, ENCODER, "img.0.weight", 4)
    w_rows = require_shape(states, ENCODER, "w_embedding.weight", 2)[0]
    h_rows = require_shape(states, ENCODER, "h_embedding.weight", 2)[0]
    vocab = require_shape(states, DECODER, "core.embed.weight", 2)[0]
    pe_rows = require_shape(states, DECODER, "core.position_enc.pe", 2)[0]
    coords = 2 if model.use_coordinates else 0
    channels = img[1] - coords
    if channels <= 0:
        raise KeyMismatchError(
            f"{ENCODER}:img.0.weight has shape {fmt_shape(img)}: {img[1]} input channels "
            f"cannot hold the {coords} coordinate channels of config.model.use_coordinates",
            [f"{ENCODER}:img.0.weight"])
    return Sizes(vocab, pe_rows, channels, h_rows, w_rows, "the checkpoint")


def vocab_size_of_params(params: Any) -> int:
    """The vocabulary size of a converted DIRL or SCORER model: its logit layer's width."""
    return int(params["decoder"]["logit"]["bias"].shape[0])


class Dims(NamedTuple):
    """The axes both tables use, each with what decides it (for error messages)."""

    hid: Dim
    half: Dim
    two_hid: Dim
    cin: Dim
    grid_h: Dim
    grid_w: Dim
    vocab: Dim
    word: Dim


def dims(model: ml_collections.ConfigDict, sizes: Sizes) -> Dims:
    """The shared axes for ``config.model`` and the data-dependent ``sizes``."""
    e = model.hidden_dim
    coords = 2 if model.use_coordinates else 0
    return Dims(
        hid=Dim(e, "hidden size (config.model.hidden_dim)"),
        half=Dim(e // 2, "hidden size / 2 (config.model.hidden_dim)"),
        two_hid=Dim(2 * e, "2 x hidden size (config.model.hidden_dim)"),
        cin=Dim(sizes.feature_channels + coords,
                f"input channels ({sizes.origin}: {sizes.feature_channels} feature channels"
                f"{' + 2 coordinates' if coords else ''})"),
        grid_h=Dim(sizes.grid_height, f"feature grid height ({sizes.origin})"),
        grid_w=Dim(sizes.grid_width, f"feature grid width ({sizes.origin})"),
        vocab=Dim(sizes.vocab_size, f"vocabulary size ({sizes.origin})"),
        word=Dim(model.word_dim, "word size (config.model.word_dim)"),
    )


def grid_embeddings(d: Dims) -> list[Entry]:
    """The encoder's learnt row / column position tables (rows = the grid's width / height)."""
    return (param(ENCODER, "w_embedding.weight", "encoder/pos_embedding/w_embedding",
                  (d.grid_w, d.half))
            + param(ENCODER, "h_embedding.weight", "encoder/pos_embedding/h_embedding",
                    (d.grid_h, d.half)))


def position_buffer(d: Dims) -> list[Entry]:
    """The decoder's sinusoid buffer, checked against ours. The official seq_length (24 / 40)
    only bounds the official decoder; ours recomputes the same table for any length, so only
    the width is fixed."""
    return buffer(DECODER, "core.position_enc.pe", (Dim(None, "official seq_length"), d.word),
                  sinusoid_check())
