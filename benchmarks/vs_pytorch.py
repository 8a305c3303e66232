"""The jitted train step (and greedy decoding) against PyTorch, on the same machine load.

    python -m benchmarks.vs_pytorch --config=configs/dirl.py:clevr_change --synthetic_inputs \
        --batch_size=16 --steps=5 --torch [--official=CHECKOUT] [--torch_threads=N] [--json=F]

Everything ``python -m changecap_jax benchmark`` measures (the same flags), plus:

* ``--torch``: the median step of the model's torch reference (tools/torch_reference/), run
  on the same batches from the same initial weights alternately with the JAX step, the ratio
  torch / JAX, torch's thread count and both first-step losses (benchmarks/torch_step.py);
  then, unless ``--decode_batches=0``, both sides' greedy decoding of the eval batch from the
  same initial weights, alternating: the ratio, the share of identical captions and the
  largest log-probability difference;
* ``--official=CHECKOUT`` (DIRL+CCR and SCORER+CBR at their clevr_change presets): the median
  step of the OFFICIAL training iteration, imported from a local checkout of tuyunbin/DIRL or
  tuyunbin/SCORER, alternating with the JAX step, and the ratio official / JAX
  (benchmarks/official_step.py).

Needs PyTorch (requirements-torch.txt). docs/performance.md has the measured ratios.
"""

from __future__ import annotations

import json

import jax
from absl import app, flags

from benchmarks import official_step, torch_step
from changecap_jax import cli, compile_cache
from changecap_jax.commands import benchmark
from changecap_jax.io.jsonio import write_json_atomic

FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.torch and not FLAGS.official:
        raise app.UsageError("give --torch, --official=CHECKOUT or both (without either, "
                             "python -m changecap_jax benchmark measures the same)")
    config = FLAGS.config
    if FLAGS.batch_size:
        config.batch_size = FLAGS.batch_size
    if FLAGS.eval_batch_size:
        config.eval_batch_size = FLAGS.eval_batch_size
    sides = ([torch_step.TorchComparison(FLAGS.torch_threads)] if FLAGS.torch else [])
    if FLAGS.official:
        sides.append(official_step.OfficialComparison(FLAGS.official, FLAGS.torch_threads))
    shapes = benchmark.shapes_from_flags(config) if FLAGS.synthetic_inputs else None
    results = benchmark.run(config, FLAGS.steps, FLAGS.decode_batches,
                            synthetic_inputs=FLAGS.synthetic_inputs, shapes=shapes,
                            input_batches=FLAGS.input_batches, matmul_size=FLAGS.matmul_size,
                            comparisons=sides)
    results.update(preset=FLAGS["config"].config_filename,
                   config=json.loads(config.to_json_best_effort()),
                   compilation_cache=jax.config.jax_compilation_cache_dir)
    print("\n".join(benchmark.report_lines(results) + torch_step.torch_lines(results)
                    + official_step.official_lines(results)))
    if FLAGS.json:
        write_json_atomic(FLAGS.json, results, indent=1)
        print(f"wrote {FLAGS.json}")


if __name__ == "__main__":
    benchmark.define_flags()
    flags.DEFINE_bool("torch", False, "Time the model's torch reference (tools/torch_reference) "
                      "on the same batches, alternating with the JAX step.")
    flags.DEFINE_string("official", None, "Time the OFFICIAL train step, imported from this "
                        "local checkout of tuyunbin/DIRL or tuyunbin/SCORER (the config's model, "
                        "clevr_change preset), alternating with the JAX step.")
    flags.DEFINE_integer("torch_threads", 0, "torch's CPU threads (0: torch's default).")
    flags.mark_flag_as_required("config")
    compile_cache.enable()
    cli.run(main)
