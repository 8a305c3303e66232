"""Per-model key tables: official torch state_dict key -> Flax param path(s) and transform.

A table is a list of :class:`Entry`, built from the model config and the data-dependent
:class:`Sizes` (vocabulary, feature channels, grid, caption length), so every entry knows the
torch shape it expects and what decides each axis (used in error messages). The transforms are
the conversion rules of ``docs/official/common.md`` §1.1 (other § and Appendices: same folder):

* ``nn.Linear`` weight (out, in) -> Dense ``kernel`` (in, out) = transpose; bias unchanged;
* 1x1 ``nn.Conv2d`` weight (out, in, 1, 1) -> Dense ``kernel`` = W[:, :, 0, 0].T (our models
  apply the 1x1 convs as a Dense over the channels of channels-last grids, §7 item 1);
* ``nn.MultiheadAttention`` ``in_proj_weight`` (3E, E) -> rows [0:E] / [E:2E] / [2E:3E] as the
  ``q_proj`` / ``k_proj`` / ``v_proj`` kernels (transposed); ``in_proj_bias`` thirds -> their
  biases; ``out_proj.weight/bias`` -> ``out_proj`` kernel (transposed) / bias;
* ``nn.LayerNorm`` weight/bias -> ``scale`` / ``bias``; ``nn.Embedding`` weight ->
  ``embedding`` unchanged; scalar parameters (shape ()) stay 0-d;
* registered buffers (the sinusoid ``core.position_enc.pe``, §7 item 3) map to no parameter:
  our models recompute them, so the converter checks that the stored values equal ours.

Each model registers a :class:`ModelSpec` in :data:`SPECS` under its ``config.model.name``:
its table builder, how to read its sizes from a snapshot, how to recognise its snapshots, and
an example batch for shape inference. Supported: DIRL+CCR (Appendix B, both decoder variants of
§4.2 / §4.5), SCORER+CBR (Appendix A) and IDC-PCL (§6, Appendix C: its own file format, the
custom LayerNorm's ``a_2`` / ``b_2`` copied, the ``position_encoding.pe`` buffer checked, the
tied ``feat_regress.weight`` checked equal to ``img_project.0.weight``, token rows reordered from
the authors' dict.json by :func:`dict_json_token_rows`; a pretraining checkpoint's pooler and
``feat_regress.*`` are dropped and the fine-tuning pooler initialised, as finetune.py restores
it, §5.4; into the pretraining model, ``config.model.stage = "pretrain"``, it converts
whole). SCORER's CBR is a third, non-official :class:`Source` ``"generator"`` (reference
S-Q1: never in the official snapshot); the converter
reads it from ``--extra_params`` (a bare torch state_dict, ``generator.state_dict()``) or
initialises it with ``--missing=init`` (listed in the report). A model whose Flax parameters
are not all listed in its table gets the rest through the same ``--missing`` policy.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from changecap_jax.convert.errors import ConversionError, KeyMismatchError, WrongModelError
from changecap_jax.convert.torch_checkpoint import (
    IDC_STATE,
    OfficialSnapshot,
    read_idc_checkpoint,
    read_official_snapshot,
)

States = Mapping[str, Mapping[str, np.ndarray]]  # source name -> {torch key: array}

ENCODER = "change_detector_state"  # official snapshot keys (§3.6, §4.5)
DECODER = "speaker_state"


# ---------------------------------------------------------------------------------------------
# Table entries
# ---------------------------------------------------------------------------------------------


class Dim(NamedTuple):
    """One torch axis: its expected size (None = any) and what decides it."""

    size: int | None
    label: str


@dataclasses.dataclass(frozen=True)
class Transform:
    """torch array -> Flax array; ``name`` is shown by :func:`format_table`."""

    name: str
    fn: Callable[[np.ndarray], np.ndarray]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        # np.array, not np.ascontiguousarray: the latter turns a 0-d scalar into shape (1,).
        return np.array(self.fn(x), order="C")


COPY = Transform("copy", lambda x: x)
TRANSPOSE = Transform("transpose", lambda x: x.T)
CONV1X1 = Transform("[:, :, 0, 0].T", lambda x: x[:, :, 0, 0].T)
SCALAR = Transform("0-d", lambda x: x.reshape(()))


def in_proj_part(index: int, embed_dim: int, *, weight: bool) -> Transform:
    """Rows ``index*E:(index+1)*E`` of a stacked ``in_proj_weight`` (transposed) or bias."""
    lo, hi = index * embed_dim, (index + 1) * embed_dim
    if weight:
        return Transform(f"rows {lo}:{hi}, transpose", lambda x: x[lo:hi].T)
    return Transform(f"[{lo}:{hi}]", lambda x: x[lo:hi])


@dataclasses.dataclass(frozen=True)
class Target:
    path: str  # Flax param path, "/"-separated, e.g. "encoder/img/kernel"
    transform: Transform


@dataclasses.dataclass(frozen=True)
class Entry:
    """One torch tensor: where it comes from, its expected shape, where it goes.

    ``targets`` is empty for a buffer and for a ``dropped`` key (read and checked, not
    converted; the string says why); ``check`` (buffers) returns an error message or None;
    ``same_as`` names a key of the same source this tensor must equal (a tied weight).
    """

    source: str
    key: str
    dims: tuple[Dim, ...]
    targets: tuple[Target, ...] = ()
    check: Callable[[np.ndarray], str | None] | None = None
    same_as: str | None = None
    dropped: str = ""

    @property
    def shape(self) -> tuple[int | None, ...]:
        return tuple(d.size for d in self.dims)

    @property
    def name(self) -> str:
        return f"{self.source}:{self.key}"

    def shape_matches(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.dims) and all(
            d.size is None or d.size == s for d, s in zip(self.dims, shape, strict=True))


@dataclasses.dataclass(frozen=True)
class Source:
    """A state_dict of the checkpoint; ``official=False``: the official snapshot lacks it."""

    name: str
    official: bool
    description: str


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The data-dependent sizes of a model.

    ``feature_channels`` excludes the coordinate channels AddSpatialInfo adds (§2.3);
    ``origin`` says where the sizes come from (the config's dataset or the checkpoint).
    Two more things a table can depend on, set by the converter: ``checkpoint_stage``, the
    official training stage that wrote the file where its format tells (IDC-PCL: "pretrain"
    or "finetune"), and ``token_rows``, the order of the token rows where the checkpoint's ids
    follow another vocabulary file (IDC-PCL's dict.json).
    """

    vocab_size: int
    max_len: int
    feature_channels: int
    grid_height: int
    grid_width: int
    origin: str
    checkpoint_stage: str | None = None
    token_rows: TokenRows | None = None


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Our token row r is the checkpoint's row ``rows[r]`` (:func:`dict_json_token_rows`)."""

    rows: tuple[int, ...]
    checkpoint_rows: int  # token rows of the checkpoint (|dict.json|)
    origin: str  # the vocabulary file
    dropped: tuple[str, ...] = ()  # checkpoint tokens with no row of ours, in id order

    def take(self, *, transpose: bool = False) -> Transform:
        """Rows of a (V, ...) matrix or (V,) vector in our order (then transposed)."""
        rows = np.asarray(self.rows)
        if transpose:
            return Transform(f"rows by {self.origin}, transpose", lambda x: x[rows].T)
        return Transform(f"rows by {self.origin}", lambda x: x[rows])


