"""DIRL + MEDIC against the official code (``VisualAIKHU/MEDIC``: ``models/model.py`` DIRL with
the router and experts, ``models/CCR_expert.py`` CCR): the official modules are imported from
the checkout named by ``CHANGECAP_OFFICIAL_MEDIC`` (skipped without it), their weights copied
into ours, and every forward tensor (difference features, routing logits, expert output), each
loss term, the gradient of the total loss (the weights of ``train/train_chg_final.py``) and the
greedy ids compared in float32.

    CHANGECAP_OFFICIAL_MEDIC=/path/to/MEDIC python -m pytest -q -n 0 tests/test_medic_official.py

Tiny sizes (hidden 16, 2 heads, 4x4 grid, batch 8) with MEDIC's own fixed sizes (classifier
width 512, 100 memory slots); dropout 0 on both sides. One pair (the semantic one) per example.
"""

from __future__ import annotations

import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from changecap_jax.convert import tables
from changecap_jax.convert.models import dirl as dirl_converter
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.data import streams
from changecap_jax.models import dirl, medic
from changecap_jax.trainers import update

OFFICIAL = os.environ.get("CHANGECAP_OFFICIAL_MEDIC")
pytestmark = pytest.mark.skipif(
    not OFFICIAL, reason="set CHANGECAP_OFFICIAL_MEDIC to a checkout of VisualAIKHU/MEDIC")
torch = pytest.importorskip("torch")

B, H, W, C, HID, HEADS, L, V = 8, 4, 4, 6, 16, 2, 7, 11
LABELS = np.array([0, 1, 2, 3, 4, 5, 0, 5])  # official indices: five types, 5 = no change
WEIGHTS = {"dirl": 0.03, "ccr": 0.05, "change_cls": 0.1, "change_type_cls": 0.1,
           "expert_disentangle": 0.1, "expert_consistency": 0.1}
TOL = dict(rtol=2e-4, atol=2e-5)


def _official_cfg() -> types.SimpleNamespace:
    ns = types.SimpleNamespace
    enc = ns(feat_dim=C, att_dim=HID, att_head=HEADS, emb_dim=HID, att_layer=1)
    dec = ns(vocab_size=V, word_dim=8, att_dim=HID, att_head=HEADS, att_layer=1, seq_length=L,
             share_wd_cls_weight=False, label_smoothing=0.0)
    return ns(model=ns(transformer_encoder=enc, transformer_decoder=dec), cls_temperature=1.0,
              type_temperature=1.0,
              loss=ns(margin_inter=0.2, margin_intra=0.7, lambda_inter=1.0, lambda_intra=1.0))


def _official_modules():
    sys.path.insert(0, OFFICIAL)
    try:
        from models.CCR_expert import CCR
        from models.model import DIRL
    finally:
        sys.path.remove(OFFICIAL)
    torch.manual_seed(0)
    cfg = _official_cfg()
    det, spk = DIRL(cfg), CCR(cfg)
    for expert in [*det.expert_modules_change, det.expert_module_no_change]:
        expert.reset_parameters()
    for m in [*det.modules(), *spk.modules()]:  # dropout off (our side: dropout_rate 0)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0
    return det.train(), spk.train()


def _ours() -> dirl.DIRLCCR:
    return dirl.DIRLCCR(
        vocab_size=V, max_len=L, variant="clevr_dc", pairs="semantic_only",
        use_coordinates=False, hidden_dim=HID, num_heads=HEADS, encoder_layers=1,
        decoder_layers=1, word_dim=8, ffn_dim=4 * HID, mlp_hidden_dim=4 * HID, dropout_rate=0.0,
        medic={"dataset_types": list(medic.TYPE_NAMES)})


def _to_ours(det_state: dict, spk_state: dict, model: dirl.DIRLCCR) -> dict:
    sizes = tables.Sizes(vocab_size=V, max_len=L, feature_channels=C, grid_height=H,
                         grid_width=W, origin="test")
    cfg = types.SimpleNamespace(**{f: getattr(model, f) for f in (
        "variant", "hidden_dim", "use_coordinates", "word_dim", "ffn_dim", "mlp_hidden_dim",
        "encoder_layers", "decoder_layers", "max_len", "medic")})
    # The converter's key table (MEDIC's keys included), without its checks: gradients too.
    flat = tables.apply_table(dirl_converter.table(cfg, sizes),
                              {ENCODER: det_state, DECODER: spk_state})
    for axis, n in (("w", W), ("h", H)):  # the official tables have 14 rows; we use the grid's
        key = f"encoder/pos_embedding/{axis}_embedding"
        flat[key] = flat[key][:n]
    return traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in flat.items()}, sep="/")


