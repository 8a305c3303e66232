"""Official SCORER+CBR snapshot (+ the CBR state_dict) -> orbax checkpoint (changecap_jax/convert),
checked against the independent torch reference (tools/torch_reference/scorer.py).

Reference: docs/official/ §1.1 (conversion rules), §3 (SCORER+CBR), §3.6
(snapshot), §7 (parity checklist), Appendix A (keys). Random seeded weights at small sizes
(hidden 64, 4 heads, 2 + 2 layers, 5x5 grid, vocabulary 30, captions of 12), float32 on CPU,
eval mode: memory, the last layer's S1 / S2, decoder logits, caption CE, L_sim and L_cbr per
pair and mean within 1e-5; gradients of every encoder / decoder tensor within 1e-4 of its
largest entry (CBR is frozen); one Adam step within 1e-5 with CBR unchanged and the logit-scale
clamp; greedy captions identical on 32 pairs. Plus default-size key completeness and the error
cases (other model, CBR missing, wrong shape).
"""

from __future__ import annotations

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
    ConversionError,
    KeyMismatchError,
    WrongModelError,
    compare,
    converter,
    registry,
    tables,
)
from changecap_jax.convert.models import scorer as scorer_converter  # noqa: E402
from changecap_jax.convert.models.scorer import GENERATOR  # noqa: E402
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER  # noqa: E402
from changecap_jax.decoding import search  # noqa: E402
from changecap_jax.trainers import caption_step, captioning, optimizers, update  # noqa: E402
from tools.torch_reference import dirl as tdirl  # noqa: E402
from tools.torch_reference import scorer as tscorer  # noqa: E402

pytestmark = pytest.mark.torch

RAW = 16  # feature channels before AddSpatialInfo
GRID, VOCAB, SEQ, HID, HEADS, WORD = 5, 30, 12, 64, 4, 48
FLAX_SIZES = dict(hidden_dim=HID, num_heads=HEADS, encoder_layers=2, decoder_layers=2,
                  word_dim=WORD, dropout_rate=0.0)
B = 8  # divisible by the 8 simulated devices (the trainer's loss runs under shard_map)
STREAMS = {"semantic": ("after_sc", "labels", "masks", "pos"),
           "distractor": ("after_nsc", "no_chg_labels", "no_chg_masks", "neg")}
LN100 = float(np.log(100.0))
REPORT: dict[str, str] = {}  # measured differences, printed at the end (pytest -s)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for line in REPORT.values():
        print(line)


def make_config(data_dir: Path):
    from configs import scorer as scorer_configs

    config = scorer_configs.get_config("clevr_change")
    config.model.update(FLAX_SIZES)
    config.dataset.data_dir = str(data_dir)  # an empty dir: the dataset is unavailable
    return config


def torch_models(seed: int = 0):
    torch.manual_seed(seed)
    enc = tscorer.ChangeDetector(feat_dim=RAW + 2, att_dim=HID, att_head=HEADS, num_layers=2,
                                 grid_size=GRID, dropout=0.0)
    dec = tscorer.Speaker(vocab_size=VOCAB, word_dim=WORD, att_dim=HID, att_head=HEADS,
                          num_layers=2, seq_length=SEQ, dropout=0.0)
    gen = tscorer.CBR(att_dim=HID, att_head=HEADS)
    with torch.no_grad():  # random, non-trivial scales (init 1.0 everywhere)
        enc.scorer[0].attention.logit_scale.fill_(0.7)
        enc.scorer[1].attention.logit_scale.fill_(1.3)
        gen.contra.logit_scale.fill_(0.9)
    return enc.eval(), dec.eval(), gen.eval()


def random_captions(rng: np.random.Generator, n: int, length: int = SEQ) -> np.ndarray:
    ids = np.zeros((n, length), np.int32)
    for i in range(n):
        words = rng.integers(1, length - 1)
        ids[i, 0] = 2
        ids[i, 1 : 1 + words] = rng.integers(4, VOCAB, size=words)
        ids[i, 1 + words] = 3
    return ids


def torch_grid(x: np.ndarray):
    t = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous()
    return tscorer.add_spatial_info(t)


