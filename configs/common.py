"""Config pieces shared by every model config (dataset presets, trainer fields)."""

from __future__ import annotations

from typing import Any

import ml_collections


def synthetic_dataset(variant: str = "moderate") -> ml_collections.ConfigDict:
    """The built-in synthetic change dataset; built on first use."""
    return ml_collections.ConfigDict({
        "name": "synthetic",
        "data_dir": "",  # '' = $CHANGECAP_DATA_DIR or the user cache folder
        "variant": variant,  # distractors: moderate | weak | extreme (none: diagnostic)
        "build_if_missing": True,
        # Hold the training split on the devices, batches gathered in the step (same losses).
        "on_device": False,
        "options": {
            "seed": 0,
            "num_train": 3000,
            "num_val": 300,
            "num_test": 600,
            "feature_shape": (8, 8, 64),
            # Stored dtype of the feature grids: float16 | float32 | bfloat16 (the model
            # upcasts to float32 on the device; half precision halves the bytes read).
            "feature_dtype": "float16",
            # The builder version to read ('' = the newest; older ones are read, not built:
            # docs/datasets.md).
            "version": "",
        },
    })


def prebuilt_dataset(name: str) -> ml_collections.ConfigDict:
    """A real dataset, built beforehand with ``python -m data_prep.build NAME``."""
    return ml_collections.ConfigDict({
        "name": name, "data_dir": "", "variant": "", "build_if_missing": False,
        # Hold the training split on the devices, batches gathered in the step (same losses).
        "on_device": False, "options": {}})


