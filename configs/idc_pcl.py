"""IDC-PCL (Yao et al., AAAI 2022): pretraining and fine-tuning; docs/official/idc_pcl.md §5.

    python -m changecap_jax.main --config=configs/idc_pcl.py:pretrain[/DATASET[/ABLATION]] \
        --workdir=P
    python -m changecap_jax.main --config=configs/idc_pcl.py[:finetune[/DATASET[/ABLATION]]] \
        --config.init_from=P        (optional: fine-tune from the pretraining run in P)

Pretraining presets (``pretrain/DATASET``; ``pretrain`` alone is the synthetic set), run by
changecap_jax/trainers/pretraining.py (§5.3, §5.6): each step draws one task, MLM : MVCL : FDA = 8
: 1 : 2,
from (seed, step); Adam with the noam schedule; every task's loss over the global batch. FDA
reads 6 hard negatives per pair from ``<split>_neg_tfidf6.json`` in the dataset's directory:
the synthetic presets make them on first use; for a real dataset make them first with
``python -m data_prep.hard_negatives --dataset=NAME [--data_dir=DIR]``.
  pretrain/synthetic          the fine-tuning CPU model below (4x4 grid, CPU_EMBEDDING, hidden
  pretrain/synthetic_extreme  128, 4 heads, FFN 256, 2 blocks, no dropout), batch 64 examples
                              (128 pairs), FDA batch 16 pairs, lr 5e-4 with noam warm-up 100,
                              1000 steps.
  pretrain/clevr_change       Table 6 / §5.6: the paper model, lr 1e-4, noam warm-up 8000,
                              250k steps, 200 pairs per step (100 examples), FDA batch 28 pairs,
                              val every 1000 steps, ratio 8:1:2.
  pretrain/birds_to_words     warm-up 4000, 50k steps, 2 blocks, captions of 80, ratio 9:1:2,
                              semantic pairs only (200 per step; the bird code is not in §5).
``--config.pretrain.tasks='("mlm", "mvcl")'`` trains a subset (Table 4: ("mlm",), ("mlm",
"mvcl"), all three); ``pretrain.task_ratio`` keeps one weight per task of (mlm, mvcl, fda) and
the enabled tasks share it. Checkpoints hold the state and each task's data stream, so a run
resumes exactly.

Cross-task data (paper §2.4, appendix A.3; ``pretrain.extra_source``): a directory written by
``python -m data_prep.cross_task`` joins every step at ``extra_source.ratio`` IDC rows : extra
rows (default (4, 1)). A caption source (CUB) gives pseudo pairs (the image, a zero grid) that
join the MLM, MVCL and FDA batches (FDA needs the source built with ``--negatives``: 3 Retrieve
+ 3 Replace per image); a classification source (NABirds) adds its classification,
contrastive and same-class matching losses to whichever task the step draws. The paper's two
stages on Birds-to-Words:
  stage 1  --config=configs/idc_pcl.py:pretrain/birds_to_words --workdir=S1 \
           --config.pretrain.extra_source.dir=CUB_DIR
  stage 2  --config=configs/idc_pcl.py:pretrain/birds_to_words --workdir=S2 \
           --config.pretrain.extra_source.dir=NABIRDS_DIR --config.init_from=S1
           (every stage-1 parameter carries over, pretraining heads included: pretraining's
           init_exclude is empty; the new fgvc_ heads start fresh)
then fine-tune with ``--config.init_from=S2`` (``init_exclude`` drops the pooler and fgvc_).

Fine-tuning presets (``finetune/DATASET``; ``finetune`` alone is the synthetic set):
  finetune/synthetic          the built-in synthetic dataset on a 4x4 grid with a CPU-sized
                              model (hidden 128, 4 heads, FFN 256, 2 cross-modal blocks, no
                              dropout) and CPU_EMBEDDING (image_feature_scale 16, type
                              embedding init std 0.02: models/idc_pcl.py, "Embedding
                              balance"), batch 64, 1000 steps, constant lr 5e-4, the official
                              summed loss. A smoke test: at 1000 steps every pair gets one
                              caption, as the official code trained on the same batches
                              writes too; with 2000-6000 steps (with or without pretraining)
                              the captions vary but hardly follow the change (docs/
                              ablations.md, "IDC-PCL: the official code on the same batches"
                              and "A larger budget").
  finetune/synthetic_extreme  the same on the extreme-distractor variant.
  finetune/clevr_change       Table 6 / §5.6: hidden 512, 8 heads, FFN 2048, 3 blocks, dropout
                              0.2, captions of 40, lr 3e-5 halved at 10k and 20k steps, at most
                              100k steps, val every 400 steps, early stop after 50 evaluations
                              without a better val CIDEr, then test with the best state.
  finetune/birds_to_words     Table 6: 2 blocks, captions of 80, batch 32, weight decay 1e-4,
                              ROUGE-L as the early-stopping metric, semantic pairs only (the
                              dataset has no distractor pairs, so no distractor classifier loss).

Ablations of the paper (Table 4, CLEVR-Change; here on every preset), appended as
``STAGE/DATASET/NAME`` (table: docs/ablations.md; each switches exactly the fields ABLATIONS
names, the synthetic set is named: ``finetune/synthetic/NAME``):
  full (default)          line 4: the full model (pretraining MLM + MVCL + FDA).
  no_difference_encoder   line 5: no image difference encoder (model.use_difference_encoder):
                          the embedded image tokens go straight into the cross-modal
                          transformer. Both stages: pretrain/DATASET/no_difference_encoder, then
                          finetune/DATASET/no_difference_encoder from it.
  no_distractor_judging   line 6, fine-tuning only: no distractor classifier loss (drops
                          loss_weights.distractor); pretrain with pretrain/DATASET (line 4's).
Lines 1-3 (the pretraining tasks) are ``--config.pretrain.tasks`` (above) and, for line 1, no
pretraining at all (fine-tune without init_from).

Batch: the official loader's 200 samples are single pairs with one sentence each, semantic and
non-semantic mixed; an example here gives both its pairs, so CLEVR-Change's 200 samples are 100
examples. Initialise from pretraining with ``--config.init_from=PRETRAIN_WORKDIR`` (every
parameter except the pooler, as ``finetune.py``; pretraining's feat_regress has no place here).

Tokens: on the trunk the text uses the dataset vocabulary (BOS = <START>, EOS = <END>) with
[MASK] and [CLS] rows appended; the official dict.json layout (BOS 1, MASK 5) is what
``python -m changecap_jax convert`` maps from.
"""

