"""Key tables: official torch state_dict key -> Flax param path(s) and transform, and the
checks and conversion that run on any table.

A table is a list of :class:`Entry`, built by a model's converter
(``changecap_jax/convert/models/``, docs/converters.md) from the model config and the
data-dependent :class:`Sizes` (vocabulary, feature channels, grid, caption length), so every
entry knows the torch shape it expects and what decides each axis (used in error messages). The
transforms are the conversion rules of ``docs/official/common.md`` §1.1 (other § and
Appendices: same folder):

* ``nn.Linear`` weight (out, in) -> Dense ``kernel`` (in, out) = transpose; bias unchanged;
* 1x1 ``nn.Conv2d`` weight (out, in, 1, 1) -> Dense ``kernel`` = W[:, :, 0, 0].T (our models
  apply the 1x1 convs as a Dense over the channels of channels-last grids, §7 item 1); a
  larger one (MEDIC's 3x3 classifiers) -> ``nn.Conv`` ``kernel`` = W.transpose(2, 3, 1, 0);
* ``nn.MultiheadAttention`` ``in_proj_weight`` (3E, E) -> rows [0:E] / [E:2E] / [2E:3E] as the
  ``q_proj`` / ``k_proj`` / ``v_proj`` kernels (transposed); ``in_proj_bias`` thirds -> their
  biases; ``out_proj.weight/bias`` -> ``out_proj`` kernel (transposed) / bias;
* ``nn.LayerNorm`` weight/bias -> ``scale`` / ``bias``; ``nn.Embedding`` weight ->
  ``embedding`` unchanged; scalar parameters (shape ()) stay 0-d;
* registered buffers (the sinusoid ``core.position_enc.pe``, §7 item 3) map to no parameter:
  our models recompute them, so the converter checks that the stored values equal ours.

An entry may also be ``dropped`` (read and checked, not converted) or tied to another key
(``same_as``). A :class:`Source` is one state_dict of the checkpoint; a non-official one (SCORER's
CBR ``generator``, reference S-Q1) is read from ``--extra_params`` or initialised with
``--missing=init``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from changecap_jax.convert.errors import KeyMismatchError
from changecap_jax.models.layers import sinusoid_table

States = Mapping[str, Mapping[str, np.ndarray]]  # source name -> {torch key: array}


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
CONV_KERNEL = Transform("transpose(2, 3, 1, 0)", lambda x: x.transpose(2, 3, 1, 0))


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
    """Our token row r is the checkpoint's row ``rows[r]`` (IDC-PCL: the order of the
    authors' dict.json, ``convert/models/idc_dict_json.py``)."""

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


def conv2d(source: str, key: str, path: str, d_in: Dim, d_out: Dim, size: int) -> list[Entry]:
    """A ``size`` x ``size`` ``nn.Conv2d`` -> ``nn.Conv``: weight (out, in, kh, kw) -> kernel
    (kh, kw, in, out); bias. Both cross-correlate, so no flip."""
    k = Dim(size, f"{size}x{size} kernel")
    return [
        Entry(source, f"{key}.weight", (d_out, d_in, k, k),
              (Target(f"{path}/kernel", CONV_KERNEL),)),
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


def apply_table(entries: Sequence[Entry], states: States,
                dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Flax path -> array of ``dtype`` for every entry whose source and key are in ``states``.

    Also maps anything in the torch layout with the same keys, e.g. gradients or optimizer
    moments. No checks: run :func:`check_states` first.
    """
    out: dict[str, np.ndarray] = {}
    for entry in entries:
        value = states.get(entry.source, {}).get(entry.key)
        if value is None:
            continue
        for target in entry.targets:
            out[target.path] = np.asarray(target.transform(np.asarray(value)), dtype)
    return out


def require_shape(states: States, source: str, key: str, rank: int) -> tuple[int, ...]:
    """The shape of ``source:key``, which must be a ``rank``-D tensor (a size read from it)."""
    value = states.get(source, {}).get(key)
    if value is None or value.ndim != rank:
        shape = None if value is None else fmt_shape(value.shape)
        raise KeyMismatchError(
            f"cannot read the model sizes: {source}:{key} is "
            f"{'missing' if value is None else f'of shape {shape}'} (expected a {rank}-D tensor)",
            [f"missing key {source}:{key}"])
    return tuple(value.shape)


def find_config_values(tree: Any, name: str) -> list[Any]:
    """Every value stored under key ``name`` anywhere in a nested config (dicts / ConfigNodes)."""
    found = []
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if key == name:
                found.append(value)
            found.extend(find_config_values(value, name))
    return found
