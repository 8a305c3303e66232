"""DIRL+CCR's torch reference (:mod:`.dirl`) built from a project config, for
``python -m benchmarks.vs_pytorch --torch`` (:mod:`.train_step`).

The modules take the config's sizes (``configs/dirl.py`` fields) and the data's (grid,
channels, vocabulary, caption length); the reference implements the full model of the official
code only, so the Tables 6-7 ablation switches are refused with the field to change.
"""

from __future__ import annotations

import ml_collections

from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.convert.tables import Sizes
from changecap_jax.data.streams import pair_streams
from tools.torch_reference import check_square_grid, check_switches
from tools.torch_reference.dirl import (
    DIRL,
    OFF_DIAGONAL_WEIGHT,
    CCRSpeaker,
    dirl_pair_losses,
    sample,
)
from tools.torch_reference.scorer import PAD_ID
from tools.torch_reference.train_step import ReferenceModel, TorchBatch, stream_mean

# The full model's switches (configs/dirl.py ABLATIONS change them; the reference has none).
FULL_MODEL = {"use_dirl": True, "use_ccr": True, "on_diagonal_weight": 1.0,
              "off_diagonal_weight": OFF_DIAGONAL_WEIGHT}


def check_model(model: ml_collections.ConfigDict) -> None:
    """TorchReferenceError unless the reference implements ``model``'s switches."""
    check_switches(model, FULL_MODEL, "DIRL+CCR")


def check_grid(sizes: Sizes) -> None:
    check_square_grid(sizes, "the torch reference's grid position tables (docs/official/ "
                             "§3.1 step 2)")


def build(model: ml_collections.ConfigDict, sizes: Sizes) -> ReferenceModel:
    """The encoder, then the decoder (the official creation order), at the config's sizes."""
    check_model(model)
    check_grid(sizes)
    dropout = float(model.dropout_rate)
    encoder = DIRL(
        feat_dim=sizes.feature_channels + (2 if model.use_coordinates else 0),
        att_dim=model.hidden_dim, att_head=model.num_heads, num_layers=model.encoder_layers,
        mlp_dim=model.mlp_hidden_dim, grid_size=sizes.grid_height, dropout=dropout)
    speaker = CCRSpeaker(
        model.variant, vocab_size=sizes.vocab_size, seq_length=sizes.max_len,
        word_dim=model.word_dim, att_dim=model.hidden_dim, att_head=model.num_heads,
        num_layers=model.decoder_layers, ffn_dim=model.ffn_dim, dropout=dropout)

    def losses(batch: TorchBatch) -> dict:
        per_stream = {}
        for stream, pair in batch.pairs.items():
            terms = dirl_pair_losses(encoder, speaker, batch.before, pair.after, pair.labels,
                                     pair.targets, pair.masks)
            per_stream[stream] = {"caption": terms["cap"], "dirl": terms["dirl"],
                                  "ccr": terms["ccr"]}
        return stream_mean(per_stream)

    return ReferenceModel(
        groups={"encoder": encoder, "decoder": speaker},
        sources={ENCODER: encoder, DECODER: speaker},
        streams=pair_streams(model.pairs), spatial_info=bool(model.use_coordinates),
        losses=losses, aux_losses=("dirl", "ccr"),
        zero_grad_rows={"decoder/embed/embedding": PAD_ID},
        greedy=lambda before, after, max_len: tuple(
            sample(speaker, *encoder(before, after)[:2], max_len=max_len)))
