"""The comparison itself: the official training iteration and ours, step by step, on the same
initial weights and the same batches.

1. Batches come from the config's dataset through the project's input pipeline
   (``data/pipeline.py``, as the trainer reads them) or, with ``inputs="random"``, from
   ``synthetic_inputs.make_batch`` at the dataset's shapes. Each batch is drawn once and given
   to both sides: ours as is, the official modules as the official dataset and loop would
   (channels first, AddSpatialInfo where the script applies it, ``labels_with_ignore`` and
   masks by the rule of ``datasets/rcc_dataset_transformer.py``).
2. The official modules are built after ``torch.manual_seed(config.seed)`` in the official
   order, their dropout probabilities set to 0 (train mode kept); the optimiser is the official
   ``build_optimizer(change_detector + speaker params, cfg)`` and ``StepLR(step_size, gamma)``
   stepped once per epoch, as ``train.py`` does.
3. Our parameters are that initialisation converted by the project's converter
   (``convert.converter.convert_params``); our step is the trainer's ``make_train_step``.
4. Per step: every loss term on both sides, the global gradient norm over the optimised
   parameters (before clipping), the learning rate, and after the update the largest absolute
   difference between the official parameters (mapped through the converter's key table) and
   ours.

Section numbers (§) and quirk ids (S-Q) refer to docs/official/ (index: README.md there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from changecap_jax import models, parallel
from changecap_jax.commands import synthetic_inputs as si
from changecap_jax.commands.reproduce import evaluate, idc_pretrain
from changecap_jax.commands.reproduce import float64 as f64
from changecap_jax.commands.reproduce import official as off
from changecap_jax.commands.reproduce.adapters import (  # noqa: F401 (the tools' names)
    Adapter,
    OfficialModel,
    OfficialSide,
    ReproduceError,
    TorchBatch,
    build_modules,
    clip_gradients,
)
from changecap_jax.commands.reproduce.adapters import tensor_batch as torch_batch  # noqa: F401
from changecap_jax.commands.reproduce.registry import adapter_for
from changecap_jax.convert import converter, registry, tables
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.convert.torch_checkpoint import OfficialSnapshot
from changecap_jax.data import datasets, pipeline
from changecap_jax.data.streams import batch_keys
from changecap_jax.models.base import INPUTS_FOLD
from changecap_jax.trainers import caption_step, optimizers, pretraining, update

INPUTS = ("dataset", "random")
SIDES = ("both", "official")  # --sides=official: the official modules alone (train_official)
# nn.Embedding(14, att_dim / 2) in models/DIRL.py and models/SCORER.py: the forward reads
# rows 0..W-1 and 0..H-1 only, so a smaller grid compares the first rows.
POSITION_TABLES = {"w_embedding.weight": "grid_width", "h_embedding.weight": "grid_height"}
NOISE_FRACTION = 1e-6  # a gradient below this fraction of the largest one is float noise


@dataclasses.dataclass(frozen=True)
class Options:
    """The command's flags (``__main__``)."""

    official_repo: Path
    steps: int
    batch_size: int | None = None  # None = config.batch_size
    inputs: str = "dataset"
    steps_per_epoch: int = 0  # 0: ceil(train split / batch) (dataset), --steps (random)
    feature_shape: tuple[int, int, int] | None = None  # random inputs: (H, W, C)
    vocab_size: int | None = None
    caption_len: int | None = None
    official_cfg: tuple[str, ...] = ()  # KEY=VALUE merged into the official cfg
    rtol: float = 1e-4
    atol: float = 0.0  # a loss term agrees when |ours - official| <= atol + rtol * magnitude
    precision: str = "float32"  # or "float64": both sides (reproduce/float64.py)
    evaluate: tuple[str, ...] = ()  # splits both trained models caption (evaluate.py)
    sides: str = "both"  # or "official": train the official modules alone
    out: Path | None = None  # where evaluate writes each side's files


