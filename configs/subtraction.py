"""The Subtraction baseline of SCORER's ablations (Tu et al., ICCV 2023, Tables 6-7, 10-12).

    python -m changecap_jax.main --config=configs/subtraction.py[:PRESET]

The model is SCORER's input embedding, a token-wise difference after - before and SCORER's
decoder (see ``changecap_jax/models/subtraction.py`` for the reading of the paper's one-line
description). It has no auxiliary losses, so ``loss_weights`` is empty. Presets mirror
``configs/scorer.py`` (same data, optimiser, batch, lr and iterations per dataset; the
SCORER-specific fields do not apply):

  synthetic (default)    built-in synthetic dataset, CPU-sized (hidden 128, 4 heads, word dim
                         64, no dropout, lr 5e-4 constant, batch 64, 1000 steps).
  synthetic_extreme      the same on the extreme-distractor variant.
  clevr_change           batch 128, lr 2e-4, StepLR x0.1 / 15 epochs, 10k iterations, both
                         pairs, coordinate channels (they cancel in the subtraction; kept so the
                         input matches SCORER's).
  clevr_dc               batch 128, lr 2e-4, semantic pair only, captions up to 40.
  spot_the_diff          batch 32, lr 2e-4, semantic pair only.
  image_editing_request  batch 16, lr 1e-4, semantic pair only.
  birds_to_words         not in a paper: the Spot-the-Diff settings.

Switch: ``model.fusion`` "difference" (default: the memory is Linear(D) of the difference D
alone) or "concat" (Linear(cat(X_bef, X_aft, D))).
"""

from __future__ import annotations

import ml_collections

from configs import common

# dataset -> (batch, lr, iterations, decode length); as configs/scorer.py
PAPER_PRESETS = {
    "clevr_change": (128, 2e-4, 10_000, 0),
    "clevr_dc": (128, 2e-4, 10_000, 40),
    "spot_the_diff": (32, 2e-4, 10_000, 0),
    "image_editing_request": (16, 1e-4, 10_000, 0),
    "birds_to_words": (32, 2e-4, 10_000, 0),  # not in a paper: Spot-the-Diff's settings
}


def _model(pairs: str, use_coordinates: bool) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "name": "subtraction",
        "pairs": pairs,
        "use_coordinates": use_coordinates,
        "hidden_dim": 512,
        "num_heads": 8,
        "decoder_layers": 2,
        "word_dim": 300,
        "dropout_rate": 0.1,
        "fusion": "difference",
    })


def get_config(preset: str = "synthetic") -> ml_collections.ConfigDict:
    config = common.trainer_defaults(ml_collections.ConfigDict())
    preset = preset or "synthetic"
    if preset in ("synthetic", "synthetic_extreme"):
        config.dataset = common.synthetic_dataset(
            "extreme" if preset == "synthetic_extreme" else "moderate")
        config.model = _model("both", True)
        config.model.update(hidden_dim=128, num_heads=4, word_dim=64, dropout_rate=0.0)
        common.cpu_training(config)
    elif preset in PAPER_PRESETS:
        batch, lr, steps, decode_len = PAPER_PRESETS[preset]
        clevr_change = preset == "clevr_change"
        config.dataset = common.prebuilt_dataset(preset)
        config.model = _model("both" if clevr_change else "semantic_only", clevr_change)
        config.batch_size = batch
        config.optim.learning_rate = lr
        config.num_train_steps = steps
        config.decode.max_len = decode_len
        config.finish_last_epoch = True  # as the official SCORER loop
    else:
        raise ValueError(f"unknown preset {preset!r} for configs/subtraction.py; choose one of "
                         f"{['synthetic', 'synthetic_extreme', *PAPER_PRESETS]}")
    config.loss_weights = {}  # no auxiliary losses
    # SCORER's decoder embedding has padding_idx=0: row 0 gets a zero gradient.
    config.optim.zero_grad_rows = {"decoder/embed/embedding": 0}
    return config
