"""Times a config's train step, decoding and input pipeline.

    python -m changecap_jax benchmark --config=configs/dirl.py [--batch_size=N] [--steps=20]
    python -m changecap_jax benchmark --config=configs/dirl.py:clevr_change --synthetic_inputs \
        [--batch_size=16] [--steps=5] [--json=bench.json]

With the config's dataset (the default) the experiment is built as for training
(``experiment.build``) and its step and state as the trainer makes them. With
``--synthetic_inputs`` no dataset is read or built: the model, optimiser and step are built from
the config alone (``models.build``, ``optimizers.make_optimizer``, ``caption_step.make_train_step``)
and fed
random batches of the dataset's shapes (``changecap_jax/commands/synthetic_inputs.py``: ResNet-101
grids,
14x14x1024 or IDC-PCL's 7x7x2048, and the built vocabularies' sizes for CLEVR-Change /
CLEVR-DC; the config's grid for the synthetic presets; ``--vocab_size``, ``--caption_len`` and
``--feature_shape`` for other datasets), so the paper-sized models can be timed on any machine.
Every model's CPU and paper fine-tuning presets work (CHEERS gets random retrieved entities);
pretraining configs and models whose batch holds other keys are refused with the reason.

Prints, in this order (the first six lines as before):

* devices, batch and eval batch;
* train-step compile time (trace/lower + XLA compile; with a warm persistent compilation cache
  the XLA part is a load from disk, ``changecap_jax/compile_cache.py``, and the detail line
  says which it was: on the CPU a step compiled in the process runs a few percent slower than
  a loaded one, docs/performance.md), then the median step
  time and examples/s after compilation;
* the median greedy decode time per eval batch, after its compile;
* peak memory (device memory stats where the backend has them, else the process's peak RSS);
* the step's XLA cost (``cost_analysis``: FLOPs and bytes accessed per step, per device) and
  its achieved FLOP/s, as a percentage of a plain jitted float32 ``--matmul_size`` square
  matmul's, timed after each step so both see the same machine load (one untimed matmul,
  then the median of three: the device's practical peak at the default matmul precision,
  which the model gets too);
* the step's matmul work counted from its jaxpr with every loop iteration
  (``changecap_jax/commands/flop_count.py``: XLA counts a loop body once, which undercounts SCORER's
  chunked matching several times over), its FLOP/s and share of the matmul's;
* with a dataset: the input pipeline's examples/s read alone (``--input_batches`` batches,
  loader and transfer to the devices, no step) and which of input and step is the bottleneck;
* against PyTorch (the project's torch reference, the official code): the same measurement
  with the other side timed alternately, ``python -m benchmarks.vs_pytorch`` (outside the
  package; it passes its sides to :func:`run` as ``comparisons``).

``--json=PATH`` writes every number, the config and the devices (atomically).
"""

from __future__ import annotations

import dataclasses
import json
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags
from ml_collections import config_flags

from changecap_jax import cli, compile_cache, models, parallel
from changecap_jax.commands import flop_count
from changecap_jax.commands import synthetic_inputs as si
from changecap_jax.cpu import allocator
from changecap_jax.decoding import search
from changecap_jax.errors import UserError
from changecap_jax.io.jsonio import write_json_atomic
from changecap_jax.models import precision
from changecap_jax.models.base import conditioning_shapes
from changecap_jax.trainers import caption_step, optimizers

if TYPE_CHECKING:
    from changecap_jax import experiment

FLAGS = flags.FLAGS
WARMUP_BATCHES = 3  # distinct global batches the timed steps cycle through
# The learning-rate schedule's epoch length when no dataset gives one: it changes the rate's
# value only, never the step's cost.
SYNTHETIC_STEPS_PER_EPOCH = 1000


@dataclasses.dataclass
class Setup:
    """What the measurements need, built from a dataset or from synthetic inputs."""

    model: Any
    train_step: Any  # jitted (state, global batch) -> (state, metrics)
    state: Any
    batches: list[dict[str, jax.Array]]  # global training batches, cycled
    decode_inputs: dict[str, Any]  # before, after, conditioning of one eval batch
    max_len: int
    experiment: Any = None  # the experiment.Experiment, with a dataset
    compiled_step: Any = None  # the compiled train_step, once time_train_step made it