@dataclasses.dataclass
class Inputs:
    """Where the batches come from, and the sizes both models are built with."""

    sizes: tables.Sizes
    steps_per_epoch: int
    description: str
    next_batch: Callable[[Any], dict[str, np.ndarray]]  # model -> the next host batch


@dataclasses.dataclass
class Result:
    """The per-step rows, their :func:`summarize`, notes on config differences, settings."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    notes: list[str]
    settings: dict[str, Any]
    evaluation: dict[str, Any] | None = None  # evaluate.evaluate_sides, with --evaluate


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def dataset_inputs(config: ml_collections.ConfigDict, options: Options) -> Inputs:
    """Training batches of the config's dataset, as the trainer draws them."""
    try:
        dataset = datasets.prepare_config(config.dataset)
    except datasets.DatasetError as e:
        raise ReproduceError(f"{e}\nBuild the dataset first, or pass --inputs=random for "
                             "random batches of its shapes") from e
    source = dataset.split("train")
    h, w, c = dataset.meta.feature_shape
    max_len = config.decode.max_len or dataset.meta.max_caption_len
    sizes = tables.Sizes(len(dataset.vocab), max_len, c, h, w,
                          f"the config's dataset {dataset.name!r}")
    iterator = iter(pipeline.train_loader(source, global_batch_size=config.batch_size,
                                          seed=config.seed, swap_prob=config.swap_prob))
    per_epoch = options.steps_per_epoch or math.ceil(len(source) / config.batch_size)
    return Inputs(sizes, per_epoch, f"dataset {dataset.name!r} ({dataset.directory}), "
                  f"{len(source)} training examples", lambda model: next(iterator))


def random_inputs(config: ml_collections.ConfigDict, options: Options) -> Inputs:
    """``synthetic_inputs.make_batch`` at the dataset's shapes (or the given ones)."""
    try:
        shapes = si.input_shapes(config, feature_shape=options.feature_shape,
                                 vocab_size=options.vocab_size, caption_len=options.caption_len)
    except si.SyntheticInputError as e:
        raise ReproduceError(str(e)) from e
    h, w, c = shapes.feature_shape
    max_len = config.decode.max_len or shapes.caption_len
    sizes = tables.Sizes(shapes.vocab_size, max_len, c, h, w, "random inputs")
    counter = iter(range(1 << 30))

    def next_batch(model: Any) -> dict[str, np.ndarray]:
        return si.make_batch(model, config.batch_size, shapes.feature_shape,
                             shapes.caption_len, shapes.vocab_size,
                             seed=config.seed + next(counter))

    return Inputs(sizes, options.steps_per_epoch or options.steps,
                  f"random batches {h}x{w}x{c}, vocabulary {shapes.vocab_size}, captions of "
                  f"{shapes.caption_len}", next_batch)


def model_batch(model: Any, batch: dict[str, Any], dtype: Any = np.float32
                ) -> dict[str, np.ndarray]:
    """The fields the model reads: grids in ``dtype`` (float32; a half-precision stored grid
    is upcast, as the model does on the device) and int32 ids."""
    keys = list(batch_keys(model.streams))
    return {k: np.asarray(batch[k], dtype if k.startswith(("before", "after")) else
                          np.int32) for k in keys}


# ---------------------------------------------------------------------------------------------
# The official side
# ---------------------------------------------------------------------------------------------


def build_official(adapter: Adapter, config: ml_collections.ConfigDict, options: Options,
                   inputs: Inputs, lib: dict[str, Any]) -> OfficialSide:
    """The official modules, optimiser and schedule (``lib``: the imported checkout)."""
    root = Path(options.official_repo).expanduser().resolve()
    official_cfg = [adapter.parse_official_cfg(o) for o in options.official_cfg]
    return adapter.build_side(config, root, lib, inputs.sizes, official_cfg,
                              inputs.steps_per_epoch)


