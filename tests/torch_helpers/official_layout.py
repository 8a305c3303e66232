"""A stand-in for an official checkout (tuyunbin/DIRL, tuyunbin/SCORER) built on the project's
torch reference, for testing ``python -m changecap_jax reproduce`` where the official code is
absent (CI).

:func:`write_checkout` lays out the files the command imports, as the official repositories
name them: ``configs/config_transformer.py`` (a ``cfg`` with ``merge_cfg_from_file`` and
``merge_cfg_from_list``), ``configs/dynamic/*.yaml`` (the training values of the shipped yamls),
``utils/utils.py`` (``build_optimizer``, ``CrossEn``) and ``models/*.py``. Each file is one
import from here: classes that take the official ``cfg`` and keep the official call signatures
and return tuples (``DIRL(cfg)(x1, x2) -> (diff_bef, diff_aft, loss)``, ``CCR._forward``,
``ChangeDetector``, ``Speaker._forward``, ``CBR``), over the package's torch reference
(:mod:`tools.torch_reference.dirl` and
:mod:`tools.torch_reference.scorer`).
Like the official encoders, the grid position tables have 14 rows. Unlike the official CBR (512
channels, 8 heads, 14x14 grid), the stand-in takes the cfg's sizes, so tests run tiny. Nothing
here is official code; the behaviour is the reference document's.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from tools.torch_reference import dirl as tdirl
from tools.torch_reference import scorer as tscorer
from tools.torch_reference.idc_pcl import IDCPCL

from .snapshot import AttrDict

GRID_ROWS = 14  # nn.Embedding(14, att_dim / 2) in the official encoders


def default_cfg() -> AttrDict:
    """The keys of ``configs/config_transformer.py`` that the command reads or sets, with the
    file's defaults (the yamls override the training ones)."""
    def node(**kw: Any) -> AttrDict:
        return AttrDict(kw)

    return node(
        model=node(
            transformer_encoder=node(feat_dim=1026, att_dim=512, emb_dim=512, att_head=8,
                                     att_layer=2),
            transformer_decoder=node(word_dim=512, att_dim=512, att_head=8, att_layer=2,
                                     vocab_size=76, seq_length=23)),
        train=node(grad_clip=1.0, optim=node(type="sgdmom", lr=0.01, alpha=0.9, beta=0.999,
                                             epsilon=1e-8, weight_decay=5e-4, step_size=15,
                                             gamma=0.1)))


def _merge(cfg: AttrDict, values: dict, where: str = "") -> None:
    for key, value in values.items():
        if key not in cfg:
            raise KeyError(f"Non-existent config key: {where}{key}")
        if isinstance(value, dict):
            _merge(cfg[key], value, f"{where}{key}.")
        else:
            cfg[key] = type(cfg[key])(value)


def merge_file(cfg: AttrDict, path: str) -> None:
    with open(path) as f:
        _merge(cfg, yaml.safe_load(f))


def merge_list(cfg: AttrDict, items: list[Any]) -> None:
    for key, value in zip(items[0::2], items[1::2], strict=True):
        if isinstance(value, str):
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                pass
        *parents, last = key.split(".")
        node = cfg
        for part in parents:
            node = node[part]
        _merge(node, {last: value}, ".".join(parents) + ".")


def build_optimizer(params: list[nn.Parameter], cfg: AttrDict) -> torch.optim.Optimizer:
    o = cfg.train.optim
    if o.type != "adam":
        raise ValueError(f"the stand-in builds Adam only, got {o.type!r}")
    return torch.optim.Adam(params, o.lr, (o.alpha, o.beta), o.epsilon,
                            weight_decay=o.weight_decay)


class CrossEn(nn.Module):
    def forward(self, sim: torch.Tensor) -> torch.Tensor:
        return tscorer.row_cross_entropy(sim)


class AddSpatialInfo(nn.Module):
    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return tscorer.add_spatial_info(feats)


def _encoder_sizes(cfg: AttrDict) -> dict[str, int]:
    e = cfg.model.transformer_encoder
    return dict(feat_dim=e.feat_dim, att_dim=e.att_dim, att_head=e.att_head,
                num_layers=e.att_layer, grid_size=GRID_ROWS)


def _decoder_sizes(cfg: AttrDict) -> dict[str, int]:
    d = cfg.model.transformer_decoder
    return dict(vocab_size=d.vocab_size, seq_length=d.seq_length, word_dim=d.word_dim,
                att_dim=d.att_dim, att_head=d.att_head, num_layers=d.att_layer)


class DIRL(tdirl.DIRL):
    def __init__(self, cfg: AttrDict) -> None:
        sizes = _encoder_sizes(cfg)
        super().__init__(mlp_dim=4 * sizes["att_dim"], **sizes)

    def forward(self, input_1: torch.Tensor, input_2: torch.Tensor) -> tuple:
        out = super().forward(input_1, input_2)
        return out.diff_bef, out.diff_aft, out.dirl_loss