# ---------------------------------------------------------------------------------------------
# Setups
# ---------------------------------------------------------------------------------------------


class BenchmarkError(UserError, ValueError):
    """A config the benchmark cannot time."""


def check_supported(config: ml_collections.ConfigDict) -> None:
    try:
        models.model_class(config.model.name)
    except models.UnknownModelError as e:
        raise BenchmarkError(str(e)) from e
    if "pretrain" in config:
        raise BenchmarkError(
            "a pretraining config (with a pretrain block) trains by per-task steps "
            "(changecap_jax.trainers.pretraining); the benchmark times the trunk's train step: "
            "use a fine-tuning preset")


def dataset_setup(config: ml_collections.ConfigDict) -> Setup:
    """The step, fresh state and batches of training on the config's dataset, made as
    ``captioning.Trainer`` makes them."""
    # Imported here: the dataset side needs TFDS and grain, which the synthetic inputs (and the
    # GPU check, changecap_jax/commands/gpu_check.py) do without.
    from changecap_jax import experiment
    from changecap_jax.data import pipeline
    from changecap_jax.trainers import captioning

    exp = experiment.build(config)
    optimizer, schedule = optimizers.make_optimizer(config.optim, exp.steps_per_epoch)
    step = caption_step.make_train_step(exp.model, optimizer, dict(config.loss_weights), exp.mesh,
                                 dict(config.optim.zero_grad_rows), schedule,
                                 compute_dtype=exp.compute_dtype)
    state = captioning.fresh_state(exp, optimizer, jax.random.PRNGKey(config.seed))
    sharding = parallel.batch_sharding(exp.mesh)
    iterator = iter(captioning.training_batches(exp))
    batches = [pipeline.to_global(next(iterator), sharding) for _ in range(WARMUP_BATCHES)]
    eval_batch = next(pipeline.eval_batches(
        exp.dataset.split("val"), global_batch_size=config.eval_batch_size))
    fields = ("before", "after_semantic", *(f"{c}_semantic" for c in exp.conditioning))
    arrays = pipeline.to_global(eval_batch, sharding, fields=fields)
    decode_inputs = {"before": arrays["before"], "after": arrays["after_semantic"],
                     "conditioning": {c: arrays[f"{c}_semantic"] for c in exp.conditioning}}
    return Setup(exp.model, step, state, batches, decode_inputs, exp.max_len, exp)


