"""The sharded programs of a training run, compiled for a TPU slice or GPUs from a CPU machine.

:func:`build_programs` makes, from a config alone, the jitted programs a training run of it
compiles (``captioning.make_train_step`` and the evaluation's ``search.decode_ids``, or one
``pretraining.make_task_step`` per pretraining task), over a ``data`` mesh of the slice's (the
GPUs') compile-only devices (``jax.experimental.topologies``), with abstract arguments: the train
state from ``jax.eval_shape`` and batches of the dataset's shapes (``synthetic_inputs``) in its
stored feature dtype (float16 unless the config's dataset says otherwise). :func:`analyse`
lowers and compiles one and reads XLA's memory and cost analyses (per chip: the programs are
SPMD over the mesh).

JAX must run on the CPU platform with libtpu (for GPUs, JAX's CUDA plugin) installed;
``tools/aot.py`` sets that up before JAX starts.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from changecap_jax import models, parallel
from changecap_jax.commands import flop_count, interconnect, tpu_specs
from changecap_jax.commands import synthetic_inputs as si
from changecap_jax.commands.benchmark import SYNTHETIC_STEPS_PER_EPOCH, xla_cost
from changecap_jax.data.negatives import NUM_NEGATIVES
from changecap_jax.decoding import search
from changecap_jax.errors import UserError
from changecap_jax.models import precision
from changecap_jax.models.base import conditioning_shapes
from changecap_jax.trainers import captioning, optimizers, pretraining, update

DEFAULT_FEATURE_DTYPE = "float16"  # data/datasets.py's default stored feature dtype


class DoesNotFitError(UserError):
    """A program that needs more HBM per chip than the chip has."""


@dataclasses.dataclass
class Program:
    """One jitted program with abstract, sharded arguments."""

    name: str  # train_step, decode, pretrain_mlm, ...
    fn: Any  # jitted
    args: tuple
    batch: int  # global batch, in ``unit``
    unit: str  # what ``batch`` counts: examples (image pairs x caption streams), samples
    batch_bytes: int  # per chip: the batch arguments' bytes
    resident_bytes: int = 0  # per chip: what stays in HBM beside it (the state at evaluation)
    resident_what: str = "train state"  # what those bytes are, for the report
    what: str = ""  # one line on what it is
    # Whether its traced matmuls have per-chip shapes: a train step's all run inside shard_map;
    # decoding is a plain jit over the sharded batch, traced with global shapes.
    traced_per_chip: bool = True
    param_count: int = 0  # the model's parameters (scalars)
    # per chip: what data parallelism all-reduces each step, the float32 gradients (one copy
    # of the parameters); 0 for a program that updates nothing (decoding)
    gradient_bytes: int = 0


def topology_mesh(topology: tpu_specs.Topology) -> Mesh:
    """A 1-D ``data`` mesh over the slice's compile-only devices (one per chip or GPU)."""
    desc = topologies.get_topology_desc(topology.name, platform=topology.platform,
                                        **topology.options)
    devices = list(desc.devices)
    if len(devices) != topology.chips:
        raise RuntimeError(f"{topology.name}: the {topology.platform} compiler made "
                           f"{len(devices)} devices for {topology.chips} chips")
    return Mesh(np.asarray(devices), (parallel.DATA_AXIS,))


def _abstract(tree: Any, sharding: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


def _batch_specs(example: dict[str, np.ndarray], batch: int, feature_dtype: Any,
                 sharding: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch of ``batch`` rows of ``example``'s fields (one row each), floating
    fields in the dataset's stored ``feature_dtype``."""
    out = {}
    for k, v in example.items():
        dtype = feature_dtype if np.issubdtype(v.dtype, np.floating) else v.dtype
        out[k] = jax.ShapeDtypeStruct((batch, *v.shape[1:]), dtype, sharding=sharding)
    return out


def _per_chip_bytes(specs: Any, chips: int) -> int:
    """Bytes per chip of batch-sharded arguments."""
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
               for s in jax.tree.leaves(specs)) // chips


def _tree_bytes(specs: Any) -> int:
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(specs))


def _tree_size(specs: Any) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs))


# config.dataset.on_device: caption ids held per record and stream where the dataset does not
# say (a few KB beside the 3 feature grids' ~1 MB at the paper shape: an estimate suffices).
CAPTIONS_PER_RECORD = 10