from __future__ import annotations

import ml_collections

from configs import common

STAGES = ("pretrain", "finetune")
# The CPU presets' two named deviations from the official embedding (models/idc_pcl.py,
# "Embedding balance"): with them the distractor classifier's training loss falls below chance
# within the presets' 1000 steps (without them it stays at chance); its held-out accuracy stays
# near chance (docs/models.md).
CPU_EMBEDDING = {"image_feature_scale": 16.0, "type_embedding_std": 0.02}
# A 4x4 grid of the synthetic scenes (the dataset variant "moderate_f4x4x64"): 34 image tokens
# instead of 130 make a training step 2.8x cheaper than the 8x8 grid the other models read.
CPU_FEATURE_SHAPE = (4, 4, 64)
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
        # The official embedding; the CPU presets change both (CPU_EMBEDDING below).
        "image_feature_scale": 1.0,
        "type_embedding_std": 1.0,
        # Table 4 lines 5-6 switches (the ABLATIONS below); True / True is the paper model.
        "use_difference_encoder": True,
        "distractor_judging": True,
    })


# Ablation -> the dotted config fields it sets, and nothing else
# (tests/test_idc_pcl_ablations.py); STAGE_ABLATIONS says in which stages each applies.
ABLATIONS: dict[str, dict[str, object]] = {
    "full": {},  # Table 4 line 4: MLM + MVCL + FDA pretraining, the difference encoder
    # Line 5: no image difference encoder, in both stages (pretrain and fine-tune with it).
    "no_difference_encoder": {"model.use_difference_encoder": False},
    # Line 6: fine-tuning without the distractor judging task (line 4's pretraining).
    "no_distractor_judging": {"model.distractor_judging": False,
                              "loss_weights.distractor": common.DROP},
}
STAGE_ABLATIONS = {
    "pretrain": ("full", "no_difference_encoder"),
    "finetune": ("full", "no_difference_encoder", "no_distractor_judging"),
}


# dataset -> (warm-up steps, total steps, task ratio mlm:mvcl:fda)  (Table 6, §5.6)
PRETRAIN_SCHEDULE = {
    "clevr_change": (8_000, 250_000, (8, 1, 2)),
    "birds_to_words": (4_000, 50_000, (9, 1, 2)),
}
PRETRAIN_SAMPLES = 200  # the official pretraining batch: 200 pairs (config/pretrain_clver.json)


