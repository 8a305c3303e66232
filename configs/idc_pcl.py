"""IDC-PCL (Yao et al., AAAI 2022) fine-tuning; reference/official_pytorch.md §5.

    python -m changecap_jax.main --config=configs/idc_pcl.py[:finetune[/DATASET]]

Presets (``finetune/DATASET``; ``finetune`` alone is the synthetic set):
  finetune/synthetic          the built-in synthetic dataset with a CPU-sized model (hidden 128,
                              4 heads, FFN 256, 2 cross-modal blocks, no dropout), batch 64,
                              1000 steps, constant lr 5e-4, the official summed loss.
  finetune/synthetic_extreme  the same on the extreme-distractor variant.
  finetune/clevr_change       Table 6 / §5.6: hidden 512, 8 heads, FFN 2048, 3 blocks, dropout
                              0.2, captions of 40, lr 3e-5 halved at 10k and 20k steps, at most
                              100k steps, val every 400 steps, early stop after 50 evaluations
                              without a better val CIDEr, then test with the best state.
  finetune/birds_to_words     Table 6: 2 blocks, captions of 80, batch 32, weight decay 1e-4,
                              ROUGE-L as the early-stopping metric, semantic pairs only (the
                              dataset has no distractor pairs, so no distractor classifier loss).

Batch: the official loader's 200 samples are single pairs with one sentence each, semantic and
non-semantic mixed; an example here gives both its pairs, so CLEVR-Change's 200 samples are 100
examples. Initialise from pretraining with ``--config.init_from=PRETRAIN_WORKDIR`` (every
parameter except the pooler, as ``finetune.py``).

Tokens: on the trunk the text uses the dataset vocabulary (BOS = <START>, EOS = <END>) with
[MASK] and [CLS] rows appended; the official dict.json layout (BOS 1, MASK 5) is what
``python -m changecap_jax.convert`` maps from.
"""

from __future__ import annotations

import ml_collections

from configs import common

STAGES = ("finetune",)
SYNTHETIC = ("synthetic", "synthetic_extreme")
# dataset -> (cross-modal blocks, caption ids, examples per step, weight decay, early-stop metric,
#             pairs)
PAPER_PRESETS = {
    "clevr_change": (3, 40, 100, 0.0, "CIDEr", "both"),
    "birds_to_words": (2, 80, 32, 1e-4, "ROUGE_L", "semantic_only"),
}


def _paper_model() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "name": "idc_pcl",
        "stage": "finetune",
        "pairs": "both",
        "hidden_dim": 512,
        "image_dim": 2048,
        "ffn_dim": 2048,
        "num_heads": 8,
        "cross_layers": 3,
        "dropout_rate": 0.2,
        "loss_reduction": "sum",  # finetune.py sums token and sample losses (I-Q10)
        "stop_at_eos": False,  # Model.greedy's fixed 39 steps (§5.5); True saves steps only
        "word_mask_probability": 0.15,
        "eos_mask_probability": 0.15,
    })


def get_config(preset: str = "finetune") -> ml_collections.ConfigDict:
    config = common.trainer_defaults(ml_collections.ConfigDict())
    stage, _, dataset = (preset or "finetune").partition("/")
    dataset = dataset or "synthetic"
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r} for configs/idc_pcl.py; choose one of "
                         f"{STAGES} (as STAGE[/DATASET])")
    config.model = _paper_model()
    config.seed = 1234  # the official seed
    config.swap_prob = 0.0  # the official loader never swaps the images
    if dataset in SYNTHETIC:
        config.dataset = common.synthetic_dataset(
            "extreme" if dataset == "synthetic_extreme" else "moderate")
        config.model.update(hidden_dim=128, num_heads=4, ffn_dim=256, cross_layers=2,
                            dropout_rate=0.0,
                            image_dim=config.dataset.options.feature_shape[-1])
        common.cpu_training(config)
    elif dataset in PAPER_PRESETS:
        layers, max_len, batch, weight_decay, metric, pairs = PAPER_PRESETS[dataset]
        config.dataset = common.prebuilt_dataset(dataset)
        config.model.update(cross_layers=layers, pairs=pairs)
        config.decode.max_len = max_len
        config.batch_size = batch
        config.eval_batch_size = 100
        config.num_train_steps = 100_000
        config.eval_every_steps = 400
        config.checkpoint_every_steps = 400
        config.early_stop_evals = 50
        config.early_stop_metric = metric
        config.optim.update(learning_rate=3e-5, schedule="piecewise", decay_factor=0.5,
                            boundaries=(10_000, 20_000), weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown dataset {dataset!r} for configs/idc_pcl.py; choose one of "
                         f"{[*SYNTHETIC, *PAPER_PRESETS]}")
    # Both protocols in every evaluation; the official model selection uses the IDC code's
    # CIDEr (clver/eval.py: whitespace tokens, §5.7), ROUGE-L for Birds-to-Words.
    config.eval_protocols = ("coco", "idc")
    config.early_stop_metric = "idc/" + config.early_stop_metric
    config.init_exclude = ("pooler",)  # finetune.py keeps the pooler's random init (§5.4)
    config.loss_weights = ({"distractor": 1.0} if config.model.pairs == "both" else {})
    config.optim.zero_grad_rows = {}  # no padding_idx in the official embedding
    return config