def make_batch(n: int, seed: int):
    rng = np.random.default_rng(seed)
    feats = [rng.random((n, GRID, GRID, RAW), dtype=np.float32) for _ in range(3)]
    caps = [random_captions(rng, n), random_captions(rng, n)]
    ours = {"before": feats[0], "after_semantic": feats[1], "after_distractor": feats[2],
            "change_caption": caps[0], "no_change_caption": caps[1]}
    kw = dict(before=torch_grid(feats[0]), after_sc=torch_grid(feats[1]),
              after_nsc=torch_grid(feats[2]))
    for ids, (lab, tgt, msk) in ((caps[0], ("labels", "targets", "masks")),
                                 (caps[1], ("no_chg_labels", "no_chg_targets", "no_chg_masks"))):
        labels = torch.from_numpy(ids).long()
        kw[lab], kw[tgt], kw[msk] = (labels, tscorer.labels_with_ignore(labels),
                                     tscorer.caption_mask(labels))
    return ours, kw


def torch_states(enc, dec, gen, what: str = "tensor") -> dict:
    def grab(module):
        if what == "grad":  # None = unused (scorer.0's logit scale, S-Q3): a zero gradient
            return {k: np.zeros(tuple(p.shape), np.float32) if p.grad is None
                    else p.grad.detach().numpy().copy() for k, p in module.named_parameters()}
        return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}

    return {ENCODER: grab(enc), DECODER: grab(dec), GENERATOR: grab(gen)}


def sizes() -> tables.Sizes:
    return tables.Sizes(VOCAB, SEQ, RAW, GRID, GRID, "test")


def diff(name: str, ours, ref, tol: float, *, rel: bool = False) -> tuple[float, float]:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    d = float(np.max(np.abs(ours - ref))) if ours.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    limit = tol * scale if rel else tol
    assert d <= limit, f"{name}: max |diff| {d:.3g} > {limit:.3g} (max |ref| {scale:.3g})"
    return d, d / scale if scale else 0.0


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert_scorer")
    enc, dec, gen = torch_models(seed=1)
    path = tmp / "scorer_clevr_change_checkpoint_700.pt"
    tsnapshot.save_official_snapshot(path, enc, dec)
    cbr_path = tmp / "cbr.pt"
    tsnapshot.save_cbr_state(cbr_path, gen)
    config = make_config(tmp / "no_data")
    report = converter.convert_checkpoint(config, path, tmp / "workdir", extra_params=cbr_path)
    assert report.step == 700 and report.dataset is None and not report.initialised
    assert len(report.from_extra_params) == 11  # torch tensors of CBR (13 Flax params)
    return enc, dec, gen, path, tmp / "workdir", config


def test_parity_forward_grad_adam_greedy(converted):
    enc, dec, gen, snapshot_path, workdir, config = converted
    params = compare.load_params(workdir)
    entries = scorer_converter.table(config.model, sizes())
    converted_flat = tables.apply_table(entries, torch_states(enc, dec, gen))
    flat_params = flax.traverse_util.flatten_dict(params, sep="/")
    assert set(flat_params) == set(converted_flat)
    for path, value in converted_flat.items():
        np.testing.assert_array_equal(np.asarray(flat_params[path]), value, err_msg=path)
    ours_batch, tb = make_batch(B, seed=2)
    _check_forward(config, workdir, ours_batch, tb, enc, dec, gen)
    model, gradients = _check_gradients(config, params, ours_batch, tb, enc, dec, gen, entries)
    _check_adam_step(config, model, params, gradients, enc, dec, gen, entries, converted_flat)
    _check_greedy(model, snapshot_path, enc, dec, gen, entries)