def synthetic_setup(config: ml_collections.ConfigDict, shapes: Any) -> Setup:
    mesh = parallel.make_mesh()
    parallel.check_global_batch(config.batch_size, mesh)
    parallel.check_global_batch(config.eval_batch_size, mesh)
    max_len = config.decode.max_len or shapes.caption_len
    model = models.build(config.model, vocab_size=shapes.vocab_size, max_len=max_len)
    host = [si.make_batch(model, config.batch_size, shapes.feature_shape, shapes.caption_len,
                          shapes.vocab_size, seed=k) for k in range(WARMUP_BATCHES)]
    si.check_model_reads(model, host[0])
    optimizer, schedule = optimizers.make_optimizer(config.optim, SYNTHETIC_STEPS_PER_EPOCH)
    step = caption_step.make_train_step(model, optimizer, dict(config.loss_weights), mesh,
                                        dict(config.optim.zero_grad_rows), schedule,
                                        compute_dtype=_compute_dtype(config))
    sharding = parallel.batch_sharding(mesh)
    batches = [jax.device_put(b, sharding) for b in host]
    state = caption_step.init_train_state(model, optimizer, host[0], mesh,
                                          jax.random.PRNGKey(config.seed))
    ev = jax.device_put(si.make_batch(model, config.eval_batch_size, shapes.feature_shape,
                                      shapes.caption_len, shapes.vocab_size, seed=99), sharding)
    decode_inputs = {"before": ev["before"], "after": ev["after_semantic"],
                     "conditioning": {c: ev[f"{c}_semantic"]
                                      for c in conditioning_shapes(model)}}
    return Setup(model, step, state, batches, decode_inputs, max_len)


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def xla_cost(compiled: Any) -> dict[str, float]:
    """FLOPs and bytes accessed of a compiled executable (per device for a sharded one)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one dict per executable on some jax versions
        cost = cost[0] if cost else {}
    cost = cost or {}
    # None where the backend does not say (JSON has no NaN).
    return {"flops": float(cost["flops"]) if "flops" in cost else None,
            "bytes_accessed": (float(cost["bytes accessed"]) if "bytes accessed" in cost
                               else None)}


MATMUL_REPEATS = 3  # timed matmuls after each step, after one untimed


def matmul_timer(n: int) -> tuple[Callable[[], float], float]:
    """(time one matmul, FLOPs) of a jitted float32 (n, n) @ (n, n), compiled and warmed up.

    Each measurement runs the matmul once untimed, then returns the median of
    ``MATMUL_REPEATS`` timed runs: the first matmul after a train step runs about a third
    slower than the next ones on the development CPU (docs/performance.md), which would
    understate the machine's matmul rate and overstate the step's share of it."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.float32)
    b = jax.random.normal(kb, (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))

    def one() -> float:
        return timed(lambda: jax.block_until_ready(matmul(a, b)))

    def measure() -> float:
        one()
        return statistics.median(one() for _ in range(MATMUL_REPEATS))

    return measure, 2.0 * n ** 3


def time_train_step(setup: Setup, steps: int, matmul_size: int) -> dict[str, Any]:
    """Compiles the step (timed), runs it once untimed, then times ``steps`` steps; a reference
    matmul runs after each step, so both see the same machine load."""
    t0 = time.perf_counter()
    traced = setup.train_step.trace(setup.state, setup.batches[0])
    lowered = traced.lower()
    lower_s = time.perf_counter() - t0
    with compile_cache.count_lookups() as cache:
        compiled = lowered.compile()  # a persistent-cache hit loads the executable instead
    compile_s = time.perf_counter() - t0
    # From the same trace: XLA's count takes each loop body once
    # (changecap_jax/commands/flop_count.py).
    dots = flop_count.jaxpr_dot_flops(traced.jaxpr)
    matmul, matmul_flops = matmul_timer(matmul_size) if matmul_size else (None, 0.0)
    state, metrics = compiled(setup.state, setup.batches[0])  # first run: allocations
    jax.block_until_ready(metrics)
    loss_first_step = float(metrics["loss"])
    times, matmul_times, faults, kernel_s = [], [], [], []
    for k in range(steps):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        state, metrics = compiled(state, setup.batches[(k + 1) % len(setup.batches)])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(after.ru_minflt - usage.ru_minflt)
        kernel_s.append(after.ru_stime - usage.ru_stime)
        if matmul is not None:
            matmul_times.append(matmul())
    setup.state = state  # the old state was donated to the step
    setup.compiled_step = compiled
    step_s = statistics.median(times)
    cost = xla_cost(compiled)
    flop_per_s = cost["flops"] / step_s if cost["flops"] is not None else None
    out = {"compile_s": compile_s, "lower_s": lower_s, "step_s": step_s, "steps": steps,
           "step_loaded_from_cache": cache.loaded, "loss_first_step": loss_first_step, **cost,
           "flop_per_s": flop_per_s, "matmul_size": matmul_size,
           "page_faults_per_step": statistics.median(faults),
           "kernel_cpu_s_per_step": statistics.median(kernel_s),
           "host_allocator": allocator.applied(),
           "dot_flops": dots.flops, "dot_flop_per_s": dots.flops / step_s,
           "dot_flops_in_scans": dots.in_scans,
           "loops_of_unknown_length": dots.unknown_trip_count_loops,
           "matmul_flop_per_s": None, "percent_of_matmul": None, "dot_percent_of_matmul": None}
    if matmul_times:
        out["matmul_flop_per_s"] = matmul_flops / statistics.median(matmul_times)
        if flop_per_s is not None:
            out["percent_of_matmul"] = 100.0 * flop_per_s / out["matmul_flop_per_s"]
        out["dot_percent_of_matmul"] = 100.0 * out["dot_flop_per_s"] / out["matmul_flop_per_s"]
    return out


