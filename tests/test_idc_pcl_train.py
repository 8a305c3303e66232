"""IDC-PCL fine-tuning on the trunk (reference §5.1, §5.4-5.6): the §5.1 caption masking, the
summed losses and the mean switch, 8 devices = 1 (masks included), a run with evaluation
(held-out distractor accuracy included), early stopping on the best state and initialisation
from another run except the pooler, the caption-free distractor classifier, and the decoding
rules (no UNK ban, all steps, appended [MASK] named in captions).

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import SMALL, assert_eight_devices_equal_one, tiny_run

from changecap_jax import exported_model, parallel
from changecap_jax.commands import export, predict
from changecap_jax.data import datasets, pipeline
from changecap_jax.decoding import search
from changecap_jax.io import checkpoints
from changecap_jax.models import base, idc_pcl
from changecap_jax.models.base import IGNORE_INDEX
from changecap_jax.trainers import caption_step, captioning, loop, update

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import idc_pcl as idc_config  # noqa: E402


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("idc_data")
    datasets.prepare("synthetic", root, "moderate", SMALL)
    return str(root)


def tiny_idc(data_dir: str, **overrides):
    config = idc_config.get_config("finetune")
    config.model.update(hidden_dim=16, num_heads=2, ffn_dim=32, cross_layers=1,
                        image_dim=SMALL["feature_shape"][-1])
    return tiny_run(config, data_dir, **{"num_train_steps": 2, **overrides})


# ---- §5.1 masking --------------------------------------------------------------------------


def test_mask_caption_follows_section_5_1():
    eos, mask, vocab = 3, 40, 42
    words = np.arange(10, 20)
    ids = np.array([2, *words, eos, 0, 0, 0], np.int32)  # BOS, 10 words, EOS, PAD
    rows = 20_000
    keys = jax.random.split(jax.random.key(0), rows)
    masked, labels = jax.jit(jax.vmap(lambda k: idc_pcl.mask_caption(
        k, jnp.asarray(ids), eos_id=eos, mask_id=mask, num_tokens=vocab)))(keys)
    masked, labels = np.asarray(masked), np.asarray(labels)
    word = slice(1, 11)
    # BOS and PAD are never touched or labelled.
    assert np.all(masked[:, [0, 12, 13, 14]] == ids[[0, 12, 13, 14]])
    assert np.all(labels[:, [0, 12, 13, 14]] == IGNORE_INDEX)
    chosen = labels[:, word] != IGNORE_INDEX
    assert np.all(labels[:, word][chosen] == np.broadcast_to(words, chosen.shape)[chosen])
    assert np.all(chosen.any(axis=1))  # no caption goes without a labelled word
    # p = 0.15 per word, plus the first word when none was drawn (0.85 ** 10 of the rows).
    assert chosen.mean() == pytest.approx(0.15 + 0.85 ** 10 / 10, abs=0.006)
    assert chosen[:, 0].mean() == pytest.approx(0.15 + 0.85 ** 10, abs=0.01)  # the fallback
    assert chosen[:, 1:].mean() == pytest.approx(0.15, abs=0.006)
    got = masked[:, word][chosen]
    orig = np.broadcast_to(words, chosen.shape)[chosen]
    # 80 % MASK, 10 % a uniform id of all 42 tokens (specials included), 10 % unchanged.
    assert (got == mask).mean() == pytest.approx(0.8 + 0.1 / vocab, abs=0.012)
    assert (got == orig).mean() == pytest.approx(0.1 + 0.1 / vocab, abs=0.01)
    replaced = got[(got != mask) & (got != orig)]
    assert replaced.min() < 4 and replaced.max() >= vocab - 2  # specials and appended rows
    assert np.all(masked[:, word][~chosen] == np.broadcast_to(words, chosen.shape)[~chosen])
    # EOS: MASK with label EOS 15 % of the time, otherwise kept and unlabelled.
    eos_masked = masked[:, 11] == mask
    assert eos_masked.mean() == pytest.approx(0.15, abs=0.01)
    assert np.all(labels[eos_masked, 11] == eos) and np.all(labels[~eos_masked, 11] == -1)
    assert np.all(masked[~eos_masked, 11] == eos)


# ---- losses and devices --------------------------------------------------------------------


def _output_and_loss(config, data_dir, tmp_path):
    trainer = captioning.Trainer(config, tmp_path, mesh=parallel.make_mesh(1))
    state = trainer.init_state()
    batch = pipeline.to_global(next(iter(trainer.train_loader())), trainer.data_sharding)
    rng = jax.random.key(7)
    loss_fn = caption_step.make_loss_fn(trainer.model, dict(config.loss_weights), trainer.mesh)
    total, metrics = jax.jit(loss_fn)(state.params, batch, rng)
    out = trainer.model.apply({"params": state.params}, batch, train=True,
                              rngs={"dropout": rng,
                                    "inputs": jax.random.fold_in(rng, base.INPUTS_FOLD)})
    # The official per-stream loss (finetune_loss, summed) on the same masked captions, from
    # the plain fine-tuning forward.
    masked = trainer.model.apply({"params": state.params}, batch, method="masked_captions",
                                 rngs={"inputs": jax.random.fold_in(rng, base.INPUTS_FOLD)})
    official = []
    for stream, (after, _, label) in idc_pcl.STREAMS.items():
        np.testing.assert_array_equal(masked[stream][1], out.caption_targets[stream])
        fwd = trainer.model.apply({"params": state.params}, batch["before"], batch[after],
                                  masked[stream][0], method="finetune")
        np.testing.assert_allclose(fwd.mlm_logits, out.caption_logits[stream], rtol=1e-5,
                                   atol=1e-5)
        mlm, dis = idc_pcl.finetune_loss(fwd.mlm_logits, out.caption_targets[stream],
                                         fwd.distractor_logits,
                                         jnp.full((batch["before"].shape[0],), label))
        official.append((float(mlm), float(dis), int(np.sum(out.caption_targets[stream] != -1))))
    return float(total), jax.device_get(metrics), official, batch["before"].shape[0]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_summed_losses_and_the_mean_switch(data_dir, tmp_path, reduction):
    config = tiny_idc(data_dir)
    config.model.loss_reduction = reduction
    total, metrics, official, b = _output_and_loss(config, data_dir, tmp_path)
    mlm_sums = [m for m, _, _ in official]
    dis_sums = [d for _, d, _ in official]
    counts = [c for _, _, c in official]
    if reduction == "sum":  # finetune.py: Σ token CE + Σ sample CE over both streams
        want_caption, want_dis = sum(mlm_sums), sum(dis_sums)
    else:  # per-stream token means averaged over the streams; sample mean over both streams
        want_caption = np.mean([m / c for m, c in zip(mlm_sums, counts, strict=True)])
        want_dis = sum(dis_sums) / (2 * b)
    assert metrics["loss/caption"] == pytest.approx(want_caption, rel=1e-5)
    assert metrics["loss/distractor"] == pytest.approx(want_dis, rel=1e-5)
    assert total == pytest.approx(want_caption + want_dis, rel=1e-5)
    assert min(counts) >= b  # every caption has at least one labelled token


def test_eight_devices_equal_one_masks_included(data_dir, tmp_path):
    config = tiny_idc(data_dir)
    assert config.model.dropout_rate == 0.0  # per-device dropout could not equal one device
    metrics = assert_eight_devices_equal_one(config, tmp_path)
    assert metrics["loss/distractor"] > 0 and metrics["loss/caption_distractor"] > 0


# ---- a run: evaluation, early stopping, init_from -----------------------------------------


def test_early_stopping_counts_and_keeps_the_best(tmp_path):
    stopper = loop.EarlyStopping(tmp_path / "best", patience=2)
    state = update.TrainState(step=jnp.int32(0), params={"w": jnp.zeros(2)}, opt_state=(),
                             rng=jax.random.key(0))
    results = [0.5, 0.7, 0.6, 0.7, 0.65]  # the tie does not count as an improvement
    stops = []
    for step, value in enumerate(results, 1):
        state = state.replace(step=jnp.int32(step), params={"w": jnp.full(2, value)})
        stops.append(stopper.update(step, {"val": {"CIDEr": value}}, state))
    assert stops == [False, False, False, True, True]
    assert (stopper.best, stopper.best_step) == (0.7, 2)
    best = stopper.restore(state)
    assert int(best.step) == 2 and np.all(np.asarray(best.params["w"]) == 0.7)
    resumed = loop.EarlyStopping(tmp_path / "best", patience=2)  # counts survive a restart
    assert (resumed.best, resumed.best_step, resumed.since) == (0.7, 2, 3)
    with pytest.raises(KeyError, match="ROUGE_L"):
        loop.EarlyStopping(tmp_path / "other", 1, "ROUGE_L").update(1, {"val": {}}, state)


def test_run_evaluates_best_state_and_init_from_skips_the_pooler(data_dir, tmp_path):
    # One val evaluation (each scores with Java twice: the COCO and the IDC protocol); the
    # counting itself is test_early_stopping_counts_and_keeps_the_best's.
    config = tiny_idc(data_dir, num_train_steps=2, eval_every_steps=2, eval_splits=("val",),
                      final_eval_splits=("test",), early_stop_evals=1, spice="off")
    first = tmp_path / "first"
    trainer = captioning.Trainer(config, first, mesh=parallel.make_mesh(1))
    trainer.train()
    record = json.loads((first / "best" / "record.json").read_text())
    assert record["metric"] == "idc/CIDEr"  # the official selection: the IDC code's CIDEr
    val_metrics = json.loads((first / "metrics" / "val_2.json").read_text())
    assert set(val_metrics["idc"]) >= {"CIDEr", "ROUGE_L", "Bleu_4", "METEOR"}
    assert val_metrics["idc"]["eval_protocol"] == "idc"
    # The test split is scored once, with the best validation state.
    captions = sorted(p.name for p in (first / "captions").iterdir())
    assert record["step"] == 2 and captions == ["test_2.json", "val_2.json"], captions

    # Export and predict: the captions of the last state equal its val evaluation's, cut at
    # EOS although the model decodes all steps.
    model_dir = export.export_model(first, tmp_path / "exported", step=2)
    predictor = predict.Predictor(exported_model.load_exported(model_dir))
    val = datasets.prepare("synthetic", data_dir, "moderate", SMALL).split("val")
    records = [val[i] for i in range(4)]
    before = np.stack([r["before"] for r in records]).astype(np.float32)
    after = np.stack([r["after_semantic"] for r in records]).astype(np.float32)
    names = [(str(i), str(i)) for i in range(4)]
    got = [p.caption for p in predictor.predict(before, after, names)]
    evaluated = {e["image_id"]: e["caption"]
                 for e in json.loads((first / "captions" / "val_2.json").read_text())}
    assert got == [evaluated[r["image_id"].decode() if isinstance(r["image_id"], bytes)
                             else str(r["image_id"])] for r in records]

    # A second run initialised from the first: all parameters but the pooler's are copied.
    second = captioning.Trainer(tiny_idc(data_dir, seed=99), tmp_path / "second",
                                mesh=parallel.make_mesh(1))
    fresh = second.init_state().params
    copied = checkpoints.init_params_from(fresh, first, ("pooler",))
    source = checkpoints.make_checkpoint_manager(first / "checkpoints", 1)
    last = source.restore(source.latest_step(), args=captioning.ocp.args.Composite(
        state=captioning.ocp.args.StandardRestore()))["state"]["params"]
    flat = lambda t: {jax.tree_util.keystr(p): np.asarray(v)  # noqa: E731
                      for p, v in jax.tree_util.tree_leaves_with_path(t)}
    got, want, init = flat(copied), flat(last), flat(fresh)
    for name, value in got.items():
        expected = init[name] if "pooler" in name else want[name]
        np.testing.assert_array_equal(value, expected, err_msg=name)
    assert any("pooler" in n for n in got)
    assert not np.array_equal(got["['pooler_0']['kernel']"], want["['pooler_0']['kernel']"])
    wider = {**fresh, "word_embedding": {"embedding": jnp.zeros((5, 3))}}
    with pytest.raises(ValueError, match=r"word_embedding/embedding has shape \(\d+, 16\)"):
        checkpoints.init_params_from(wider, first, ("pooler",))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoints.init_params_from(fresh, tmp_path / "nowhere")

    # Each evaluation also judges every pair with the distractor classifier (§5.6's val pass):
    # the same logits as the fine-tuning forward with the pair's caption, label 1 = semantic.
    judged = val_metrics["distractor"]
    val_records = [val[i] for i in range(len(val))]
    before = np.stack([r["before"] for r in val_records]).astype(np.float32)
    correct, loss = 0, 0.0
    for after_key, caption_key, label in (("after_semantic", "change_caption_ids", 1),
                                          ("after_distractor", "no_change_caption_ids", 0)):
        out = trainer.model.apply(
            {"params": last}, before,
            np.stack([r[after_key] for r in val_records]).astype(np.float32),
            np.stack([r[caption_key][0] for r in val_records]).astype(np.int32),
            method=trainer.model.finetune)
        log_probs = np.asarray(jax.nn.log_softmax(out.distractor_logits), np.float64)
        correct += int(np.sum(np.argmax(log_probs, -1) == label))
        loss -= float(np.sum(log_probs[:, label]))
    assert judged["num_pairs"] == 2 * len(val)
    assert judged["accuracy"] == pytest.approx(100.0 * correct / (2 * len(val)), abs=1e-9)
    assert judged["loss"] == pytest.approx(loss / (2 * len(val)), rel=1e-5)
    scalars = [json.loads(line) for line in (first / "scalars.jsonl").read_text().splitlines()]
    logged = [r for r in scalars if "val/distractor_accuracy" in r]
    assert [(r["step"], r["val/distractor_accuracy"]) for r in logged] == [
        (2, judged["accuracy"])]


def test_distractor_classifier_reads_the_images_only():
    # Image queries never attend text under the fine-tuning mask, so the classifier needs no
    # caption: classify_distractor equals finetune's logits whatever the caption is.
    model = idc_pcl.IDCPCL(vocab_size=20, max_len=8, hidden_dim=16, num_heads=2, ffn_dim=32,
                           cross_layers=2, image_dim=8, dropout_rate=0.0)
    rng = np.random.default_rng(0)
    img1, img2 = (rng.random((3, 2, 2, 8), dtype=np.float32) for _ in range(2))
    ids = jnp.asarray(rng.integers(0, 20, (2, 3, 8)), jnp.int32)
    params = model.init(jax.random.key(1), img1, img2, ids[0], method=model.finetune)
    judged = model.apply(params, img1, img2, method=model.classify_distractor)
    assert judged.shape == (3, 2)
    for caption in ids:
        out = model.apply(params, img1, img2, caption, method=model.finetune)
        np.testing.assert_allclose(judged, out.distractor_logits, rtol=1e-5, atol=1e-6)
    swapped = model.apply(params, img2, img1, method=model.classify_distractor)
    assert not np.allclose(swapped, judged, atol=1e-4)  # it does read the images, in order
    pretraining = idc_pcl.IDCPCL(vocab_size=20, stage="pretrain", hidden_dim=16, num_heads=2,
                                 ffn_dim=32, cross_layers=1, image_dim=8)
    with pytest.raises(ValueError, match="fine-tuning head"):
        pretraining.init(jax.random.key(0), img1, img2, method=pretraining.classify_distractor)


# ---- decoding rules --------------------------------------------------------------------------


def test_decoding_rules_no_unk_ban_all_steps_and_extra_tokens(data_dir):
    dataset = datasets.prepare("synthetic", data_dir, "moderate", SMALL)
    vocab_size = len(dataset.vocab)
    model = idc_pcl.IDCPCL(vocab_size=vocab_size, max_len=12, hidden_dim=16, num_heads=2,
                           ffn_dim=32, cross_layers=1, image_dim=SMALL["feature_shape"][-1])
    assert model.num_tokens == vocab_size + 2
    assert model.extra_tokens == {vocab_size: "<MASK>", vocab_size + 1: "<CLS>"}
    rules = model.decoding_rules
    assert (rules.start_id, rules.end_id, rules.banned_ids, rules.stop_at_end) == (2, 3, (), False)
    grid = np.random.default_rng(0).random((4, 4, 4, 16), np.float32)
    params = model.init(jax.random.key(1), grid, grid, jnp.zeros((4, 12), jnp.int32),
                        method="finetune")["params"]
    # Make UNK (1) the likeliest token everywhere: the official decoder does not ban it.
    bias = params["output_layer"]["bias"].at[1].add(100.0)
    params = {**params, "output_layer": {**params["output_layer"], "bias": bias}}
    ids = np.asarray(search.greedy_decode(model, {"params": params}, grid, grid,
                                            max_len=12).ids)
    assert np.all(ids[:, 0] == 2) and np.all(ids[:, 1:] == 1)  # 11 steps, all UNK
    # Ending the loop at EOS changes no caption: the rows only differ after EOS.
    end_bias = params["output_layer"]["bias"].at[3].add(200.0)
    params = {**params, "output_layer": {**params["output_layer"], "bias": end_bias}}
    raw = np.asarray(search.greedy_decode(model, {"params": params}, grid, grid,
                                            max_len=12).ids)
    early = np.asarray(search.greedy_decode(model.clone(stop_at_eos=True),
                                              {"params": params}, grid, grid, max_len=12).ids)
    # Raw ids keep EOS and what followed it; the early stop writes 0 from EOS on (trunk rule).
    assert np.all(raw[:, 1] == 3) and np.all(early[:, 1:] == 0)
    assert [dataset.vocab.decode(r) for r in raw] == [dataset.vocab.decode(r) for r in early]
    named = dataset.vocab.decode(np.array([2, 5, vocab_size, 3]), model.extra_tokens)
    assert named.split()[-1] == "<MASK>"
    with pytest.raises(ValueError, match="extra tokens"):
        dataset.vocab.decode(np.array([2, vocab_size + 5, 3]), model.extra_tokens)