def _numpy_state(module, grads: bool = False) -> dict:
    value = lambda p: p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
    return {k: value(p).detach().numpy().copy() for k, p in module.named_parameters()}


def _batch(rng: np.random.Generator, grid: int = H) -> dict[str, np.ndarray]:
    ids = np.zeros((B, L), np.int64)
    for b in range(B):
        n = rng.integers(3, L)
        ids[b, :n] = np.concatenate([[2], rng.integers(4, V, n - 2), [3]])
    return {"before": rng.normal(size=(B, grid, grid, C)).astype(np.float32),
            "after_semantic": rng.normal(size=(B, grid, grid, C)).astype(np.float32),
            "change_caption": ids, "change_type": LABELS}


def _official_forward(det, spk, batch, probes):
    grid = lambda x: torch.tensor(x).permute(0, 3, 1, 2)
    labels = torch.tensor(batch["change_type"])
    hooks = [det.change_classifier.register_forward_hook(
                 lambda m, i, o: probes.__setitem__("change_logits", o.mean((2, 3)))),
             det.type_classifier.register_forward_hook(
                 lambda m, i, o: probes.__setitem__("type_logits", o.mean((2, 3))))]
    d1, d2, cdcr, losses, final = det(grid(batch["before"]), grid(batch["after_semantic"]), labels)
    for h in hooks:
        h.remove()
    ids = torch.tensor(batch["change_caption"])
    mask = torch.tensor(np.asarray(streams.caption_mask(jnp.asarray(ids.numpy()))),
                        dtype=torch.float32)
    target = torch.tensor(np.asarray(streams.make_caption_targets(jnp.asarray(ids.numpy()))))
    cap, _, sim = spk._forward(torch.cat([d1, d2], -1), final, ids, mask, target.long())
    terms = {"caption": cap, "dirl": cdcr, "ccr": sim, "change_cls": losses["change_cls_loss"],
             "change_type_cls": losses["change_type_cls_loss"],
             "expert_disentangle": losses["expert_disentangle_loss"],
             "expert_consistency": losses["expert_consistency_loss"]}
    probes.update(diff_before=d1, diff_after=d2, features=final)
    return terms


def _our_forward(model, params, batch):
    jb = {k: jnp.asarray(v) for k, v in batch.items()}

    def probe(m, b):
        before = m.encoder.embed_image(b["before"], train=True)
        enc = m.encoder(before, b["after_semantic"], train=True)
        labels = medic.medic_labels(b["change_type"], medic.TYPE_NAMES, no_change=False)
        out = m.plugin(enc.diff_before, enc.diff_after, b["before"].shape[1:3], labels,
                       train=True)
        return {"diff_before": enc.diff_before, "diff_after": enc.diff_after,
                "features": out.features, "change_logits": out.change_logits,
                "type_logits": out.type_logits}

    def loss(p):
        out = model.apply({"params": p}, jb, train=True, rngs={"dropout": jax.random.PRNGKey(0)})
        logits, targets = out.caption_logits["semantic"], out.caption_targets["semantic"]
        logp = jax.nn.log_softmax(logits, -1)
        valid = targets >= 0
        nll = -jnp.take_along_axis(logp, jnp.clip(targets, 0)[..., None], -1)[..., 0]
        terms = {"caption": jnp.sum(nll * valid) / jnp.sum(valid), **out.aux_losses}
        total = terms["caption"] + sum(WEIGHTS[k] * terms[k] for k in WEIGHTS)
        return total, terms

    (_, terms), grads = jax.value_and_grad(loss, has_aux=True)(params)
    probes = model.apply({"params": params}, jb, method=probe)
    return terms, grads, probes


def _greedy_official(det, spk, batch):
    det.eval(), spk.eval()
    grid = lambda x: torch.tensor(x).permute(0, 3, 1, 2)
    with torch.no_grad():
        d1, d2, _, final = det(grid(batch["before"]), grid(batch["after_semantic"]),
                               torch.tensor(batch["change_type"]))
        ids, _ = spk.sample(torch.cat([d1, d2], -1), final, sample_max=1)
    return ids.numpy()