def _compute_dtype(config: ml_collections.ConfigDict) -> Any:
    return precision.compute_dtype(config.get("compute_dtype", "float32"))


def time_decode(setup: Setup, batches: int, compute_dtype: Any = jnp.float32) -> dict[str, Any]:
    """Greedy decoding of one eval batch in ``compute_dtype`` (as evaluation decodes): compile
    (first call) and the median of ``batches``."""
    if batches <= 0:
        return {"decode_compile_s": None, "decode_s_per_batch": None}
    params, inputs = precision.cast_floating((setup.state.params, setup.decode_inputs),
                                             compute_dtype)

    def once() -> float:
        return timed(lambda: jax.block_until_ready(search.greedy_decode(
            setup.model, {"params": params}, inputs["before"], inputs["after"],
            max_len=setup.max_len, conditioning=inputs["conditioning"]).ids))

    compile_s = once()
    return {"decode_compile_s": compile_s,
            "decode_s_per_batch": statistics.median(once() for _ in range(batches))}


def time_input(exp: experiment.Experiment | None, batches: int) -> dict[str, Any]:
    """Examples/s of the experiment's input pipeline alone: the loader's next batch and its
    transfer to the devices, as the training loop does them, without the step."""
    if exp is None or batches <= 0:
        return {"input_examples_per_s": None, "input_batches": None}
    from changecap_jax.data import pipeline  # grain: the dataset side only (dataset_setup)
    from changecap_jax.trainers import captioning

    sharding = parallel.batch_sharding(exp.mesh)
    iterator = iter(captioning.training_batches(exp))
    # The first batch opens the record files and starts grain's readers: not timed.
    jax.block_until_ready(pipeline.to_global(next(iterator), sharding))
    t0 = time.perf_counter()
    for _ in range(batches):
        jax.block_until_ready(pipeline.to_global(next(iterator), sharding))
    elapsed = time.perf_counter() - t0
    return {"input_examples_per_s": batches * exp.config.batch_size / elapsed,
            "input_batches": batches}


def bottleneck(step_examples_per_s: float, input_examples_per_s: float | None) -> str | None:
    """The slower of the step and the input pipeline ("train step" / "input pipeline")."""
    if input_examples_per_s is None:
        return None
    return "input pipeline" if input_examples_per_s < step_examples_per_s else "train step"


