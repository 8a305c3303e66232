"""What ``reproduce`` knows about yaolinli/IDC's PRETRAINING: ``clver/pretrain.py`` with
``clver/modules_pretrain.py`` (docs/official/ §5.1-§5.3, §5.6), for the config
``configs/idc_pcl.py:pretrain`` (any of its tasks mlm, mvcl, fda).

* Task: step t (1-based) trains the task our trainer draws, ``draw_task(seed, t, ...)``; the
  official loop's ``MetaLoader`` draw (python ``random``) is not replayed, so both sides train
  the same task on the same batch at every step.
* Model: ``modules_pretrain.Model`` built after ``torch.manual_seed(seed)`` with the config's
  sizes over the trunk vocabulary (as the fine-tuning adapter, ``idc_pcl.py``), ``tasks`` the
  official names of ours (mvcl = ``mvm_contrst``) and ``tmp`` = ``pretrain.fda_temperature``.
* Optimiser and lr: pretrain.py's ``Adam(lr, weight_decay)`` from
  ``clver/config/pretrain_clver.json`` (``--official_cfg=KEY=VALUE`` changes one), the lr of
  step t set before ``optimizer.step()`` as ``utils.get_lr_sched(t - 1, args)`` (noam, 1e-8 at
  step 0). The loss is the loop's ``raw_loss.mean()`` of ``model(batch, task)``.
* Inputs: random batches only (``--inputs=random``): an example's pairs (semantic, then
  distractor) are the samples, as ``data/pretrain_samples.py`` makes them; an FDA step reads
  ``pretrain.fda_batch_size`` samples, each with 6 negatives: the captions of the next 6
  samples of its batch (cyclically). The masks are ours (``mlm_inputs``, ``mvcl_mask`` with
  the step's keys), given to both sides: the official side reads the masked caption and its
  labels (MLM) or the zeroed regions, ``img_mask`` and the unmasked ``img_label`` (MVCL).
* float64: ``mfm_nce`` casts its logits with ``.float()``; in a float64 run that call keeps
  float64 (:func:`keep_float64`, said in the notes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from changecap_jax import models, parallel
from changecap_jax.commands.reproduce import float64 as f64
from changecap_jax.commands.reproduce import idc_pcl
from changecap_jax.commands.reproduce.adapters import (
    OfficialModel,
    OfficialSide,
    ReproduceError,
    disable_dropout,
)
from changecap_jax.convert import tables
from changecap_jax.data import streams as stream_fields
from changecap_jax.models import idc_pcl_pretraining as pre
from changecap_jax.models.base import INPUTS_FOLD
from changecap_jax.trainers import optimizers, pretraining, update

SETTINGS = "clver/config/pretrain_clver.json"  # pretrain.py's --config
MODULES = ("para", "utils", "modules_pretrain")
OFFICIAL_TASKS = {"mlm": "mlm", "mvcl": "mvm_contrst", "fda": "fda"}
NEGATIVES = 6  # pretrain_clver.json's neg_num
OFFICIAL_MODEL = {"stage": "pretrain", "use_difference_encoder": True,
                  "word_mask_probability": 0.15, "eos_mask_probability": 0.15}
TERMS = ("total",)  # the drawn task's loss; each row names its task


@contextlib.contextmanager
def keep_float64() -> Iterator[None]:
    """``Tensor.float()`` of a float64 tensor returns it unchanged (``mfm_nce``'s cast of its
    logits), so a float64 run stays float64; any other call runs as it is."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Keep(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if (func is torch.Tensor.float and args and isinstance(args[0], torch.Tensor)
                    and args[0].dtype == torch.float64):
                return args[0]
            return func(*args, **(kwargs or {}))

    with Keep():
        yield


def script_argv(root: Path, overrides: list[tuple[str, Any]] = ()) -> list[str]:
    """pretrain.py's command line (the json config, then each ``--official_cfg``)."""
    settings = root / SETTINGS
    if not settings.is_file():
        raise ReproduceError(f"{root} lacks the official config {SETTINGS}")
    return ["pretrain.py", "--dataset=clver", "--exp_name=reproduce", f"--config={settings}",
            *(f"--{key}={value}" for key, value in overrides)]