def resident_dataset_bytes(config: ml_collections.ConfigDict, shapes: si.InputShapes,
                           chips: int, feature_dtype: Any,
                           train_records: int | None = None) -> int:
    """Per chip: the training split held on the devices with ``config.dataset.on_device``
    (``trainers/on_device_data.py``): ceil(records / chips) x (3 feature grids + 2 x K caption
    ids + id and change type); 0 without it. Records: ``train_records``, else the synthetic
    dataset's ``num_train``."""
    if not config.dataset.get("on_device", False):
        return 0
    options = config.dataset.get("options") or {}
    records = train_records or options.get("num_train")
    if not records:
        raise UserError(f"config.dataset.on_device: the number of training records of "
                        f"{config.dataset.name!r} is not known here; give --train_records")
    captions = options.get("captions_per_pair", CAPTIONS_PER_RECORD)
    per_record = (3 * math.prod(shapes.feature_shape) * np.dtype(feature_dtype).itemsize
                  + 2 * captions * shapes.caption_len * 4 + 8)
    return math.ceil(records / chips) * per_record


def build_programs(config: ml_collections.ConfigDict, mesh: Mesh, shapes: si.InputShapes,
                   include_decode: bool = True,
                   train_records: int | None = None) -> list[Program]:
    """The programs of a training run of ``config`` on ``mesh`` (module docstring)."""
    if "pretrain" in config:
        return _pretraining_programs(config, mesh, shapes)
    chips = mesh.devices.size
    parallel.check_global_batch(config.batch_size, mesh)
    if include_decode:
        parallel.check_global_batch(config.eval_batch_size, mesh, "eval_batch_size")
    compute_dtype = precision.compute_dtype(config.get("compute_dtype", "float32"))
    feature_dtype = np.dtype(config.dataset.options.get("feature_dtype", DEFAULT_FEATURE_DTYPE))
    max_len = config.decode.max_len or shapes.caption_len
    model = models.build(config.model, vocab_size=shapes.vocab_size, max_len=max_len)
    example = si.make_batch(model, 1, shapes.feature_shape, shapes.caption_len,
                            shapes.vocab_size)
    si.check_model_reads(model, example)
    optimizer, schedule = optimizers.make_optimizer(config.optim, SYNTHETIC_STEPS_PER_EPOCH)
    step = captioning.make_train_step(
        model, optimizer, dict(config.loss_weights), mesh, dict(config.optim.zero_grad_rows),
        schedule, compute_dtype=compute_dtype,
        skip_nonfinite=config.get("skip_nonfinite_updates", False))
    repl, data = parallel.replicated(mesh), parallel.batch_sharding(mesh)
    state = _abstract(jax.eval_shape(lambda: captioning.init_train_state(
        model, optimizer, example, mesh, jax.random.PRNGKey(0))), repl)
    batch = _batch_specs(example, config.batch_size, feature_dtype, data)
    programs = [Program("train_step", step, (state, batch), config.batch_size, "examples",
                        _per_chip_bytes(batch, chips),
                        resident_bytes=resident_dataset_bytes(config, shapes, chips,
                                                              feature_dtype, train_records),
                        resident_what="training split (config.dataset.on_device)",
                        what="the update: forward, backward and optimiser, one global batch",
                        param_count=_tree_size(state.params),
                        gradient_bytes=_tree_bytes(state.params))]
    if include_decode:
        programs.append(_decode_program(config, model, state, example, feature_dtype,
                                        compute_dtype, max_len, mesh))
    return programs


def _decode_program(config: ml_collections.ConfigDict, model: Any, state: Any,
                    example: dict, feature_dtype: Any, compute_dtype: Any, max_len: int,
                    mesh: Mesh) -> Program:
    """Evaluation's decoding of one eval batch (``search.decode_ids``, as
    ``captioning.Trainer.decode_fn``), from the parameters cast once to the compute dtype;
    the train state stays in HBM meanwhile."""
    repl, data = parallel.replicated(mesh), parallel.batch_sharding(mesh)
    chips = mesh.devices.size
    params = _abstract(jax.eval_shape(lambda p: precision.cast_floating(p, compute_dtype),
                                      state.params), repl)
    size = config.eval_batch_size
    names = conditioning_shapes(model)
    fields = {"before": example["before"], "after": example["after_semantic"],
              **{n: example[f"{n}_semantic"] for n in names}}
    inputs = _batch_specs(fields, size, feature_dtype, data)
    conditioning = {n: inputs.pop(n) for n in names}

    def decode(params: Any, before: jax.Array, after: jax.Array, conditioning: dict) -> Any:
        return search.decode_ids(model, params, before, after, decode_config=config.decode,
                                   max_len=max_len, key=jax.random.key(config.seed),
                                   conditioning=conditioning, compute_dtype=compute_dtype)

    fn = jax.jit(decode, in_shardings=(repl, data, data, data), out_shardings=data)
    batch_args = (inputs["before"], inputs["after"], conditioning)
    beam = config.decode.get("beam_size", 1)
    how = f"beam search of {beam}" if beam > 1 else ("sampling" if config.decode.sample
                                                      else "greedy decoding")
    return Program("decode", fn, (params, *batch_args), size, "pairs",
                   _per_chip_bytes(batch_args, chips), resident_bytes=_tree_bytes(state),
                   what=f"evaluation: {how} of one eval batch, {max_len} tokens, with the "
                        "train state resident", traced_per_chip=False,
                   param_count=_tree_size(state.params))


