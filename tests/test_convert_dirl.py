"""Official DIRL+CCR snapshot -> orbax checkpoint (changecap_jax/convert), checked tensor by tensor
against the independent torch reference (tools/torch_reference/dirl.py), both decoder
variants.

Reference: docs/official/ §1.1 (conversion rules), §1.2 (Adam, padding
row), §4 (DIRL+CCR), §4.5 / Appendix B (keys), §7 (parity checklist). Random seeded weights at
small sizes (hidden 64, 4 heads, 2 + 2 layers, 7x7 grid, vocabulary 30, captions of 12), float32
on CPU, eval mode: encoder outputs, memory, logits, CCR vectors, caption CE and every auxiliary
loss within 1e-5; gradients within 1e-4 of each tensor's largest entry; one Adam step within
1e-5; greedy captions identical on 32 pairs. Plus default-size key completeness, the error
cases, the extra-parameter policy, and convert -> evaluate_checkpoint end to end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from torch_helpers import snapshot as tsnapshot  # noqa: E402

from changecap_jax import models, parallel  # noqa: E402
from changecap_jax.convert import (  # noqa: E402
    CheckpointFormatError,
    ConversionError,
    KeyMismatchError,
    WrongModelError,
    compare,
    converter,
    registry,
    tables,
)
from changecap_jax.convert.models import dirl as dirl_converter  # noqa: E402
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER  # noqa: E402
from changecap_jax.convert.torch_checkpoint import (  # noqa: E402
    ConfigNode,
    load_torch_file,
    read_official_snapshot,
)
from changecap_jax.decoding import search  # noqa: E402
from changecap_jax.trainers import caption_step, captioning, optimizers, update  # noqa: E402
from tools.torch_reference import dirl as tdirl  # noqa: E402
from tools.torch_reference import scorer as tscorer  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
RAW = 16  # feature channels before AddSpatialInfo
GRID, VOCAB, SEQ = 7, 30, 12
TORCH_SIZES = dict(att_dim=64, att_head=4, num_layers=2, mlp_dim=128, grid_size=GRID,
                   vocab_size=VOCAB, seq_length=SEQ, word_dim=48, ffn_dim=128)
FLAX_SIZES = dict(hidden_dim=64, num_heads=4, encoder_layers=2, decoder_layers=2, word_dim=48,
                  ffn_dim=128, mlp_hidden_dim=128, dropout_rate=0.0)
END_BIAS = {"clevr_change": 0.0, "clevr_dc": 1.5}
B = 8  # divisible by the 8 simulated devices (the trainer's loss runs under shard_map)
STREAMS = {"semantic": ("after_semantic", "change_caption", "pos"),
           "distractor": ("after_distractor", "no_change_caption", "neg")}
REPORT: dict[str, str] = {}  # measured differences, printed at the end (pytest -s)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for line in REPORT.values():
        print(line)


def make_config(variant: str, data_dir: Path):
    from configs import dirl as dirl_configs

    config = dirl_configs.get_config(variant)
    config.model.update(FLAX_SIZES)
    config.dataset.data_dir = str(data_dir)  # an empty dir: the dataset is unavailable
    return config


def torch_models(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    feat = RAW + 2 if variant == "clevr_change" else RAW
    enc, dec = tdirl.build_dirl(variant, feat_dim=feat, **TORCH_SIZES)
    return enc.eval(), dec.eval()


def random_captions(rng: np.random.Generator, n: int, length: int = SEQ) -> np.ndarray:
    ids = np.zeros((n, length), np.int32)
    for i in range(n):
        words = rng.integers(1, length - 1)  # 1 .. length - 2 words, then END
        ids[i, 0] = 2
        ids[i, 1 : 1 + words] = rng.integers(4, VOCAB, size=words)
        ids[i, 1 + words] = 3
    return ids


def make_batch(variant: str, n: int, seed: int):
    """(our batch: channels-last raw features, caption ids; torch kwargs of dirl_losses)."""
    rng = np.random.default_rng(seed)
    feats = [rng.random((n, GRID, GRID, RAW), dtype=np.float32) for _ in range(3)]
    caps = [random_captions(rng, n), random_captions(rng, n)]
    ours = {"before": feats[0], "after_semantic": feats[1], "change_caption": caps[0]}
    if variant == "clevr_change":
        ours.update(after_distractor=feats[2], no_change_caption=caps[1])
    return ours, torch_inputs(variant, ours)


def torch_grid(x: np.ndarray, variant: str):
    t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous()
    return tscorer.add_spatial_info(t) if variant == "clevr_change" else t


def torch_captions(ids: np.ndarray):
    labels = torch.from_numpy(ids).long()
    return labels, tscorer.labels_with_ignore(labels), tscorer.caption_mask(labels)


def torch_inputs(variant: str, ours: dict) -> dict:
    labels, targets, masks = torch_captions(ours["change_caption"])
    kw = dict(before=torch_grid(ours["before"], variant),
              after_sc=torch_grid(ours["after_semantic"], variant),
              labels=labels, targets=targets, masks=masks)
    if variant == "clevr_change":
        labels, targets, masks = torch_captions(ours["no_change_caption"])
        kw.update(after_nsc=torch_grid(ours["after_distractor"], variant),
                  no_chg_labels=labels, no_chg_targets=targets, no_chg_masks=masks)
    return kw


def torch_states(enc, dec, what: str = "tensor") -> dict:
    def grab(module):
        if what == "grad":
            return {k: p.grad.detach().numpy().copy() for k, p in module.named_parameters()}
        return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}

    return {ENCODER: grab(enc), DECODER: grab(dec)}


def sizes(feature_channels: int = RAW, vocab: int = VOCAB) -> tables.Sizes:
    return tables.Sizes(vocab, SEQ, feature_channels, GRID, GRID, "test")


def diff(name: str, ours, ref, tol: float, *, rel: bool = False) -> tuple[float, float]:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    d = float(np.max(np.abs(ours - ref))) if ours.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    limit = tol * scale if rel else tol
    assert d <= limit, f"{name}: max |diff| {d:.3g} > {limit:.3g} (max |ref| {scale:.3g})"
    return d, d / scale if scale else 0.0


# ---------------------------------------------------------------------------------------------
# Conversion through the command's code path (module-scoped: used by several tests)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=tdirl.VARIANTS)
def converted(request, tmp_path_factory):
    variant = request.param
    tmp = tmp_path_factory.mktemp(f"convert_{variant}")
    enc, dec = torch_models(variant, seed=1)
    path = tmp / f"dirl_{variant}_checkpoint_1200.pt"
    tsnapshot.save_official_snapshot(path, enc, dec)
    workdir = tmp / "workdir"
    if variant == "clevr_change":
        # Once through the real command line (a subprocess), as docs/convert.md gives it: the
        # snapshot's model_cfg pickles as utils.attr_dict.AttrDict, like the official train.py's,
        # and converts without --allow_pickle.
        args = [sys.executable, "-m", "changecap_jax.convert",
                f"--config={ROOT / 'configs/dirl.py'}:clevr_change",
                *(f"--config.model.{k}={v}" for k, v in FLAX_SIZES.items()),
                f"--config.dataset.data_dir={tmp / 'no_data'}",
                f"--torch_checkpoint={path}", f"--workdir={workdir}"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "wrote step 1200" in done.stdout, done.stdout
    else:
        report = converter.convert_checkpoint(make_config(variant, tmp / "no_data"), path,
                                              workdir)
        assert report.step == 1200 and report.dataset is None
    return variant, enc, dec, path, workdir, make_config(variant, tmp / "no_data")


def test_parity_forward_grad_adam_greedy(converted):
    variant, enc, dec, snapshot_path, workdir, config = converted
    params = compare.load_params(workdir)
    snap_states = torch_states(enc, dec)
    entries = dirl_converter.table(config.model, sizes())
    converted_flat = tables.apply_table(entries, snap_states)
    for path, value in converted_flat.items():  # the restored checkpoint holds the weights
        leaf = params
        for part in path.split("/"):
            leaf = leaf[part]
        np.testing.assert_array_equal(np.asarray(leaf), value, err_msg=path)
    ours_batch, tb = make_batch(variant, B, seed=2)
    _check_forward(variant, config, workdir, ours_batch, tb, enc, dec)
    model, gradients = _check_gradients(variant, config, params, ours_batch, tb, enc, dec,
                                        entries)
    _check_adam_step(variant, config, params, gradients, enc, dec, entries, converted_flat)
    _check_greedy(variant, model, params, snapshot_path, enc, dec)


def _check_forward(variant, config, workdir, ours_batch, tb, enc, dec) -> None:
    """Forward (eval mode): every intermediate of forward_outputs against the torch modules."""
    out = compare.forward_outputs(config, workdir, ours_batch)
    with torch.no_grad():
        ref = tdirl.dirl_losses(enc, dec, **tb)
        streams = ["semantic"] + (["distractor"] if variant == "clevr_change" else [])
        worst: dict[str, tuple[float, float]] = {}

        def track(group: str, name: str, ours, want, tol: float = 1e-5) -> None:
            d = diff(name, ours, want, tol)
            old = worst.get(group, (0.0, 0.0))
            worst[group] = (max(old[0], d[0]), max(old[1], d[1]))

        for stream in streams:
            _track_stream(variant, stream, out, ref, tb, enc, dec, track)
        track("caption CE", "mean", out["caption_ce"], ref["cap"])
        track("aux dirl", "mean", out["aux/dirl"], ref["dirl"])
        track("aux ccr", "mean", out["aux/ccr"], ref["ccr"])
        track("total loss", "total", out["loss"], ref["total"])
    for group, (a, r) in worst.items():
        REPORT[f"{variant} {group}"] = (f"PARITY {variant:12s} {group:28s} max abs {a:.2e}  "
                                        f"max rel {r:.2e}")


def _track_stream(variant, stream, out, ref, tb, enc, dec, track) -> None:
    after_key, cap_key, tag = STREAMS[stream]
    before = tb["before"]
    after = tb["after_sc"] if stream == "semantic" else tb["after_nsc"]
    labels = tb["labels"] if stream == "semantic" else tb["no_chg_labels"]
    masks = tb["masks"] if stream == "semantic" else tb["no_chg_masks"]
    e = enc(before, after)
    d = e.diff_bef.shape[-1]
    track("encoder diff_bef/diff_aft", stream, out[f"encoder/{stream}/diff_before"],
          e.diff_bef)
    track("encoder diff_bef/diff_aft", stream, out[f"encoder/{stream}/diff_after"],
          e.diff_aft)
    for side, x0 in (("before", e.input_bef), ("after", e.input_aft)):
        mlp = enc.mlp(x0.reshape(-1, d)).reshape(x0.shape)
        track("encoder MLP head", stream, out[f"encoder/{stream}/mlp_{side}"], mlp)
    memory = dec.memory(e.diff_bef, e.diff_aft)
    track("decoder memory", stream, out[f"decoder.memory/{stream}"], memory)
    o = dec.decode(memory, labels, masks)
    track("decoder logits", stream, out[f"logits/{stream}"], o.logits)
    np.testing.assert_array_equal(out[f"decoder/{stream}/logits"],
                                  out[f"logits/{stream}"])
    track("CCR t / v", stream, out[f"decoder/{stream}/t"], o.t)
    track("CCR t / v", stream, out[f"decoder/{stream}/v"], o.v)
    name = f"cap_{tag}" if variant == "clevr_change" else "cap"
    track("caption CE", stream, out[f"caption_ce/{stream}"], ref[name])
    for aux in ("dirl", "ccr"):
        name = f"{aux}_{tag}" if variant == "clevr_change" else aux
        track(f"aux {aux}", stream, out[f"aux/{aux}/{stream}"], ref[name])


def _check_gradients(variant, config, params, ours_batch, tb, enc, dec, entries):
    """Gradients of the trainer's loss (8-device shard_map) vs torch backward; returns the
    model and (our gradients, flat, torch's by Flax path, the float-noise paths, the largest
    torch gradient entry)."""
    model = models.build(config.model, vocab_size=VOCAB, max_len=SEQ)
    mesh = parallel.make_mesh()
    loss_fn = caption_step.make_loss_fn(model, dict(config.loss_weights), mesh)
    sharded = jax.device_put({k: jnp.asarray(v) for k, v in ours_batch.items()},
                             parallel.batch_sharding(mesh))
    grad_fn = jax.jit(jax.grad(lambda p: loss_fn(p, sharded, jax.random.PRNGKey(0))[0]))
    replicated = jax.device_put(params, parallel.replicated(mesh))
    grads = update.zero_gradient_rows(grad_fn(replicated), dict(config.optim.zero_grad_rows))
    grads = jax.device_get(grads)
    flat_grads = {k: np.asarray(v) for k, v in
                  flax.traverse_util.flatten_dict(grads, sep="/").items()}
    for module in (enc, dec):
        module.zero_grad()
    tdirl.dirl_losses(enc, dec, **tb)["total"].backward()
    ref_grads = tables.apply_table(entries, torch_states(enc, dec, "grad"))
    assert set(ref_grads) == set(flat_grads)
    largest = max(np.abs(g).max() for g in ref_grads.values())
    worst_rel, noise = 0.0, []
    for path, want in ref_grads.items():
        got, scale = flat_grads[path], np.abs(want).max()
        if scale < 1e-6 * largest:
            # Analytically zero (a bias before the DIRL z-score, attention key biases under
            # softmax): both sides must agree that it is float noise.
            assert np.abs(got).max() < 1e-6 * largest, path
            noise.append(path)
            continue
        worst_rel = max(worst_rel, diff(path, got, want, 1e-4, rel=True)[1])
    row0 = flat_grads["decoder/embed/embedding"][0]
    assert not row0.any() and not ref_grads["decoder/embed/embedding"][0].any()
    REPORT[f"{variant} grads"] = (f"PARITY {variant:12s} {'gradients (per tensor)':28s} max rel "
                                  f"{worst_rel:.2e} over {len(ref_grads) - len(noise)} tensors; "
                                  f"{len(noise)} analytically-zero tensors: {noise}")
    return model, (grads, flat_grads, ref_grads, noise, largest)


def _check_adam_step(variant, config, params, gradients, enc, dec, entries,
                     converted_flat) -> None:
    """One Adam step: our make_optimizer (preset optim config) vs torch.optim.Adam."""
    grads, flat_grads, ref_grads, noise, largest = gradients
    assert (config.optim.learning_rate, config.optim.b1, config.optim.b2, config.optim.eps) == (
        2e-4, 0.9, 0.999, 1e-8)
    optimizer, _ = optimizers.make_optimizer(config.optim, steps_per_epoch=100)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    stepped = flax.traverse_util.flatten_dict(
        optax.apply_updates(params, updates), sep="/")
    torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=2e-4, betas=(0.9, 0.999),
                     eps=1e-8).step()
    ref_stepped = tables.apply_table(entries, torch_states(enc, dec))
    worst_adam, compared, skipped = 0.0, 0, sum(ref_grads[p].size for p in noise)
    for path, want in ref_stepped.items():
        if path in noise:
            continue  # Adam maps float noise to about +-lr on both sides, independently
        got = np.asarray(stepped[path])
        # Entries whose gradient is below the float noise of the loss get +-lr of random sign;
        # exact zeros on both sides (e.g. embedding rows of absent words) must stay put.
        g_ref, g_ours = ref_grads[path], flat_grads[path]
        real = (np.abs(g_ref) > 1e-6 * largest) | ((g_ref == 0) & (g_ours == 0))
        skipped += int((~real).sum())
        d = np.abs(got - want)[real]
        compared += int(real.sum())
        worst_adam = max(worst_adam, float(d.max()) if d.size else 0.0)
        assert worst_adam <= 1e-5, (path, worst_adam)
    emb_before = converted_flat["decoder/embed/embedding"][0]
    np.testing.assert_array_equal(np.asarray(stepped["decoder/embed/embedding"][0]), emb_before)
    np.testing.assert_array_equal(ref_stepped["decoder/embed/embedding"][0], emb_before)
    if variant == "clevr_dc":
        assert np.abs(emb_before).max() > 0  # the xavier init overwrote the pad row (§4.4)
    else:
        assert not emb_before.any()  # CCR_no_init keeps it zero
    REPORT[f"{variant} adam"] = (f"PARITY {variant:12s} {'Adam step params':28s} max abs "
                                 f"{worst_adam:.2e} over {compared} entries ({skipped} "
                                 "float-noise gradient entries not compared)")


def _check_greedy(variant, model, params, snapshot_path, enc, dec) -> None:
    """Greedy captions on 32 random pairs. A random per-pair channel offset makes the
    untrained model's captions depend on the pair (the attention averages of i.i.d. tokens
    barely do); on DC, END gets a bias (on both sides) so that rows finish at different
    steps."""
    end_bias = jnp.zeros(VOCAB).at[3].set(END_BIAS[variant])
    params["decoder"]["logit"]["bias"] = params["decoder"]["logit"]["bias"] + end_bias
    rng = np.random.default_rng(3)
    before, after = (rng.random((32, GRID, GRID, RAW), dtype=np.float32)
                     + 3 * rng.standard_normal((32, 1, 1, RAW), dtype=np.float32)
                     for _ in range(2))
    ours_ids = search.greedy_decode(model, {"params": params}, jnp.asarray(before),
                                      jnp.asarray(after), max_len=SEQ).ids
    with torch.no_grad():
        # The weights before the Adam step.
        saved = tsnapshot.load_official_snapshot(snapshot_path)
        enc.load_state_dict(saved["change_detector_state"])
        dec.load_state_dict(saved["speaker_state"])
        dec.logit.bias[3] += END_BIAS[variant]
        e = enc(torch_grid(before, variant), torch_grid(after, variant))
        ref_ids = tdirl.sample(dec, e.diff_bef, e.diff_aft, sample_max=True, max_len=SEQ).ids
    np.testing.assert_array_equal(np.asarray(ours_ids), ref_ids.numpy())
    lengths = (ref_ids.numpy() != 0).sum(1)
    distinct = len({tuple(row) for row in ref_ids.tolist()})
    assert distinct >= 8 and lengths.min() < lengths.max(), (distinct, lengths)
    REPORT[f"{variant} greedy"] = (f"PARITY {variant:12s} {'greedy captions (32 pairs)':28s} "
                                   f"identical; {distinct} distinct, lengths "
                                   f"{lengths.min()}..{lengths.max()}")


# ---------------------------------------------------------------------------------------------
# Default sizes: every key of Appendix B maps, with the right shapes (no heavy compute)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,total", [("clevr_change", 4_736_000 + 9_148_764),
                                           ("clevr_dc", 4_734_976 + 9_159_755)])
def test_default_sizes_complete(variant, total, tmp_path):
    from configs import dirl as dirl_configs

    torch.manual_seed(0)
    enc, dec = tdirl.build_dirl(variant)  # official sizes (§4 table, Appendix B)
    states = torch_states(enc, dec)
    snapshot = converter.OfficialSnapshot(tmp_path / "x.pt", states, None, None)
    config = dirl_configs.get_config(variant)
    config.dataset.data_dir = str(tmp_path / "no_data")
    spec = registry.converter_for("dirl")
    spec.check_identity(config.model, states, None)
    found = spec.sizes_from_states(config.model, states)
    assert (found.vocab_size, found.max_len, found.feature_channels, found.grid_height) == {
        "clevr_change": (76, 24, 1024, 14), "clevr_dc": (87, 40, 1024, 14)}[variant]
    report = converter.ConversionReport("x", "dirl", variant, found, None)
    params = converter.convert_params(config, snapshot, found, report=report)
    assert report.num_params == total  # Appendix B unique parameter counts
    assert report.buffers_checked == ["speaker_state:core.position_enc.pe"]
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    in_proj = states[DECODER]["core.layer.1.cross_att.in_proj_weight"]
    np.testing.assert_array_equal(flat["decoder/layer_1/cross_att/v_proj/kernel"],
                                  in_proj[1024:].T)
    np.testing.assert_array_equal(flat["encoder/img/kernel"],
                                  states[ENCODER]["img.0.weight"][:, :, 0, 0].T)


# ---------------------------------------------------------------------------------------------
# Error cases
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("snapshots")
    out = {}
    for variant in tdirl.VARIANTS:
        enc, dec = torch_models(variant, seed=4)
        out[variant] = tmp / f"{variant}.pt"
        tsnapshot.save_official_snapshot(out[variant], enc, dec)
        out[f"{variant}_modules"] = (enc, dec)
    return out


def _convert(variant: str, path: Path, tmp_path: Path, **kw):
    config = make_config(variant, tmp_path / "no_data")
    return converter.convert_checkpoint(config, path, tmp_path / "workdir", **kw)


def test_unreadable_and_foreign_files(snapshots, tmp_path):
    data = snapshots["clevr_change"].read_bytes()
    cases = {
        "truncated.pt": (data[: len(data) // 2], "truncated"),
        "random.pt": (np.random.default_rng(0).bytes(4096), "not a PyTorch checkpoint"),
        "empty.pt": (b"", "empty"),
    }
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointFormatError, match=expected):
            _convert("clevr_change", tmp_path / name, tmp_path)
    enc, _ = snapshots["clevr_change_modules"]
    torch.save(enc.state_dict(), tmp_path / "plain.pt")
    with pytest.raises(CheckpointFormatError, match="bare state_dict"):
        _convert("clevr_change", tmp_path / "plain.pt", tmp_path)
    torch.save([torch.zeros(3)], tmp_path / "list.pt")
    with pytest.raises(CheckpointFormatError, match="holds a list"):
        _convert("clevr_change", tmp_path / "list.pt", tmp_path)
    torch.save({"change_detector_state": {}, "other": 1}, tmp_path / "partial.pt")
    with pytest.raises(CheckpointFormatError, match="lacks \\['speaker_state'\\]"):
        _convert("clevr_change", tmp_path / "partial.pt", tmp_path)
    with pytest.raises(FileNotFoundError):
        _convert("clevr_change", tmp_path / "absent.pt", tmp_path)
    with pytest.MonkeyPatch.context() as patch:  # torch is optional: a clear message without it
        patch.setitem(sys.modules, "torch", None)
        with pytest.raises(ImportError, match="pip install -r requirements-torch.txt"):
            _convert("clevr_change", snapshots["clevr_change"], tmp_path)
    assert not (tmp_path / "workdir" / "checkpoints").exists() or not any(
        (tmp_path / "workdir" / "checkpoints").iterdir())


def _save_importable(path: Path, obj, module: str, *classes: type) -> None:
    """``torch.save(obj, path)`` while ``classes`` import from ``module`` (pickle needs that to
    save them); afterwards the module is gone again, so the loader under test cannot import it."""
    names = module.split(".")
    with pytest.MonkeyPatch.context() as patch:
        for depth in range(1, len(names) + 1):
            child = types.ModuleType(".".join(names[:depth]))
            patch.setitem(sys.modules, child.__name__, child)
            if depth > 1:
                setattr(sys.modules[".".join(names[: depth - 1])], names[depth - 1], child)
        for cls in classes:
            setattr(child, cls.__qualname__, cls)
        torch.save(obj, path)
    assert module not in sys.modules


def test_official_attrdict_config(snapshots, tmp_path):
    """The official train.py pickles model_cfg as nested utils.attr_dict.AttrDict, which
    torch's weights-only loader refuses: the converter reads it, without --allow_pickle and
    without importing the class, as nested mappings whose values drive the heads check."""
    enc, dec = snapshots["clevr_change_modules"]
    path = tmp_path / "DIRL+CCR_checkpoint_15000.pt"
    saved = tsnapshot.save_official_snapshot(path, enc, dec)
    assert "utils.attr_dict" not in sys.modules
    with pytest.raises(pickle.UnpicklingError, match=r"utils\.attr_dict\.AttrDict"):
        torch.load(path, weights_only=True)

    snap = read_official_snapshot(path)
    cfg = snap.model_cfg
    for node in (cfg, cfg["model"], cfg["model"]["transformer_encoder"], cfg["train"]["optim"]):
        assert type(node) is ConfigNode  # the inert stand-in, not the pickled class
    assert cfg["model"]["transformer_encoder"]["att_head"] == 4
    assert cfg["model"]["transformer_decoder"]["share_wd_cls_weight"] is False
    assert cfg["train"]["optim"]["lr"] == 2e-4 and cfg["train"]["start_from"] is None
    assert cfg["gpu_id"] == [0] and cfg["data"]["train"]["max_samples"] is None
    assert cfg == saved["model_cfg"]
    assert snap.iteration == 15000 and not snap.ignored
    assert _convert("clevr_change", path, tmp_path).step == 15000
    config = make_config("clevr_change", tmp_path / "no_data")
    config.model.num_heads = 8  # the heads are read from the AttrDict config
    with pytest.raises(WrongModelError, match="att_head = \\[4\\]"):
        converter.convert_checkpoint(config, path, tmp_path / "w")


def test_other_config_classes_and_numpy_values(snapshots, tmp_path):
    """yacs CfgNode and a fork's AttrDict (another package path) read as inert mappings, with
    their pickled attributes; NumPy values a script adds to the dict load too."""
    enc, dec = snapshots["clevr_change_modules"]
    states = {"change_detector_state": enc.state_dict(), "speaker_state": dec.state_dict()}
    cfg_node = type("CfgNode", (dict,), {"__module__": "yacs.config"})
    cfg = cfg_node(model=cfg_node(transformer_encoder=cfg_node(att_head=4, feat_dim=RAW + 2)))
    cfg.__dict__.update({"__immutable__": True, "__deprecated_keys__": set()})
    _save_importable(tmp_path / "yacs_checkpoint_15000.pt", {**states, "model_cfg": cfg},
                     "yacs.config", cfg_node)
    snap = read_official_snapshot(tmp_path / "yacs_checkpoint_15000.pt")
    assert snap.iteration == 15000 and type(snap.model_cfg) is ConfigNode
    assert snap.model_cfg["model"]["transformer_encoder"]["att_head"] == 4
    assert snap.model_cfg.__dict__["__immutable__"] is True
    assert _convert("clevr_change", tmp_path / "yacs_checkpoint_15000.pt", tmp_path).step == 15000

    fork = type("AttrDict", (dict,), {"__module__": "lib.utils.attr_dict"})
    extras = {"iteration": np.int64(700), "best_cider": np.float64(1.25),
              "history": np.arange(3.0), "optimizer": {"lr": [2e-4], "step": torch.tensor(7)}}
    _save_importable(tmp_path / "fork.pt",
                     {**states, "model_cfg": fork(model=fork(att_head=4)), **extras},
                     "lib.utils.attr_dict", fork)
    snap = read_official_snapshot(tmp_path / "fork.pt")
    assert type(snap.model_cfg["model"]) is ConfigNode
    assert snap.model_cfg["model"]["att_head"] == 4
    assert snap.iteration == 700 and set(snap.ignored) == {"best_cider", "history", "optimizer"}
    loaded = load_torch_file(tmp_path / "fork.pt")
    assert loaded["best_cider"] == 1.25 and type(loaded["best_cider"]) is np.float64
    np.testing.assert_array_equal(loaded["history"], [0.0, 1.0, 2.0])
    assert int(loaded["optimizer"]["step"]) == 7


def test_refused_and_unimportable_classes(snapshots, tmp_path):
    """Any other pickled class is refused by name, with --allow_pickle as the way for trusted
    files; under --allow_pickle a class whose module is missing is reported as such, not as a
    damaged file."""
    import argparse

    enc, dec = snapshots["clevr_change_modules"]
    states = {"change_detector_state": enc.state_dict(), "speaker_state": dec.state_dict()}
    torch.save({**states, "model_cfg": argparse.Namespace(att_head=4)}, tmp_path / "ns.pt")
    with pytest.raises(CheckpointFormatError, match="argparse.Namespace.*--allow_pickle"):
        read_official_snapshot(tmp_path / "ns.pt")
    assert read_official_snapshot(tmp_path / "ns.pt", allow_pickle=True).model_cfg.att_head == 4

    payload = type("Payload", (), {"__module__": "evil.payload"})
    not_config = type("AttrDict", (dict,), {"__module__": "evil.payload"})  # wrong module
    for cls in (payload, not_config):
        path = tmp_path / f"{cls.__qualname__}.pt"
        _save_importable(path, {**states, "model_cfg": cls()}, "evil.payload", cls)
        with pytest.raises(CheckpointFormatError,
                           match=rf"pickles the Python object evil\.payload\.{cls.__qualname__}"
                                 r", which the safe loader does not construct.*--allow_pickle"):
            _convert("clevr_change", path, tmp_path)
        with pytest.raises(CheckpointFormatError) as info:
            _convert("clevr_change", path, tmp_path, allow_pickle=True)
        message = str(info.value)
        assert (f"pickles evil.payload.{cls.__qualname__}, whose module evil.payload cannot be "
                "imported here: ModuleNotFoundError: No module named 'evil'") in message
        assert "damaged" not in message and "truncated" not in message


def test_wrong_model(snapshots, tmp_path):
    with pytest.raises(WrongModelError, match="CLEVR-DC.*configs/dirl.py:clevr_dc"):
        _convert("clevr_change", snapshots["clevr_dc"], tmp_path)
    with pytest.raises(WrongModelError, match="CLEVR-Change.*configs/dirl.py:clevr_change"):
        _convert("clevr_dc", snapshots["clevr_change"], tmp_path)
    torch.manual_seed(0)
    cd = tscorer.ChangeDetector(feat_dim=RAW + 2, att_dim=16, att_head=2, grid_size=4)
    sp = tscorer.Speaker(vocab_size=12, word_dim=10, att_dim=16, att_head=2, seq_length=8)
    tsnapshot.save_official_snapshot(tmp_path / "scorer.pt", cd, sp)
    with pytest.raises(WrongModelError, match="SCORER"):
        _convert("clevr_change", tmp_path / "scorer.pt", tmp_path)
    # The heads are invisible in the weights; the snapshot's model_cfg says 4.
    config = make_config("clevr_change", tmp_path / "no_data")
    config.model.num_heads = 8
    with pytest.raises(WrongModelError, match="att_head = \\[4\\]"):
        converter.convert_checkpoint(config, snapshots["clevr_change"], tmp_path / "w")


def _edited(snapshots, tmp_path: Path, edit) -> Path:
    saved = tsnapshot.load_official_snapshot(snapshots["clevr_change"])
    edit(saved)
    path = tmp_path / "edited.pt"
    tsnapshot.torch_save(saved, path)
    return path


def test_missing_unexpected_and_misshaped_keys(snapshots, tmp_path):
    key = "core.layer.0.linear1.weight"
    path = _edited(snapshots, tmp_path,
                   lambda s: s["speaker_state"].__setitem__(key, torch.zeros(100, 64)))
    with pytest.raises(KeyMismatchError) as info:
        _convert("clevr_change", path, tmp_path)
    message = str(info.value)
    assert f"speaker_state:{key}" in message and "(100, 64)" in message
    assert "(128, 64)" in message and "config.model.ffn_dim" in message

    path = _edited(snapshots, tmp_path,
                   lambda s: s["speaker_state"].pop("core.layer.1.norm2.bias"))
    with pytest.raises(KeyMismatchError, match="missing key speaker_state:core.layer.1.norm2.bias"):
        _convert("clevr_change", path, tmp_path)

    path = _edited(snapshots, tmp_path, lambda s: s["change_detector_state"].__setitem__(
        "transformer.2.norm1.weight", torch.ones(64)))
    with pytest.raises(KeyMismatchError,
                       match=r"unexpected key change_detector_state:transformer.2.norm1.weight "
                             r"with shape \(64,\)"):
        _convert("clevr_change", path, tmp_path)

    def bad_pe(s):
        s["speaker_state"]["core.position_enc.pe"] = s["speaker_state"]["core.position_enc.pe"] + 1
    with pytest.raises(KeyMismatchError, match="core.position_enc.pe: the buffer differs"):
        _convert("clevr_change", _edited(snapshots, tmp_path, bad_pe), tmp_path)


def test_extra_parameter_policy(snapshots, tmp_path, monkeypatch):
    """The SCORER/CBR path (parameters the official snapshot lacks), exercised on DIRL by
    declaring its ``logit`` layer a non-official source."""
    base = registry.CONVERTERS["dirl"]

    def table(model, sizes):
        return [dataclasses.replace(e, source="generator") if e.key.startswith("logit.") else e
                for e in base.table(model, sizes)]

    spec = dataclasses.replace(base, table=table, sources=(
        *base.sources, tables.Source("generator", False, "test head")))
    monkeypatch.setitem(registry.CONVERTERS, "dirl", spec)
    enc, dec = snapshots["clevr_change_modules"]
    logit = {"logit.weight": dec.logit.weight.detach(), "logit.bias": dec.logit.bias.detach()}
    path = _edited(snapshots, tmp_path, lambda s: [s["speaker_state"].pop(k) for k in logit])

    with pytest.raises(ConversionError, match="(?s)decoder/logit/bias.*--extra_params"):
        _convert("clevr_change", path, tmp_path)

    config = make_config("clevr_change", tmp_path / "no_data")
    snapshot = read_official_snapshot(path)
    torch.save(logit, tmp_path / "extra.pt")
    extra = converter.read_extra_params(spec, tmp_path / "extra.pt")  # what --extra_params reads
    report = converter.ConversionReport("x", "dirl", "clevr_change", sizes(), None)
    params = converter.convert_params(config, snapshot, sizes(), extra_states=extra,
                                      report=report)
    assert report.from_extra_params == ["generator:logit.weight", "generator:logit.bias"]
    assert not report.initialised
    np.testing.assert_array_equal(np.asarray(params["decoder"]["logit"]["kernel"]),
                                  logit["logit.weight"].numpy().T)

    report = converter.ConversionReport("x", "dirl", "clevr_change", sizes(), None)
    params = converter.convert_params(config, snapshot, sizes(), missing="init", report=report)
    assert report.initialised == ["decoder/logit/bias", "decoder/logit/kernel"]
    assert params["decoder"]["logit"]["kernel"].shape == (64, VOCAB)

    torch.save({"logit.weight": logit["logit.weight"][:5]}, tmp_path / "bad_extra.pt")
    with pytest.raises(KeyMismatchError) as info:
        _convert("clevr_change", path, tmp_path / "b", extra_params=tmp_path / "bad_extra.pt")
    assert "generator:logit.weight: the checkpoint has shape (5, 64)" in str(info.value)
    assert "missing key generator:logit.bias" in str(info.value)


# ---------------------------------------------------------------------------------------------
# End to end: convert -> evaluate_checkpoint on the tiny synthetic dataset
# ---------------------------------------------------------------------------------------------


def test_convert_then_evaluate(small_synthetic, tmp_path):
    from train_helpers import SMALL, tiny_config

    data_dir = small_synthetic.directory.parents[2]
    config = tiny_config(str(data_dir), final_eval_splits=("test",), spice="off")
    assert dict(config.dataset.options) == SMALL
    vocab = len(small_synthetic.vocab)
    h, w, c = small_synthetic.meta.feature_shape
    m = config.model
    torch.manual_seed(5)
    enc, dec = tdirl.build_dirl("clevr_change", feat_dim=c + 2, att_dim=m.hidden_dim,
                                att_head=m.num_heads, mlp_dim=m.mlp_hidden_dim, grid_size=h,
                                vocab_size=vocab, seq_length=small_synthetic.meta.max_caption_len,
                                word_dim=m.word_dim, ffn_dim=m.ffn_dim)

    # A vocabulary-dependent shape that disagrees with the dataset is named with both shapes.
    torch.manual_seed(5)
    _, small_dec = tdirl.build_dirl("clevr_change", feat_dim=c + 2, att_dim=m.hidden_dim,
                                    att_head=m.num_heads, mlp_dim=m.mlp_hidden_dim, grid_size=h,
                                    vocab_size=vocab - 3, word_dim=m.word_dim, ffn_dim=m.ffn_dim)
    tsnapshot.save_official_snapshot(tmp_path / "wrong_vocab.pt", enc, small_dec)
    with pytest.raises(KeyMismatchError) as info:
        converter.convert_checkpoint(config, tmp_path / "wrong_vocab.pt", tmp_path / "x")
    message = str(info.value)
    assert f"speaker_state:core.embed.weight: the checkpoint has shape ({vocab - 3}, " in message
    assert f"expects ({vocab}, {m.word_dim})" in message and "dataset 'synthetic'" in message

    path = tmp_path / "dirl_ccr_synthetic_checkpoint_300.pt"
    tsnapshot.save_official_snapshot(path, enc, dec)
    workdir = tmp_path / "workdir"
    report = converter.convert_checkpoint(config, path, workdir)
    assert report.dataset == "synthetic" and report.saved_data_iterator and report.step == 300
    results = captioning.evaluate_checkpoint(config, workdir)
    metrics_file = workdir / "metrics" / "test_300.json"
    assert metrics_file.exists(), sorted(p.name for p in workdir.rglob("*"))
    metrics = json.loads(metrics_file.read_text())
    assert "CIDEr" in metrics and metrics["CIDEr"] == pytest.approx(results["test"]["CIDEr"])
    with pytest.raises(ConversionError, match="already holds checkpoints"):
        converter.convert_checkpoint(config, path, workdir)