def fmt_shape(shape: Sequence[int | None]) -> str:
    inner = ", ".join("*" if s is None else str(s) for s in shape)
    return f"({inner}{',' if len(shape) == 1 else ''})"


# Builders for the usual torch modules. d_in / d_out are Dims.


def linear(source: str, key: str, path: str, d_in: Dim, d_out: Dim, *,
           bias: bool = True) -> list[Entry]:
    """``nn.Linear``: weight (out, in) -> kernel (in, out); bias."""
    out = [Entry(source, f"{key}.weight", (d_out, d_in), (Target(f"{path}/kernel", TRANSPOSE),))]
    if bias:
        out.append(Entry(source, f"{key}.bias", (d_out,), (Target(f"{path}/bias", COPY),)))
    return out


def conv1x1(source: str, key: str, path: str, d_in: Dim, d_out: Dim) -> list[Entry]:
    """1x1 ``nn.Conv2d`` applied as a Dense over channels (§1.1, §7 item 1)."""
    one = Dim(1, "1x1 kernel")
    return [
        Entry(source, f"{key}.weight", (d_out, d_in, one, one),
              (Target(f"{path}/kernel", CONV1X1),)),
        Entry(source, f"{key}.bias", (d_out,), (Target(f"{path}/bias", COPY),)),
    ]


def layer_norm(source: str, key: str, path: str, dim: Dim) -> list[Entry]:
    """``nn.LayerNorm``: weight -> scale, bias -> bias."""
    return [
        Entry(source, f"{key}.weight", (dim,), (Target(f"{path}/scale", COPY),)),
        Entry(source, f"{key}.bias", (dim,), (Target(f"{path}/bias", COPY),)),
    ]


def embedding(source: str, key: str, path: str, rows: Dim, cols: Dim) -> list[Entry]:
    """``nn.Embedding`` weight -> ``embedding`` unchanged."""
    return [Entry(source, key, (rows, cols), (Target(path, COPY),))]


def param(source: str, key: str, path: str, dims: tuple[Dim, ...],
          transform: Transform = COPY) -> list[Entry]:
    """Any other tensor copied (or transformed) to one Flax param."""
    return [Entry(source, key, dims, (Target(path, transform),))]


def scalar(source: str, key: str, path: str) -> list[Entry]:
    """A 0-d parameter (SCORER's ``logit_scale``)."""
    return [Entry(source, key, (), (Target(path, SCALAR),))]


def mha(source: str, key: str, path: str, embed_dim: Dim, *, bias: bool = True) -> list[Entry]:
    """``nn.MultiheadAttention`` -> ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj`` (§1.1)."""
    e = embed_dim.size
    three = Dim(3 * e, f"3 x {embed_dim.label}")
    parts = ("q_proj", "k_proj", "v_proj")
    out = [Entry(source, f"{key}.in_proj_weight", (three, embed_dim), tuple(
        Target(f"{path}/{p}/kernel", in_proj_part(i, e, weight=True))
        for i, p in enumerate(parts)))]
    if bias:
        out.append(Entry(source, f"{key}.in_proj_bias", (three,), tuple(
            Target(f"{path}/{p}/bias", in_proj_part(i, e, weight=False))
            for i, p in enumerate(parts))))
    out += linear(source, f"{key}.out_proj", f"{path}/out_proj", embed_dim, embed_dim, bias=bias)
    return out


def buffer(source: str, key: str, dims: tuple[Dim, ...],
           check: Callable[[np.ndarray], str | None]) -> list[Entry]:
    """A registered buffer: no Flax parameter; ``check`` validates the stored values."""
    return [Entry(source, key, dims, (), check)]


def sinusoid_check(tolerance: float = 1e-5) -> Callable[[np.ndarray], str | None]:
    """Check of ``core.position_enc.pe`` against the table our decoders compute (§3.2)."""
    from changecap_jax.models.layers import sinusoid_table

    def check(pe: np.ndarray) -> str | None:
        want = sinusoid_table(pe.shape[0], pe.shape[1])
        diff = float(np.max(np.abs(pe - want))) if pe.size else 0.0
        if not np.isfinite(diff) or diff > tolerance:
            return (f"the buffer differs from the sinusoid table the Flax model computes (max "
                    f"|diff| {diff:.3g} > {tolerance:g}); this is not a standard positional "
                    "encoding")
        return None

    return check


