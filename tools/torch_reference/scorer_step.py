"""SCORER+CBR's torch reference (:mod:`.scorer`) built from a project config, for
``python -m benchmarks.vs_pytorch --torch`` (:mod:`.train_step`).

The modules take the config's sizes (``configs/scorer.py`` fields) and the data's (grid,
channels, vocabulary, caption length). After each optimiser step the last SCORER layer's and
CBR's logit scales are clamped to <= ln 100, as the official loop does (§3.4); CBR stays out of
the optimiser when ``optim.frozen`` names ``"cbr"`` (the official default, S-Q1). The
reference implements the official matching and CBR only, so the other ablation switches are
refused with the field to change.
"""

from __future__ import annotations

import ml_collections

from changecap_jax.convert.models.scorer import GENERATOR
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.convert.tables import Sizes
from changecap_jax.data.streams import pair_streams
from tools.torch_reference import check_square_grid, check_switches
from tools.torch_reference.scorer import (
    CBR,
    PAD_ID,
    ChangeDetector,
    Speaker,
    clamp_logit_scales,
    sample,
    scorer_pair_losses,
)
from tools.torch_reference.train_step import ReferenceModel, TorchBatch, stream_mean

# The official model's switches (configs/scorer.py ABLATIONS change them).
OFFICIAL = {"use_sim": True, "use_cbr": True, "matching": "official",
            "cbr_mean_by_length": False}


def check_model(model: ml_collections.ConfigDict) -> None:
    """TorchReferenceError unless the reference implements ``model``'s switches."""
    check_switches(model, OFFICIAL, "SCORER+CBR")


def check_grid(sizes: Sizes) -> None:
    check_square_grid(sizes, "the torch reference's grid position tables and CBR "
                             "(docs/official/ §3.1 step 2, §3.3)")


def build(model: ml_collections.ConfigDict, sizes: Sizes) -> ReferenceModel:
    """ChangeDetector, Speaker, CBR in the official creation order, at the config's sizes."""
    check_model(model)
    check_grid(sizes)
    dropout = float(model.dropout_rate)
    detector = ChangeDetector(
        feat_dim=sizes.feature_channels + (2 if model.use_coordinates else 0),
        att_dim=model.hidden_dim, att_head=model.get("encoder_heads") or model.num_heads,
        num_layers=model.encoder_layers, grid_size=sizes.grid_height, dropout=dropout)
    speaker = Speaker(
        vocab_size=sizes.vocab_size, word_dim=model.word_dim, att_dim=model.hidden_dim,
        att_head=model.num_heads, num_layers=model.decoder_layers, seq_length=sizes.max_len,
        dropout=dropout)
    generator = CBR(att_dim=model.hidden_dim, att_head=model.num_heads)

    def losses(batch: TorchBatch) -> dict:
        per_stream = {}
        for stream, pair in batch.pairs.items():
            terms = scorer_pair_losses(detector, speaker, generator, batch.before, pair.after,
                                       pair.labels, pair.targets, pair.masks)
            per_stream[stream] = {"caption": terms["cap"], "sim": terms["sim"],
                                  "cbr": terms["cbr"]}
        return stream_mean(per_stream)

    return ReferenceModel(
        groups={"encoder": detector, "decoder": speaker, "cbr": generator},
        sources={ENCODER: detector, DECODER: speaker, GENERATOR: generator},
        streams=pair_streams(model.pairs), spatial_info=bool(model.use_coordinates),
        losses=losses, aux_losses=("sim", "cbr"),
        zero_grad_rows={"decoder/embed/embedding": PAD_ID},
        after_step=lambda: clamp_logit_scales(detector, generator),
        greedy=lambda before, after, max_len: tuple(
            sample(speaker, detector(before, after).memory, max_len=max_len)))