class _CCR(tdirl.CCRSpeaker):
    VARIANT = ""

    def __init__(self, cfg: AttrDict) -> None:
        sizes = _decoder_sizes(cfg)
        super().__init__(self.VARIANT, ffn_dim=4 * sizes["att_dim"], **sizes)

    def _forward(self, diff_bef: torch.Tensor, diff_aft: torch.Tensor, seq: torch.Tensor,
                 mask: torch.Tensor, labels_with_ignore: torch.Tensor) -> tuple:
        out = self(diff_bef, diff_aft, seq, mask)
        return tscorer.caption_cross_entropy(out.logits, labels_with_ignore), None, out.ccr_loss


class CCRNoInit(_CCR):  # models/CCR_no_init.py (CLEVR-Change)
    VARIANT = "clevr_change"


class CCRDC(_CCR):  # models/CCR.py (CLEVR-DC)
    VARIANT = "clevr_dc"


class ChangeDetector(tscorer.ChangeDetector):
    def __init__(self, cfg: AttrDict) -> None:
        super().__init__(**_encoder_sizes(cfg))

    def forward(self, input_1: torch.Tensor, input_2: torch.Tensor) -> tuple:
        out = super().forward(input_1, input_2)
        return out.memory, out.sim_bef, out.sim_aft, out.input_bef, out.input_aft


class Speaker(tscorer.Speaker):
    def __init__(self, cfg: AttrDict) -> None:
        super().__init__(**_decoder_sizes(cfg))

    def _forward(self, encoder_output: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor,
                 labels_with_ignore: torch.Tensor) -> tuple:
        logits, hidden = self(encoder_output, seq, mask)
        return tscorer.caption_cross_entropy(logits, labels_with_ignore), logits, None, hidden


class CBR(tscorer.CBR):
    def __init__(self, cfg: AttrDict) -> None:
        e = cfg.model.transformer_encoder
        super().__init__(att_dim=e.att_dim, att_head=e.att_head)


# ---------------------------------------------------------------------------------------------
# The checkout on disk
# ---------------------------------------------------------------------------------------------

CONFIG_MODULE = """from torch_helpers import official_layout as _layout

cfg = _layout.default_cfg()


def merge_cfg_from_file(path):
    _layout.merge_file(cfg, path)


def merge_cfg_from_list(items):
    _layout.merge_list(cfg, items)
"""
TRAIN = {"grad_clip": -1.0, "optim": {"type": "adam", "lr": 0.0002, "weight_decay": 0.0}}
YAMLS = {  # the shipped yamls' model sizes and training values
    "transformer_clevr_change.yaml": (1026, 76, 24), "transformer_dc.yaml": (1024, 87, 40),
    "transformer.yaml": (1026, 76, 24)}
MODULES = {
    "dirl": {"models/DIRL.py": "DIRL, AddSpatialInfo",
             "models/CCR_no_init.py": "CCRNoInit as CCR", "models/CCR.py": "CCRDC as CCR"},
    "scorer": {"models/SCORER.py": "ChangeDetector, AddSpatialInfo",
               "models/transformer_decoder.py": "Speaker", "models/CBR.py": "CBR"},
}
REPO_YAMLS = {"dirl": ("transformer_clevr_change.yaml", "transformer_dc.yaml"),
              "scorer": ("transformer.yaml",)}


def _yaml_text(feat_dim: int, vocab: int, seq_length: int) -> str:
    return yaml.safe_dump({
        "model": {"transformer_encoder": {"feat_dim": feat_dim, "att_dim": 512},
                  "transformer_decoder": {"word_dim": 300, "vocab_size": vocab,
                                          "seq_length": seq_length}},
        "train": TRAIN})


def write_checkout(root: Path, model: str) -> Path:
    """Writes the stand-in checkout of ``model`` ("dirl" or "scorer") under ``root``."""
    files = {"configs/config_transformer.py": CONFIG_MODULE, "utils/__init__.py": "",
             "utils/utils.py": "from torch_helpers.official_layout import build_optimizer, "
                               "CrossEn  # noqa: F401\n"}
    for name in REPO_YAMLS[model]:
        files[f"configs/dynamic/{name}"] = _yaml_text(*YAMLS[name])
    for path, names in MODULES[model].items():
        files[path] = f"from torch_helpers.official_layout import {names}  # noqa: F401\n"
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def real_checkout(model: str) -> Path:
    """The real official checkout of ``model`` named by ``CHANGECAP_OFFICIAL_DIRL`` /
    ``_SCORER`` / ``_IDC`` / ``_MEDIC``; skips the calling test when the variable is unset."""
    import os

    import pytest

    variable = f"CHANGECAP_OFFICIAL_{model.upper()}"
    checkout = os.environ.get(variable)
    if not checkout:
        repository = {"dirl": "tuyunbin/DIRL", "scorer": "tuyunbin/SCORER",
                      "idc": "yaolinli/IDC", "medic": "VisualAIKHU/MEDIC"}[model]
        pytest.skip(f"no official checkout: set {variable}=PATH to a clone of {repository} "
                    "to run this")
    return Path(checkout)


# ---------------------------------------------------------------------------------------------
# yaolinli/IDC (clver/), over the test reference tools/torch_reference/idc_pcl.py
# ---------------------------------------------------------------------------------------------