def _pretraining_programs(config: ml_collections.ConfigDict, mesh: Mesh,
                          shapes: si.InputShapes) -> list[Program]:
    """One update per pretraining task (``pretraining.make_task_step``), each on its batch:
    batch_size x pair streams samples for MLM and MVCL, ``pretrain.fda_batch_size`` samples
    with their hard negatives for FDA (as ``pretraining.PretrainTrainer`` reads them)."""
    if config.get("compute_dtype", "float32") != "float32":
        raise pretraining.PretrainError(
            "pretraining computes in float32 only (config.compute_dtype = "
            f"{config.compute_dtype!r}), as python -m changecap_jax.main refuses it")
    if config.pretrain.extra_source.dir:
        raise UserError("the aot check builds pretraining without a cross-task source "
                        "(config.pretrain.extra_source.dir); leave it empty here")
    chips = mesh.devices.size
    feature_dtype = np.dtype(config.dataset.options.get("feature_dtype", DEFAULT_FEATURE_DTYPE))
    max_len = config.decode.max_len or shapes.caption_len
    model = models.build(config.model, vocab_size=shapes.vocab_size, max_len=max_len)
    optimizer, schedule = optimizers.make_optimizer(config.optim, SYNTHETIC_STEPS_PER_EPOCH)
    repl, data = parallel.replicated(mesh), parallel.batch_sharding(mesh)
    grid, length = shapes.feature_shape, shapes.caption_len
    rng = jax.random.PRNGKey(0)

    def init() -> Any:
        img = jnp.zeros((1, *grid), jnp.float32)
        params = model.init({"params": rng}, img, img, jnp.zeros((1, length), jnp.int32),
                            method="pretrain")["params"]
        return update.TrainState(step=jnp.int32(0), params=params,
                                 opt_state=optimizer.init(params), rng=rng)

    state = _abstract(jax.eval_shape(init), repl)
    pairs = config.batch_size * len(model.streams)
    programs = []
    for task in config.pretrain.tasks:
        samples = int(config.pretrain.fda_batch_size) if task == "fda" else pairs
        if samples <= 0 or samples % chips:
            raise parallel.BatchSizeError(
                f"task {task!r} reads {samples} samples per step: it must be a positive "
                f"multiple of the {chips} chips")
        example = {"img1": np.zeros((1, *grid), np.float32),
                   "img2": np.zeros((1, *grid), np.float32),
                   "ids": np.zeros((1, length), np.int32)}
        if task == "fda":
            example["negatives"] = np.zeros((1, NUM_NEGATIVES, length), np.int32)
        batch = _batch_specs(example, samples, feature_dtype, data)
        step = pretraining.make_task_step(
            model, task, optimizer, mesh, schedule,
            fda_temperature=float(config.pretrain.get("fda_temperature", 1.0)),
            zero_grad_rows=dict(config.optim.zero_grad_rows),
            skip_nonfinite=config.get("skip_nonfinite_updates", False))
        what = (f"pretraining update of task {task}"
                + (f", each sample with {NUM_NEGATIVES} hard negatives" if task == "fda" else ""))
        programs.append(Program(f"pretrain_{task}", step, (state, batch), samples, "samples",
                                _per_chip_bytes(batch, chips), what=what,
                                param_count=_tree_size(state.params),
                                gradient_bytes=_tree_bytes(state.params)))
    return programs


# ---------------------------------------------------------------------------------------------
# Compile and analyse
# ---------------------------------------------------------------------------------------------


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "aliased": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
           "generated_code": int(m.generated_code_size_in_bytes)}
    # Donated arguments come back as outputs in the same buffers (the train state).
    out["total"] = (out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
                    + out["generated_code"])
    return out