def format_table(entries: Sequence[Entry]) -> str:
    """The table as text: one line per torch key (shape -> Flax path (transform))."""
    lines = []
    for e in entries:
        where = "; ".join(f"{t.path} ({t.transform.name})" for t in e.targets) or (
            f"dropped: {e.dropped}" if e.dropped else "buffer: checked, not converted")
        lines.append(f"{e.name:58s} {fmt_shape(e.shape):20s} -> {where}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Checking and applying a table
# ---------------------------------------------------------------------------------------------


def _axis_notes(entry: Entry, got: Sequence[int]) -> str:
    if len(got) != len(entry.dims):
        return f"rank {len(got)} instead of {len(entry.dims)}"
    notes = [f"axis {i} is the {d.label} = {d.size}"
             for i, (d, s) in enumerate(zip(entry.dims, got, strict=True))
             if d.size is not None and d.size != s]
    return "; ".join(notes)


def check_states(entries: Sequence[Entry], states: States, sources: Sequence[str]) -> list[str]:
    """Problems of ``states`` for the ``sources`` given (one line each, naming the key and both
    shapes): missing keys, unexpected keys, wrong shapes, failed buffer checks."""
    problems = []
    expected = {(e.source, e.key) for e in entries}
    for source in sources:
        state = states.get(source, {})
        for entry in (e for e in entries if e.source == source):
            if entry.key not in state:
                problems.append(f"missing key {entry.name}: the model needs shape "
                                f"{fmt_shape(entry.shape)}")
                continue
            got = tuple(state[entry.key].shape)
            if not entry.shape_matches(got):
                problems.append(f"{entry.name}: the checkpoint has shape {fmt_shape(got)} but the "
                                f"model built from the config expects {fmt_shape(entry.shape)} "
                                f"({_axis_notes(entry, got)})")
                continue
            if not np.issubdtype(state[entry.key].dtype, np.floating):
                problems.append(f"{entry.name}: dtype {state[entry.key].dtype} is not floating")
                continue
            if entry.check is not None:
                message = entry.check(state[entry.key])
                if message:
                    problems.append(f"{entry.name}: {message}")
            tied = state.get(entry.same_as) if entry.same_as else None
            if tied is not None and not np.array_equal(state[entry.key], tied):
                problems.append(f"{entry.name} must equal {source}:{entry.same_as} (tied "
                                "weights) but differs")
        for key in state:
            if (source, key) not in expected:
                problems.append(f"unexpected key {source}:{key} with shape "
                                f"{fmt_shape(state[key].shape)}: the model has no such tensor")
    return problems


def apply_table(entries: Sequence[Entry], states: States) -> dict[str, np.ndarray]:
    """Flax path -> float32 array for every entry whose source and key are in ``states``.

    Also maps anything in the torch layout with the same keys, e.g. gradients or optimizer
    moments. No checks: run :func:`check_states` first.
    """
    out: dict[str, np.ndarray] = {}
    for entry in entries:
        value = states.get(entry.source, {}).get(entry.key)
        if value is None:
            continue
        for target in entry.targets:
            out[target.path] = np.asarray(target.transform(np.asarray(value)), np.float32)
    return out


# ---------------------------------------------------------------------------------------------
# Recognising a snapshot
# ---------------------------------------------------------------------------------------------


class Identity(NamedTuple):
    model: str | None  # config.model.name of the family, None if unknown
    variant: str | None
    description: str


def identify_checkpoint(states: States) -> Identity:
    """Which official model a snapshot's state_dicts belong to, from signature keys."""
    enc = states.get(ENCODER, {})
    dec = states.get(DECODER, {})
    if "scorer.0.attention.query.weight" in enc or "core.layer.0.dec_enc_attention.query.weight" \
            in dec:
        return Identity("scorer", None, "SCORER+CBR (tuyunbin/SCORER, Appendix A)")
    if "mlp.0.weight" in enc or "core.layer.0.self_att.in_proj_weight" in dec:
        if "core.fc.1.weight" in dec or "core.embed_fc.1.weight" in dec:
            return Identity("dirl", "clevr_dc",
                            "DIRL+CCR CLEVR-DC (decoder models/CCR.py, with the LayerNorms "
                            "core.fc.1 / core.embed_fc.1)")
        return Identity("dirl", "clevr_change",
                        "DIRL+CCR CLEVR-Change (decoder models/CCR_no_init.py, without "
                        "core.fc.1 / core.embed_fc.1)")
    keys = sorted(enc)[:4] + sorted(dec)[:4]
    return Identity(None, None, f"unrecognised model (keys such as {keys})")


def find_config_values(tree: Any, name: str) -> list[Any]:
    """Every value stored under key ``name`` anywhere in a nested config (dicts / ConfigNodes)."""
    found = []
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if key == name:
                found.append(value)
            found.extend(find_config_values(value, name))
    return found


# ---------------------------------------------------------------------------------------------
# Model specs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the converter needs to know about one model family.

    Attributes:
      name: ``config.model.name``.
      title: for messages.
      sources: the state_dicts of its checkpoint (official ones first).
      table: (model config, sizes) -> entries.
      sizes_from_states: (model config, states) -> the sizes the checkpoint was built with.
      check_identity: (model config, states, model_cfg) -> None, or raises WrongModelError.
      example_batch: (Flax model, sizes) -> a batch of zeros for ``model.init``.
      vocab_size_of_params: Flax params -> vocabulary size.
      read_snapshot: (path, allow_pickle=...) -> OfficialSnapshot; the official file format.
      fresh_params: (model config, sizes) -> Flax param paths that the official restore
        leaves at their fresh initialisation, so the converter initialises them as the
        trainer does without asking (IDC-PCL: the pooler, from a pretraining checkpoint).
      token_rows: None, or (model config, dataset vocabulary, vocabulary file, checkpoint
        token rows) -> :class:`TokenRows`, for checkpoints whose token ids follow another
        vocabulary file (IDC-PCL: ``--dict_json``).
      init_inputs: None (``model.init(key, example_batch, train=False)``), or (Flax model,
        sizes) -> (args, kwargs) of ``model.init`` after the key (IDC-PCL's pretraining
        model initialises through its ``pretrain`` method).
    """

    name: str
    title: str
    sources: tuple[Source, ...]
    table: Callable[[ml_collections.ConfigDict, Sizes], list[Entry]]
    sizes_from_states: Callable[[ml_collections.ConfigDict, States], Sizes]
    check_identity: Callable[[ml_collections.ConfigDict, States, Any], None]
    example_batch: Callable[[Any, Sizes], dict[str, np.ndarray]]
    vocab_size_of_params: Callable[[Mapping[str, Any]], int]
    read_snapshot: Callable[..., OfficialSnapshot] = read_official_snapshot
    fresh_params: Callable[[ml_collections.ConfigDict, Sizes], tuple[str, ...]] = (
        lambda model, sizes: ())
    token_rows: Callable[[ml_collections.ConfigDict, Any, str, int], TokenRows] | None = None
    init_inputs: Callable[[Any, Sizes], tuple[tuple, dict[str, Any]]] | None = None


# ---- DIRL + CCR (§4, Appendix B) --------------------------------------------------------------


def _require(states: States, source: str, key: str, rank: int) -> tuple[int, ...]:
    value = states.get(source, {}).get(key)
    if value is None or value.ndim != rank:
        shape = None if value is None else fmt_shape(value.shape)
        raise KeyMismatchError(
            f"cannot read the model sizes: {source}:{key} is "
            f"{'missing' if value is None else f'of shape {shape}'} (expected a {rank}-D tensor)",
            [f"missing key {source}:{key}"])
    return tuple(value.shape)


def dirl_sizes_from_states(model: ml_collections.ConfigDict, states: States) -> Sizes:
    """Vocabulary, PE rows, input channels and grid of a DIRL snapshot."""
    img = _require(states, ENCODER, "img.0.weight", 4)
    w_rows = _require(states, ENCODER, "w_embedding.weight", 2)[0]
    h_rows = _require(states, ENCODER, "h_embedding.weight", 2)[0]
    vocab = _require(states, DECODER, "core.embed.weight", 2)[0]
    pe_rows = _require(states, DECODER, "core.position_enc.pe", 2)[0]
    coords = 2 if model.use_coordinates else 0
    channels = img[1] - coords
    if channels <= 0:
        raise KeyMismatchError(
            f"{ENCODER}:img.0.weight has shape {fmt_shape(img)}: {img[1]} input channels "
            f"cannot hold the {coords} coordinate channels of config.model.use_coordinates",
            [f"{ENCODER}:img.0.weight"])
    return Sizes(vocab, pe_rows, channels, h_rows, w_rows, "the checkpoint")


def dirl_check_identity(model: ml_collections.ConfigDict, states: States, model_cfg: Any) -> None:
    found = identify_checkpoint(states)
    if found.model != "dirl":
        raise WrongModelError(
            f"the snapshot holds a {found.description} checkpoint, but the config builds model "
            f"'dirl' (DIRL+CCR); use the config of that model")
    if found.variant != model.variant:
        raise WrongModelError(
            f"the snapshot is {found.description}, but config.model.variant is "
            f"{model.variant!r}; convert it with the matching preset, "
            f"--config=configs/dirl.py:{found.variant}")
    heads = {int(h) for h in find_config_values(model_cfg, "att_head")
             if isinstance(h, int | np.integer)}
    if heads and heads != {int(model.num_heads)}:
        # The weights cannot tell the number of heads (in_proj is (3E, E) for any split).
        raise WrongModelError(
            f"the snapshot's model_cfg says att_head = {sorted(heads)}, but config.model."
            f"num_heads is {model.num_heads}; set --config.model.num_heads={min(heads)}")


def dirl_table(model: ml_collections.ConfigDict, sizes: Sizes) -> list[Entry]:
    """Appendix B (CLEVR-Change) and the CLEVR-DC differences, for any sizes."""
    if model.variant not in ("clevr_change", "clevr_dc"):
        raise ValueError(f"unknown DIRL variant {model.variant!r}")
    dc = model.variant == "clevr_dc"
    e = model.hidden_dim
    hid = Dim(e, "hidden size (config.model.hidden_dim)")
    half = Dim(e // 2, "hidden size / 2 (config.model.hidden_dim)")
    coords = 2 if model.use_coordinates else 0
    cin = Dim(sizes.feature_channels + coords,
              f"input channels ({sizes.origin}: {sizes.feature_channels} feature channels"
              f"{' + 2 coordinates' if coords else ''})")
    grid_h = Dim(sizes.grid_height, f"feature grid height ({sizes.origin})")
    grid_w = Dim(sizes.grid_width, f"feature grid width ({sizes.origin})")
    mlp = Dim(model.mlp_hidden_dim, "DIRL MLP width (config.model.mlp_hidden_dim)")
    vocab = Dim(sizes.vocab_size, f"vocabulary size ({sizes.origin})")
    word = Dim(model.word_dim, "word size (config.model.word_dim)")
    ffn = Dim(model.ffn_dim, "FFN width (config.model.ffn_dim)")
    two_hid = Dim(2 * e, "2 x hidden size (config.model.hidden_dim)")

    t = conv1x1(ENCODER, "img.0", "encoder/img", cin, hid)
    t += param(ENCODER, "w_embedding.weight", "encoder/pos_embedding/w_embedding", (grid_w, half))
    t += param(ENCODER, "h_embedding.weight", "encoder/pos_embedding/h_embedding", (grid_h, half))
    t += linear(ENCODER, "mlp.0", "encoder/mlp_0", hid, mlp)
    t += linear(ENCODER, "mlp.3", "encoder/mlp_3", mlp, hid)
    for layer in range(model.encoder_layers):
        t += mha(ENCODER, f"transformer.{layer}.attention",
                 f"encoder/transformer_{layer}/attention", hid)
        t += layer_norm(ENCODER, f"transformer.{layer}.norm1",
                        f"encoder/transformer_{layer}/norm1", hid)

    t += embedding(DECODER, "core.embed.weight", "decoder/embed/embedding", vocab, word)
    t += linear(DECODER, "core.fc.0", "decoder/fc_0", word, hid)
    if dc:
        t += layer_norm(DECODER, "core.fc.1", "decoder/fc_1", hid)
    t += linear(DECODER, "core.embed_fc.0", "decoder/embed_fc_0", two_hid, hid)
    if dc:
        t += layer_norm(DECODER, "core.embed_fc.1", "decoder/embed_fc_1", hid)
    # The official seq_length (24 / 40) only bounds the official decoder; ours recomputes the
    # same table for any length, so only the width is fixed.
    t += buffer(DECODER, "core.position_enc.pe",
                (Dim(None, "official seq_length"), word), sinusoid_check())
    for layer in range(model.decoder_layers):
        src, dst = f"core.layer.{layer}", f"decoder/layer_{layer}"
        t += mha(DECODER, f"{src}.self_att", f"{dst}/self_att", hid)
        t += mha(DECODER, f"{src}.cross_att", f"{dst}/cross_att", hid)
        for norm in ("norm1", "norm2", "norm3"):
            t += layer_norm(DECODER, f"{src}.{norm}", f"{dst}/{norm}", hid)
        t += linear(DECODER, f"{src}.linear1", f"{dst}/linear1", hid, ffn)
        t += linear(DECODER, f"{src}.linear2", f"{dst}/linear2", ffn, hid)
    t += linear(DECODER, "logit", "decoder/logit", hid, vocab)
    return t


def dirl_example_batch(model: Any, sizes: Sizes) -> dict[str, np.ndarray]:
    from changecap_jax.models.dirl import STREAMS

    grid = np.zeros((1, sizes.grid_height, sizes.grid_width, sizes.feature_channels), np.float32)
    ids = np.zeros((1, sizes.max_len), np.int32)
    batch = {"before": grid}
    for stream in model.streams:
        after_key, caption_key = STREAMS[stream]
        batch[after_key] = grid
        batch[caption_key] = ids
    return batch


DIRL_SPEC = ModelSpec(
    name="dirl",
    title="DIRL+CCR (tuyunbin/DIRL)",
    sources=(
        Source(ENCODER, True, "encoder DIRL (models/DIRL.py)"),
        Source(DECODER, True, "decoder CCR (models/CCR_no_init.py or models/CCR.py)"),
    ),
    table=dirl_table,
    sizes_from_states=dirl_sizes_from_states,
    check_identity=dirl_check_identity,
    example_batch=dirl_example_batch,
    vocab_size_of_params=lambda params: int(params["decoder"]["logit"]["bias"].shape[0]),
)

# ---- SCORER + CBR (§3, Appendix A) ------------------------------------------------------------

GENERATOR = "generator"  # CBR: never in the official snapshot (S-Q1)


def scorer_sizes_from_states(model: ml_collections.ConfigDict, states: States) -> Sizes:
    """Vocabulary, PE rows, input channels and grid of a SCORER snapshot."""
    img = _require(states, ENCODER, "img.0.weight", 4)
    w_rows = _require(states, ENCODER, "w_embedding.weight", 2)[0]
    h_rows = _require(states, ENCODER, "h_embedding.weight", 2)[0]
    vocab = _require(states, DECODER, "core.embed.weight", 2)[0]
    pe_rows = _require(states, DECODER, "core.position_enc.pe", 2)[0]
    coords = 2 if model.use_coordinates else 0
    channels = img[1] - coords
    if channels <= 0:
        raise KeyMismatchError(
            f"{ENCODER}:img.0.weight has shape {fmt_shape(img)}: {img[1]} input channels "
            f"cannot hold the {coords} coordinate channels of config.model.use_coordinates",
            [f"{ENCODER}:img.0.weight"])
    return Sizes(vocab, pe_rows, channels, h_rows, w_rows, "the checkpoint")


def scorer_check_identity(model: ml_collections.ConfigDict, states: States,
                          model_cfg: Any) -> None:
    found = identify_checkpoint(states)
    if found.model != "scorer":
        raise WrongModelError(
            f"the snapshot holds a {found.description} checkpoint, but the config builds model "
            f"'scorer' (SCORER+CBR); use the config of that model")
    heads = {int(h) for h in find_config_values(model_cfg, "att_head")
             if isinstance(h, int | np.integer)}
    if heads and heads != {int(model.num_heads)}:
        # The weights cannot tell the number of heads (q/k/v are (E, E) for any split).
        raise WrongModelError(
            f"the snapshot's model_cfg says att_head = {sorted(heads)}, but config.model."
            f"num_heads is {model.num_heads}; set --config.model.num_heads={min(heads)}")


def scorer_table(model: ml_collections.ConfigDict, sizes: Sizes) -> list[Entry]:
    """Appendix A (``models/SCORER.py``, the Speaker, CBR), for any sizes."""
    e = model.hidden_dim
    hid = Dim(e, "hidden size (config.model.hidden_dim)")
    half = Dim(e // 2, "hidden size / 2 (config.model.hidden_dim)")
    two_hid = Dim(2 * e, "2 x hidden size (config.model.hidden_dim)")
    coords = 2 if model.use_coordinates else 0
    cin = Dim(sizes.feature_channels + coords,
              f"input channels ({sizes.origin}: {sizes.feature_channels} feature channels"
              f"{' + 2 coordinates' if coords else ''})")
    grid_h = Dim(sizes.grid_height, f"feature grid height ({sizes.origin})")
    grid_w = Dim(sizes.grid_width, f"feature grid width ({sizes.origin})")
    vocab = Dim(sizes.vocab_size, f"vocabulary size ({sizes.origin})")
    word = Dim(model.word_dim, "word size (config.model.word_dim)")

    t = conv1x1(ENCODER, "img.0", "encoder/img_0", cin, hid)
    t += param(ENCODER, "w_embedding.weight", "encoder/pos_embedding/w_embedding", (grid_w, half))
    t += param(ENCODER, "h_embedding.weight", "encoder/pos_embedding/h_embedding", (grid_h, half))
    for layer in range(model.encoder_layers):
        src, dst = f"scorer.{layer}.attention", f"encoder/scorer_{layer}/attention"
        t += scalar(ENCODER, f"{src}.logit_scale", f"{dst}/logit_scale")
        for proj in ("query", "key", "value"):
            t += linear(ENCODER, f"{src}.{proj}", f"{dst}/{proj}", hid, hid)
        t += layer_norm(ENCODER, f"{src}.layer_norm", f"{dst}/layer_norm", hid)
    t += linear(ENCODER, "embed_fc.0", "encoder/embed_fc_0", two_hid, hid)

    t += embedding(DECODER, "core.embed.weight", "decoder/embed/embedding", vocab, word)
    t += buffer(DECODER, "core.position_enc.pe",
                (Dim(None, "official seq_length"), word), sinusoid_check())
    t += linear(DECODER, "core.fc.0", "decoder/fc_0", word, hid)
    t += layer_norm(DECODER, "core.fc.2", "decoder/fc_2", hid)
    for layer in range(model.decoder_layers):
        src, dst = f"core.layer.{layer}", f"decoder/layer_{layer}"
        for att in ("self_attention", "dec_enc_attention"):
            for proj in ("query", "key", "value"):
                t += linear(DECODER, f"{src}.{att}.{proj}", f"{dst}/{att}/{proj}", hid, hid)
        t += layer_norm(DECODER, f"{src}.norm1", f"{dst}/norm1", hid)
        t += linear(DECODER, f"{src}.hidden_intermediate.dense",
                    f"{dst}/hidden_intermediate/dense", hid, hid)
        t += layer_norm(DECODER, f"{src}.norm2", f"{dst}/norm2", hid)
        t += linear(DECODER, f"{src}.output.dense", f"{dst}/output/dense", hid, hid)
        t += layer_norm(DECODER, f"{src}.output.LayerNorm", f"{dst}/output/LayerNorm", hid)
    t += linear(DECODER, "logit", "decoder/logit", hid, vocab)

    if model.get("use_cbr", True):
        t += conv1x1(GENERATOR, "conv1", "cbr/conv1", two_hid, hid)
        t += mha(GENERATOR, "mh_att", "cbr/mh_att", hid, bias=False)
        t += conv1x1(GENERATOR, "conv2.0", "cbr/conv2_0", hid, hid)
        t += scalar(GENERATOR, "contra.logit_scale", "cbr/contra/logit_scale")
        t += linear(GENERATOR, "contra.query", "cbr/contra/query", hid, hid)
        t += linear(GENERATOR, "contra.key", "cbr/contra/key", hid, hid)
    return t


def scorer_example_batch(model: Any, sizes: Sizes) -> dict[str, np.ndarray]:
    from changecap_jax.models.scorer import STREAMS

    grid = np.zeros((1, sizes.grid_height, sizes.grid_width, sizes.feature_channels), np.float32)
    ids = np.zeros((1, sizes.max_len), np.int32)
    batch = {"before": grid}
    for stream in model.streams:
        after_key, caption_key = STREAMS[stream]
        batch[after_key] = grid
        batch[caption_key] = ids
    return batch


SCORER_SPEC = ModelSpec(
    name="scorer",
    title="SCORER+CBR (tuyunbin/SCORER)",
    sources=(
        Source(ENCODER, True, "encoder SCORER (models/SCORER.py)"),
        Source(DECODER, True, "decoder Speaker (models/transformer_decoder.py)"),
        Source(GENERATOR, False, "CBR generator (models/CBR.py; never in the official "
               "snapshot, reference S-Q1)"),
    ),
    table=scorer_table,
    sizes_from_states=scorer_sizes_from_states,
    check_identity=scorer_check_identity,
    example_batch=scorer_example_batch,
    vocab_size_of_params=lambda params: int(params["decoder"]["logit"]["bias"].shape[0]),
)

# ---- IDC-PCL (§5, §6, Appendix C) -------------------------------------------------------------

IDC_SPECIALS = ("<PAD>", "<BOS>", "<EOS>", "<UNK>", "<MASK>", "<CLS>")  # dict.json, by name
IDC_FIXED_IDS = {"<BOS>": 1, "<MASK>": 5}  # hard-coded by the official decoder (I-Q8)
# Our specials (changecap_jax/data/vocab.py) and appended rows <- the dict.json tokens.
TRUNK_FROM_DICT = {"<NULL>": "<PAD>", "<UNK>": "<UNK>", "<START>": "<BOS>", "<END>": "<EOS>"}
LISTED_WORDS = 20


def read_dict_json(path: str | os.PathLike[str]) -> dict[str, int]:
    """The authors' ``dict.json`` (word -> id), checked: ids 0..V-1 each once, the six specials
    present, <BOS> = 1 and <MASK> = 5 (§5.1). Errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dict.json file {path} (--dict_json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path} (--dict_json) is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{path} (--dict_json) must be a JSON object word -> id, got a "
                              f"JSON {type(data).__name__}")
    for word, i in data.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise ConversionError(f"{path}: the id of {word!r} is {i!r}, not an integer")
    missing = [t for t in IDC_SPECIALS if t not in data]
    if missing:
        raise ConversionError(f"{path} lacks the special token(s) {missing}; the official "
                              f"dict.json has all of {list(IDC_SPECIALS)}")
    for token, want in IDC_FIXED_IDS.items():
        if data[token] != want:
            raise ConversionError(
                f"{path}: {token!r} has id {data[token]}, but the official decoder hard-codes "
                f"{token} = {want} (modules_finetune.py, reference I-Q8)")
    by_id: dict[int, list[str]] = {}
    for word, i in data.items():
        by_id.setdefault(i, []).append(word)
    shared = [(i, w) for i, w in sorted(by_id.items()) if len(w) > 1]
    outside = [(w[0], i) for i, w in sorted(by_id.items()) if not 0 <= i < len(data)]
    if shared or outside:
        detail = (f"id {shared[0][0]} is shared by {shared[0][1]}" if shared
                  else f"{outside[0][0]!r} has id {outside[0][1]}")
        raise ConversionError(f"{path}: the ids must be 0..{len(data) - 1}, each once; {detail}")
    return data