def _check_forward(config, workdir, ours_batch, tb, enc, dec, gen) -> None:
    """Forward (eval mode): every intermediate of forward_outputs against the torch modules."""
    out = compare.forward_outputs(config, workdir, ours_batch)
    worst: dict[str, tuple[float, float]] = {}

    def track(group: str, name: str, ours, want, tol: float = 1e-5) -> None:
        d = diff(f"{group} {name}", ours, want, tol)
        old = worst.get(group, (0.0, 0.0))
        worst[group] = (max(old[0], d[0]), max(old[1], d[1]))

    with torch.no_grad():
        ref = tscorer.scorer_losses(enc, dec, gen, **tb)
        for stream, (after_key, lab, msk, tag) in STREAMS.items():
            e = enc(tb["before"], tb[after_key])
            track("encoder memory", stream, out[f"encoder/{stream}/memory"], e.memory)
            track("encoder X0", stream, out[f"encoder/{stream}/tokens_before"], e.input_bef)
            track("encoder X0", stream, out[f"encoder/{stream}/tokens_after"], e.input_aft)
            track("S1 / S2 (last layer)", stream, out[f"encoder/{stream}/sim_before"],
                  e.sim_bef)
            track("S1 / S2 (last layer)", stream, out[f"encoder/{stream}/sim_after"],
                  e.sim_aft)
            logits, sent = dec(e.memory, tb[lab], tb[msk])
            track("decoder logits", stream, out[f"logits/{stream}"], logits)
            track("decoder sentence", stream, out[f"decoder/{stream}/sentence"], sent)
            hall = gen.hallucinate(e.input_bef, sent, tb[msk])
            track("CBR hallucination", stream, out[f"cbr.hallucinate/{stream}"], hall)
            track("caption CE", stream, out[f"caption_ce/{stream}"], ref[f"cap_{tag}"])
            track("aux sim", stream, out[f"aux/sim/{stream}"], ref[f"sim_{tag}"])
            track("aux cbr", stream, out[f"aux/cbr/{stream}"], ref[f"cbr_{tag}"])
        track("caption CE", "mean", out["caption_ce"], ref["cap"])
        track("aux sim", "mean", out["aux/sim"], ref["sim"])
        track("aux cbr", "mean", out["aux/cbr"], ref["cbr"])
        track("total loss", "total", out["loss"], ref["total"])
    for group, (a, r) in worst.items():
        REPORT[group] = f"PARITY scorer {group:24s} max abs {a:.2e}  max rel {r:.2e}"


def _check_gradients(config, params, ours_batch, tb, enc, dec, gen, entries):
    """Gradients of the trainer's loss (8-device shard_map) vs torch backward; returns the
    model and (our gradients, flat, torch's by Flax path, the float-noise paths, the largest
    torch gradient entry)."""
    model = models.build(config.model, vocab_size=VOCAB, max_len=SEQ)
    mesh = parallel.make_mesh()
    loss_fn = caption_step.make_loss_fn(model, dict(config.loss_weights), mesh)
    sharded = jax.device_put({k: jnp.asarray(v) for k, v in ours_batch.items()},
                             parallel.batch_sharding(mesh))
    grad_fn = jax.jit(jax.grad(lambda p: loss_fn(p, sharded, jax.random.PRNGKey(0))[0]))
    grads = update.zero_gradient_rows(grad_fn(jax.device_put(params, parallel.replicated(mesh))),
                                     dict(config.optim.zero_grad_rows))
    grads = jax.device_get(grads)
    flat_grads = {k: np.asarray(v) for k, v in
                  flax.traverse_util.flatten_dict(grads, sep="/").items()}
    for module in (enc, dec, gen):
        module.zero_grad()
    tscorer.scorer_losses(enc, dec, gen, **tb)["total"].backward()
    torch_grads = torch_states(enc, dec, gen, "grad")
    torch_grads.pop(GENERATOR)  # CBR is frozen: only encoder / decoder grads matter
    ref_grads = tables.apply_table(entries, torch_grads)
    assert set(ref_grads) == {p for p in flat_grads if not p.startswith("cbr/")}
    largest = max(np.abs(g).max() for g in ref_grads.values())
    worst_rel, noise = 0.0, []
    for path, want in ref_grads.items():
        got, scale = flat_grads[path], np.abs(want).max()
        if scale < 1e-6 * largest:  # analytically zero (e.g. key biases under softmax)
            assert np.abs(got).max() < 1e-6 * largest, path
            noise.append(path)
            continue
        worst_rel = max(worst_rel, diff(path, got, want, 1e-4, rel=True)[1])
    assert not flat_grads["decoder/embed/embedding"][0].any()
    assert not ref_grads["decoder/embed/embedding"][0].any()
    REPORT["grads"] = (f"PARITY scorer {'gradients (per tensor)':24s} max rel {worst_rel:.2e} "
                       f"over {len(ref_grads) - len(noise)} tensors; analytically zero: {noise}")
    return model, (grads, flat_grads, ref_grads, noise, largest)