def peak_memory() -> dict[str, Any]:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return {"peak_memory_bytes": int(stats["peak_bytes_in_use"]),
                "peak_memory_source": "device peak"}
    # ru_maxrss is in KiB on Linux.
    return {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_memory_source": "process RSS"}


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


class Comparison(Protocol):
    """Another implementation timed alternately with the JAX step (``benchmarks/``)."""

    def check_config(self, config: ml_collections.ConfigDict) -> None:
        """Refuses a config it cannot run, before anything is built."""

    def prepare(self, config: ml_collections.ConfigDict, setup: Setup) -> None:
        """Builds its side; may set the JAX state's initial weights (before any JAX step)."""

    def compare(self, setup: Setup, config: ml_collections.ConfigDict, steps: int,
                decode_batches: int, steps_per_epoch: int) -> dict[str, Any]:
        """Its measurements, to add to the results."""


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(config: ml_collections.ConfigDict, steps: int, decode_batches: int, *,
        synthetic_inputs: bool = False, shapes: Any = None, input_batches: int = 0,
        matmul_size: int = 2048, comparisons: Sequence[Comparison] = ()) -> dict[str, Any]:
    """Returns the measured numbers (also used by tests). ``shapes``: the
    ``synthetic_inputs.InputShapes`` of a synthetic run (default: the config dataset's).
    ``comparisons``: other implementations to time against the JAX step, each prepared after
    the JAX side is built and compared after the JAX measurements."""
    check_supported(config)
    if steps < 1:
        raise BenchmarkError(f"steps must be >= 1, got {steps}")
    for other in comparisons:
        other.check_config(config)
    if synthetic_inputs:
        shapes = shapes or si.input_shapes(config)
        setup = synthetic_setup(config, shapes)
    else:
        setup = dataset_setup(config)
    for other in comparisons:
        other.prepare(config, setup)
    results = time_train_step(setup, steps, matmul_size)
    results["examples_per_s"] = config.batch_size / results["step_s"]
    results.update(time_decode(setup, decode_batches, _compute_dtype(config)))
    results.update(time_input(setup.experiment, input_batches))
    results["bottleneck"] = bottleneck(results["examples_per_s"],
                                       results["input_examples_per_s"])
    results.update(
        inputs="synthetic" if synthetic_inputs else "dataset",
        input_shapes=dataclasses.asdict(shapes) if synthetic_inputs else None,
        batch_size=config.batch_size, eval_batch_size=config.eval_batch_size,
        devices={"count": jax.device_count(), "platform": jax.devices()[0].platform,
                 "kind": jax.devices()[0].device_kind},
        **peak_memory())
    epoch = setup.experiment.steps_per_epoch if setup.experiment else SYNTHETIC_STEPS_PER_EPOCH
    for other in comparisons:
        results.update(other.compare(setup, config, steps, decode_batches, epoch))
    return results


def report_lines(results: dict[str, Any]) -> list[str]:
    """The printed report; the first lines are the ones this command always printed."""
    r = results
    dev = r["devices"]
    lines = [f"devices: {dev['count']} x {dev['platform']}; batch {r['batch_size']}; "
             f"eval batch {r['eval_batch_size']}",
             f"train step compile: {r['compile_s']:.2f} s",
             f"train step median:  {r['step_s'] * 1e3:.1f} ms "
             f"({r['examples_per_s']:.1f} examples/s, {r['steps']} steps)"]
    if r["decode_s_per_batch"] is not None:
        lines += [f"greedy decode compile: {r['decode_compile_s']:.2f} s",
                  f"greedy decode median:  {r['decode_s_per_batch'] * 1e3:.1f} ms per batch of "
                  f"{r['eval_batch_size']}"]
    lines.append(f"peak memory: {r['peak_memory_bytes'] / 2**20:.0f} MiB "
                 f"({r['peak_memory_source']})")
    return lines + _detail_lines(r)


def _dot_line(r: dict[str, Any]) -> str:
    line = (f"matmul work (dots of the traced step, every loop iteration counted): "
            f"{r['dot_flops'] / 1e9:.2f} GFLOP, {r['dot_flop_per_s'] / 1e9:.1f} GFLOP/s")
    if r["dot_percent_of_matmul"] is not None:
        line += f" = {r['dot_percent_of_matmul']:.1f}% of the matmul's"
    if r["dot_flops_in_scans"]:
        line += (f"; {r['dot_flops_in_scans'] / 1e9:.2f} GFLOP of it in loops, whose body "
                 "XLA's count takes once")
    if r["loops_of_unknown_length"]:
        line += f" ({r['loops_of_unknown_length']} while loop(s) counted once)"
    return line


def _cache_note(loaded: bool | None) -> str:
    # A step compiled in this process runs a few percent slower on the CPU than one loaded
    # from the cache (docs/performance.md, "Compiled here or loaded").
    if loaded is None:
        return ""
    return (" (loaded from the persistent compilation cache)" if loaded
            else " (compiled in this process: not in the persistent compilation cache)")


def _detail_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"train step compile = trace and lower {r['lower_s']:.2f} s + XLA compile "
             f"{r['compile_s'] - r['lower_s']:.2f} s{_cache_note(r['step_loaded_from_cache'])}"]
    if r["input_shapes"]:
        s = r["input_shapes"]
        lines.append(f"inputs: synthetic (grid {tuple(s['feature_shape'])}, vocab "
                     f"{s['vocab_size']}, captions of {s['caption_len']})")
    if r["flops"] is not None:
        moved = (f", {r['bytes_accessed'] / 1e9:.2f} GB accessed"
                 if r["bytes_accessed"] is not None else "")
        lines.append(f"train step cost (XLA, per device): {r['flops'] / 1e9:.2f} GFLOP{moved}; "
                     f"achieved {r['flop_per_s'] / 1e9:.1f} GFLOP/s")
    else:
        lines.append("train step cost: XLA gives no FLOP count on this backend")
    if r["percent_of_matmul"] is not None:
        n = r["matmul_size"]
        lines.append(f"step FLOP/s = {r['percent_of_matmul']:.1f}% of a float32 {n}x{n} "
                     f"matmul's ({r['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s)")
    lines.append(_dot_line(r))
    lines.append(f"host memory: {r['page_faults_per_step']:.0f} page faults and "
                 f"{r['kernel_cpu_s_per_step']:.2f} s of kernel CPU time per step (median); "
                 f"host allocator: {r['host_allocator']} (changecap_jax/cpu/allocator.py)")
    if r["input_examples_per_s"] is not None:
        lines.append(f"input pipeline alone: {r['input_examples_per_s']:.1f} examples/s "
                     f"({r['input_batches']} batches)")
        lines.append(f"bottleneck: {r['bottleneck']} (step {r['examples_per_s']:.1f} vs input "
                     f"{r['input_examples_per_s']:.1f} examples/s)")
    if "compilation_cache" in r:
        lines.append(f"compilation cache: {r['compilation_cache'] or 'off'}")
    return lines


