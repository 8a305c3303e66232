"""DIRL + CCR (Tu et al., ECCV 2024); docs/official/dirl.md §4.

    python -m changecap_jax.main --config=configs/dirl.py[:PRESET[/ABLATION]]

Presets:
  synthetic (default)    the built-in synthetic dataset with a CPU-sized model (hidden 128,
                         4 heads, word dim 64, FFN 256, no dropout, lr 5e-4 constant, batch
                         64, 1000 steps, loss weights 0.5 / 0.3): the budget of the studies
                         in docs/ablations.md; about 6 minutes on an idle 2-core CPU.
  quickstart             the README's first run: the synthetic preset at 750 steps with lr
                         1e-3, the paper's CLEVR-DC loss weights (0.03 / 0.05), the training
                         split on the device and one evaluation (test) at the end. At the
                         synthetic preset's weights CCR held back colour and material (material
                         CIDEr 33 on one CPU); with these every change type is learned, over
                         three seeds (README, "Quick start"; docs/ablations.md).
  synthetic_extreme      the same on the extreme-distractor variant.
  clevr_change           paper, official code: CCR_no_init decoder, coordinates, both pairs,
                         weights 0.5 / 0.3, batch 128, lr 2e-4, 15k iterations.
  clevr_dc               paper, official code: CCR decoder (LNs, xavier), no coordinates,
                         semantic pair only, weights 0.03 / 0.05, captions up to 40, 13k.
  spot_the_diff          paper text: weights 0.5 / 0.004 (DIRL paper §4.6 / supplement); batch 32
                         and lr 2e-4 from SCORER's Table 8 (same authors, same trunk).
  image_editing_request  paper text: weights 0.001 / 0.05; batch 16, lr 1e-4 (SCORER Table 8).
  birds_to_words         not in the paper (DIRL was not evaluated on Birds-to-Words): the
                         Spot-the-Diff settings, captions up to 80 tokens (IDC's bird length).

The real datasets are built first with ``python -m data_prep.build DATASET --raw_dir=...
--data_dir=DIR`` and selected by the preset plus ``--config.dataset.data_dir=DIR``. The
authors released code for CLEVR-Change and CLEVR-DC only; for the other datasets the model
follows the CLEVR-DC code path (CCR decoder, no coordinate channels, one pair per example),
which is our reading, and 10k iterations as the paper's text says.

Ablations of the paper (Tables 6-7, on CLEVR-DC in the paper; here on every preset), appended
as ``PRESET/NAME`` (table: docs/ablations.md; each switches exactly the fields ABLATIONS names):
  dirl_ccr (default)     Table 6 "Transformer + DIRL + CCR": the full model.
  transformer            Table 6 the vanilla Transformer: no DIRL loss (nor its MLP head), no
                         CCR loss; the same cross-attention encoder and decoder.
  dirl                   Table 6 "+DIRL" (= Table 7's DIRL with both terms): no CCR loss.
  ccr                    Table 6 "+CCR": no DIRL loss.
  dirl_non_perturbation  Table 7: DIRL without CCR, only the first term of Eq. (4)
                         (model.off_diagonal_weight = 0).
  dirl_discrimination    Table 7: DIRL without CCR, only the second term of Eq. (4)
                         (model.on_diagonal_weight = 0; alpha stays 0.003).
MEDIC plug-in (docs/models.md "MEDIC"), appended as ``PRESET/medic``: DIRL + MEDIC as the
official code ``VisualAIKHU/MEDIC`` trains it (``configs/dynamic/transformer_medic_*.yaml``,
``run/run_*_final.sh``): the CCR decoder of ``models/CCR_expert.py`` (LNs, xavier) reading
cat(diff, experts), loss weights dirl 0.03 / ccr 0.05 and MEDIC's cls 0.1 / type 0.1 /
disentangle / consistency (CLEVR-Change 0.1 / 0.1, batch 64, 30k iterations; CLEVR-DC
0.1 / 0.01, batch 128, 50k; Spot-the-Diff 0.01 / 0.01, batch 128, 50k; Image Editing Request:
no run script, the training script's defaults 0.1 / 0.1). MEDIC needs change-type labels:
Spot-the-Diff and Image Editing Request as built here have none and are refused.

The lambda_d / lambda_c study (Fig. 5) is a sweep of loss_weights.dirl / loss_weights.ccr
(docs/ablations.md, "Sweeps").
"""

from __future__ import annotations

import ml_collections

from configs import common


def _paper_model(variant: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "name": "dirl",
        "variant": variant,
        "pairs": "both" if variant == "clevr_change" else "semantic_only",
        "use_coordinates": variant == "clevr_change",
        "hidden_dim": 512,
        "num_heads": 8,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "word_dim": 300,
        "ffn_dim": 2048,
        "mlp_hidden_dim": 2048,
        "dropout_rate": 0.1,
        "off_diagonal_weight": 0.003,
        # Tables 6-7 switches (the ABLATIONS below); the defaults are the full model.
        "use_dirl": True,
        "use_ccr": True,
        "on_diagonal_weight": 1.0,
    })


