"""Ahead-of-time check of a training run on a TPU slice or GPUs, from a machine without them.

    python -m changecap_jax aot --config=configs/dirl.py:clevr_change --topology=v5e:4x4 \
        [--batch_size=N] [--eval_batch_size=N] [--config.compute_dtype=bfloat16] \
        [--programs=train_step,decode] [--json=aot.json]

Compiles the sharded programs a training run of the config compiles (the train step and the
evaluation's decoding; for an IDC-PCL pretraining preset, the update of each pretraining
task) for the named slice with libtpu's compiler (for GPUs, with the compiler of JAX's CUDA
plugin), on this machine's CPU (``tools/aot_programs.py``), and prints per chip (GPU), for each
program:

* HBM used (arguments, of them the batch; temporaries; outputs not aliased to the donated
  arguments; generated code; for decoding, the train state that stays resident) against the
  chip's published HBM (``tools/tpu_specs.py``; a GPU's: ``tools/gpu_specs.py``);
* FLOPs (the larger of XLA's count and the traced matmuls with every loop iteration: XLA
  counts a loop body once) and bytes accessed, by XLA's cost analysis;
* the parameter count and the gradient all-reduce of a train step: data parallelism
  all-reduces the float32 gradients every step, ``2 (n - 1) / n`` times their bytes through
  each chip's ICI (a GPU's NVLink, and between GPU hosts each host's network,
  ``--host_network_gbps``, by default an assumed 8 x 400 Gb/s); ``tools/interconnect.py``.
  The compiled program's own all-reduce bytes are printed beside it as a check;
* a roofline lower bound on the step's time, the largest of FLOPs / bf16 peak, bytes / HBM
  bandwidth and the all-reduce's bytes / interconnect bandwidth, saying which bounds it, and
  the examples/s it implies (XLA's own ``optimal_seconds`` comes back negative from the TPU
  compiler, so the bound is computed from the published peaks; a GPU's float32 programs use
  its TF32 peak). A program without XLA's cost analysis (GPUs, where jaxlib's private entry
  point ``aot_programs.module_cost`` is missing) prints a ``warning:`` line: its bound then
  lacks the memory term;
* an estimate of the largest global batch that fits: the state, code and outputs as a fixed
  part, the batch and every temporary as proportional to the batch (from this one compile,
  ``aot_programs.analyse``). Too high for a loss whose memory grows faster than the batch
  (SCORER's batch-wide matching, quadratic): compile at the estimate to confirm.

A program over the chip's HBM available (by the compiler's refusal or by its count) ends
the command with one ``error:`` line saying by how much, exit status 2, after the report.

The slice is named as libtpu spells it (``v5e:2x2``, ``v5e:4x4`` = 16 chips on 4 hosts,
``v4:2x2x1``, ``v5p:2x2x2``, ``v6e:2x4``) or by its Cloud accelerator type (``v5litepod-8``,
``v4-8``, ``v5p-8``, ``v6e-8``); GPUs by card, hosts and GPUs per host (``h100:8``,
``h100:2x8``; ``tools/gpu_specs.py``). A TPU slice needs ``pip install libtpu==0.0.42.1``
(the version ``jax[tpu]==0.10.2`` pins; requirements-aot.txt). The command runs with
``JAX_PLATFORMS=cpu``, which it sets itself, as it sets ``TPU_SKIP_MDS_QUERY=1`` (no metadata
server off Cloud) and ``TPU_WORKER_HOSTNAMES=localhost`` and ``TPU_HOST_BOUNDS=1,1,1``
(libtpu otherwise warns that it cannot find a TPU VM's workers). GPUs need JAX's CUDA plugin
(``pip install jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2``, 126 MiB of wheels; not
NVIDIA's CUDA wheels), which compiles for a described card with none present; a GPU's memory
is the pool JAX's client will take there (``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75).
docs/accelerators.md has measured results.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from changecap_jax import cli, cpu
from changecap_jax.commands import gpu_specs, tpu_specs
from changecap_jax.errors import UserError

FLAGS = flags.FLAGS
LIBTPU_PIN = "libtpu==0.0.42.1"  # what jax[tpu]==0.10.2 installs
# The CUDA plugin at jax's version; without jax[cuda13]'s NVIDIA wheels, which only running needs.
CUDA_PLUGIN_PINS = "jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2"
CUDA_PLUGIN_MODULE = "jax_plugins.xla_cuda13"
PROGRAMS = ("train_step", "decode")  # of a fine-tuning config; pretraining has its tasks'
GIB = 2**30


class LibtpuMissingError(UserError):
    """libtpu, the TPU compiler, is not installed."""


class CudaPluginMissingError(UserError):
    """JAX's CUDA plugin, the GPU compiler, is not installed."""