def _check_adam_step(config, model, params, gradients, enc, dec, gen, entries,
                     converted_flat) -> None:
    """One Adam step (CBR frozen) + the logit-scale clamp."""
    grads, flat_grads, ref_grads, noise, largest = gradients
    # Both sides start the step with the clamped scales above ln 100, so the clamp acts.
    last = "encoder/scorer_1/attention/logit_scale"
    start = jax.tree.map(jnp.asarray, params)
    start["encoder"]["scorer_1"]["attention"]["logit_scale"] = jnp.float32(4.7)
    start["cbr"]["contra"]["logit_scale"] = jnp.float32(4.8)
    with torch.no_grad():
        enc.scorer[1].attention.logit_scale.fill_(4.7)
        gen.contra.logit_scale.fill_(4.8)
    optimizer, _ = optimizers.make_optimizer(config.optim, steps_per_epoch=100)
    updates, _ = optimizer.update(grads, optimizer.init(start), start)
    stepped = model.post_update(optax.apply_updates(start, updates))
    stepped = {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(stepped,
                                                                             sep="/").items()}
    torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=2e-4, betas=(0.9, 0.999),
                     eps=1e-8).step()
    tscorer.clamp_logit_scales(enc, gen)
    ref_stepped = tables.apply_table(entries, torch_states(enc, dec, gen))
    assert float(ref_stepped[last]) == pytest.approx(LN100, abs=1e-7)
    np.testing.assert_allclose(stepped[last], LN100, atol=1e-6)
    np.testing.assert_allclose(stepped["cbr/contra/logit_scale"], LN100, atol=1e-6)
    np.testing.assert_allclose(ref_stepped["cbr/contra/logit_scale"], LN100, atol=1e-6)
    worst_adam, compared, skipped = 0.0, 0, 0
    for path, want in ref_stepped.items():
        got = stepped[path]
        if path.startswith("cbr/"):
            if path != "cbr/contra/logit_scale":  # frozen: exactly the converted values
                np.testing.assert_array_equal(got, converted_flat[path], err_msg=path)
                np.testing.assert_array_equal(want, converted_flat[path], err_msg=path)
            continue
        if path in noise:
            skipped += want.size
            continue
        g_ref, g_ours = ref_grads[path], flat_grads[path]
        real = (np.abs(g_ref) > 1e-6 * largest) | ((g_ref == 0) & (g_ours == 0))
        skipped += int((~real).sum())
        d = np.abs(got - want)[real]
        compared += int(real.sum())
        worst_adam = max(worst_adam, float(d.max()) if d.size else 0.0)
        assert worst_adam <= 1e-5, (path, worst_adam)
    REPORT["adam"] = (f"PARITY scorer {'Adam step params':24s} max abs {worst_adam:.2e} over "
                      f"{compared} entries ({skipped} float-noise gradient entries not compared);"
                      " CBR unchanged, clamp to ln 100 matches")


def _check_greedy(model, snapshot_path, enc, dec, gen, entries) -> None:
    """Greedy captions on 32 random pairs. The Speaker's N(0, 0.02) init makes an untrained
    model's captions nearly independent of the pair: the (pre-step) decoder matrices are
    scaled by 10 and END gets a bias of 4, on the torch side, and the edited weights go
    through the key table again."""
    rng = np.random.default_rng(3)
    before, after = (rng.random((32, GRID, GRID, RAW), dtype=np.float32)
                     + 3 * rng.standard_normal((32, 1, 1, RAW), dtype=np.float32)
                     for _ in range(2))
    with torch.no_grad():
        saved = tsnapshot.load_official_snapshot(snapshot_path)
        enc.load_state_dict(saved["change_detector_state"])
        dec.load_state_dict(saved["speaker_state"])
        for name, p in dec.named_parameters():
            if name.endswith("weight") and p.ndim == 2:
                p.mul_(10.0)
        dec.logit.bias[3] += 4.0
        memory = enc(torch_grid(before), torch_grid(after)).memory
        ref_ids = tscorer.sample(dec, memory, sample_max=True, max_len=SEQ).ids
    edited = flax.traverse_util.unflatten_dict(
        {k: jnp.asarray(v) for k, v in
         tables.apply_table(entries, torch_states(enc, dec, gen)).items()}, sep="/")
    ours_ids = search.greedy_decode(model, {"params": edited}, jnp.asarray(before),
                                      jnp.asarray(after), max_len=SEQ).ids
    np.testing.assert_array_equal(np.asarray(ours_ids), ref_ids.numpy())
    lengths = (ref_ids.numpy() != 0).sum(1)
    distinct = len({tuple(row) for row in ref_ids.tolist()})
    assert distinct >= 8 and lengths.min() < lengths.max(), (distinct, lengths)
    REPORT["greedy"] = (f"PARITY scorer {'greedy captions (32)':24s} identical; {distinct} "
                        f"distinct, lengths {lengths.min()}..{lengths.max()}")