def _greedy_ours(model, params, batch):
    def memory(m, b):
        before = m.encoder.embed_image(b["before"], train=False, with_mlp=False)
        enc = m.encoder(before, b["after_semantic"], train=False)
        grid = b["before"].shape[1:3]
        return m._memory(enc, grid, b["change_type"], train=False)[0]  # official labels

    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    mem = model.apply({"params": params}, jb, method=memory)
    ids = np.zeros((B, L), np.int32)
    nxt, unfinished = np.full(B, 2), np.ones(B, bool)
    for t in range(L):  # the official CCR.sample loop (full recompute, unk masked)
        ids[:, t] = nxt
        logits = np.array(model.apply({"params": params}, mem, jnp.asarray(ids),
                                      method=model.decode))
        logits[:, :, 1] = -1e10
        nxt = logits[:, t].argmax(-1)
        unfinished &= nxt != 3
        nxt = nxt * unfinished
        if not unfinished.any():
            break
    return ids


def test_forward_losses_gradients_and_greedy_ids_match_the_official_code(monkeypatch):
    det, spk = _official_modules()
    model = _ours()
    batch = _batch(np.random.default_rng(0))
    # Official label 5 = no change = our K; the dataset's order is MEDIC's here. -2 is not a
    # dataset index: our forward maps it to MEDIC's no-change label K directly.
    ours_batch = dict(batch, change_type=np.where(LABELS == 5, -2, LABELS).astype(np.int32))
    monkeypatch.setattr(medic, "medic_labels", lambda change_type, *a, **k: jnp.where(
        change_type == -2, len(medic.TYPE_NAMES), change_type))
    params = _to_ours(_numpy_state(det), _numpy_state(spk), model)
    probes_t: dict = {}
    terms_t = _official_forward(det, spk, batch, probes_t)
    total_t = terms_t["caption"] + sum(WEIGHTS[k] * terms_t[k] for k in WEIGHTS)
    total_t.backward()
    terms, grads, probes = _our_forward(model, params, ours_batch)
    report = {}
    for name, ref in terms_t.items():
        report[f"loss/{name}"] = abs(float(terms[name]) - ref.item())
        np.testing.assert_allclose(float(terms[name]), ref.item(), err_msg=name, **TOL)
    rows = (probes_t["change_logits"].argmax(-1) == 1) & (torch.tensor(LABELS) != 5)
    assert 0 < int(rows.sum()) < B  # both routes taken: the comparison covers both
    probes["type_logits"] = probes["type_logits"][np.asarray(rows.numpy())]
    for name, ref in probes_t.items():
        ref = ref.detach().numpy()
        report[name] = float(np.max(np.abs(np.asarray(probes[name]) - ref)))
        np.testing.assert_allclose(np.asarray(probes[name]), ref, err_msg=name, **TOL)
    # The trainer's padding_idx mask (the presets' optim.zero_grad_rows), as torch's gradient.
    grads = update.zero_gradient_rows(grads, {"decoder/embed/embedding": 0})
    tgrads = _to_ours(_numpy_state(det, grads=True), _numpy_state(spk, grads=True), model)
    flat_t = traverse_util.flatten_dict(tgrads, sep="/")
    flat = traverse_util.flatten_dict(grads, sep="/")
    assert set(flat) == set(flat_t), sorted(set(flat) ^ set(flat_t))
    assert any(k.startswith("medic/") and np.abs(v).max() > 0 for k, v in flat_t.items())
    report["grad"] = max(float(np.max(np.abs(np.asarray(flat[k]) - np.asarray(v))))
                         for k, v in flat_t.items())
    largest = max(float(np.max(np.abs(np.asarray(v)))) for v in flat_t.values())
    report["grad_over_largest"] = report["grad"] / largest  # relative to the largest entry
    for k, v in flat_t.items():
        np.testing.assert_allclose(np.asarray(flat[k]), np.asarray(v), rtol=1e-3, atol=1e-5,
                                   err_msg=k)
    print("max |ours - official| (forward, losses, gradients):", report)
    ids_t, ids = _greedy_official(det, spk, batch), _greedy_ours(model, params, batch)
    report["greedy_ids_mismatches"] = int((ids_t != ids).sum())
    print("greedy ids: shape", ids.shape, "mismatches", report["greedy_ids_mismatches"])
    np.testing.assert_array_equal(ids, ids_t)


