"""SCORER + CBR (Tu et al., ICCV 2023); docs/official/scorer.md §3.

    python -m changecap_jax.main --config=configs/scorer.py[:PRESET[/ABLATION]]

Presets:
  synthetic (default)    the built-in synthetic dataset with a CPU-sized model (hidden 128,
                         4 heads, word dim 64, no dropout, lr 5e-4 constant, batch 64, eval
                         batch 200, 1000 steps, eval/checkpoint every 500; DIRL's synthetic
                         budget). The Speaker FFN is hidden -> hidden by construction (its
                         residual adds the GELU output to the FFN output), so its width is 128
                         here, not DIRL's 256. A step costs about 2.7x DIRL's on CPU (1.7 s vs
                         0.64 s on 2 busy cores): the batch-wide token matching is
                         O(B^2 N^2 D) and runs three times per pair.
  synthetic_extreme      the same on the extreme-distractor variant.
  clevr_change           official code (transformer.yaml): 2 SCORER layers, coordinates, both
                         pairs, weights sim 0.1 / cbr 0.001, batch 128, lr 2e-4 with StepLR x0.1
                         every 15 epochs, 10k iterations (the official loop finishes its last
                         epoch: 10 070), CBR frozen.
  clevr_dc               paper text (supplement): weights 0.01 / 0.004, 1 layer, batch 128,
                         lr 2e-4; semantic pair only, no coordinates, captions up to 40.
  spot_the_diff          paper text: weights 0.3 / 0.5, 3 layers, batch 32, lr 2e-4.
  image_editing_request  paper text: weights 0.003 / 0.06, 2 layers, batch 16, lr 1e-4.
  birds_to_words         not in the paper: the Spot-the-Diff settings.

Ablations of the paper (paper §4.5, supplement §6.3), appended as ``PRESET/NAME`` (table:
docs/ablations.md; each switches exactly the fields ABLATIONS names):
  scorer_cbr (default)   the full model.
  scorer, rr, rr_cbr     Tables 6-7 (10-12): without CBR; without L_sim and CBR (vanilla
                         representation reconstruction); without L_sim. Subtraction is its own
                         model: configs/subtraction.py.
  mtm_per_subspace, tm, max_pool, mean_pool
                         Fig. 3: model.matching (changecap_jax.models.losses.matching_similarity).
  heads{1,2,4,8,16}      Fig. 4: model.encoder_heads (the SCORER layers' heads).
  layers{1,2,3,4}        Fig. 5: model.encoder_layers.

MEDIC plug-in (docs/models.md "MEDIC on SCORER+CBR"), appended as ``PRESET/medic``: SCORER +
MEDIC, the MEDIC paper's claim (its official code has no SCORER configuration): the router and
experts read X1 and X2, the last SCORER layer's outputs, and the experts' features join the
fusion into the decoder memory. The plug-in's settings and MEDIC's loss weights are DIRL+MEDIC's
(configs/common.py ``MEDIC_PRESETS``: cls 0.1 / type 0.1 / disentangle / consistency); SCORER's
own weights, batch, learning rate and iterations stay the preset's (MEDIC's run scripts'
batch and iterations are DIRL's). One setting is ours, on every SCORER+MEDIC preset:
``model.medic.feature_routing="router"``, the expert features routed by the router in training
as at test; MEDIC's official label-and-router routing in training cost SCORER+MEDIC 29.8 CIDEr
on the built-in set over three seeds (docs/ablations.md "Why SCORER+MEDIC lost").
Spot-the-Diff and Image Editing Request as built here have no change types and are refused.

Layer numbers: the paper (Fig. 5 text) sets "2, 1, 3, and 2 on four datasets", in the order of
its Table 8 (CLEVR-Change, CLEVR-DC, Spot-the-Diff, IER); "the layer number is the deepest on
Spot-the-Diff" confirms that order. Decoder: 8 heads, 2 layers on all four (paper §4.3).
Iterations: "10K iterations in total" (supplement §6.1). Only the CLEVR-Change config exists in
the official repository; the other datasets follow the CLEVR-DC code path of the same authors'
DIRL (no coordinate channels, one pair per example), which is our reading.

Switches (faithful values are the defaults):
  optim.frozen           ("cbr",) as the official optimiser, which never updates CBR (S-Q1);
                         --config.optim.frozen='()' trains CBR.
  model.cbr_mean_by_length  False: CBR's sentence mean divides by the padded length (S-Q8);
                         True divides by the caption length.
  model.use_sim / model.use_cbr  ablations (RR = use_sim False); loss_weights must then name
                         only the remaining losses, and optim.frozen must not name "cbr" when
                         use_cbr is False.
  model.match_chunk_size    batch columns of the token-wise matching per step (memory only).
  model.matching         "official" (S-Q2); the Fig. 3 variants are presets (above).
  model.encoder_heads    heads of the SCORER layers (num_heads: the decoder's and CBR's).
  decode.sample          False (greedy, test.py); the official in-training validation samples
                         (S-Q9): --config.decode.sample=True reproduces that.
"""

from __future__ import annotations

import ml_collections

from configs import common


