"""Converter of IDC-PCL checkpoints (yaolinli/IDC ``clver/``) into
:mod:`changecap_jax.models.idc_pcl`.

The official files are the pretraining dict ``{"global_step", "model_state_dict",
"task_batch_num"}`` and the fine-tuning ``best_checkpoint.pt``, a bare state_dict; keys may
carry DataParallel's ``module.`` prefix (read by ``convert/torch_checkpoint.py``). The key table
is docs/official/ Appendix C (§6), with Flax paths by :func:`torch_key_to_flax`:

* a numeric segment is joined to the one before it (``layers.0`` -> ``layers_0``,
  ``img_project.0`` -> ``img_project_0``, ``sublayer.1`` -> ``sublayer_1``, ``pooler.0`` ->
  ``pooler_0``, ``net.0`` -> ``net_0``); Linear ``weight`` -> ``kernel`` = weight.T; Embedding
  ``weight`` -> ``embedding`` (``word_embedding``, ``position_encoding.type_pe``); the custom
  LayerNorm's ``a_2`` / ``b_2`` and biases unchanged;
* ``position_encoding.pe`` is a buffer: checked against the table the model computes
  (:func:`changecap_jax.models.idc_pcl.idc_sinusoid_table`, I-Q2), not converted;
* ``feat_regress.weight`` IS ``img_project.0.weight`` (I-Q4): one Flax param,
  ``img_project_0/kernel``; the converter checks that the two are equal;
* the token rows of ``word_embedding`` and ``output_layer`` are reordered from the authors'
  dict.json to the dataset vocabulary (``convert/models/idc_dict_json.py``, ``--dict_json``);
* a pretraining checkpoint converts whole into the pretraining model
  (``config.model.stage = "pretrain"``); into the fine-tuning model it is restored as
  ``finetune.py`` does (§5.4): the pooler and ``feat_regress.*`` are checked and dropped, the
  fine-tuning pooler is initialised as the trainer does.

Official checkpoints convert only into a model that reads its features unscaled
(``image_feature_scale`` 1.0, the paper presets). :func:`load_torch_state_dict` converts a
whole state_dict without a config (the model tests use it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from changecap_jax.convert.errors import ConversionError, WrongModelError
from changecap_jax.convert.model_converter import ModelConverter, zero_batch
from changecap_jax.convert.models.idc_dict_json import dict_json_token_rows
from changecap_jax.convert.tables import (
    COPY,
    TRANSPOSE,
    Dim,
    Entry,
    Sizes,
    Source,
    States,
    Target,
    TokenRows,
    buffer,
    linear,
    require_shape,
)
from changecap_jax.convert.torch_checkpoint import IDC_STATE, read_idc_checkpoint
from changecap_jax.models.idc_pcl import NUM_TYPES, idc_sinusoid_table

_EMBEDDINGS = ("word_embedding.weight", "position_encoding.type_pe.weight")
PE_KEY = "position_encoding.pe"
TIED_KEY = "feat_regress.weight"
# A pretraining checkpoint's keys that the fine-tuning model has no parameter for (§5.4).
_POOLER_SKIPPED = "the official restore skips every 'pooler' key (finetune.py, reference §5.4)"
_HEAD_SKIPPED = "the pretraining MVCL head, not in the fine-tuning model (reference §5.4)"


def torch_key_to_flax(key: str) -> tuple[str, ...] | None:
    """Official key -> Flax param path; None for the ``position_encoding.pe`` buffer (a
    constant). ``feat_regress.weight`` maps to the tied ``img_project_0/kernel``."""
    key = key.removeprefix("module.")
    if key == PE_KEY:
        return None
    if key == TIED_KEY:
        return ("img_project_0", "kernel")
    path = re.sub(r"\.(\d+)(?=\.|$)", r"_\1", key).split(".")
    if key in _EMBEDDINGS:
        return (*path[:-1], "embedding")
    if path[-1] == "weight":
        return (*path[:-1], "kernel")
    return tuple(path)


def load_torch_state_dict(state_dict: Mapping[str, Any]) -> dict:
    """Official state_dict (numpy arrays or torch tensors) -> Flax ``params`` tree.

    Linear weights are transposed; the tied ``feat_regress.weight`` must equal
    ``img_project.0.weight`` and becomes no extra param; ``position_encoding.pe`` must equal
    :func:`idc_sinusoid_table` to 1e-6."""

    def to_numpy(v: Any) -> np.ndarray:
        v = v.detach().cpu().numpy() if hasattr(v, "detach") else v  # torch tensors
        return np.asarray(v, np.float32)

    arrays = {k.removeprefix("module."): to_numpy(v) for k, v in state_dict.items()}
    params: dict = {}
    for key, value in arrays.items():
        path = torch_key_to_flax(key)
        if path is None:
            want = idc_sinusoid_table(value.shape[-2], value.shape[-1])
            if not np.allclose(value.reshape(want.shape), want, atol=1e-6, rtol=0):
                raise ValueError(f"{key} differs from the official sinusoid table")
            continue
        if key == TIED_KEY:
            if not np.array_equal(value, arrays["img_project.0.weight"]):
                raise ValueError("feat_regress.weight is not tied to img_project.0.weight")
            continue
        if path[-1] == "kernel":
            value = value.T
        node = params
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = jnp.asarray(value)
    return params


def sizes_from_states(model: ml_collections.ConfigDict, states: States) -> Sizes:
    """Token rows and feature channels of an IDC-PCL checkpoint; the grid and the caption
    length are not in it (the official 7x7 and 40 stand in)."""
    vocab = require_shape(states, IDC_STATE, "word_embedding.weight", 2)[0]
    channels = require_shape(states, IDC_STATE, "img_project.0.weight", 2)[1]
    return Sizes(vocab, 40, channels, 7, 7, "the checkpoint")


def check_identity(model: ml_collections.ConfigDict, states: States, model_cfg: Any) -> None:
    """An IDC-PCL state_dict, a model that reads its features unscaled, and a pretraining
    checkpoint for the pretraining model."""
    state = states.get(IDC_STATE, {})
    signature = ("word_embedding.weight", "position_encoding.type_pe.weight", "encoder.norm.a_2")
    if not any(k in state for k in signature):
        raise WrongModelError(
            f"the file is not an IDC-PCL checkpoint (yaolinli/IDC, reference §6): it has none "
            f"of {list(signature)} (keys such as {sorted(state)[:4]})")
    scale = model.get("image_feature_scale", 1.0)
    if scale != 1.0:  # type_embedding_std only sets an init, which the import replaces
        raise WrongModelError(
            f"config.model.image_feature_scale is {scale}, but the official model reads its "
            "features unscaled (1.0; the synthetic CPU presets' embedding balance, "
            "models/idc_pcl.py): convert with a paper preset, e.g. "
            "--config=configs/idc_pcl.py:finetune/clevr_change, or set "
            "--config.model.image_feature_scale=1.0")
    if model.stage == "pretrain" and "feat_regress.bias" not in state:
        raise WrongModelError(
            "config.model.stage is 'pretrain' but the file is a fine-tuning checkpoint (no "
            "feat_regress.*, the MVCL head): convert it with "
            "--config=configs/idc_pcl.py:finetune/DATASET")


def _token_rows(model: ml_collections.ConfigDict, sizes: Sizes) -> TokenRows:
    """The token order, after checking that the table can be built for these sizes."""
    tokens = sizes.token_rows
    if tokens is None:
        raise ConversionError("the IDC-PCL key table needs the token order: pass "
                              "--dict_json=PATH (the authors' dict.json)")
    if model.image_dim != sizes.feature_channels:
        raise ConversionError(
            f"config.model.image_dim = {model.image_dim} but the features have "
            f"{sizes.feature_channels} channels ({sizes.origin}): set "
            f"--config.model.image_dim={sizes.feature_channels}")
    return tokens


def _trunk_keys(model: ml_collections.ConfigDict, d: Dim, feat: Dim,
                vocab: Dim) -> list[tuple[str, tuple[Dim, ...]]]:
    """Key and shape of every parameter both stages share, in Appendix C order."""
    ffn = Dim(model.ffn_dim, "FFN width (config.model.ffn_dim)")
    keys: list[tuple[str, tuple[Dim, ...]]] = [
        ("word_embedding.weight", (vocab, d)),
        ("img_project.0.weight", (d, feat)), ("img_project.0.bias", (d,)),
        ("position_encoding.type_pe.weight", (Dim(NUM_TYPES, "type embeddings"), d)),
        ("position_encoding.layernorm.a_2", (d,)), ("position_encoding.layernorm.b_2", (d,)),
    ]
    for name, blocks in (("single_img_encoder", 1), ("double_img_encoder", 1),
                         ("encoder", model.cross_layers)):
        keys += [(f"{name}.norm.a_2", (d,)), (f"{name}.norm.b_2", (d,))]
        for i in range(blocks):
            block = f"{name}.layers.{i}"
            for proj in ("q_linear", "v_linear", "k_linear", "out"):
                keys += [(f"{block}.attn.{proj}.weight", (d, d)),
                         (f"{block}.attn.{proj}.bias", (d,))]
            keys += [(f"{block}.feed_forward.w_1.weight", (ffn, d)),
                     (f"{block}.feed_forward.w_1.bias", (ffn,)),
                     (f"{block}.feed_forward.w_2.weight", (d, ffn)),
                     (f"{block}.feed_forward.w_2.bias", (d,))]
            for j in (0, 1):
                keys += [(f"{block}.sublayer.{j}.norm.a_2", (d,)),
                         (f"{block}.sublayer.{j}.norm.b_2", (d,))]
    return keys + [("output_layer.weight", (vocab, d)), ("output_layer.bias", (vocab,))]


def _trunk(model: ml_collections.ConfigDict, tokens: TokenRows, d: Dim,
           feat: Dim) -> list[Entry]:
    """The entries both stages share, the token rows reordered, the sinusoid buffer checked."""
    vocab = Dim(tokens.checkpoint_rows, f"dict.json size ({tokens.origin})")
    by_tokens = {"word_embedding.weight": tokens.take(),
                 "output_layer.weight": tokens.take(transpose=True),
                 "output_layer.bias": tokens.take()}
    t = []
    for key, dims in _trunk_keys(model, d, feat, vocab):
        path = "/".join(torch_key_to_flax(key))
        transform = by_tokens.get(key, TRANSPOSE if path.endswith("/kernel") else COPY)
        t.append(Entry(IDC_STATE, key, dims, (Target(path, transform),)))
    t[3:3] = buffer(IDC_STATE, PE_KEY,
                    (Dim(1, "batch axis"), Dim(None, "official sinusoid rows (200)"), d),
                    _sinusoid_check)  # Appendix C order
    return t


def _pretraining_head(d: Dim, feat: Dim, pooler_in: Dim, two: Dim) -> list[Entry]:
    """The pretraining model's 3d -> 2 pooler and MVCL head, the tied weight checked."""
    t = linear(IDC_STATE, "pooler.0", "pooler_0", pooler_in, two)
    t.append(Entry(IDC_STATE, TIED_KEY, (d, feat), same_as="img_project.0.weight",
                   dropped="tied: one parameter with img_project.0.weight"))
    t.append(Entry(IDC_STATE, "feat_regress.bias", (feat,),
                   (Target("feat_regress/bias", COPY),)))
    t += linear(IDC_STATE, "feat_regress.net.0", "feat_regress/net_0", d, d)
    for leaf in ("a_2", "b_2"):
        t.append(Entry(IDC_STATE, f"feat_regress.net.2.{leaf}", (d,),
                       (Target(f"feat_regress/net_2/{leaf}", COPY),)))
    return t