IDC_SETTINGS = {  # clver/config/finetune_clver.json's training values
    "n_embs": 512, "img_embs": 2048, "dim_ff": 2048, "n_head": 8, "n_block": 3,
    "weight_decay": 0.0, "lr": 3e-5, "batch_size": 200, "dropout": 0.2, "max_len": 40}
IDC_PARA = '''import argparse
import json
import sys


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--warmup_steps", type=int, default=4000)
    parser.add_argument("--tmp", type=float, default=1.0)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--exp_name", required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    given = {a[2:].split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
    for key, value in json.load(open(args.config)).items():
        if key not in given:
            setattr(args, key, value)
    return args
'''
IDC_UTILS = '''from para import parse_args

args = parse_args()  # as the official utils.py, at import


def finetune_lr_schedule(global_step, lr):
    return lr if global_step < 10000 else lr / 2 if global_step < 20000 else lr / 4


def noam_schedule(step, warmup_step=4000):
    return step / warmup_step if step <= warmup_step else (warmup_step / step) ** 0.5


def get_lr_sched(global_step, args, pretrain=True):
    if pretrain:
        return args.lr * noam_schedule(global_step, args.warmup_steps) or 1e-8
    return finetune_lr_schedule(global_step, args.lr)
'''
IDC_MODULES = "from torch_helpers.official_layout import IdcFinetuneModel as Model  # noqa\n"
IDC_PRETRAIN_SETTINGS = {  # clver/config/pretrain_clver.json's training values
    **IDC_SETTINGS, "lr": 1e-4, "warmup_steps": 8000, "tmp": 1.0,
    "pretrain_tasks": ["mlm", "mvm_contrst", "fda"]}
IDC_PRETRAIN_MODULES = ("from torch_helpers.official_layout import IdcPretrainModel as Model"
                        "  # noqa\n")


class IdcFinetuneModel(IDCPCL):
    """``clver/modules_finetune.py``'s ``Model`` signature and ``forward(batch)`` over the test
    reference: (per-token MLM CE at labelled positions, per-sample distractor CE)."""

    def __init__(self, ff_dim: int, img_embs: int, n_hidden: int, n_head: int, n_block: int,
                 img_enc_block: int, vocab_size: int, dropout: float, max_len: int,
                 CLS: int) -> None:  # noqa: N803 (the official name)
        super().__init__(vocab_size, CLS, "finetune", n_hidden, img_embs, ff_dim, n_head,
                         n_block, dropout)

    def forward(self, batch: dict, compute_loss: bool = True) -> tuple:
        import torch.nn.functional as F

        out = self.finetune_forward(batch["img1"], batch["img2"], batch["cap"])
        labels = batch["cap_label"]
        keep = labels != -1
        mlm = F.cross_entropy(out.mlm_logits[keep], labels[keep], reduction="none")
        itm = F.cross_entropy(out.distractor_logits, batch["diff_label"].view(-1),
                              reduction="none")
        return mlm, itm


class IdcPretrainModel(IDCPCL):
    """``clver/modules_pretrain.py``'s ``Model`` signature and ``forward(batch, task)`` over
    the test reference: (per-token MLM CE, per-region MVCL NCE, or the FDA mean), None."""

    def __init__(self, ff_dim: int, img_embs: int, n_hidden: int, n_head: int, n_block: int,
                 img_enc_block: int, vocab_size: int, dropout: float, max_len: int,
                 tasks: list, tmp: float, CLS: int) -> None:  # noqa: N803 (the official name)
        super().__init__(vocab_size, CLS, "pretrain", n_hidden, img_embs, ff_dim, n_head,
                         n_block, dropout)
        self.fda_tmp = tmp

    def forward(self, batch: dict, task: str, compute_loss: bool = True) -> tuple:
        from tools.torch_reference.idc_pcl import fda_loss, mlm_token_losses, mvcl_loss

        img1, img2 = batch["img1"], batch["img2"]
        if task == "fda":
            caps = batch["caps"]
            group = caps.size(1)
            out = self.pretrain_forward(img1.repeat_interleave(group, 0),
                                        img2.repeat_interleave(group, 0),
                                        caps.view(-1, caps.size(-1)))
            return fda_loss(out.visual, out.text_cls, group, self.fda_tmp), None
        out = self.pretrain_forward(img1, img2, batch["cap"])
        if task == "mlm":
            return mlm_token_losses(out.mlm_logits, batch["cap_label"]), None
        return mvcl_loss(out.regressed, batch["img_mask"], batch["img_label"]), None


def write_idc_checkout(root: Path) -> Path:
    """The stand-in of yaolinli/IDC's ``clver/`` files that reproduce imports."""
    import json

    files = {"clver/para.py": IDC_PARA, "clver/utils.py": IDC_UTILS,
             "clver/modules_finetune.py": IDC_MODULES,
             "clver/config/finetune_clver.json": json.dumps(IDC_SETTINGS),
             "clver/modules_pretrain.py": IDC_PRETRAIN_MODULES,
             "clver/config/pretrain_clver.json": json.dumps(IDC_PRETRAIN_SETTINGS)}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root
