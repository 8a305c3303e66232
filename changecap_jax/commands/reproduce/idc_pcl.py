"""What ``reproduce`` knows about yaolinli/IDC: IDC-PCL fine-tuning as ``clver/finetune.py``
trains it (docs/official/ §5.4-§5.6, quirk ids I-Q there).

The official side is ``clver/modules_finetune.py``'s ``Model``, built with the config's sizes
over the trunk vocabulary (its [MASK] and [CLS] rows appended, as our model has them), so the
two state_dicts match key for key without the authors' dict.json. The optimiser is
``finetune.py``'s: ``torch.optim.Adam(lr, weight_decay)`` with the values of
``clver/config/finetune_clver.json`` (``--official_cfg=lr=0.0005`` changes one), and the lr of
each step from ``utils.finetune_lr_schedule`` (halved at 10k and 20k steps), set before
``optimizer.step()`` as the loop does. The loss is the loop's ``mlm_loss.sum() +
itm_loss.sum()``.

The official dataset masks each caption in its loader (``mask_sent``, python ``random``); here
both sides read the masks our train step draws (``IDCPCL.masked_captions`` with the step's
``"inputs"`` rng), so they see the same masked words. An example of ours gives two official
samples: its semantic pair (distractor label 1) and its distractor pair (label 0), each with
its own caption; the official batch holds all semantic rows, then all distractor rows.

The CPU presets' embedding balance (``image_feature_scale``, ``type_embedding_std``;
models/idc_pcl.py) is applied to the official modules from outside: the features are
multiplied by the scale before they reach ``img_project``, and ``type_pe``'s N(0, 1)
initialisation is multiplied by the std. Both are said in the notes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from changecap_jax import models
from changecap_jax.commands.reproduce import official as off
from changecap_jax.commands.reproduce.adapters import (
    Adapter,
    OfficialModel,
    OfficialSide,
    ReproduceError,
    disable_dropout,
)
from changecap_jax.convert import tables
from changecap_jax.convert.torch_checkpoint import IDC_STATE
from changecap_jax.data import streams as stream_fields
from changecap_jax.models.idc_pcl import idc_sinusoid_table

FOLDER = "clver"  # the CLEVR-Change code of the checkout
SETTINGS = "clver/config/finetune_clver.json"  # finetune.py's --config
MODULES = ("para", "utils", "modules_finetune")  # utils imports para at import time
WEIGHTS = {"distractor": 1.0}  # finetune.py: loss = mlm_loss + itm_loss
# What the trunk's fine-tuning model must be for the official Model to build and train it.
OFFICIAL_MODEL = {"stage": "finetune", "pairs": "both", "use_difference_encoder": True,
                  "distractor_judging": True, "loss_reduction": "sum",
                  "word_mask_probability": 0.15, "eos_mask_probability": 0.15}


def script_argv(root: Path, overrides: list[tuple[str, Any]] = ()) -> list[str]:
    """finetune.py's command line: its required flags, the json config, then each
    ``--official_cfg`` KEY=VALUE as ``--KEY=VALUE`` (para.py lets those win over the json)."""
    settings = root / SETTINGS
    if not settings.is_file():
        raise off.OfficialCheckoutError(f"{root} lacks the official config {SETTINGS}")
    return ["finetune.py", "--dataset=clver", "--exp_name=reproduce", f"--config={settings}",
            *(f"--{key}={value}" for key, value in overrides)]


@contextlib.contextmanager
def as_script(argv: list[str]) -> Iterator[None]:
    """``clver/utils.py`` parses ``sys.argv`` and seeds ``random`` / ``np.random`` when it is
    imported: give it ``argv`` and put both generators back after."""
    saved, py_state, np_state = sys.argv, random.getstate(), np.random.get_state()
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved
        random.setstate(py_state)
        np.random.set_state(np_state)


def official_args(lib: dict[str, Any], argv: list[str]) -> Any:
    """The official ``args`` (``para.parse_args()``) of ``argv``; a bad flag is one line."""
    with as_script(argv), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            return lib["para"].parse_args()
        except SystemExit as e:
            lines = err.getvalue().strip().splitlines()
            raise ReproduceError(f"--official_cfg: clver/para.py refused {argv[4:]}: "
                                 f"{lines[-1] if lines else e}") from None


@functools.lru_cache(maxsize=4)
def _masker(model: Any) -> Any:
    """``model.masked_captions`` (no parameters needed), jitted once per model."""
    return jax.jit(lambda batch, key: model.apply({"params": {}}, batch,
                                                  method="masked_captions",
                                                  rngs={"inputs": key}))


class IdcPclAdapter(Adapter):
    """yaolinli/IDC ``clver/finetune.py`` (fine-tuning, both pairs, summed losses)."""

    name = "idc_pcl"
    repository = "yaolinli/IDC"
    fixed_widths = ("clver/modules_finetune.py has 7 type embeddings and 200 sinusoid rows; "
                    "the image tokens are the grid's cells, row-major")
    snapshot_sources = (IDC_STATE,)

    def script(self, model: ml_collections.ConfigDict) -> str:
        return "clver/finetune.py"

    def yaml(self, model: ml_collections.ConfigDict) -> str:
        return SETTINGS

    def module_names(self, model: ml_collections.ConfigDict) -> tuple[str, ...]:
        return MODULES

    def import_lib(self, root: Path, model: ml_collections.ConfigDict) -> dict[str, Any]:
        with as_script(script_argv(root)):
            return off.import_official(root / FOLDER, MODULES, packages=())

    def official_weights(self, model: ml_collections.ConfigDict) -> dict[str, float]:
        return dict(WEIGHTS)

    def fit_config(self, config: ml_collections.ConfigDict) -> list[str]:
        m = config.model
        wrong = {k: m.get(k) for k, v in OFFICIAL_MODEL.items() if m.get(k) != v}
        if wrong:
            raise ReproduceError(f"the official clver/finetune.py trains {OFFICIAL_MODEL}; the "
                                 f"config has {wrong}")
        notes = []
        if m.image_feature_scale != 1.0:
            notes.append(f"model.image_feature_scale = {m.image_feature_scale}: the official "
                         "modules read the features multiplied by it (the preset's embedding "
                         "balance, applied from outside)")
        if m.type_embedding_std != 1.0:
            notes.append(f"model.type_embedding_std = {m.type_embedding_std}: the official "
                         "type_pe's N(0, 1) initialisation is multiplied by it")
        return notes

    def fit_sizes(self, sizes: tables.Sizes, model: Any) -> tables.Sizes:
        """The official modules are built over our token rows: the identity order."""
        rows = tables.TokenRows(tuple(range(model.num_tokens)), model.num_tokens,
                                "the trunk vocabulary (the official modules are built with it)")
        return dataclasses.replace(sizes, token_rows=rows)

    def build_side(self, config: ml_collections.ConfigDict, root: Path, lib: dict[str, Any],
                   sizes: tables.Sizes, official_cfg: list[tuple[str, Any]],
                   steps_per_epoch: int) -> OfficialSide:
        """finetune.py: ``torch.manual_seed(args.seed)``, ``Model(...)``, Adam, the lr per
        step from ``finetune_lr_schedule``."""
        import torch

        args = official_args(lib, script_argv(root, official_cfg))
        m = config.model
        ours = models.build(m, vocab_size=sizes.vocab_size, max_len=sizes.max_len)
        torch.manual_seed(config.seed)  # finetune.py seeds torch with args.seed (1234)
        module = lib["modules_finetune"].Model(
            ff_dim=m.ffn_dim, img_embs=sizes.feature_channels, n_hidden=m.hidden_dim,
            n_head=m.num_heads, n_block=m.cross_layers, img_enc_block=1,
            vocab_size=ours.num_tokens, dropout=m.dropout_rate, max_len=sizes.max_len,
            CLS=ours.cls_token)
        if m.type_embedding_std != 1.0:
            with torch.no_grad():
                module.position_encoding.type_pe.weight.mul_(m.type_embedding_std)
        disable_dropout([module])
        model = OfficialModel({"model": module}, None, lib, dict(WEIGHTS), ("model",))
        optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad],
                                     lr=args.lr, weight_decay=args.weight_decay)
        return OfficialSide(self, model, args, optimizer, None, steps_per_epoch,
                            lr_at=lambda step: lib["utils"].get_lr_sched(step, args,
                                                                         pretrain=False))

    def parse_official_cfg(self, text: str) -> tuple[str, Any]:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ReproduceError(f"--official_cfg takes KEY=VALUE, a flag of clver/para.py "
                                 f"(e.g. lr=0.0005), got {text!r}")
        return key.strip(), value.strip()

    def clip(self, side: OfficialSide) -> None:
        """finetune.py does not clip."""

    def torch_batch(self, batch: dict[str, np.ndarray], model: Any, streams: tuple[str, ...],
                    spatial_info: Any | None, inputs_key: Any) -> dict[str, Any]:
        """The official loader's dict: img1, img2 (B', N, C) tokens, the masked caption
        ``cap``, its ``cap_label`` (-1 = no loss) and ``diff_label`` (B', 1)."""
        import torch

        masked = jax.device_get(_masker(model)(batch, inputs_key))
        scale = np.asarray(model.image_feature_scale, batch["before"].dtype)

        def tokens(x: np.ndarray) -> np.ndarray:
            return (x.reshape(x.shape[0], -1, x.shape[-1]) * scale).astype(x.dtype)

        before = tokens(batch["before"])
        rows = {"img1": [], "img2": [], "cap": [], "cap_label": [], "diff_label": []}
        for stream in streams:
            fields = stream_fields.STREAMS[stream]
            ids, labels = (np.asarray(a, np.int64) for a in masked[stream])
            rows["img1"].append(before)
            rows["img2"].append(tokens(batch[fields.after]))
            rows["cap"].append(ids)
            rows["cap_label"].append(labels)
            rows["diff_label"].append(np.full((len(ids), 1), fields.distractor_label, np.int64))
        return {k: torch.from_numpy(np.ascontiguousarray(np.concatenate(v)))
                for k, v in rows.items()}

    def losses(self, official: OfficialModel, batch: dict[str, Any]) -> dict[str, Any]:
        """finetune.py's loop body: the summed per-token MLM and per-sample distractor CEs."""
        mlm, itm = official.modules["model"](batch, compute_loss=True)
        caption, distractor = mlm.sum(), itm.sum()
        return {"caption": caption, "distractor": distractor, "total": caption + distractor}

    def pe_table(self, shape: tuple[int, ...]) -> np.ndarray:
        return idc_sinusoid_table(shape[-2], shape[-1], np.float64).reshape(shape)

    def sources(self, official: OfficialModel) -> dict[str, Any]:
        return {IDC_STATE: official.modules["model"]}

    def differences(self, config: ml_collections.ConfigDict, cfg: Any) -> list[str]:
        o = config.optim
        out = []
        for ours, value, theirs in (("learning_rate", o.learning_rate, "lr"),
                                    ("weight_decay", o.get("weight_decay", 0.0),
                                     "weight_decay")):
            official = float(getattr(cfg, theirs))
            if not np.isclose(float(value), official, rtol=1e-12, atol=0):
                out.append(f"optim.{ours} = {value}, official {theirs} = {official} "
                           f"({SETTINGS}; --official_cfg={theirs}=VALUE sets it)")
        adam = {"b1": 0.9, "b2": 0.999, "eps": 1e-8}  # torch.optim.Adam's defaults
        out += [f"optim.{k} = {o[k]}, official torch.optim.Adam default {v}"
                for k, v in adam.items() if float(o[k]) != v]
        official_steps = (o.get("schedule") == "piecewise" and tuple(o.boundaries) ==
                          (10_000, 20_000) and o.decay_factor == 0.5)
        if not official_steps:
            out.append("the official lr is halved at steps 10,000 and 20,000 "
                       "(utils.finetune_lr_schedule); the config's schedule is "
                       f"{o.get('schedule')!r}, equal to it only on shorter runs if constant")
        return out
