"""Per-model key tables: official torch state_dict key -> Flax param path(s) and transform.

A table is a list of :class:`Entry`, built from the model config and the data-dependent
:class:`Sizes` (vocabulary, feature channels, grid, caption length), so every entry knows the
torch shape it expects and what decides each axis (used in error messages). The transforms are
the conversion rules of ``shared/reference/official_pytorch.md`` §1.1:

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
§4.2 / §4.5) and SCORER+CBR (Appendix A). SCORER's CBR is a third, non-official
:class:`Source` ``"generator"`` (reference S-Q1: never in the official snapshot); the converter
reads it from ``--extra_params`` (a bare torch state_dict, ``generator.state_dict()``) or
initialises it with ``--missing=init`` (listed in the report). A model whose Flax parameters
are not all listed in its table gets the rest through the same ``--missing`` policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from changecap_jax.convert.errors import KeyMismatchError, WrongModelError

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

    ``targets`` is empty for a buffer; ``check`` (buffers) returns an error message or None.
    """

    source: str
    key: str
    dims: tuple[Dim, ...]
    targets: tuple[Target, ...] = ()
    check: Callable[[np.ndarray], str | None] | None = None

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
    """

    vocab_size: int
    max_len: int
    feature_channels: int
    grid_height: int
    grid_width: int
    origin: str


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
            "buffer: checked, not converted")
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
    """

    name: str
    title: str
    sources: tuple[Source, ...]
    table: Callable[[ml_collections.ConfigDict, Sizes], list[Entry]]
    sizes_from_states: Callable[[ml_collections.ConfigDict, States], Sizes]
    check_identity: Callable[[ml_collections.ConfigDict, States, Any], None]
    example_batch: Callable[[Any, Sizes], dict[str, np.ndarray]]
    vocab_size_of_params: Callable[[Mapping[str, Any]], int]


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

# config.model.name -> spec. Subtraction adds its own here.
SPECS: dict[str, ModelSpec] = {"dirl": DIRL_SPEC, "scorer": SCORER_SPEC}


def get_spec(model_name: str) -> ModelSpec:
    if model_name not in SPECS:
        raise WrongModelError(
            f"no torch checkpoint mapping for model {model_name!r}; models with one: "
            f"{sorted(SPECS)}")
    return SPECS[model_name]