def _pretraining(config: ml_collections.ConfigDict, dataset: str) -> None:
    """The pretraining stage (changecap_jax/trainers/pretraining.py, §5.3/§5.6): one task per step,
    Adam
    with the noam schedule, no distractor classifier, no early stopping."""
    warmup, steps, ratio = PRETRAIN_SCHEDULE.get(dataset, (100, 1000, (8, 1, 2)))
    config.pretrain = ml_collections.ConfigDict({
        # Table 4's ablations: ("mlm",), ("mlm", "mvcl"); the ratio applies to those enabled.
        "tasks": ("mlm", "mvcl", "fda"),
        "task_ratio": ratio,  # one weight per task of (mlm, mvcl, fda)
        # FDA samples (pairs) per step, each with its 6 negatives: the official int(200 / 7) =
        # 28 (196 captions); the CPU presets 16 of their 128 pairs (a multiple of 8 devices).
        "fda_batch_size": 28 if dataset in PRETRAIN_SCHEDULE else 16,
        "fda_temperature": 1.0,  # args.tmp (§5.3); MVCL's nce_temp is fixed at 1 (I-Q5)
        "val_batches": 2,  # val batches per task at each validation (the same ones every time)
        # A.3's cross-task data (changecap_jax/trainers/pretraining.py, "Cross-task source"): a
        # directory
        # of python -m data_prep.cross_task; its meta.json says caption (CUB) or classify
        # (NABirds). "" = none.
        "extra_source": ml_collections.ConfigDict({
            "dir": "",
            "split": "train",
            "ratio": (4, 1),  # IDC rows : extra rows per step (A.3: B2W : NABirds = 4 : 1)
            # Classification sources: how many fixed pairs (0: one per image, as A.3) and
            # the losses added to the drawn task's (paper silent: weights 1).
            "num_pairs": 0,
            "classify_weight": 1.0,
            "contrastive_weight": 1.0,
            "match_weight": 1.0,
            # "transfg" (the margin loss of He et al. 2021: the loss A.3 cites, so the
            # default) or "supcon" (Khosla et al.); margin for transfg (TransFG's 0.4),
            # temperature for supcon (the paper's contrastive tau is 1).
            "contrastive": "transfg",
            "temperature": 1.0,
            "margin": 0.4,
            "pooling": "mean",  # single-image encoding: "mean" of its regions or "cls"
            "match_pooling": "cls",  # pair encoding: cat(CLS1, CLS2) or "mean" per image
        }),
    })
    config.optim.update(schedule="noam", warmup_steps=warmup, weight_decay=0.0, boundaries=())
    if dataset in PRETRAIN_SCHEDULE:
        config.optim.learning_rate = 1e-4
        config.num_train_steps = steps
        # 200 pairs per step: 100 examples of two pairs, or 200 of one.
        config.batch_size = PRETRAIN_SAMPLES // (2 if config.model.pairs == "both" else 1)
        config.eval_every_steps = 1000
        config.checkpoint_every_steps = 1000
        config.early_stop_evals = 0
    config.loss_weights = {}
    config.init_exclude = ()


def get_config(preset: str = "finetune") -> ml_collections.ConfigDict:
    config = common.trainer_defaults(ml_collections.ConfigDict())
    stage, rest = common.split_preset(preset, "finetune")
    dataset, ablation = common.split_preset(rest, "synthetic")
    ablation = ablation or "full"
    common.require_choice(stage, STAGES, "stage", "configs/idc_pcl.py",
                          hint=" (as STAGE[/DATASET[/ABLATION]])")
    if stage in STAGE_ABLATIONS:
        common.require_choice(ablation, STAGE_ABLATIONS[stage], f"{stage} ablation",
                              "configs/idc_pcl.py", shown=list(STAGE_ABLATIONS[stage]))
    config.model = _paper_model()
    config.model.stage = stage
    config.seed = 1234  # the official seed
    config.swap_prob = 0.0  # the official loader never swaps the images
    if dataset in SYNTHETIC:
        config.dataset = common.synthetic_dataset(
            "extreme" if dataset == "synthetic_extreme" else "moderate")
        config.dataset.options.feature_shape = CPU_FEATURE_SHAPE
        config.model.update(hidden_dim=128, num_heads=4, ffn_dim=256, cross_layers=2,
                            dropout_rate=0.0, image_dim=CPU_FEATURE_SHAPE[-1], **CPU_EMBEDDING)
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
    # finetune.py keeps the pooler's random init (§5.4); the cross-task heads (fgvc_classifier,
    # fgvc_matcher) of a pretraining run with a classification source never carry over.
    config.init_exclude = ("pooler", "fgvc_")
    if stage == "pretrain":
        _pretraining(config, dataset)
    else:
        config.loss_weights = ({"distractor": 1.0} if config.model.pairs == "both" else {})
        config.optim.zero_grad_rows = {}  # no padding_idx in the official embedding
    common.set_fields(config, ABLATIONS[ablation])
    return config