class IdcPclPretrainAdapter(idc_pcl.IdcPclAdapter):
    """yaolinli/IDC ``clver/pretrain.py`` (one task per step, noam lr, mean losses)."""

    pretraining = True
    # The authors ran torch 1.9 (the IDC README), whose ``model.zero_grad()`` zeroes the
    # gradients in place: a head that the step's task does not reach (MLM's output_layer in
    # an MVCL step) still takes an Adam step on its moments, as optax's Adam does. torch >= 2.0
    # sets them to None and skips it. build_side also gives every parameter a zero gradient
    # before step 1, so each Adam step count starts at step 1 as optax's single count does
    # (under torch 1.9 a head's count starts at the first step of its task: the one
    # difference left, docs/reproduce.md).
    zero_grads_in_place = True

    def script(self, model: ml_collections.ConfigDict) -> str:
        return "clver/pretrain.py"

    def yaml(self, model: ml_collections.ConfigDict) -> str:
        return SETTINGS

    def module_names(self, model: ml_collections.ConfigDict) -> tuple[str, ...]:
        return MODULES

    def import_lib(self, root: Path, model: ml_collections.ConfigDict) -> dict[str, Any]:
        with idc_pcl.as_script(script_argv(root)):
            return idc_pcl.off.import_official(root / idc_pcl.FOLDER, MODULES, packages=())

    def official_weights(self, model: ml_collections.ConfigDict) -> dict[str, float]:
        return {}

    def loss_terms(self, config: ml_collections.ConfigDict) -> tuple[str, ...]:
        return TERMS

    def fit_config(self, config: ml_collections.ConfigDict) -> list[str]:
        m = config.model
        wrong = {k: m.get(k) for k, v in OFFICIAL_MODEL.items() if m.get(k) != v}
        if wrong:
            raise ReproduceError(f"the official clver/pretrain.py trains {OFFICIAL_MODEL}; the "
                                 f"config has {wrong}")
        if config.pretrain.extra_source.get("dir"):
            raise ReproduceError("reproduce compares IDC pretraining without a cross-task "
                                 "source (the official clver/ code has none): unset "
                                 "config.pretrain.extra_source.dir")
        pre_tasks = tuple(config.pretrain.tasks)
        pretraining.task_probabilities(pre_tasks, tuple(config.pretrain.task_ratio))
        notes = [n for n in super().fit_config(_as_finetune(config))]
        return notes + [f"tasks {pre_tasks}: step t trains draw_task(seed, t) on both sides "
                        "(the official MetaLoader draw is not replayed)"]

    def build_side(self, config: ml_collections.ConfigDict, root: Path, lib: dict[str, Any],
                   sizes: tables.Sizes, official_cfg: list[tuple[str, Any]],
                   steps_per_epoch: int) -> OfficialSide:
        """pretrain.py: ``torch.manual_seed(args.seed)``, ``Model(...)``, Adam, the lr of
        each step from ``get_lr_sched(global_step, args)``."""
        import torch

        args = idc_pcl.official_args(lib, script_argv(root, official_cfg))
        m = config.model
        ours = models.build(m, vocab_size=sizes.vocab_size, max_len=sizes.max_len)
        torch.manual_seed(config.seed)  # pretrain.py seeds torch with args.seed (1234)
        with contextlib.redirect_stdout(io.StringIO()):  # Model prints its fda temperature
            module = lib["modules_pretrain"].Model(
                ff_dim=m.ffn_dim, img_embs=sizes.feature_channels, n_hidden=m.hidden_dim,
                n_head=m.num_heads, n_block=m.cross_layers, img_enc_block=1,
                vocab_size=ours.num_tokens, dropout=m.dropout_rate, max_len=sizes.max_len,
                tasks=[OFFICIAL_TASKS[t] for t in config.pretrain.tasks],
                tmp=float(config.pretrain.fda_temperature), CLS=ours.cls_token)
        if m.type_embedding_std != 1.0:
            with torch.no_grad():
                module.position_encoding.type_pe.weight.mul_(m.type_embedding_std)
        disable_dropout([module])
        model = OfficialModel({"model": module}, None, lib, {}, ("model",))
        trained = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trained, lr=args.lr, weight_decay=args.weight_decay)
        for p in trained:  # see zero_grads_in_place
            p.grad = torch.zeros_like(p)
        return OfficialSide(self, model, args, optimizer, None, steps_per_epoch,
                            lr_at=lambda step: lib["utils"].get_lr_sched(step, args))

    def losses(self, official: OfficialModel, batch: dict[str, Any]) -> dict[str, Any]:
        """pretrain.py's loop body: ``raw_loss, _ = model(batch, task)``, ``.mean()``."""
        with keep_float64():
            raw, _ = official.modules["model"](batch["batch"], batch["task"], compute_loss=True)
        return {"total": raw.mean()}

    def differences(self, config: ml_collections.ConfigDict, cfg: Any) -> list[str]:
        o = config.optim
        out = []
        for ours, value, theirs in (("learning_rate", o.learning_rate, "lr"),
                                    ("weight_decay", o.get("weight_decay", 0.0),
                                     "weight_decay"),
                                    ("warmup_steps", o.get("warmup_steps", 0), "warmup_steps")):
            official = float(getattr(cfg, theirs))
            if not np.isclose(float(value), official, rtol=1e-12, atol=0):
                out.append(f"optim.{ours} = {value}, official {theirs} = {official} "
                           f"({SETTINGS}; --official_cfg={theirs}=VALUE sets it)")
        if o.get("schedule") != "noam":
            out.append(f"optim.schedule = {o.get('schedule')!r}, official noam "
                       "(utils.get_lr_sched)")
        temperature = float(config.pretrain.fda_temperature)
        if "fda" in config.pretrain.tasks and float(cfg.tmp) != temperature:
            out.append(f"pretrain.fda_temperature = {temperature}; the official Model is built "
                       f"with it (the json's tmp = {cfg.tmp} is not used)")
        adam = {"b1": 0.9, "b2": 0.999, "eps": 1e-8}  # torch.optim.Adam's defaults
        return out + [f"optim.{k} = {o[k]}, official torch.optim.Adam default {v}"
                      for k, v in adam.items() if float(o[k]) != v]