def test_default_sizes_complete(tmp_path):
    from configs import scorer as scorer_configs

    torch.manual_seed(0)
    enc, dec, gen = tscorer.ChangeDetector(), tscorer.Speaker(), tscorer.CBR()
    states = torch_states(enc, dec, gen)
    extra = {GENERATOR: states.pop(GENERATOR)}
    snapshot = converter.OfficialSnapshot(tmp_path / "x.pt", states, None, None)
    config = scorer_configs.get_config("clevr_change")
    config.dataset.data_dir = str(tmp_path / "no_data")
    spec = registry.converter_for("scorer")
    spec.check_identity(config.model, states, None)
    found = spec.sizes_from_states(config.model, states)
    assert (found.vocab_size, found.max_len, found.feature_channels, found.grid_height) == (
        76, 24, 1024, 14)
    entries = spec.table(config.model, found)
    count = {s: sum(int(np.prod(e.shape)) for e in entries if e.source == s and e.targets)
             for s in (ENCODER, DECODER, GENERATOR)}
    assert count == {ENCODER: 2_635_778, DECODER: 4_425_564,
                     GENERATOR: 2_361_345}
    report = converter.ConversionReport("x", "scorer", None, found, None)
    params = converter.convert_params(config, snapshot, found, extra_states=extra,
                                      report=report)
    assert report.num_params == 2_635_778 + 4_425_564 + 2_361_345
    assert report.buffers_checked == ["speaker_state:core.position_enc.pe"]
    assert not report.initialised
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    in_proj = extra[GENERATOR]["mh_att.in_proj_weight"]
    np.testing.assert_array_equal(flat["cbr/mh_att/v_proj/kernel"], in_proj[1024:].T)
    np.testing.assert_array_equal(flat["encoder/img_0/kernel"],
                                  states[ENCODER]["img.0.weight"][:, :, 0, 0].T)


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("snapshots")
    enc, dec, gen = torch_models(seed=4)
    out = {"scorer": tmp / "scorer.pt", "cbr": tmp / "cbr.pt", "dirl": tmp / "dirl.pt"}
    tsnapshot.save_official_snapshot(out["scorer"], enc, dec)
    tsnapshot.save_cbr_state(out["cbr"], gen)
    torch.manual_seed(4)
    denc, ddec = tdirl.build_dirl("clevr_change", feat_dim=RAW + 2, att_dim=HID, att_head=HEADS,
                                  num_layers=2, mlp_dim=128, grid_size=GRID, vocab_size=VOCAB,
                                  seq_length=SEQ, word_dim=WORD, ffn_dim=128)
    tsnapshot.save_official_snapshot(out["dirl"], denc, ddec)
    return out


def _convert(path: Path, tmp_path: Path, **kw):
    return converter.convert_checkpoint(make_config(tmp_path / "no_data"), path,
                                        tmp_path / "workdir", **kw)


def test_wrong_model(snapshots, tmp_path):
    with pytest.raises(WrongModelError, match="DIRL.*'scorer'"):
        _convert(snapshots["dirl"], tmp_path, extra_params=snapshots["cbr"])


def test_missing_cbr_policy(snapshots, tmp_path):
    with pytest.raises(ConversionError, match=r"(?s)cbr/.*generator \(CBR.*--extra_params"):
        _convert(snapshots["scorer"], tmp_path, missing="error")
    report = _convert(snapshots["scorer"], tmp_path, missing="init")
    assert report.initialised and all(p.startswith("cbr/") for p in report.initialised)
    assert len(report.initialised) == 13 and "initialised (--missing=init)" in report.summary()
    params = flax.traverse_util.flatten_dict(compare.load_params(tmp_path / "workdir"), sep="/")
    assert float(params["cbr/contra/logit_scale"]) == 1.0  # the trainer's init, not the file's