def set_environment() -> None:
    """The environment the compile-only TPU client needs; before JAX starts (an allocator
    restart of the process keeps it: it re-executes with this environment)."""
    # Compile only: JAX must not look for (and wait on) a TPU of this machine.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata server to ask
    # Without these libtpu looks for the workers and host layout of a TPU VM and warns on
    # stderr; the slice's own layout comes from the topology name.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    # libtpu takes a machine-wide lock file for the chips it drives; compiling drives none,
    # and several checks (or tests) may compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def check_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise LibtpuMissingError(f"libtpu is not installed: the aot check compiles with the "
                                 f"TPU compiler it holds; pip install {LIBTPU_PIN}")


def cuda_plugin_installed() -> bool:
    try:
        return importlib.util.find_spec(CUDA_PLUGIN_MODULE) is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def check_cuda_plugin() -> None:
    if not cuda_plugin_installed():
        raise CudaPluginMissingError(f"JAX's CUDA plugin is not installed: the aot check "
                                     f"compiles for GPUs with it; pip install "
                                     f"{CUDA_PLUGIN_PINS}")


def resolve_topology(name: str, host_network_gbps: float | None = None) -> tpu_specs.Topology:
    """GPUs (``h100:8``, ``gpu_specs``) or else a TPU slice (``tpu_specs``)."""
    return (gpu_specs.resolve_topology(name, host_network_gbps)
            or tpu_specs.resolve_topology(name))


def run(config: Any, topology_name: str, programs: tuple[str, ...] = PROGRAMS,
        shapes: Any = None, host_network_gbps: float | None = None,
        train_records: int | None = None) -> dict[str, Any]:
    """Compiles and analyses ``config``'s programs for the slice ``topology_name``; returns
    the results (``--json``'s content)."""
    topology = resolve_topology(topology_name, host_network_gbps)
    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise UserError(f"--programs: unknown {sorted(unknown)}; choose from {list(PROGRAMS)}")
    gpu = topology.platform == "cuda"
    if gpu:
        check_cuda_plugin()
    else:
        check_libtpu()
    # JAX, imported here: after set_environment, and not for --help or a flag error.
    import jax

    from changecap_jax.commands import aot_programs
    from changecap_jax.commands import synthetic_inputs as si

    mesh = aot_programs.topology_mesh(topology)
    shapes = shapes or si.input_shapes(config)
    built = aot_programs.build_programs(config, mesh, shapes,
                                        include_decode="decode" in programs,
                                        train_records=train_records)
    if "pretrain" not in config and "train_step" not in programs:
        built = [p for p in built if p.name != "train_step"]
    devices = mesh.devices.flatten()
    compute_dtype = config.get("compute_dtype", "float32")
    results = {
        "platform": topology.platform,
        "topology": topology.name, "accelerator_type": topology.alias or None,
        "chips": topology.chips, "hosts": len({d.process_index for d in devices}),
        "device_kind": devices[0].device_kind, "chip": topology.chip.name,
        "chip_source": topology.chip.source, "hbm_bytes": topology.chip.hbm_bytes,
        "hbm_available": topology.chip.hbm_available,
        "hbm_bytes_per_s": topology.chip.hbm_bytes_per_s,
        "bf16_flop_per_s": topology.chip.bf16_flop_per_s,
        "f32_flop_per_s": topology.chip.peak_flop_per_s("float32"),
        "memory_fraction": gpu_specs.memory_fraction() if gpu else None,
        "link": topology.chip.link, "link_bytes_per_s": topology.chip.link_bytes_per_s,
        "network": topology.network or None,
        "network_bytes_per_s": topology.network_bytes_per_s if topology.hosts > 1 else None,
        "compute_dtype": compute_dtype,
        "batch_size": config.batch_size, "eval_batch_size": config.eval_batch_size,
        "input_shapes": {"feature_shape": list(shapes.feature_shape),
                         "vocab_size": shapes.vocab_size, "caption_len": shapes.caption_len},
        "jax": jax.__version__, "libtpu": None if gpu else _version("libtpu"),
        "cuda_plugin": _version("jax-cuda13-plugin") if gpu else None, "programs": [],
    }
    for program in built:
        try:
            measured = aot_programs.compile_program(program)
        except aot_programs.DoesNotFitError as e:  # reported after the programs that fit
            results["refused"] = {"program": program.name, "message": str(e)}
            break
        results["programs"].append(aot_programs.analyse(
            program, measured, topology.chip, topology.chips, compute_dtype,
            topology.fabric()))
    return results


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _capacity(results: dict[str, Any]) -> str:
    pool = (f", JAX's pool of {results['memory_fraction']:g}" if results.get("memory_fraction")
            else "")
    return f"{results['hbm_available'] / GIB:.2f} GiB available{pool}"