def _official_attr_dict(tree: types.SimpleNamespace) -> object:
    """``tree`` as the official config class (``utils/attr_dict.py`` AttrDict), which the train
    script pickles as ``model_cfg``."""
    sys.path.insert(0, OFFICIAL)
    try:
        from utils.attr_dict import AttrDict
    finally:
        sys.path.remove(OFFICIAL)
    convert = lambda x: AttrDict({k: convert(v) for k, v in vars(x).items()}) \
        if isinstance(x, types.SimpleNamespace) else x
    return convert(tree)


def test_a_checkpoint_saved_as_the_train_script_does_converts(tmp_path, monkeypatch):
    """A checkpoint dict as ``train/train_chg_final.py`` saves it (change_detector_state,
    speaker_state, optimizer_state, lr_scheduler_state, scaler_state, iteration, epoch,
    model_cfg), converted by the command's code path into a workdir for
    ``configs/dirl.py:clevr_dc/medic`` (tiny sizes): every loss term, the routing logits and
    expert output, and the greedy ids of the converted workdir equal the official modules'.
    The official encoder's grid tables have 14 rows: the batch is on a 14 x 14 grid."""
    from changecap_jax.convert import compare, converter
    from configs import dirl as dirl_config

    det, spk = _official_modules()
    easydict = types.ModuleType("easydict")  # scheduler.py imports it; only its name is needed
    easydict.EasyDict = dict
    monkeypatch.setitem(sys.modules, "easydict", easydict)
    sys.path.insert(0, OFFICIAL)
    try:
        from scheduler import build_scheduler
    finally:
        sys.path.remove(OFFICIAL)
    optimizer = torch.optim.Adam([*det.parameters(), *spk.parameters()], lr=1e-4)
    scheduler = build_scheduler(types.SimpleNamespace(
        type_name="PolyLR", keywords={"gamma": 0.9, "n_iteration": 100}), optimizer)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    path = tmp_path / "medic_checkpoint_1200.pt"
    torch.save({"change_detector_state": det.state_dict(), "speaker_state": spk.state_dict(),
                "optimizer_state": optimizer.state_dict(),
                "lr_scheduler_state": scheduler.state_dict(),
                "scaler_state": scaler.state_dict(), "iteration": 1200, "epoch": 3,
                "model_cfg": _official_attr_dict(_official_cfg())}, path)
    config = dirl_config.get_config("clevr_dc/medic")
    config.model.update(hidden_dim=HID, num_heads=HEADS, encoder_layers=1, decoder_layers=1,
                        word_dim=8, ffn_dim=4 * HID, mlp_hidden_dim=4 * HID, dropout_rate=0.0,
                        pairs="semantic_only")
    config.dataset.data_dir = str(tmp_path / "no_data")
    config.decode.max_len = L
    report = converter.convert_checkpoint(config, path, tmp_path / "workdir")
    assert report.step == 1200
    params = compare.load_params(tmp_path / "workdir")
    assert params["medic"]["change_classifier"]["conv_0"]["kernel"].shape == (3, 3, 2 * HID, 512)
    model = converter.build_model(config, tables.Sizes(V, L, C, 14, 14, "test"))

    batch = _batch(np.random.default_rng(3), grid=14)
    ours_batch = dict(batch, change_type=np.where(LABELS == 5, -2, LABELS).astype(np.int32))
    monkeypatch.setattr(medic, "medic_labels", lambda change_type, *a, **k: jnp.where(
        change_type == -2, len(medic.TYPE_NAMES), change_type))
    probes_t: dict = {}
    with torch.no_grad():
        terms_t = _official_forward(det, spk, batch, probes_t)
    terms, _, probes = _our_forward(model, params, ours_batch)
    report = {f"loss/{k}": abs(float(terms[k]) - v.item()) for k, v in terms_t.items()}
    for name, ref in terms_t.items():
        np.testing.assert_allclose(float(terms[name]), ref.item(), err_msg=name, **TOL)
    rows = np.asarray(((probes_t["change_logits"].argmax(-1) == 1)
                       & (torch.tensor(LABELS) != 5)).numpy())
    probes["type_logits"] = probes["type_logits"][rows]
    for name, ref in probes_t.items():
        ref = ref.detach().numpy()
        report[name] = float(np.max(np.abs(np.asarray(probes[name]) - ref)))
        np.testing.assert_allclose(np.asarray(probes[name]), ref, err_msg=name, **TOL)
    ids_t, ids = _greedy_official(det, spk, batch), _greedy_ours(model, params, batch)
    report["greedy_ids_mismatches"] = int((ids_t != ids).sum())
    print("converted workdir vs official, max |diff|:", report)
    np.testing.assert_array_equal(ids, ids_t)