def dict_json_token_rows(model: ml_collections.ConfigDict, vocab: Any,
                         dict_json: str | os.PathLike[str], checkpoint_rows: int) -> TokenRows:
    """IDC-PCL's token permutation. The official rows follow dict.json; ours follow the
    dataset vocabulary (<NULL>, <UNK>, <START>, <END>, words) with [MASK] and [CLS] appended.
    Our row <- dict.json id: <NULL> <- <PAD>, <UNK> <- <UNK>, <START> <- <BOS>, <END> <- <EOS>,
    each word by its string, [MASK] <- <MASK>, [CLS] <- <CLS>. A dataset word absent from
    dict.json is an error; dict.json words absent from the dataset are dropped."""
    layout = tuple(model.get(k, d) for k, d in
                   (("bos_id", 2), ("eos_id", 3), ("mask_id", None), ("cls_id", None)))
    if layout != (2, 3, None, None):
        raise ConversionError(
            "the converter writes the trunk's token layout: config.model.bos_id = 2 (<START>), "
            "eos_id = 3 (<END>), mask_id = cls_id = None ([MASK], [CLS] appended); got "
            f"(bos_id, eos_id, mask_id, cls_id) = {layout}")
    official = read_dict_json(dict_json)
    if len(official) != checkpoint_rows:
        raise ConversionError(
            f"{dict_json} has {len(official)} ids but the checkpoint's "
            f"{IDC_STATE}:word_embedding.weight has {checkpoint_rows} rows: it is not the "
            "dict.json of this checkpoint")
    names = [TRUNK_FROM_DICT.get(vocab.id_to_word[i], vocab.id_to_word[i])
             for i in range(len(vocab))] + ["<MASK>", "<CLS>"]
    absent = [w for w in names if w not in official]
    if absent:
        shown = ", ".join(repr(w) for w in absent[:LISTED_WORDS])
        more = f" and {len(absent) - LISTED_WORDS} more" if len(absent) > LISTED_WORDS else ""
        raise ConversionError(
            f"{len(absent)} words of the dataset vocabulary are not in {dict_json}, so the "
            f"checkpoint has no rows for them: {shown}{more}")
    rows = tuple(official[w] for w in names)
    used = set(rows)
    dropped = tuple(w for w, i in sorted(official.items(), key=lambda kv: kv[1])
                    if i not in used)
    return TokenRows(rows, len(official), str(dict_json), dropped)