def report_lines(results: dict[str, Any]) -> list[str]:
    r = results
    given = f" = {r['accelerator_type']}" if r["accelerator_type"] else ""
    lines = [f"{r['preset']} on {r['topology']}{given}: {r['chips']} x {r['device_kind']} "
             f"({r['chip']}) on {r['hosts']} host(s); compute {r['compute_dtype']}; per chip "
             f"{r['hbm_bytes'] / GIB:.0f} GiB HBM ({_capacity(r)}), "
             f"{r['hbm_bytes_per_s'] / 1e9:.0f} GB/s, "
             f"{r['bf16_flop_per_s'] / 1e12:.0f} bf16 TFLOP/s"
             + (f", {r['f32_flop_per_s'] / 1e12:.0f} TF32" if r.get("platform") == "cuda"
                else "")
             + f"; {r['link']} {r['link_bytes_per_s'] / 1e9:.0f} GB/s per chip each way"
             + (f", {r['network']}" if r.get("network_bytes_per_s") else "")
             + f" ({r['chip_source']})"]
    for p in r["programs"]:
        m = p["memory"]
        unit = p["unit"]
        lines += [
            f"{p['program']} (global batch {p['batch']} {unit}, {p['per_chip_batch']:g} per "
            f"chip): {p['what']}",
            f"  HBM per chip: {_gib(p['hbm_used'])} = {100 * p['hbm_fraction']:.1f}% of "
            f"{_capacity(r)}: arguments {_gib(m['arguments'])} (batch {_gib(p['batch_bytes'])})"
            f", temporaries {_gib(m['temporaries'])}, outputs {_gib(m['outputs'])} "
            f"({_gib(m['aliased'])} in the donated arguments' buffers), code "
            f"{_gib(m['generated_code'])}"
            + (f", resident {p.get('resident_what', 'train state')} "
               f"{_gib(p['resident_bytes'])}" if p["resident_bytes"]
               else ""),
            f"  cost per chip: {p['flops'] / 1e9:.1f} GFLOP (XLA {(p['xla_flops'] or 0) / 1e9:.1f}"
            f", traced matmuls with loops {p['dot_flops'] / 1e9:.1f}), "
            f"{(p['bytes_accessed'] or 0) / 1e9:.2f} GB accessed"
            + (f"; {p['loops_counted_once']} while loop(s) counted once"
               if p["loops_counted_once"] else ""),
            f"  parameters: {p['param_count']:,}; " + _all_reduce_line(p),
            f"  roofline: >= {p['roofline_compute_s'] * 1e3:.2f} ms compute, >= "
            + (f"{p['roofline_memory_s'] * 1e3:.2f} ms HBM traffic"
               if p["bytes_accessed"] is not None else "? ms HBM traffic (no cost analysis)")
            + f", >= {p['roofline_comm_s'] * 1e3:.2f} ms all-reduce -> >= "
            f"{p['roofline_s'] * 1e3:.2f} ms ({p['bound_by']}-bound), <= "
            f"{p['roofline_per_s']:,.0f} {unit}/s",
            *(f"  warning: {w}" for w in p.get("warnings", ())),
            f"  largest global batch that fits (estimate, linear in the batch: compile at it "
            f"to confirm): {p['largest_batch_estimate']} "
            f"{unit}; compiled in {p['lower_s'] + p['compile_s']:.0f} s",
        ]
    return lines


def _all_reduce_line(p: dict[str, Any]) -> str:
    compiled = p.get("compiled_all_reduce_bytes")
    check = (f" (the compiled program's all-reduces: {compiled / 1e6:,.1f} MB)"
             if compiled is not None else "")
    comm = p.get("all_reduce")
    if not comm:
        return f"no gradient all-reduce{check}"
    line = (f"gradient all-reduce {comm['payload_bytes'] / 1e6:,.1f} MB float32{check}: "
            f"{comm['intra_bytes'] / 1e6:,.1f} MB sent per chip")
    if comm["inter_bytes"]:
        line += (f" in-host ({comm['intra_s'] * 1e3:.2f} ms), "
                 f"{comm['inter_bytes'] / 1e6:,.1f} MB per host between hosts "
                 f"({comm['inter_s'] * 1e3:.2f} ms)")
    return line + f" -> >= {comm['seconds'] * 1e3:.2f} ms, bound by {comm['bound_by']}"