def cpu_training(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The trainer fields of every model's synthetic (CPU) preset: batch 64, 1000 steps, a
    constant lr 5e-4, val every 500 steps. Sized so a run (dataset build included) ends within
    ~15 min on 2 cores."""
    config.batch_size = 64
    config.eval_batch_size = 200
    config.num_train_steps = 1000
    config.log_every_steps = 50
    config.eval_every_steps = 500
    config.checkpoint_every_steps = 500
    config.optim.learning_rate = 5e-4
    config.optim.decay_every_epochs = 0  # 0 = constant learning rate
    return config


def input_pipeline() -> ml_collections.ConfigDict:
    """``config.data``: how the loaders read (data/pipeline.py ReadAhead); the batches do not
    depend on it.

    workers: grain worker processes assembling training batches (eval_workers: for
    evaluation); 0 reads in the training process, enough for the CPU presets. threads:
    reading threads per process. prefetch: batches read ahead per thread pool and per worker
    queue (host memory ~ 2 * prefetch + threads local batches per worker). An accelerator
    host wants more: one core reads ~190 paper-sized (3 x 14x14x1024) float32 examples/s,
    ~330 float16; e.g. 16 cores: workers=6, threads=2 (docs/input_pipeline.md).
    device_prefetch: training batches moved to the devices ahead of the step (0: none).
    """
    return ml_collections.ConfigDict({
        "workers": 0, "eval_workers": 0, "threads": 2, "prefetch": 2, "device_prefetch": 2})


def trainer_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Fields every model shares; a model config sets the values that differ."""
    config.seed = 1111
    config.batch_size = 128  # global: examples per step (each gives its pairs)
    config.eval_batch_size = 128
    config.num_train_steps = 10_000
    # Round the run up to whole epochs as the official loop does (10,000 -> 10,070 updates
    # on CLEVR-Change); the paper presets set it, the CPU presets stop at num_train_steps.
    config.finish_last_epoch = False
    config.log_every_steps = 50
    config.eval_every_steps = 1000
    config.checkpoint_every_steps = 1000
    config.keep_checkpoints = 3
    # Saves write in a background thread: the steps go on while the arrays are written
    # (docs/training_loop.md "Checkpoints"); False blocks each step until its save is on disk.
    config.async_checkpoints = True
    config.eval_splits = ("val",)
    config.final_eval_splits = ("val", "test")
    config.num_logged_examples = 4  # generated captions printed beside references at each eval
    config.swap_prob = 0.5  # official before/distractor swap augmentation
    # Dtype of the forward pass (float32 | bfloat16); parameters, optimizer state, softmax,
    # normalisation statistics and losses stay float32 (changecap_jax/models/precision.py).
    config.compute_dtype = "float32"
    config.data = input_pipeline()
    config.optim = ml_collections.ConfigDict({
        "learning_rate": 2e-4,
        "b1": 0.9,
        "b2": 0.999,
        "eps": 1e-8,
        "schedule": "step_lr",  # step_lr | piecewise | noam (changecap_jax.trainers.captioning)
        "decay_factor": 0.1,
        "decay_every_epochs": 15,  # StepLR(step_size=15) stepped once per epoch
        "boundaries": (),  # piecewise: steps where lr is multiplied by decay_factor
        "warmup_steps": 0,  # noam
        "weight_decay": 0.0,  # torch Adam's L2 term
        "grad_clip_norm": 0.0,  # 0 = no clipping (the official yaml's grad_clip -1)
        # Rows of embedding tables whose gradient is zeroed (torch padding_idx=0).
        "zero_grad_rows": {},
        # Top-level parameter groups the optimiser never updates (official SCORER: CBR).
        "frozen": (),
    })
    config.decode = ml_collections.ConfigDict({
        "sample": False,  # greedy (test-time protocol); True = multinomial sampling
        "max_len": 0,  # 0 = the dataset's maximum caption length
        # > 1: beam search (every model; the official code decodes greedily, beam 1 = greedy)
        "beam_size": 1,
        "length_penalty": 0.0,  # GNMT alpha for ranking beams; 0 = the highest log-probability
    })
    config.spice = "auto"
    # "coco" (pycocoevalcap as SCORER/DIRL) always; add "idc" to also score the captions the
    # IDC-PCL code's way (whitespace tokens, no PTB tokenizer), written under metrics["idc"].
    config.eval_protocols = ("coco",)
    # Caption metrics per viewpoint-change bin (this many quantile bins of the pairs' viewpoint
    # IoU) and the pointing game, where the records carry the IoU (synthetic set; CLEVR-Change
    # with its IoU file). 0 = off. metrics["difficulty"]; docs/evaluation.md.
    config.difficulty_bins = 4
    # Initialise from another run's latest checkpoint (parameters with the same path and
    # shape; paths containing an init_exclude entry stay fresh). Empty = no.
    config.init_from = ""
    config.init_exclude = ()
    # Stop after this many validation evaluations without improving early_stop_metric, then
    # score final_eval_splits with the best state (0 = off: train all steps, score the last).
    config.early_stop_evals = 0
    # A jax.profiler trace of steps start..start+count-1 (process 0) into <workdir>/profile/,
    # for TensorBoard's profile plugin: (start, count), e.g. (10, 5); () = off.
    # docs/training.md "Profiling a run".
    config.profile_steps = ()
    config.early_stop_metric = "CIDEr"
    # An update whose loss, gradients or new parameters are not finite stops the run before
    # anything non-finite is saved (exit status 3); True skips such updates instead (the
    # parameters stay as they were), counting them in the logs (docs/training.md).
    config.skip_nonfinite_updates = False
    return config


def split_preset(preset: str, default: str) -> tuple[str, str]:
    """``"PRESET[/SUB]"`` -> ``(PRESET, SUB)``; an empty preset is ``default``, SUB may be ""."""
    first, _, second = (preset or default).partition("/")
    return first, second


def require_choice(value: str, choices: Any, what: str, config_file: str, *,
                   shown: Any = None, hint: str = "") -> None:
    """A clear error for a preset part that is not one of ``choices`` (listed as ``shown``)."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r} for {config_file}; choose one of "
                         f"{choices if shown is None else shown}{hint}")


DROP = "<dropped>"  # a value of set_fields: the key is removed from its dict


def set_fields(config: ml_collections.ConfigDict, fields: dict[str, object]) -> None:
    """Sets each dotted ``fields`` path of ``config`` to its value (in place); a value
    :data:`DROP` removes the key where it exists (an ablation's dropped loss weight)."""
    for path, value in fields.items():
        *parents, leaf = path.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        if isinstance(value, str) and value == DROP:
            if leaf in node:
                del node[leaf]
        else:
            node[leaf] = value


# dataset -> (disentangle, consistency, batch, iterations) of MEDIC's run scripts
# (``VisualAIKHU/MEDIC`` ``run/run_*_final.sh``; configs/dirl.py's docstring); None: the preset's.
MEDIC_PRESETS = {
    "synthetic": (0.1, 0.1, None, None), "synthetic_extreme": (0.1, 0.1, None, None),
    "clevr_change": (0.1, 0.1, 64, 30_000), "clevr_dc": (0.1, 0.01, 128, 50_000),
    "spot_the_diff": (0.01, 0.01, 128, 50_000), "image_editing_request": (0.1, 0.1, None, None),
}


def add_medic_plugin(config: ml_collections.ConfigDict, preset: str) -> None:
    """Switches the MEDIC plug-in on (``config.model.medic``, docs/models.md "MEDIC") with the
    official module settings and MEDIC's loss weights of ``preset``; smaller memories and
    classifiers on the synthetic presets. The host's own settings are its config's business."""
    from changecap_jax.data.synthetic.scenes import CHANGE_TYPES  # the CLEVR datasets' types

    if preset not in MEDIC_PRESETS:
        raise ValueError(f"no MEDIC preset for {preset!r}; choose one of {list(MEDIC_PRESETS)}")
    disentangle, consistency, _, _ = MEDIC_PRESETS[preset]
    config.model.medic = ml_collections.ConfigDict({
        "dataset_types": list(CHANGE_TYPES), "memory_size": 100, "classifier_hidden": 512,
        "cls_temperature": 1.0, "type_temperature": 1.0, "margin_inter": 0.2,
        "margin_intra": 0.7, "lambda_inter": 1.0, "lambda_intra": 1.0,
        # ours, the official behaviour by default (changecap_jax/models/medic.py)
        "feature_routing": "labels", "detach_host_features": False})
    if preset.startswith("synthetic"):
        config.model.medic.update(memory_size=20, classifier_hidden=64)
    config.loss_weights.update({"change_cls": 0.1, "change_type_cls": 0.1,
                                "expert_disentangle": disentangle,
                                "expert_consistency": consistency})