def _dropped_pretraining_keys(d: Dim, feat: Dim, pooler_in: Dim, two: Dim) -> list[Entry]:
    """A pretraining checkpoint's pooler and MVCL head, read into the fine-tuning model:
    checked (the tie too), not converted."""
    skipped = [
        ("pooler.0.weight", (two, pooler_in), _POOLER_SKIPPED),
        ("pooler.0.bias", (two,), _POOLER_SKIPPED),
        (TIED_KEY, (d, feat), _HEAD_SKIPPED),
        ("feat_regress.bias", (feat,), _HEAD_SKIPPED),
        ("feat_regress.net.0.weight", (d, d), _HEAD_SKIPPED),
        ("feat_regress.net.0.bias", (d,), _HEAD_SKIPPED),
        ("feat_regress.net.2.a_2", (d,), _HEAD_SKIPPED),
        ("feat_regress.net.2.b_2", (d,), _HEAD_SKIPPED),
    ]
    return [Entry(IDC_STATE, key, dims, dropped=why,
                  same_as="img_project.0.weight" if key == TIED_KEY else None)
            for key, dims, why in skipped]


def table(model: ml_collections.ConfigDict, sizes: Sizes) -> list[Entry]:
    """Appendix C for the model of ``model.stage``, for any sizes. Flax paths
    by :func:`torch_key_to_flax`; the token rows of ``word_embedding`` and ``output_layer`` are
    reordered by ``sizes.token_rows``. For the pretraining model (``model.stage ==
    "pretrain"``) the 3d -> 2 pooler and ``feat_regress`` convert too; for the fine-tuning
    model, a pretraining checkpoint's (``sizes.checkpoint_stage == "pretrain"``) pooler and
    ``feat_regress.*`` are checked but dropped (§5.4)."""
    tokens = _token_rows(model, sizes)
    e = model.hidden_dim
    d = Dim(e, "hidden size (config.model.hidden_dim)")
    feat = Dim(sizes.feature_channels, f"feature channels ({sizes.origin})")
    two = Dim(2, "distractor classes")
    pretraining_pooler = Dim(3 * e, "3 x hidden size (pretraining pooler)")
    t = _trunk(model, tokens, d, feat)
    if model.stage == "pretrain":  # the whole pretraining model
        return t + _pretraining_head(d, feat, pretraining_pooler, two)
    if sizes.checkpoint_stage != "pretrain":
        return t + linear(IDC_STATE, "pooler.0", "pooler_0",
                          Dim(2 * e, "2 x hidden size (fine-tuning pooler)"), two)
    return t + _dropped_pretraining_keys(d, feat, pretraining_pooler, two)