def _as_finetune(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy whose model passes the fine-tuning adapter's checks (for its embedding notes)."""
    copy = ml_collections.ConfigDict(config.to_dict())
    copy.model.update({k: v for k, v in idc_pcl.OFFICIAL_MODEL.items()})
    return copy


# ---------------------------------------------------------------------------------------------
# Batches and masks
# ---------------------------------------------------------------------------------------------


def pair_samples(batch: dict[str, np.ndarray], streams: tuple[str, ...],
                 rows: int | None = None) -> dict[str, np.ndarray]:
    """An example batch as pretraining samples (each stream's pairs, semantic first): img1,
    img2 grids and ids; the first ``rows`` of them, with ``NEGATIVES`` negatives each (the
    captions of the next samples, cyclically) when ``rows`` is given (FDA)."""
    img2 = np.concatenate([batch[stream_fields.STREAMS[s].after] for s in streams])
    ids = np.concatenate([batch[stream_fields.STREAMS[s].caption] for s in streams])
    out = {"img1": np.concatenate([batch["before"]] * len(streams)), "img2": img2, "ids": ids}
    if rows is None:
        return out
    if rows > len(ids):
        raise ReproduceError(f"pretrain.fda_batch_size = {rows} samples, the batch gives "
                             f"{len(ids)}")
    out["negatives"] = np.stack([np.roll(ids, -k, 0) for k in range(1, NEGATIVES + 1)], 1)
    return {k: v[:rows] for k, v in out.items()}


@functools.lru_cache(maxsize=8)
def _masks(model: Any, task: str) -> Any:
    """The masks our step draws for ``task`` from its rng (jitted once per task)."""
    def draw(batch: dict, step_rng: jax.Array) -> Any:
        keys = pre.sample_keys(jax.random.fold_in(step_rng, INPUTS_FOLD),
                               jnp.arange(batch["ids"].shape[0]))
        if task == "mlm":
            return pre.mlm_inputs(model, keys, batch["ids"])
        grid = batch["img1"].shape
        return pre.mvcl_mask(keys, math.prod(grid[1:-1]))

    return jax.jit(draw)


def torch_samples(samples: dict[str, np.ndarray], model: Any, task: str,
                  step_rng: jax.Array) -> dict[str, Any]:
    """The official loader's batch of ``task``: img1 / img2 tokens (B, N, C), times the
    preset's feature scale; ``cap`` / ``cap_label`` (MLM: masked by our step's keys);
    MVCL: the regions our step zeroes, ``img_mask`` and the unmasked ``img_label``; FDA:
    ``caps`` (B, 1 + K, L), the caption first."""
    import torch

    scale = np.asarray(model.image_feature_scale, samples["img1"].dtype)

    def tokens(x: np.ndarray) -> np.ndarray:
        return x.reshape(x.shape[0], -1, x.shape[-1])

    img1, img2 = tokens(samples["img1"]), tokens(samples["img2"])
    ids = np.asarray(samples["ids"], np.int64)
    out = {"cap": ids, "cap_label": np.full_like(ids, -1)}
    if task == "mlm":
        masked, labels = jax.device_get(_masks(model, task)(samples, step_rng))
        out.update(cap=np.asarray(masked, np.int64), cap_label=np.asarray(labels, np.int64))
    elif task == "mvcl":
        mask = np.asarray(jax.device_get(_masks(model, task)(samples, step_rng)))
        n = img1.shape[1]
        out.update(img_mask=mask, img_label=np.concatenate([img1, img2], 1))
        img1 = np.where(mask[:, :n, None], 0.0, img1).astype(img1.dtype)
        img2 = np.where(mask[:, n:, None], 0.0, img2).astype(img2.dtype)
    else:
        out["caps"] = np.concatenate([ids[:, None], samples["negatives"].astype(np.int64)], 1)
    out.update(img1=(img1 * scale).astype(img1.dtype), img2=(img2 * scale).astype(img2.dtype))
    return {"task": OFFICIAL_TASKS[task],
            "batch": {k: torch.from_numpy(np.array(v)) for k, v in out.items()}}


# ---------------------------------------------------------------------------------------------
# Our side and the steps
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OursPretrain:
    """Our pretraining state and one jitted update per task (the trainer's
    ``make_task_step``)."""

    steps: dict[str, Any]
    state: update.TrainState
    sharding: Any


def build_ours(config: ml_collections.ConfigDict, model: Any, params: Any,
               steps_per_epoch: int, dtype: Any) -> OursPretrain:
    """The trainer's optimiser and task updates over ``params`` (the official
    initialisation, converted), computing in ``dtype``."""
    mesh = parallel.make_mesh(1)
    optimizer, schedule = optimizers.make_optimizer(config.optim, steps_per_epoch)
    steps = {t: pretraining.make_task_step(
        model, t, optimizer, mesh, schedule,
        fda_temperature=float(config.pretrain.fda_temperature),
        zero_grad_rows=dict(config.optim.zero_grad_rows), with_grads=True,
        compute_dtype=jnp.dtype(dtype)) for t in config.pretrain.tasks}
    state = update.TrainState(step=jnp.int32(0), params=params,
                              opt_state=optimizer.init(params),
                              rng=jax.random.PRNGKey(config.seed))
    state = jax.device_put(state, parallel.replicated(mesh))
    return OursPretrain(steps, state, parallel.batch_sharding(mesh))


def ours_step(side: OursPretrain, task: str, samples: dict[str, np.ndarray]
              ) -> dict[str, float]:
    """One update of ``task``: its loss, the gradient norm and the lr."""
    import optax

    side.state, metrics, grads = side.steps[task](side.state,
                                                  jax.device_put(samples, side.sharding))
    out = {"total": metrics["loss"], "grad_norm": optax.global_norm(grads),
           "lr": metrics["learning_rate"]}
    return {k: float(v) for k, v in jax.device_get(out).items()}


def task_samples(config: ml_collections.ConfigDict, model: Any, batch: dict[str, np.ndarray],
                 task: str) -> dict[str, np.ndarray]:
    """The samples of a step of ``task`` (grids in the batch's dtype, int32 ids)."""
    rows = int(config.pretrain.fda_batch_size) if task == "fda" else None
    samples = pair_samples(batch, tuple(model.streams), rows)
    return {k: v if k.startswith("img") else np.asarray(v, np.int32)
            for k, v in samples.items()}

def check_float64(ours: OursPretrain, task: str, samples: dict[str, np.ndarray]) -> None:
    """``run.check_ours_float64`` for one task's update."""
    narrow = f64.jax_float32_values(ours.steps[task], ours.state, samples)
    if narrow:
        raise ReproduceError(f"float64: our {task} update computes in a narrower float: "
                             + "; ".join(narrow))


def task_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task: its steps and the largest relative loss difference over them."""
    out: dict[str, Any] = {}
    for row in rows:
        entry = out.setdefault(row["task"], {"steps": 0, "max_rel_diff": 0.0})
        entry["steps"] += 1
        entry["max_rel_diff"] = max(entry["max_rel_diff"], row["total_rel_diff"])
    return out