def official_step(side: OfficialSide, batch: TorchBatch) -> dict[str, float]:
    """One iteration of the official loop body; returns its losses, norm and lr."""
    optimizer = side.optimizer
    optimizer.zero_grad(set_to_none=not side.adapter.zero_grads_in_place)
    losses = side.adapter.losses(side.model, batch)
    losses["total"].backward()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    side.adapter.clip(side)
    if side.lr_at is not None:  # the loop sets each step's lr itself (IDC's finetune.py)
        for group in optimizer.param_groups:
            group["lr"] = side.lr_at(side.step)
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    side.adapter.after_step(side.model)
    side.step += 1
    if side.scheduler is not None and side.step % side.steps_per_epoch == 0:
        side.scheduler.step()  # the end of an epoch: lr_scheduler.step()
    return {**{k: v.item() for k, v in losses.items()}, "grad_norm": norm, "lr": lr}


def trim_position_tables(states: dict[str, dict[str, np.ndarray]],
                         sizes: tables.Sizes) -> dict[str, dict[str, np.ndarray]]:
    """The official grid position tables cut to the grid's rows (``POSITION_TABLES``)."""
    if ENCODER not in states:  # a model without grid position tables (IDC-PCL)
        return states
    encoder = dict(states[ENCODER])
    for key, size_name in POSITION_TABLES.items():
        rows = getattr(sizes, size_name)
        if key in encoder and encoder[key].shape[0] > rows:
            encoder[key] = encoder[key][:rows]
    return {**states, ENCODER: encoder}


# ---------------------------------------------------------------------------------------------
# Our side
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OursSide:
    """Our jitted train step and state on one device."""

    step_fn: Any
    state: Any
    sharding: Any
    frozen: tuple[str, ...]
    aux_terms: tuple[str, ...]


def convert(config: ml_collections.ConfigDict, inputs: Inputs,
            states: dict[str, dict[str, np.ndarray]],
            snapshot_sources: tuple[str, ...]) -> Any:
    """The official modules' state_dicts as our parameters (the project's converter)."""
    snapshot = OfficialSnapshot(Path("<the official modules>"),
                                {k: states[k] for k in snapshot_sources}, None, 0)
    extra = {k: v for k, v in states.items() if k not in snapshot_sources}
    return converter.convert_params(config, snapshot, inputs.sizes, extra_states=extra)


def build_ours(config: ml_collections.ConfigDict, model: Any, inputs: Inputs,
               states: dict[str, dict[str, np.ndarray]], dtype: Any = np.float32,
               snapshot_sources: tuple[str, ...] = (ENCODER, DECODER)) -> OursSide:
    """The official initialisation through the converter (parameters, and so the Adam
    moments, in ``dtype``), the trainer's optimiser and step computing in ``dtype``, on one
    device."""
    params = jax.tree.map(lambda x: np.asarray(x, dtype),
                          convert(config, inputs, states, snapshot_sources))
    mesh = parallel.make_mesh(1)
    optimizer, schedule = optimizers.make_optimizer(config.optim, inputs.steps_per_epoch)
    step_fn = caption_step.make_train_step(model, optimizer, dict(config.loss_weights), mesh,
                                    dict(config.optim.zero_grad_rows), schedule,
                                    with_grads=True, compute_dtype=jnp.dtype(dtype))
    state = update.TrainState(step=jnp.int32(0), params=params,
                             opt_state=optimizer.init(params),
                             rng=jax.random.PRNGKey(config.seed))
    # Committed and replicated like the step's outputs, so the step compiles once.
    state = jax.device_put(state, parallel.replicated(mesh))
    return OursSide(step_fn, state, parallel.batch_sharding(mesh),
                    tuple(config.optim.get("frozen", ())), tuple(config.loss_weights))


def inputs_key(rng: jax.Array, step: Any) -> jax.Array:
    """The ``"inputs"`` rng our train step at 0-based ``step`` gives the model (update.py,
    caption_step.py): ``fold_in(fold_in(rng, step), INPUTS_FOLD)``."""
    return jax.random.fold_in(jax.random.fold_in(rng, step), INPUTS_FOLD)