def _paper_model(
    pairs: str, use_coordinates: bool, encoder_layers: int
) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "name": "scorer",
        "pairs": pairs,
        "use_coordinates": use_coordinates,
        "hidden_dim": 512,
        "num_heads": 8,
        "encoder_layers": encoder_layers,
        "decoder_layers": 2,
        "word_dim": 300,
        "dropout_rate": 0.1,
        "use_sim": True,
        "use_cbr": True,
        "cbr_mean_by_length": False,
        "match_chunk_size": 8,
        "matching": "official",
        # None: the SCORER layers have num_heads heads (the Fig. 4 presets set it apart).
        "encoder_heads": ml_collections.config_dict.placeholder(int),
    })


DROP = common.DROP  # an ABLATIONS value: the key is removed from its dict

# Ablation -> the dotted config fields it sets, and nothing else (tests/test_scorer_ablations.py).
# Dropping a loss also drops its weight; without CBR nothing is left to freeze.
_NO_CBR = {"model.use_cbr": False, "loss_weights.cbr": DROP, "optim.frozen": ()}
_NO_SIM = {"model.use_sim": False, "loss_weights.sim": DROP}
ABLATIONS: dict[str, dict[str, object]] = {
    "scorer_cbr": {},  # Tables 6-7 "SCORER+CBR"
    "scorer": dict(_NO_CBR),  # "SCORER"
    "rr": {**_NO_SIM, **_NO_CBR},  # "RR": vanilla representation reconstruction
    "rr_cbr": dict(_NO_SIM),  # "RR+CBR"
    # Fig. 3 (the default "official" matching is the reference of the others)
    "mtm_per_subspace": {"model.matching": "per_subspace"},
    "tm": {"model.matching": "tokenwise_single_head"},
    "max_pool": {"model.matching": "max_pool"},
    "mean_pool": {"model.matching": "mean_pool"},
    # Fig. 4 / Fig. 5: the figures' x values are not in the paper's text; these sweeps hold the
    # values the paper picks (8 heads; 2, 1, 3, 2 layers) and their neighbours.
    **{f"heads{n}": {"model.encoder_heads": n} for n in (1, 2, 4, 8, 16)},
    **{f"layers{n}": {"model.encoder_layers": n} for n in (1, 2, 3, 4)},
}


def apply_ablation(config: ml_collections.ConfigDict, name: str) -> None:
    """Sets the fields of ``ABLATIONS[name]`` in ``config`` (in place)."""
    common.require_choice(name, ABLATIONS, "ablation", "configs/scorer.py", shown=list(ABLATIONS))
    common.set_fields(config, ABLATIONS[name])


# dataset -> (encoder layers, loss weights (sim, cbr), batch, lr, iterations, decode length)
PAPER_PRESETS = {
    "clevr_change": (2, (0.1, 0.001), 128, 2e-4, 10_000, 0),
    "clevr_dc": (1, (0.01, 0.004), 128, 2e-4, 10_000, 40),
    "spot_the_diff": (3, (0.3, 0.5), 32, 2e-4, 10_000, 0),
    "image_editing_request": (2, (0.003, 0.06), 16, 1e-4, 10_000, 0),
    # Not in the paper (SCORER was not evaluated on Birds-to-Words): Spot-the-Diff's settings.
    "birds_to_words": (3, (0.3, 0.5), 32, 2e-4, 10_000, 0),
}


def get_config(preset: str = "synthetic") -> ml_collections.ConfigDict:
    config = common.trainer_defaults(ml_collections.ConfigDict())
    preset, ablation = common.split_preset(preset, "synthetic")
    if preset in ("synthetic", "synthetic_extreme"):
        config.dataset = common.synthetic_dataset(
            "extreme" if preset == "synthetic_extreme" else "moderate")
        config.model = _paper_model("both", True, 2)
        config.model.update(hidden_dim=128, num_heads=4, word_dim=64,
                            dropout_rate=0.0)
        common.cpu_training(config)
        config.loss_weights = {"sim": 0.1, "cbr": 0.001}
    elif preset in PAPER_PRESETS:
        layers, (w_sim, w_cbr), batch, lr, steps, decode_len = PAPER_PRESETS[preset]
        clevr_change = preset == "clevr_change"
        config.dataset = common.prebuilt_dataset(preset)
        config.model = _paper_model("both" if clevr_change else "semantic_only", clevr_change,
                                    layers)
        config.batch_size = batch
        config.optim.learning_rate = lr
        config.num_train_steps = steps
        config.loss_weights = {"sim": w_sim, "cbr": w_cbr}
        config.decode.max_len = decode_len
        config.finish_last_epoch = True  # official: the last epoch runs to its end (10,070)
    else:
        raise ValueError(f"unknown preset {preset!r} for configs/scorer.py; choose one of "
                         f"{['synthetic', 'synthetic_extreme', *PAPER_PRESETS]}")
    config.optim.frozen = ("cbr",)  # S-Q1: the official optimiser never updates CBR
    # core.embed has padding_idx=0: torch zeroes row 0's gradient (its value is N(0, 0.02)).
    config.optim.zero_grad_rows = {"decoder/embed/embedding": 0}
    if ablation == "medic":
        common.add_medic_plugin(config, preset)
        config.model.medic.feature_routing = "router"  # module docstring
    else:
        apply_ablation(config, ablation or "scorer_cbr")
    return config