def idc_sizes_from_states(model: ml_collections.ConfigDict, states: States) -> Sizes:
    """Token rows and feature channels of an IDC-PCL checkpoint; the grid and the caption
    length are not in it (the official 7x7 and 40 stand in)."""
    vocab = _require(states, IDC_STATE, "word_embedding.weight", 2)[0]
    channels = _require(states, IDC_STATE, "img_project.0.weight", 2)[1]
    return Sizes(vocab, 40, channels, 7, 7, "the checkpoint")


def idc_check_identity(model: ml_collections.ConfigDict, states: States,
                       model_cfg: Any) -> None:
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


def idc_table(model: ml_collections.ConfigDict, sizes: Sizes) -> list[Entry]:
    """Appendix C for the model of ``model.stage``, for any sizes. Flax paths
    by :func:`changecap_jax.models.idc_pcl.torch_key_to_flax`; the token rows of
    ``word_embedding`` and ``output_layer`` are reordered by ``sizes.token_rows``. For the
    pretraining model (``model.stage == "pretrain"``) the 3d -> 2 pooler and ``feat_regress``
    convert too; for the fine-tuning model, a pretraining checkpoint's
    (``sizes.checkpoint_stage == "pretrain"``) pooler and ``feat_regress.*`` are checked but
    dropped (§5.4)."""
    from changecap_jax.models import idc_pcl

    tokens = sizes.token_rows
    if tokens is None:
        raise ConversionError("the IDC-PCL key table needs the token order: pass "
                              "--dict_json=PATH (the authors' dict.json)")
    if model.image_dim != sizes.feature_channels:
        raise ConversionError(
            f"config.model.image_dim = {model.image_dim} but the features have "
            f"{sizes.feature_channels} channels ({sizes.origin}): set "
            f"--config.model.image_dim={sizes.feature_channels}")
    e = model.hidden_dim
    d = Dim(e, "hidden size (config.model.hidden_dim)")
    ffn = Dim(model.ffn_dim, "FFN width (config.model.ffn_dim)")
    feat = Dim(sizes.feature_channels, f"feature channels ({sizes.origin})")
    vocab = Dim(tokens.checkpoint_rows, f"dict.json size ({tokens.origin})")
    two = Dim(2, "distractor classes")
    keys: list[tuple[str, tuple[Dim, ...]]] = [
        ("word_embedding.weight", (vocab, d)),
        ("img_project.0.weight", (d, feat)), ("img_project.0.bias", (d,)),
        ("position_encoding.type_pe.weight", (Dim(idc_pcl.NUM_TYPES, "type embeddings"), d)),
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
    keys += [("output_layer.weight", (vocab, d)), ("output_layer.bias", (vocab,))]
    by_tokens = {"word_embedding.weight": tokens.take(),
                 "output_layer.weight": tokens.take(transpose=True),
                 "output_layer.bias": tokens.take()}
    t = []
    for key, dims in keys:
        path = "/".join(idc_pcl.torch_key_to_flax(key))
        transform = by_tokens.get(key, TRANSPOSE if path.endswith("/kernel") else COPY)
        t.append(Entry(IDC_STATE, key, dims, (Target(path, transform),)))
    t[3:3] = buffer(IDC_STATE, idc_pcl.PE_KEY,
                    (Dim(1, "batch axis"), Dim(None, "official sinusoid rows (200)"), d),
                    _idc_sinusoid_check)  # Appendix C order
    if model.stage == "pretrain":  # the whole pretraining model, the tied weight checked
        t += linear(IDC_STATE, "pooler.0", "pooler_0",
                    Dim(3 * e, "3 x hidden size (pretraining pooler)"), two)
        t.append(Entry(IDC_STATE, idc_pcl.TIED_KEY, (d, feat), same_as="img_project.0.weight",
                       dropped="tied: one parameter with img_project.0.weight"))
        t.append(Entry(IDC_STATE, "feat_regress.bias", (feat,),
                       (Target("feat_regress/bias", COPY),)))
        t += linear(IDC_STATE, "feat_regress.net.0", "feat_regress/net_0", d, d)
        for leaf in ("a_2", "b_2"):
            t.append(Entry(IDC_STATE, f"feat_regress.net.2.{leaf}", (d,),
                           (Target(f"feat_regress/net_2/{leaf}", COPY),)))
        return t
    if sizes.checkpoint_stage != "pretrain":
        return t + linear(IDC_STATE, "pooler.0", "pooler_0",
                          Dim(2 * e, "2 x hidden size (fine-tuning pooler)"), two)
    pooler = "the official restore skips every 'pooler' key (finetune.py, reference §5.4)"
    head = "the pretraining MVCL head, not in the fine-tuning model (reference §5.4)"
    pretrain_only = [
        ("pooler.0.weight", (two, Dim(3 * e, "3 x hidden size (pretraining pooler)")), pooler),
        ("pooler.0.bias", (two,), pooler),
        (idc_pcl.TIED_KEY, (d, feat), head),
        ("feat_regress.bias", (feat,), head),
        ("feat_regress.net.0.weight", (d, d), head), ("feat_regress.net.0.bias", (d,), head),
        ("feat_regress.net.2.a_2", (d,), head), ("feat_regress.net.2.b_2", (d,), head),
    ]
    return t + [Entry(IDC_STATE, key, dims, dropped=why,
                      same_as="img_project.0.weight" if key == idc_pcl.TIED_KEY else None)
                for key, dims, why in pretrain_only]


def _idc_sinusoid_check(pe: np.ndarray) -> str | None:
    from changecap_jax.models.idc_pcl import idc_sinusoid_table

    want = idc_sinusoid_table(pe.shape[1], pe.shape[2])
    diff = float(np.max(np.abs(pe[0] - want))) if pe.size else 0.0
    if not np.isfinite(diff) or diff > 1e-6:
        return (f"the buffer differs from the IDC sinusoid table the Flax model computes (max "
                f"|diff| {diff:.3g} > 1e-06, reference I-Q2)")
    return None


def idc_fresh_params(model: ml_collections.ConfigDict, sizes: Sizes) -> tuple[str, ...]:
    """From a pretraining checkpoint the fine-tuning pooler stays fresh (§5.4)."""
    fresh = sizes.checkpoint_stage == "pretrain" and model.stage == "finetune"
    return ("pooler_0/bias", "pooler_0/kernel") if fresh else ()


def idc_example_batch(model: Any, sizes: Sizes) -> dict[str, np.ndarray]:
    from changecap_jax.models.idc_pcl import STREAMS

    grid = np.zeros((1, sizes.grid_height, sizes.grid_width, sizes.feature_channels), np.float32)
    batch = {"before": grid}
    for stream in model.streams:
        after_key, caption_key, _ = STREAMS[stream]
        batch[after_key] = grid
        batch[caption_key] = np.zeros((1, sizes.max_len), np.int32)
    return batch


def idc_init_inputs(model: Any, sizes: Sizes) -> tuple[tuple, dict[str, Any]]:
    if model.stage != "pretrain":
        return (idc_example_batch(model, sizes),), {"train": False}
    grid = np.zeros((1, sizes.grid_height, sizes.grid_width, sizes.feature_channels), np.float32)
    return (grid, grid, np.zeros((1, sizes.max_len), np.int32)), {"method": "pretrain"}


IDC_SPEC = ModelSpec(
    name="idc_pcl",
    title="IDC-PCL (yaolinli/IDC)",
    sources=(Source(IDC_STATE, True, "the model's state_dict (the pretraining checkpoint's "
                    "model_state_dict or the fine-tuning best_checkpoint.pt)"),),
    table=idc_table,
    sizes_from_states=idc_sizes_from_states,
    check_identity=idc_check_identity,
    example_batch=idc_example_batch,
    # word_embedding rows = the vocabulary + the appended [MASK] and [CLS]
    vocab_size_of_params=lambda params: int(params["word_embedding"]["embedding"].shape[0]) - 2,
    read_snapshot=read_idc_checkpoint,
    fresh_params=idc_fresh_params,
    token_rows=dict_json_token_rows,
    init_inputs=idc_init_inputs,
)

# config.model.name -> spec. Subtraction adds its own here.
SPECS: dict[str, ModelSpec] = {"dirl": DIRL_SPEC, "scorer": SCORER_SPEC, "idc_pcl": IDC_SPEC}


def get_spec(model_name: str) -> ModelSpec:
    if model_name not in SPECS:
        raise WrongModelError(
            f"no torch checkpoint mapping for model {model_name!r}; models with one: "
            f"{sorted(SPECS)}")
    return SPECS[model_name]
