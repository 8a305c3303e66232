"""``python -m changecap_jax convert``: official PyTorch snapshot -> orbax checkpoint.

Supported models: DIRL+CCR (configs/dirl.py:clevr_change / clevr_dc), SCORER+CBR
(configs/scorer.py:clevr_change ...) and IDC-PCL (configs/idc_pcl.py:finetune/DATASET), e.g.

    python -m changecap_jax convert --config=configs/scorer.py:clevr_change \
        --torch_checkpoint=scorer_checkpoint_10000.pt --workdir=DIR --extra_params=cbr.pt
    python -m changecap_jax convert --config=configs/idc_pcl.py:finetune/clevr_change \
        --torch_checkpoint=best_checkpoint.pt --dict_json=dataset_clver/dict.json --workdir=DIR

(SCORER's CBR ``generator`` is never in the official snapshot: pass its state_dict with
--extra_params, or --missing=init to initialise it as the trainer does. IDC-PCL takes the
fine-tuning state_dict or the pretraining checkpoint {'global_step', 'model_state_dict',
'task_batch_num'}; the latter is restored as yaolinli/IDC clver/finetune.py does: every key but
the pooler's, feat_regress.* dropped, the pooler initialised as the trainer does; with
--config=configs/idc_pcl.py:pretrain/DATASET a pretraining checkpoint converts whole. Its token
rows are reordered from the authors' dict.json to the built dataset's vocabulary.)

    --config=configs/MODEL.py[:PRESET]  the config the checkpoint will be used with (same flags as
                                        changecap_jax.main, e.g. --config.model.num_heads=8)
    --torch_checkpoint=PATH             official snapshot, e.g. dirl_ccr_clevr_change_checkpoint_
                                        15000.pt as train.py of tuyunbin/SCORER or tuyunbin/DIRL
                                        saves it (its AttrDict model_cfg is read as plain
                                        mappings), or an IDC-PCL file (yaolinli/IDC)
    --dict_json=PATH                    IDC-PCL only (required): the authors' dict.json
    --workdir=DIR                       writes DIR/checkpoints/<step>; then run
                                        python -m changecap_jax.main --config=... --workdir=DIR
                                        --mode=eval
    --extra_params=PATH                 torch state_dict of parameters the snapshot lacks
                                        (SCORER's CBR, which tuyunbin/SCORER train.py does
                                        not save)
    --missing=error|init                without --extra_params: fail (default) or initialise them
    --step=N                            checkpoint step (default: the snapshot's iteration or
                                        IDC-PCL's global_step, else 0)
    --allow_pickle                      full pickle for files the safe loaders refuse (they
                                        name the refused class); trusted files only, and the
                                        code that wrote the file must be importable
    --print_table                       print the key table (torch key -> Flax path) and exit

Any problem (unreadable file, other model, missing / unexpected / mis-shaped key) exits with
status 2 and a one-line message naming the key and both shapes (its traceback with --verbose).
See :mod:`changecap_jax.convert.converter`.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from changecap_jax import cli, compile_cache
from changecap_jax.convert import converter, registry, tables

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=True)
flags.DEFINE_string("torch_checkpoint", None, "Official PyTorch snapshot (.pt).")
flags.DEFINE_string("workdir", None, "Output directory (writes WORKDIR/checkpoints).")
flags.DEFINE_string("extra_params", None, "torch state_dict of parameters the snapshot lacks "
                    "(SCORER: the CBR generator.state_dict()).")
flags.DEFINE_enum("missing", "error", ["error", "init"],
                  "Parameters no file provides: fail, or initialise them as the trainer does.")
flags.DEFINE_string("dict_json", None, "IDC-PCL: the authors' dict.json (word -> id) that "
                    "the checkpoint's token rows follow.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the snapshot's iteration, else 0).")
flags.DEFINE_bool("allow_pickle", False, "Allow full pickle (trusted files only).")
flags.DEFINE_bool("print_table", False, "Print the key table for the config and exit.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # A ConversionError or a missing file ends the command with its message (changecap_jax.cli).
    config = FLAGS.config
    if FLAGS.print_table:
        model_converter = registry.converter_for(config.model.name)
        snapshot = model_converter.read_snapshot(FLAGS.torch_checkpoint,
                                                 allow_pickle=FLAGS.allow_pickle)
        dataset, why = converter.open_dataset(config)
        sizes = converter.checkpoint_sizes(config, model_converter, snapshot, dataset, why,
                                           FLAGS.dict_json)
        print(tables.format_table(model_converter.table(config.model, sizes)))
        return
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    report = converter.convert_checkpoint(
        config, FLAGS.torch_checkpoint, FLAGS.workdir, extra_params=FLAGS.extra_params,
        missing=FLAGS.missing, step=FLAGS.step, allow_pickle=FLAGS.allow_pickle,
        dict_json=FLAGS.dict_json)
    print(report.summary())


if __name__ == "__main__":
    compile_cache.enable()
    flags.mark_flags_as_required(["config", "torch_checkpoint"])
    cli.run(main)