def cost_warnings(results: dict[str, Any]) -> list[str]:
    """Every program's warnings (a missing cost analysis)."""
    return [w for p in results["programs"] for w in p.get("warnings", ())]


def check_fits(results: dict[str, Any]) -> None:
    """Raises :class:`~aot_programs.DoesNotFitError` for a program the compiler refused, else
    for the first one over the HBM available."""
    from changecap_jax.commands.aot_programs import DoesNotFitError

    if results.get("refused"):
        raise DoesNotFitError(results["refused"]["message"])
    for p in results["programs"]:
        if not p["fits"]:
            raise DoesNotFitError(
                f"{p['program']} at global batch {p['batch']} {p['unit']} needs "
                f"{_gib(p['hbm_used'])} of HBM per chip, {_gib(p['over_bytes'])} over the "
                f"{_gib(results['hbm_available'])} available per {results['chip']} "
                f"{'GPU' if results.get('platform') == 'cuda' else 'chip'}; the "
                f"largest global batch that fits is about {p['largest_batch_estimate']} "
                f"(estimate)")


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "Model config file.", lock_config=False)
    flags.DEFINE_string("topology", None, f"The TPU slice or GPUs: {tpu_specs.known_names()}.")
    flags.DEFINE_integer("batch_size", None, "Global batch size (default: the config's).")
    flags.DEFINE_integer("eval_batch_size", None, "Decode batch size (default: the config's).")
    flags.DEFINE_list("programs", list(PROGRAMS),
                      "Which programs of a fine-tuning config to compile (a pretraining "
                      "config compiles its tasks' updates).")
    flags.DEFINE_integer("vocab_size", None, "Vocabulary size (datasets without recorded sizes).")
    flags.DEFINE_integer("caption_len", None, "Padded caption length (likewise).")
    flags.DEFINE_integer("train_records", None,
                         "Training records, for config.dataset.on_device (which adds the "
                         "split's bytes per chip to the train step; default: the synthetic "
                         "dataset's num_train).")
    flags.DEFINE_string("json", None, "Also write the results to this JSON file.")
    flags.DEFINE_float("host_network_gbps", None,
                       "GPUs on several hosts: each host's network bandwidth, one direction, "
                       f"in Gb/s (default {gpu_specs.DEFAULT_HOST_NETWORK_GBPS:g}, an assumed "
                       "8 x 400 Gb/s InfiniBand per H100 node; tools/gpu_specs.py).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # The programs are for TPU (GPU) although JAX runs on the CPU here: none of the CPU tunings
    # (changecap_jax/cpu/) that cli.run turned on belongs in them.
    cpu.enable(False)
    config = FLAGS.config
    if FLAGS.batch_size:
        config.batch_size = FLAGS.batch_size
    if FLAGS.eval_batch_size:
        config.eval_batch_size = FLAGS.eval_batch_size
    shapes = None
    if FLAGS.vocab_size or FLAGS.caption_len:
        from changecap_jax.commands import synthetic_inputs as si

        shapes = si.input_shapes(config, vocab_size=FLAGS.vocab_size,
                                 caption_len=FLAGS.caption_len)
    results = run(config, FLAGS.topology, tuple(FLAGS.programs), shapes,
                  FLAGS.host_network_gbps, FLAGS.train_records)
    results.update(preset=FLAGS["config"].config_filename,
                   config=json.loads(config.to_json_best_effort()))
    print("\n".join(report_lines(results)), flush=True)
    for line in cost_warnings(results):  # also on stderr: a bound without its memory term
        print(f"warning: {line}", file=sys.stderr, flush=True)
    if FLAGS.json:
        from changecap_jax.io.jsonio import write_json_atomic

        write_json_atomic(FLAGS.json, results, indent=1)
        print(f"wrote {FLAGS.json}", flush=True)
    check_fits(results)


if __name__ == "__main__":
    set_environment()
    define_flags()
    flags.mark_flag_as_required("config")
    flags.mark_flag_as_required("topology")
    cli.run(main)