def compile_program(program: Program) -> dict[str, Any]:
    """Lowers and compiles ``program``; XLA's per-chip memory and cost, the traced step's
    matmul FLOPs with every loop iteration counted, and the times taken. A program over the
    chip's HBM raises :class:`DoesNotFitError` with the compiler's own account."""
    t0 = time.perf_counter()
    traced = program.fn.trace(*program.args)
    lowered = traced.lower()
    lower_s = time.perf_counter() - t0
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DoesNotFitError(refusal_message(program, str(e))) from e
    compile_s = time.perf_counter() - t0 - lower_s
    dots = flop_count.jaxpr_dot_flops(traced.jaxpr)
    cost, source = xla_cost(compiled), "xla"
    if cost["flops"] is None and cost["bytes_accessed"] is None:
        cost, source = module_cost(compiled), "module_cost"
    if cost["flops"] is None and cost["bytes_accessed"] is None:
        source = None  # analyse warns: the roofline lacks its memory term
    return {"memory": _memory(compiled), **cost, "cost_source": source,
            "dot_flops": dots.flops, "loops_counted_once": dots.unknown_trip_count_loops,
            "all_reduce_bytes": all_reduce_bytes(compiled),
            "lower_s": lower_s, "compile_s": compile_s}


# An all-reduce's result type in optimised HLO text: "%x = f32[512,512]{1,0} all-reduce(" or
# a tuple "(f32[8]{0}, bf16[4,4]{1,0}) all-reduce-start(" (asynchronous: the -done repeats it).
_ALL_REDUCE = re.compile(r"=\s*(.+?)\s+all-reduce(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def all_reduce_bytes(compiled: Any) -> int | None:
    """Bytes per chip that the compiled program's all-reduces carry (their results), read from
    its optimised HLO: a check on the gradients' count, which the communication term uses.
    None where the executable has no HLO text."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - a backend without it only loses the check
        return None
    if not text:
        return None
    total = 0
    for match in _ALL_REDUCE.finditer(text):
        for dtype, dims in _ARRAY.findall(match.group(1)):
            itemsize = _HLO_ITEMSIZE.get(dtype)
            if itemsize:
                total += itemsize * math.prod(int(d) for d in dims.split(",") if d)
    return total


_HLO_ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2,
                 "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}


def module_cost(compiled: Any) -> dict[str, float | None]:
    """XLA's cost analysis of the compiled (optimised) module, run by the CPU client: the CUDA
    plugin's compile-only executable has none ("GetCostAnalysis is not supported"). The
    analysis is XLA's generic one (per fusion, its operands and outputs), which does not know
    library calls (cuBLAS, cuDNN): they add nothing, so FLOPs take the traced matmuls too.
    None where jaxlib has no such entry point."""
    try:  # private: jaxlib's binding of HloCostAnalysis
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        modules = compiled.runtime_executable().hlo_modules()
        cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), modules[0])
    except (AttributeError, ImportError, jax.errors.JaxRuntimeError):
        return {"flops": None, "bytes_accessed": None}
    return {"flops": float(cost["flops"]) if "flops" in cost else None,
            "bytes_accessed": (float(cost["bytes accessed"]) if "bytes accessed" in cost
                               else None)}


# libtpu's refusal: "... the total memory required for HLO temporaries (5.84T) exceeds
# available HBM (15.75G)." (binary units)
REFUSAL = re.compile(r"required for ([^(]+?) \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                     r"\(([\d.]+)([KMGT]?)\)")
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refusal_message(program: Program, error: str) -> str:
    """One line on a program the TPU compiler refused for lack of HBM: how much over."""
    head = f"{program.name} at global batch {program.batch} {program.unit} does not fit"
    match = REFUSAL.search(error)
    if not match:
        first = next((s.strip() for s in error.splitlines() if s.strip()), "")
        return f"{head}: the TPU compiler refuses it: {first[:300]}"
    what, need, need_unit, have, have_unit = match.groups()
    need_b, have_b = float(need) * UNITS[need_unit], float(have) * UNITS[have_unit]
    return (f"{head}: its {what.strip()} alone need {need_b / 2**30:,.2f} GiB of HBM per chip, "
            f"{(need_b - have_b) / 2**30:,.2f} GiB over the {have_b / 2**30:.2f} GiB available "
            f"(the TPU compiler's count)")


def _cost_warnings(program: Program, measured: dict[str, Any]) -> list[str]:
    """The warning of a program whose executable has no XLA cost analysis."""
    if measured.get("bytes_accessed") is not None and measured.get("flops") is not None:
        return []
    return [f"{program.name}: no XLA cost analysis (XLA's "
            f"{'FLOPs' if measured.get('flops') is None else 'bytes accessed'} missing: the "
            f"compiler's executable has none and aot_programs.module_cost, a private jaxlib "
            f"entry point, is unavailable or failed); the roofline's memory term is "
            f"{'missing' if measured.get('bytes_accessed') is None else 'kept'} and its FLOPs "
            f"are the traced matmuls only, so the bound may be far too low"]


def _largest_batch(program: Program, mem: dict[str, Any], used: float, room: float,
                   chips: int) -> int | None:
    """The largest global batch estimated to fit in ``room`` bytes per chip.

    Batch-independent: the state (parameters, optimiser), code, outputs and whatever stays
    resident; the rest (the batch and every temporary) is taken as proportional to the batch.
    That overstates the per-example cost by the batch-independent temporaries (the
    gradients), and understates it where memory grows faster than the batch: SCORER's
    batch-wide matching (estimated 1,504 from batch 128 on a v5litepod-8; compiled at 1,504 it
    needs 20.5 GiB per chip of the 15.75: docs/accelerators.md)."""
    per_unit = (program.batch_bytes + mem["temporaries"]) / (program.batch / chips)
    fixed = used - program.batch_bytes - mem["temporaries"]
    return max(0, int((room - fixed) // per_unit)) * chips if per_unit else None


def analyse(program: Program, measured: dict[str, Any], chip: tpu_specs.Chip,
            chips: int, compute_dtype: str = "bfloat16",
            fabric: interconnect.Interconnect | None = None) -> dict[str, Any]:
    """The per-chip figures of a compiled program against ``chip``: HBM used and its share,
    the roofline lower bound on its time (the largest of FLOPs at the matmul peak of
    ``compute_dtype``, bytes at the HBM bandwidth, and the gradient all-reduce over ``fabric``
    at its links' bandwidth) and the throughput it implies, and an estimate of the largest
    global batch that fits. A program without XLA's cost analysis gets a warning: its roofline
    then has no memory term and counts the traced matmuls only."""
    mem = measured["memory"]
    used = mem["total"] + program.resident_bytes
    # XLA counts a loop body once; the jaxpr count takes every iteration of scans (SCORER's
    # chunked matching), so the larger of the two is the better lower bound.
    dot_flops = measured["dot_flops"] / (1 if program.traced_per_chip else chips)
    flops = max(measured["flops"] or 0.0, dot_flops)
    compute_s = flops / chip.peak_flop_per_s(compute_dtype)
    memory_s = (measured["bytes_accessed"] or 0.0) / chip.hbm_bytes_per_s
    comm = (interconnect.allreduce(program.gradient_bytes, fabric)
            if fabric is not None and program.gradient_bytes else None)
    comm_s = comm["seconds"] if comm else 0.0
    terms = {"compute": compute_s, "memory": memory_s, "communication": comm_s}
    bound_by = max(terms, key=terms.get)  # ties: compute first, as before
    bound_s = terms[bound_by]
    per_chip_batch = program.batch / chips
    room = chip.hbm_available
    return {
        "program": program.name, "what": program.what, "batch": program.batch,
        "unit": program.unit, "per_chip_batch": per_chip_batch,
        "memory": mem, "batch_bytes": program.batch_bytes,
        "resident_bytes": program.resident_bytes, "resident_what": program.resident_what,
        "hbm_used": used,
        "hbm_available": room, "hbm_fraction": used / room,
        "fits": used <= room, "over_bytes": max(0, used - room),
        "xla_flops": measured["flops"], "dot_flops": dot_flops, "flops": flops,
        "loops_counted_once": measured["loops_counted_once"],
        "bytes_accessed": measured["bytes_accessed"],
        "cost_source": measured.get("cost_source", "xla"),
        "param_count": program.param_count, "gradient_bytes": program.gradient_bytes,
        "all_reduce": comm, "compiled_all_reduce_bytes": measured.get("all_reduce_bytes"),
        "roofline_compute_s": compute_s, "roofline_memory_s": memory_s,
        "roofline_comm_s": comm_s,
        "roofline_s": bound_s, "bound_by": bound_by,
        "roofline_per_s": program.batch / bound_s if bound_s else None,
        "largest_batch_estimate": _largest_batch(program, mem, used, room, chips),
        "warnings": _cost_warnings(program, measured),
        "lower_s": measured["lower_s"], "compile_s": measured["compile_s"],
    }