def _sinusoid_check(pe: np.ndarray) -> str | None:
    want = idc_sinusoid_table(pe.shape[1], pe.shape[2])
    diff = float(np.max(np.abs(pe[0] - want))) if pe.size else 0.0
    if not np.isfinite(diff) or diff > 1e-6:
        return (f"the buffer differs from the IDC sinusoid table the Flax model computes (max "
                f"|diff| {diff:.3g} > 1e-06, reference I-Q2)")
    return None


def fresh_params(model: ml_collections.ConfigDict, sizes: Sizes) -> tuple[str, ...]:
    """From a pretraining checkpoint the fine-tuning pooler stays fresh (§5.4)."""
    fresh = sizes.checkpoint_stage == "pretrain" and model.stage == "finetune"
    return ("pooler_0/bias", "pooler_0/kernel") if fresh else ()


def example_batch(model: Any, sizes: Sizes) -> dict[str, np.ndarray]:
    """Zeros in the layout of the fine-tuning model's streams."""
    return zero_batch(model, sizes)


def init_inputs(model: Any, sizes: Sizes) -> tuple[tuple, dict[str, Any]]:
    """``model.init`` arguments: the pretraining model initialises through ``pretrain``."""
    if model.stage != "pretrain":
        return (example_batch(model, sizes),), {"train": False}
    grid = np.zeros((1, sizes.grid_height, sizes.grid_width, sizes.feature_channels), np.float32)
    return (grid, grid, np.zeros((1, sizes.max_len), np.int32)), {"method": "pretrain"}


def vocab_size_of_params(params: Any) -> int:
    """word_embedding rows = the vocabulary + the appended [MASK] and [CLS]."""
    return int(params["word_embedding"]["embedding"].shape[0]) - 2


CONVERTER = ModelConverter(
    name="idc_pcl",
    title="IDC-PCL (yaolinli/IDC)",
    sources=(Source(IDC_STATE, True, "the model's state_dict (the pretraining checkpoint's "
                    "model_state_dict or the fine-tuning best_checkpoint.pt)"),),
    table=table,
    sizes_from_states=sizes_from_states,
    check_identity=check_identity,
    example_batch=example_batch,
    vocab_size_of_params=vocab_size_of_params,
    read_snapshot=read_idc_checkpoint,
    fresh_params=fresh_params,
    token_rows=dict_json_token_rows,
    init_inputs=init_inputs,
)