# Ablation -> the dotted config fields it sets, and nothing else (tests/test_dirl_ablations.py).
# A loss that is off also loses its weight (the trainer weights exactly the model's losses).
_NO_DIRL = {"model.use_dirl": False, "loss_weights.dirl": common.DROP}
_NO_CCR = {"model.use_ccr": False, "loss_weights.ccr": common.DROP}
ABLATIONS: dict[str, dict[str, object]] = {
    "dirl_ccr": {},  # Table 6 row 4: the full model
    "transformer": {**_NO_DIRL, **_NO_CCR},  # Table 6 row 1 (= Table 7 row 1)
    "dirl": dict(_NO_CCR),  # Table 6 row 2 (= Table 7 row 4)
    "ccr": dict(_NO_DIRL),  # Table 6 row 3
    # Table 7 rows 2-3: one term of Eq. (4), without CCR as the table's DIRL rows.
    "dirl_non_perturbation": {**_NO_CCR, "model.off_diagonal_weight": 0.0},
    "dirl_discrimination": {**_NO_CCR, "model.on_diagonal_weight": 0.0},
}


# dataset -> (decoder variant, loss weights (dirl, ccr), batch, lr, iterations, decode length)
PAPER_PRESETS = {
    "clevr_change": ("clevr_change", (0.5, 0.3), 128, 2e-4, 15_000, 0),
    "clevr_dc": ("clevr_dc", (0.03, 0.05), 128, 2e-4, 13_000, 40),
    "spot_the_diff": ("clevr_dc", (0.5, 0.004), 32, 2e-4, 10_000, 0),
    "image_editing_request": ("clevr_dc", (0.001, 0.05), 16, 1e-4, 10_000, 0),
    "birds_to_words": ("clevr_dc", (0.5, 0.004), 32, 2e-4, 10_000, 0),
}


def add_medic(config: ml_collections.ConfigDict, preset: str) -> None:
    """DIRL + MEDIC as the official code trains it: the plug-in with its official settings
    (``common.add_medic_plugin``, ``common.MEDIC_PRESETS``), the CCR_expert.py decoder, and on
    the paper datasets DIRL's weights and the batch and iterations of MEDIC's run scripts."""
    common.add_medic_plugin(config, preset)
    config.model.variant = "clevr_dc"  # MEDIC's CCR_expert.py: LNs + xavier, on every dataset
    if not preset.startswith("synthetic"):
        _, _, batch, steps = common.MEDIC_PRESETS[preset]
        config.loss_weights.update({"dirl": 0.03, "ccr": 0.05})
        config.batch_size = batch or config.batch_size
        config.num_train_steps = steps or config.num_train_steps


def _quickstart(config: ml_collections.ConfigDict) -> None:
    """The README's run (docs/ablations.md, "The quick start preset"): fewer steps at a larger
    lr and the CLEVR-DC weights, under which CCR no longer holds back the colour and material
    changes on this budget; the training split held on the device (the loader's batches, no
    reading threads beside the step); one evaluation, of the test split, when training ends."""
    config.num_train_steps = 750
    config.optim.learning_rate = 1e-3
    config.eval_every_steps = config.checkpoint_every_steps = 750
    config.final_eval_splits = ("test",)
    config.dataset.on_device = True
    config.loss_weights = {"dirl": 0.03, "ccr": 0.05}


def get_config(preset: str = "synthetic") -> ml_collections.ConfigDict:
    config = common.trainer_defaults(ml_collections.ConfigDict())
    preset, ablation = common.split_preset(preset, "synthetic")
    if preset in ("synthetic", "synthetic_extreme", "quickstart"):
        config.dataset = common.synthetic_dataset(
            "extreme" if preset == "synthetic_extreme" else "moderate")
        config.model = _paper_model("clevr_change")
        config.model.update(hidden_dim=128, num_heads=4, word_dim=64, ffn_dim=256,
                            mlp_hidden_dim=256)
        # No dropout on this short CPU budget: with 0.1 the model learned half as fast (val
        # total CIDEr 62 vs 71 at step 400 on the moderate set) and steps cost ~35% more.
        config.model.dropout_rate = 0.0
        common.cpu_training(config)
        config.loss_weights = {"dirl": 0.5, "ccr": 0.3}
        if preset == "quickstart":
            _quickstart(config)
    elif preset in PAPER_PRESETS:
        variant, (w_dirl, w_ccr), batch, lr, steps, decode_len = PAPER_PRESETS[preset]
        config.dataset = common.prebuilt_dataset(preset)
        config.model = _paper_model(variant)
        config.batch_size = batch
        config.optim.learning_rate = lr
        config.num_train_steps = steps
        config.loss_weights = {"dirl": w_dirl, "ccr": w_ccr}
        config.decode.max_len = decode_len
        config.finish_last_epoch = True  # official: the last epoch runs to its end
    else:
        raise ValueError(f"unknown preset {preset!r} for configs/dirl.py; choose one of "
                         f"{['synthetic', 'synthetic_extreme', 'quickstart', *PAPER_PRESETS]}")
    config.optim.zero_grad_rows = {"decoder/embed/embedding": 0}
    if ablation == "medic":
        add_medic(config, preset)
        return config
    ablation = ablation or "dirl_ccr"
    common.require_choice(ablation, ABLATIONS, "ablation", "configs/dirl.py",
                          shown=list(ABLATIONS))
    common.set_fields(config, ABLATIONS[ablation])
    return config