def shapes_from_flags(config: ml_collections.ConfigDict) -> Any:
    grid = tuple(int(v) for v in FLAGS.feature_shape) if FLAGS.feature_shape else None
    return si.input_shapes(config, feature_shape=grid, vocab_size=FLAGS.vocab_size,
                           caption_len=FLAGS.caption_len)


def define_flags() -> None:
    """The command's flags; defined when run as a command only, so that importing the module
    (tests, other tools) never clashes with another module's ``--config`` flag."""
    config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=False)
    flags.DEFINE_integer("batch_size", None, "Global batch size (default: the config's).")
    flags.DEFINE_integer("eval_batch_size", None, "Decode batch size (default: the config's).")
    flags.DEFINE_integer("steps", 20, "Timed train steps after compilation.")
    flags.DEFINE_integer("decode_batches", 3, "Timed decode batches after compilation (0: none).")
    flags.DEFINE_bool("synthetic_inputs", False,
                      "Random batches of the dataset's shapes instead of the dataset.")
    flags.DEFINE_list("feature_shape", None, "With --synthetic_inputs: grid H,W,C of each image.")
    flags.DEFINE_integer("vocab_size", None, "With --synthetic_inputs: vocabulary size.")
    flags.DEFINE_integer("caption_len", None, "With --synthetic_inputs: padded caption length.")
    flags.DEFINE_integer("input_batches", 20,
                         "Batches read to time the input pipeline alone (dataset only; 0: skip).")
    flags.DEFINE_integer("matmul_size", 2048, "Side of the reference float32 matmul (0: skip).")
    flags.DEFINE_string("json", None, "Write all results to this JSON file.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if FLAGS.batch_size:
        config.batch_size = FLAGS.batch_size
    if FLAGS.eval_batch_size:
        config.eval_batch_size = FLAGS.eval_batch_size
    shapes = shapes_from_flags(config) if FLAGS.synthetic_inputs else None
    results = run(config, FLAGS.steps, FLAGS.decode_batches,
                  synthetic_inputs=FLAGS.synthetic_inputs, shapes=shapes,
                  input_batches=FLAGS.input_batches, matmul_size=FLAGS.matmul_size)
    results.update(preset=FLAGS["config"].config_filename,
                   config=json.loads(config.to_json_best_effort()),
                   compilation_cache=jax.config.jax_compilation_cache_dir)
    print("\n".join(report_lines(results)))
    if FLAGS.json:
        write_json_atomic(FLAGS.json, results, indent=1)
        print(f"wrote {FLAGS.json}")


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("config")
    compile_cache.enable()
    cli.run(main)