def ours_step(side: OursSide, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One trainer step; its loss terms, gradient norm (trained groups) and lr."""
    side.state, metrics, grads = side.step_fn(side.state, jax.device_put(batch, side.sharding))
    trained = {k: v for k, v in grads.items() if k not in side.frozen}
    out = {"caption": metrics["loss/caption"], "total": metrics["loss"],
           "grad_norm": optax.global_norm(trained), "lr": metrics["learning_rate"]}
    out.update({k: metrics[f"loss/{k}"] for k in side.aux_terms})
    return {k: float(v) for k, v in jax.device_get(out).items()}


def float_noise_params(entries: list[tables.Entry],
                       gradients: dict[str, dict[str, np.ndarray]]) -> tuple[str, ...]:
    """Our paths whose official gradient is float noise (below ``NOISE_FRACTION`` of the
    largest entry): the analytically zero gradients of a bias before the DIRL z-score or of an
    attention key bias under the softmax. Adam turns such noise into steps of about +-lr of
    random sign on each side, so these parameters drift apart by up to lr per step."""
    flat = tables.apply_table(entries, gradients)
    largest = max(float(np.max(np.abs(g), initial=0.0)) for g in flat.values())
    return tuple(sorted(p for p, g in flat.items()
                        if 0.0 < float(np.max(np.abs(g), initial=0.0)) < NOISE_FRACTION * largest))


def param_difference(entries: list[tables.Entry], states: dict[str, dict[str, np.ndarray]],
                     params: Any, noise: tuple[str, ...], initial: dict[str, np.ndarray]
                     ) -> dict[str, Any]:
    """Over the parameters with a real gradient: the largest |official - ours| (and where it
    is) and ||official - ours|| / ||official - initial|| (how far apart the two are, relative
    to how far training moved them); and the largest |official - ours| over the float-noise
    ones."""
    reference = tables.apply_table(entries, states, np.float64)
    ours = flax.traverse_util.flatten_dict(jax.device_get(params), sep="/")
    worst, where, noisy, apart, moved = 0.0, "", 0.0, 0.0, 0.0
    for path, value in reference.items():
        delta = np.asarray(ours[path], np.float64) - value
        d = float(np.max(np.abs(delta), initial=0.0))
        if path in noise:
            noisy = max(noisy, d)
            continue
        apart += float(np.sum(delta**2))
        moved += float(np.sum((value - initial[path].astype(np.float64)) ** 2))
        if d > worst or not where:
            worst, where = d, path
    return {"param_max_abs_diff": worst, "param_max_abs_diff_at": where,
            "noise_param_max_abs_diff": noisy,
            "param_rel_l2_diff": math.sqrt(apart) / max(math.sqrt(moved), 1e-30)}


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def relative(ours: float, official: float) -> float:
    """|ours - official| / max(|ours|, |official|) (0 when both are 0)."""
    return abs(ours - official) / max(abs(ours), abs(official), 1e-30)


def make_row(step: int, terms: tuple[str, ...], official: dict[str, float],
             ours: dict[str, float], param_diff: dict[str, Any]) -> dict[str, Any]:
    """One table row: lrs, each term and the gradient norm on both sides with their relative
    difference, and the parameter differences."""
    row: dict[str, Any] = {"step": step, "lr_official": official["lr"], "lr_ours": ours["lr"]}
    for name in (*terms, "grad_norm"):
        row.update({f"{name}_official": official[name], f"{name}_ours": ours[name],
                    f"{name}_rel_diff": relative(ours[name], official[name])})
    return {**row, **param_diff}


def prepare(config: ml_collections.ConfigDict, options: Options
            ) -> tuple[ml_collections.ConfigDict, Adapter, list[str]]:
    """A copy of ``config`` with the options applied, dropout off and the widths the official
    code fixes; the adapter; notes on what was changed."""
    if options.inputs not in INPUTS:
        raise ReproduceError(f"--inputs must be one of {INPUTS}, got {options.inputs!r}")
    if options.sides not in SIDES:
        raise ReproduceError(f"--sides must be one of {SIDES}, got {options.sides!r}")
    if options.steps < 1:
        raise ReproduceError(f"--steps must be >= 1, got {options.steps}")
    config = ml_collections.ConfigDict(config.to_dict())
    adapter = adapter_for(config.model)
    if options.batch_size:
        config.batch_size = options.batch_size
    notes = []
    if config.model.dropout_rate:
        notes.append(f"model.dropout_rate {config.model.dropout_rate} -> 0 (dropout off on "
                     "both sides)")
        config.model.dropout_rate = 0.0
    return config, adapter, notes + adapter.fit_config(config)


def compare(config: ml_collections.ConfigDict, options: Options,
            log: Callable[[dict[str, Any]], None] = lambda row: None) -> Result:
    """Runs ``options.steps`` steps on both sides; ``log`` sees every row as it is made."""
    f64.check_precision(options.precision)
    config, adapter, notes = prepare(config, options)
    root = Path(options.official_repo).expanduser().resolve()
    lib = adapter.import_lib(root, config.model)
    inputs = (random_inputs if options.inputs == "random" else dataset_inputs)(config, options)
    model = models.build(config.model, vocab_size=inputs.sizes.vocab_size,
                         max_len=inputs.sizes.max_len)
    inputs.sizes = adapter.fit_sizes(inputs.sizes, model)
    terms = adapter.loss_terms(config)
    with off.running_official(), jax.default_matmul_precision("highest"), \
            f64.jax_precision(options.precision):
        side = build_official(adapter, config, options, inputs, lib)
        notes += adapter.differences(config, side.cfg)
        if options.precision == "float64":
            notes += f64.official_to_float64(side.model, adapter.pe_table)
        if adapter.pretraining and options.sides == "official":
            raise ReproduceError("--sides=official is not supported for IDC pretraining")
        if adapter.pretraining:
            rows, noise, ours = run_pretrain_steps(config, options, model, inputs, side,
                                                   terms, log)
            trained = {"ours": ours.state.params}
        elif options.sides == "official":
            rows, noise, trained = train_official(config, options, model, inputs, side,
                                                  terms, log), (), {}
        else:
            rows, noise, ours = run_steps(config, options, model, inputs, side, terms, log)
            trained = {"ours": ours.state.params}
    evaluation = None
    if options.evaluate:
        if options.out is None:
            raise ReproduceError("--evaluate needs an output folder (--out)")
        states = trim_position_tables(adapter.states(side.model), inputs.sizes)
        trained["official"] = convert(config, inputs, states, adapter.snapshot_sources)
        evaluation = evaluate.evaluate_sides(config, trained, options.steps,
                                             Path(options.out), tuple(options.evaluate))
    settings = {"model": config.model.name, "repository": adapter.repository,
                "script": adapter.script(config.model), "yaml": adapter.yaml(config.model),
                "inputs": inputs.description, "batch_size": config.batch_size,
                "steps": options.steps, "steps_per_epoch": inputs.steps_per_epoch,
                "official_cfg": list(options.official_cfg), "rtol": options.rtol,
                "evaluate": list(options.evaluate), "sides": options.sides,
                "atol": options.atol, "precision": options.precision,
                "float_noise_params": list(noise), "config": config.to_dict()}
    summary = ({"sides": "official", "final": rows[-1]} if options.sides == "official" else
               summarize(rows, terms, options.rtol, options.atol))
    summary["precision"] = options.precision
    if adapter.pretraining:
        summary["by_task"] = idc_pretrain.task_summary(rows)
    return Result(rows, summary, notes, settings, evaluation)


def run_steps(config: ml_collections.ConfigDict, options: Options, model: Any, inputs: Inputs,
              side: OfficialSide, terms: tuple[str, ...],
              log: Callable[[dict[str, Any]], None]
              ) -> tuple[list[dict[str, Any]], tuple[str, ...], OursSide]:
    """Our side built from the official initialisation, then the steps of both sides in
    ``options.precision``; the rows, the float-noise parameters found at step 1 and our
    side."""
    adapter, dtype = side.adapter, f64.host_dtype(options.precision)
    states = trim_position_tables(adapter.states(side.model), inputs.sizes)
    ours = build_ours(config, model, inputs, states, dtype, adapter.snapshot_sources)
    entries = registry.converter_for(config.model.name).table(config.model, inputs.sizes)
    initial = tables.apply_table(entries, states, dtype)
    rows: list[dict[str, Any]] = []
    for step in range(1, options.steps + 1):
        raw = inputs.next_batch(model)
        batch = {**model_batch(model, raw, dtype), **adapter.extra_fields(raw)}
        if step == 1 and options.precision == "float64":
            check_ours_float64(ours, batch)
        with f64.torch_precision(options.precision), f64.official_guard(options.precision):
            tb = adapter.torch_batch(batch, model, tuple(model.streams),
                                     side.model.spatial_info,
                                     inputs_key(ours.state.rng, ours.state.step))
            official = _official_step_with_hint(side, tb, step)
        mine = ours_step(ours, batch)
        if step == 1:
            noise = float_noise_params(entries, adapter.gradients(side.model))
        states = trim_position_tables(adapter.states(side.model), inputs.sizes)
        diff = param_difference(entries, states, ours.state.params, noise, initial)
        rows.append(make_row(step, terms, official, mine, diff))
        log(rows[-1])
    return rows, noise, ours


def run_pretrain_steps(config: ml_collections.ConfigDict, options: Options, model: Any,
                       inputs: Inputs, side: OfficialSide, terms: tuple[str, ...],
                       log: Callable[[dict[str, Any]], None]
                       ) -> tuple[list[dict[str, Any]], tuple[str, ...], Any]:
    """:func:`run_steps` for IDC pretraining (``idc_pretrain.py``): step t trains
    ``draw_task(seed, t)`` on both sides; each row names its task."""
    ip = idc_pretrain
    if options.inputs != "random":
        raise ReproduceError("reproduce compares IDC pretraining on --inputs=random only")
    adapter, dtype = side.adapter, f64.host_dtype(options.precision)
    tasks = tuple(config.pretrain.tasks)
    probabilities = pretraining.task_probabilities(tasks, tuple(config.pretrain.task_ratio))
    states = adapter.states(side.model)
    params = jax.tree.map(lambda x: np.asarray(x, dtype),
                          convert(config, inputs, states, adapter.snapshot_sources))
    ours = ip.build_ours(config, model, params, inputs.steps_per_epoch, dtype)
    entries = registry.converter_for(config.model.name).table(config.model, inputs.sizes)
    initial = tables.apply_table(entries, states, dtype)
    rows: list[dict[str, Any]] = []
    noise: tuple[str, ...] = ()
    for step in range(1, options.steps + 1):
        task = pretraining.draw_task(config.seed, step, tasks, probabilities)
        batch = model_batch(model, inputs.next_batch(model), dtype)
        samples = ip.task_samples(config, model, batch, task)
        if options.precision == "float64" and task not in {r["task"] for r in rows}:
            ip.check_float64(ours, task, samples)
        step_rng = jax.random.fold_in(ours.state.rng, ours.state.step)
        with f64.torch_precision(options.precision), f64.official_guard(options.precision):
            official = _official_step_with_hint(
                side, ip.torch_samples(samples, model, task, step_rng), step)
        mine = ip.ours_step(ours, task, samples)
        if step == 1:
            noise = float_noise_params(entries, adapter.gradients(side.model))
        diff = param_difference(entries, adapter.states(side.model), ours.state.params,
                                noise, initial)
        rows.append({"task": task, **make_row(step, terms, official, mine, diff)})
        log(rows[-1])
    return rows, noise, ours




def train_official(config: ml_collections.ConfigDict, options: Options, model: Any,
                   inputs: Inputs, side: OfficialSide, terms: tuple[str, ...],
                   log: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """``--sides=official``: the official modules alone, on the batches (and with the
    ``"inputs"`` rng, so the IDC-PCL masks) our trainer would give its model at each step."""
    dtype, rng = f64.host_dtype(options.precision), jax.random.PRNGKey(config.seed)
    rows = []
    for step in range(1, options.steps + 1):
        batch = model_batch(model, inputs.next_batch(model), dtype)
        with f64.torch_precision(options.precision), f64.official_guard(options.precision):
            tb = side.adapter.torch_batch(batch, model, tuple(model.streams),
                                          side.model.spatial_info, inputs_key(rng, step - 1))
            official = _official_step_with_hint(side, tb, step)
        rows.append({"step": step, "lr_official": official["lr"],
                     **{f"{t}_official": official[t] for t in (*terms, "grad_norm")}})
        log(rows[-1])
    return rows


def check_ours_float64(ours: OursSide, batch: dict[str, np.ndarray]) -> None:
    """Refuses a float64 run whose train step (model, loss, optimiser, schedule) computes
    anything below float64 from float64 values (:func:`float64.jax_float32_values`)."""
    narrow = f64.jax_float32_values(ours.step_fn, ours.state, batch)
    if narrow:
        raise ReproduceError("float64: our train step computes in a narrower float: "
                             + "; ".join(narrow))


def _official_step_with_hint(side: OfficialSide, batch: TorchBatch, step: int
                             ) -> dict[str, float]:
    """:func:`official_step`; a failure on the first step names what the official code
    hard-codes."""
    try:
        return official_step(side, batch)
    except RuntimeError as e:
        if step > 1:
            raise
        raise ReproduceError(f"the official code failed on the first step: {e}\n(note: "
                             f"{side.adapter.fixed_widths})") from e


def summarize(rows: list[dict[str, Any]], terms: tuple[str, ...], rtol: float,
              atol: float = 0.0) -> dict[str, Any]:
    """Max relative difference per term over all steps (and where), the parameter
    differences at steps 1, 10 and the last, and whether every loss term agrees at every step:
    |ours - official| <= atol + rtol * max(|ours|, |official|)."""
    def agrees(row: dict[str, Any], t: str) -> bool:
        a, b = row[f"{t}_ours"], row[f"{t}_official"]
        return abs(a - b) <= atol + rtol * max(abs(a), abs(b))

    worst = {t: max(rows, key=lambda r, t=t: r[f"{t}_rel_diff"]) for t in (*terms, "grad_norm")}
    outside = [r["step"] for r in rows if not all(agrees(r, t) for t in terms)]
    marks = sorted({s for s in (1, 10, len(rows)) if s <= len(rows)})
    return {
        "max_rel_diff": {t: r[f"{t}_rel_diff"] for t, r in worst.items()},
        "max_rel_diff_step": {t: r["step"] for t, r in worst.items()},
        "max_abs_diff": {t: max(abs(r[f"{t}_ours"] - r[f"{t}_official"]) for r in rows)
                         for t in terms},
        "param_max_abs_diff": {str(s): rows[s - 1]["param_max_abs_diff"] for s in marks},
        "noise_param_max_abs_diff": {str(s): rows[s - 1]["noise_param_max_abs_diff"]
                                     for s in marks},
        "param_rel_l2_diff": {str(s): rows[s - 1]["param_rel_l2_diff"] for s in marks},
        "lr_equal": all(math.isclose(r["lr_official"], r["lr_ours"], rel_tol=1e-6)
                        for r in rows),
        "rtol": rtol,
        "atol": atol,
        "losses_within_tolerance": not outside,
        "first_step_outside_tolerance": outside[0] if outside else None,
    }