def test_wrong_shaped_key(snapshots, tmp_path):
    saved = tsnapshot.load_official_snapshot(snapshots["scorer"])
    saved["speaker_state"]["core.fc.0.weight"] = torch.zeros(HID, WORD + 1)
    bad = tmp_path / "bad.pt"
    tsnapshot.torch_save(saved, bad)
    with pytest.raises(KeyMismatchError, match=r"speaker_state:core\.fc\.0\.weight.*\(64, 49\)"
                       r".*\(64, 48\)") as info:
        _convert(bad, tmp_path, extra_params=snapshots["cbr"])
    assert len(info.value.problems) == 1
    cbr = torch.load(snapshots["cbr"], weights_only=True)
    cbr["conv1.weight"] = cbr["conv1.weight"][:, :HID]
    bad_cbr = tmp_path / "bad_cbr.pt"
    torch.save(cbr, bad_cbr)
    with pytest.raises(KeyMismatchError, match=r"generator:conv1\.weight"):
        _convert(snapshots["scorer"], tmp_path, extra_params=bad_cbr)


# ---------------------------------------------------------------------------------------------
# End to end: the convert command (with --extra_params) -> evaluate_checkpoint on tiny synthetic
# ---------------------------------------------------------------------------------------------


def test_convert_command_then_evaluate(small_synthetic, tmp_path):
    import json
    import os
    import subprocess
    import sys

    from train_helpers import SMALL

    root = Path(__file__).resolve().parents[1]
    data_dir = small_synthetic.directory.parents[2]
    vocab = len(small_synthetic.vocab)
    h, _, c = small_synthetic.meta.feature_shape
    seq = small_synthetic.meta.max_caption_len
    torch.manual_seed(3)
    enc = tscorer.ChangeDetector(feat_dim=c + 2, att_dim=32, att_head=4, num_layers=2,
                                 grid_size=h, dropout=0.0)
    dec = tscorer.Speaker(vocab_size=vocab, word_dim=16, att_dim=32, att_head=4, num_layers=2,
                          seq_length=seq, dropout=0.0)
    gen = tscorer.CBR(att_dim=32, att_head=4)
    path = tmp_path / "scorer_synthetic_checkpoint_40.pt"
    tsnapshot.save_official_snapshot(path, enc.eval(), dec.eval())
    cbr_path = tmp_path / "cbr.pt"
    tsnapshot.save_cbr_state(cbr_path, gen.eval())

    workdir = tmp_path / "workdir"
    overrides = [f"--config.dataset.data_dir={data_dir}",
                 *(f"--config.dataset.options.{k}={v}" for k, v in SMALL.items()),
                 "--config.model.hidden_dim=32", "--config.model.num_heads=4",
                 "--config.model.word_dim=16", "--config.eval_batch_size=8",
                 "--config.final_eval_splits=('test',)", "--config.spice=off"]
    args = [sys.executable, "-m", "changecap_jax.convert",
            f"--config={root / 'configs/scorer.py'}:synthetic", *overrides,
            f"--torch_checkpoint={path}", f"--extra_params={cbr_path}", f"--workdir={workdir}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote step 40" in done.stdout, done.stdout

    # The converted parameters are the torch tensors (spot check: decoder embedding, CBR).
    params = flax.traverse_util.flatten_dict(compare.load_params(workdir), sep="/")
    np.testing.assert_array_equal(params["decoder/embed/embedding"],
                                  dec.state_dict()["core.embed.weight"].numpy())
    np.testing.assert_array_equal(params["cbr/contra/logit_scale"],
                                  gen.state_dict()["contra.logit_scale"].numpy().reshape(
                                      params["cbr/contra/logit_scale"].shape))

    from configs import scorer as scorer_configs

    config = scorer_configs.get_config("synthetic")
    config.dataset.data_dir = str(data_dir)
    config.dataset.options = dict(SMALL)
    config.model.update(hidden_dim=32, num_heads=4, word_dim=16)
    config.update(eval_batch_size=8, final_eval_splits=("test",))
    config.spice = "off"
    results = captioning.evaluate_checkpoint(config, workdir)
    metrics = json.loads((workdir / "metrics" / "test_40.json").read_text())
    assert metrics["CIDEr"] == pytest.approx(results["test"]["CIDEr"])
    assert set(metrics) >= {"Bleu_4", "METEOR", "ROUGE_L", "CIDEr"}
