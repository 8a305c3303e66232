"""CHEERS (2025): change entity-guided heterogeneous representation disentangling.

    python -m changecap_jax.main --config=configs/cheers.py[:PRESET[/ABLATION]]

CHEERS reads k retrieved change entities per pair. The synthetic presets make them on first
use (``data_prep/first_use.py``); for a real dataset prepare them once:

    python -m data_prep.entities --dataset=NAME --data_dir=DIR     # entities.json
    python -m data_prep.retrieval --dataset=NAME --data_dir=DIR    # entity_retrieval/

(the synthetic dataset: the retrieval trains its small JAX image-text model, whose embedding
width is ``model.entity_dim`` = 64 below; the real datasets: CLIP ViT-L/14 with
``--backbone=clip --clip_path=...``, 768-dim text embeddings).

Presets:
  synthetic (default)    the built-in synthetic dataset, CPU-sized (hidden 128, 4 heads, word
                         dim 64, FFN 256, 1 HRD layer, no dropout, lr 5e-4 constant, batch 64,
                         1000 steps), as the DIRL/SCORER synthetic presets.
  synthetic_extreme      the same on the extreme-distractor variant.
  clevr_change           paper §4.3: hidden 512, ResNet-101 14x14 features, batch 128, lr 1e-3,
                         greedy decoding; both pairs (as DIRL/SCORER on CLEVR-Change).
  clevr_dc               batch 128, lr 1e-3, semantic pair only (no distractors in CLEVR-DC).
  spot_the_diff          batch 96, lr 5e-4, semantic pair only.

Ablations (Table 4), appended as ``PRESET/NAME``: baseline, cre, dre, hrd, gate, full (the
default). Figure 5's entity count is ``--config.model.num_entities=K`` (retrieve with
``--k`` at least K).

Not given by the paper, our choices (each a field): the number of HRD layers (2; Fig. 6 shows
the effect but its values are not in the text), dropout 0.1, 10k iterations, the trunk's
StepLR (x0.1 every 15 epochs, as DIRL/SCORER whose numbers CHEERS compares with), the gate
activation, q / k+ and the temperature of Eq. 9 (``changecap_jax/models/cheers.py``).
"""

from __future__ import annotations

import ml_collections

from configs import common

# Table 4 rows: which parts are on.
ABLATIONS = {
    "baseline": dict(use_cre=False, use_dre=False, entity_consistency=False, use_gate=False),
    "cre": dict(use_cre=True, use_dre=False, entity_consistency=False, use_gate=False),
    "dre": dict(use_cre=False, use_dre=True, entity_consistency=False, use_gate=False),
    "hrd": dict(use_cre=True, use_dre=True, entity_consistency=True, use_gate=False),
    "gate": dict(use_cre=False, use_dre=False, entity_consistency=False, use_gate=True),
    "full": dict(use_cre=True, use_dre=True, entity_consistency=True, use_gate=True),
}

# dataset -> (pairs, batch, lr)  (paper §4.3)
PAPER_PRESETS = {
    "clevr_change": ("both", 128, 1e-3),
    "clevr_dc": ("semantic_only", 128, 1e-3),
    "spot_the_diff": ("semantic_only", 96, 5e-4),
}


def _paper_model(pairs: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "name": "cheers",
        "pairs": pairs,
        "use_coordinates": False,
        "hidden_dim": 512,
        "num_heads": 8,
        "hrd_layers": 2,
        "decoder_layers": 2,
        "word_dim": 300,
        "ffn_dim": 2048,
        "dropout_rate": 0.1,
        "num_entities": 3,  # paper §4.5: 3 entities is the best count
        "entity_dim": 768,  # CLIP ViT-L/14 text embeddings
        **ABLATIONS["full"],
        "gate_activation": "sigmoid",
        "attention_residual": True,
        "decoder_ffn": True,
        "similarity_scale": 1.0,
        "infonce_temperature": 0.07,
        "fusion_activation": "none",  # Eq. 12 as printed
    })


def get_config(preset: str = "synthetic") -> ml_collections.ConfigDict:
    config = common.trainer_defaults(ml_collections.ConfigDict())
    preset, ablation = common.split_preset(preset, "synthetic")
    ablation = ablation or "full"
    common.require_choice(ablation, ABLATIONS, "ablation", "configs/cheers.py",
                          shown=sorted(ABLATIONS))
    if preset.startswith("synthetic"):
        if preset not in ("synthetic", "synthetic_extreme"):
            raise ValueError(f"unknown preset {preset!r} for configs/cheers.py")
        config.dataset = common.synthetic_dataset(
            "extreme" if preset == "synthetic_extreme" else "moderate")
        config.model = _paper_model("both")
        config.model.update(hidden_dim=128, num_heads=4, word_dim=64, ffn_dim=256,
                            hrd_layers=1, dropout_rate=0.0, entity_dim=64)
        common.cpu_training(config)
    elif preset in PAPER_PRESETS:
        pairs, batch, lr = PAPER_PRESETS[preset]
        config.dataset = common.prebuilt_dataset(preset)
        config.model = _paper_model(pairs)
        config.batch_size = batch
        config.optim.learning_rate = lr
        config.num_train_steps = 10_000
    else:
        raise ValueError(f"unknown preset {preset!r} for configs/cheers.py; choose one of "
                         f"{['synthetic', 'synthetic_extreme', *PAPER_PRESETS]}")
    config.model.update(ABLATIONS[ablation])
    config.loss_weights = {"consistency": 0.75, "infonce": 0.5}  # lambda_v, lambda_m (Table 5)
    config.optim.zero_grad_rows = {}
    return config
