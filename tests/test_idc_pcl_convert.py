"""Official IDC-PCL checkpoints -> orbax checkpoints (``python -m changecap_jax convert``),
checked against the independent torch reference (tools/torch_reference/idc_pcl.py).

Reference: docs/official/ §5 (model, losses, decoding), §5.1 (dict.json:
BOS = 1, MASK = 5), §5.4 (the fine-tuning restore skips the pooler), §6 / Appendix C (keys).
Random torch weights at small sizes (hidden 32, 4 heads, 2 cross-modal blocks, FFN 64) on the
tiny synthetic dataset's 4x4x16 grids; the authors' token order is a dict.json written by the
test (its six specials first, the dataset's words shuffled), so every token row is permuted.

* fine-tuning state_dict with DataParallel's "module." prefix, converted by the command (a
  subprocess): per-token MLM CE, distractor CE, summed loss within 1e-5, gradients within 1e-4
  of each tensor's largest entry, greedy ids identical over 40 tokens on 32 random pairs;
* pretraining dict {global_step, model_state_dict, task_batch_num} into the pretraining model:
  per-token MLM CE, per-region MVCL NCE, FDA loss within 1e-5, gradients within 1e-4 (the tied
  feat_regress.weight is one parameter); into the fine-tuning model: all but the pooler, which
  is the trainer's initialisation (§5.4);
* a dict.json with words the dataset lacks: those rows are dropped and listed, the others keep
  their logits; and the errors (wrong dict.json, missing flag, tie broken, missing key).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from train_helpers import tiny_run  # noqa: E402

from changecap_jax import models  # noqa: E402
from changecap_jax.convert import (  # noqa: E402
    ConversionError,
    KeyMismatchError,
    WrongModelError,
    compare,
    converter,
    registry,
    tables,
)
from changecap_jax.convert.models import idc_dict_json  # noqa: E402
from changecap_jax.convert.models import idc_pcl as idc_converter  # noqa: E402
from changecap_jax.convert.torch_checkpoint import IDC_STATE  # noqa: E402
from changecap_jax.decoding import search  # noqa: E402
from changecap_jax.models import idc_pcl, idc_pcl_pretraining  # noqa: E402
from changecap_jax.models.idc_pcl_pretraining import on_one_device  # noqa: E402
from tools.torch_reference import idc_pcl as tref  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import idc_pcl as idc_config  # noqa: E402

# The SMALL synthetic grids; the official embedding (not the synthetic presets' CPU balance).
SIZES = dict(hidden_dim=32, num_heads=4, ffn_dim=64, cross_layers=2, dropout_rate=0.0,
             image_dim=16, image_feature_scale=1.0)
SPECIALS = {"<PAD>": 0, "<BOS>": 1, "<EOS>": 2, "<UNK>": 3, "<CLS>": 4, "<MASK>": 5}
TOL, GRAD_TOL = 1e-5, 1e-4
PAIRS, STEPS = 32, 40


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config(stage: str, data_dir: str):
    config = tiny_run(idc_config.get_config(stage), data_dir)
    config.model.update(SIZES)
    return config


def write_dict_json(path: Path, vocab, extra: tuple[str, ...] = (), seed: int = 0) -> dict:
    """The authors' layout: the six specials, then the dataset's words (and ``extra`` words the
    dataset lacks) in a shuffled order."""
    trunk_specials = set(idc_dict_json.TRUNK_FROM_DICT)
    words = [vocab.id_to_word[i] for i in range(len(vocab))
             if vocab.id_to_word[i] not in trunk_specials] + list(extra)
    order = np.random.default_rng(seed).permutation(len(words))
    table = {**SPECIALS, **{words[k]: len(SPECIALS) + j for j, k in enumerate(order)}}
    path.write_text(json.dumps(table))
    return table


def torch_model(stage: str, num_tokens: int, channels: int, seed: int,
                weight_scale: float = 1.0) -> tref.IDCPCL:
    torch.manual_seed(seed)
    model = tref.IDCPCL(num_tokens, SPECIALS["<CLS>"], stage, n_embs=SIZES["hidden_dim"],
                        img_embs=channels, dim_ff=SIZES["ffn_dim"], n_head=SIZES["num_heads"],
                        n_block=SIZES["cross_layers"], dropout=0.0)
    with torch.no_grad():
        # Non-trivial LN and bias values, so a mix-up cannot hide. ``weight_scale`` multiplies
        # the Linear weights: at the default init the logits barely depend on the input and
        # every greedy caption is one repeated token, which would hide a mis-ordered row.
        for name, p in model.named_parameters():
            if name.endswith(("a_2", "b_2")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif p.dim() == 2 and "embedding" not in name and "type_pe" not in name:
                p.mul_(weight_scale)
    return model.eval()


def trunk_to_official(vocab, table: dict) -> np.ndarray:
    """Our token id (vocabulary + [MASK], [CLS]) -> the dict.json id."""
    names = [idc_dict_json.TRUNK_FROM_DICT.get(vocab.id_to_word[i], vocab.id_to_word[i])
             for i in range(len(vocab))] + ["<MASK>", "<CLS>"]
    return np.array([table[n] for n in names])


def check(name: str, ours, ref, tol: float = TOL, *, rel: bool = False) -> None:
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref.detach().numpy() if hasattr(ref, "detach") else ref, np.float64)
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    d = float(np.max(np.abs(ours - ref)))
    limit = tol * max(float(np.max(np.abs(ref))), 1e-30) if rel else tol
    assert d <= limit, f"{name}: max |diff| {d:.3g} > {limit:.3g}"


def check_grads(ours: dict, ref_named: dict, config, sizes: tables.Sizes) -> None:
    """Torch gradients mapped by the converter's own table (rows permuted, kernels
    transposed) against ours, within GRAD_TOL of each tensor's largest entry; a gradient that
    is zero in exact arithmetic (k_linear.bias) is held to 1e-7 absolute."""
    entries = idc_converter.table(config.model, sizes)
    want = tables.apply_table(entries, {IDC_STATE: ref_named})
    ours = flax.traverse_util.flatten_dict(ours, sep="/")
    assert set(want) == set(ours), set(want) ^ set(ours)
    for path, g in want.items():
        if float(np.max(np.abs(g))) < 1e-7:
            assert float(np.max(np.abs(np.asarray(ours[path])))) < 1e-7, path
            continue
        check(f"grad {path}", ours[path], g, GRAD_TOL, rel=True)


def pairs(n: int, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.random((n, *shape), dtype=np.float32),
            rng.random((n, *shape), dtype=np.float32))


def t_tokens(x: np.ndarray):
    return torch.from_numpy(x.reshape(x.shape[0], -1, x.shape[-1]))


CONFIG_FILE = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
from configs import idc_pcl
from train_helpers import tiny_run


def get_config(stage="finetune"):
    config = tiny_run(idc_pcl.get_config(stage), {data_dir!r})
    config.model.update({sizes!r})
    return config
"""


def run_convert(tmp: Path, data_dir: str, *flags: str) -> subprocess.CompletedProcess:
    """The command, on a config file that is this test's tiny finetune config."""
    config_file = tmp / "tiny_idc_config.py"
    config_file.write_text(CONFIG_FILE.format(root=str(ROOT), tests=str(ROOT / "tests"),
                                              data_dir=data_dir, sizes=SIZES))
    args = [sys.executable, "-m", "changecap_jax.convert", f"--config={config_file}", *flags]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def setup(small_synthetic, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("idc_convert")
    data_dir = str(small_synthetic.directory.parents[2])
    vocab = small_synthetic.vocab
    channels = small_synthetic.meta.feature_shape[-1]
    table = write_dict_json(tmp / "dict.json", vocab)
    return tmp, data_dir, vocab, channels, table


@pytest.fixture(scope="module")
def finetune_converted(setup):
    tmp, data_dir, vocab, channels, table = setup
    converted = []
    for name, prefix, scale in (("best_checkpoint", "module.", 1.0), ("greedy", "", 4.0)):
        ref = torch_model("finetune", len(table), channels, seed=1, weight_scale=scale)
        path = tmp / f"{name}.pt"
        torch.save({f"{prefix}{k}": v for k, v in ref.state_dict().items()}, path)
        workdir = tmp / f"{name}_workdir"
        done = run_convert(tmp, data_dir, f"--torch_checkpoint={path}",
                           f"--dict_json={tmp / 'dict.json'}", f"--workdir={workdir}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "wrote step 0" in done.stdout and "token rows reordered" in done.stdout, \
            done.stdout
        converted.append((ref, workdir))
    return converted


def test_finetune_checkpoint_converted_by_the_command(setup, finetune_converted):
    tmp, data_dir, vocab, channels, table = setup
    (ref, workdir), (greedy_ref, greedy_workdir) = finetune_converted
    config = make_config("finetune", data_dir)
    params = compare.load_params(workdir)
    model = models.build(config.model, vocab_size=len(vocab), max_len=STEPS)
    to_official = trunk_to_official(vocab, table)
    grid = (4, 4, channels)

    # Losses and gradients on a teacher-forced batch (ids drawn from our rows).
    b, length = 6, 12
    img1, img2 = pairs(b, grid, seed=2)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, len(vocab) + 2, (b, length))
    ids[:, 0] = vocab.word_to_id["<START>"]
    labels = np.where(rng.random(ids.shape) < 0.3, rng.integers(0, len(vocab), ids.shape), -1)
    labels[:, 1] = 7
    diff_labels = np.array([0, 1, 1, 0, 1, 0])
    t_labels = np.where(labels >= 0, to_official[np.maximum(labels, 0)], -1)

    out_t = ref.finetune_forward(t_tokens(img1), t_tokens(img2),
                                 torch.from_numpy(to_official[ids]))
    per_token_t = tref.mlm_token_losses(out_t.mlm_logits, torch.from_numpy(t_labels))
    diff_t = torch.nn.functional.cross_entropy(out_t.distractor_logits,
                                               torch.from_numpy(diff_labels), reduction="none")
    loss_t = tref.finetune_loss(out_t, torch.from_numpy(t_labels), torch.from_numpy(diff_labels))
    ref.zero_grad()
    loss_t.backward()

    def loss_fn(p):
        o = model.apply({"params": p}, img1, img2, ids, method="finetune")
        mlm, diff = idc_pcl.finetune_loss(o.mlm_logits, labels, o.distractor_logits, diff_labels)
        per_token, keep = idc_pcl.token_cross_entropy(o.mlm_logits, labels)
        per_pair, _ = idc_pcl.token_cross_entropy(o.distractor_logits, diff_labels)
        return mlm + diff, (per_token, keep, per_pair)

    (loss, (per_token, keep, per_pair)), grads = jax.jit(
        jax.value_and_grad(loss_fn, has_aux=True))(params)
    check("MLM per-token CE", np.asarray(per_token)[np.asarray(keep)], per_token_t)
    check("distractor CE", per_pair, diff_t)
    check("summed loss", loss, loss_t, rel=True)
    sizes = tables.Sizes(len(vocab), STEPS, channels, 4, 4, "test",
                          token_rows=idc_dict_json.dict_json_token_rows(
                              config.model, vocab, tmp / "dict.json", len(table)))
    named = {k.removeprefix("module."): p.grad.numpy() for k, p in ref.named_parameters()}
    check_grads(grads, named, config, sizes)

    # Greedy: 40 tokens on 32 random pairs, ours through the trunk's cached loop.
    img1, img2 = pairs(PAIRS, grid, seed=4)
    want = greedy_ref.greedy(t_tokens(img1), t_tokens(img2), max_len=STEPS).numpy()
    greedy_params = compare.load_params(greedy_workdir)
    got = np.asarray(search.greedy_decode(model, {"params": greedy_params}, img1, img2,
                                            max_len=STEPS).ids)
    assert got.shape == (PAIRS, STEPS)
    assert len({tuple(row) for row in got}) >= 8  # captions that depend on the images
    np.testing.assert_array_equal(to_official[got], want)


def pretraining_dict(ref: tref.IDCPCL, path: Path, step: int = 1234) -> None:
    torch.save({"global_step": step, "model_state_dict": ref.state_dict(),
                "task_batch_num": {"mlm": 900, "mvcl": 110, "fda": 224}}, path)


def pretraining_batch(vocab, channels: int, to_official: np.ndarray) -> tuple:
    """A pretraining batch: ids, MLM labels (ours and the dict.json ids), the masked regions
    of either image, their features, and the two images with those regions zeroed."""
    b, length, n = 14, 12, 16  # two FDA groups of 7; 4x4 grids
    img1, img2 = pairs(b, (4, 4, channels), seed=6)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, len(vocab) + 2, (b, length))
    labels = np.where(rng.random(ids.shape) < 0.2, rng.integers(0, len(vocab), ids.shape), -1)
    labels[:, 2] = 9
    t_labels = np.where(labels >= 0, to_official[np.maximum(labels, 0)], -1)
    region = rng.random((b, n)) < 0.2
    region[:, 0] = True
    first = rng.random(b) < 0.5
    img_mask = np.concatenate([region & first[:, None], region & ~first[:, None]], 1)
    img_label = np.concatenate([img1.reshape(b, n, -1), img2.reshape(b, n, -1)], 1)
    m1 = img1 * ~img_mask[:, :n].reshape(b, 4, 4, 1)
    m2 = img2 * ~img_mask[:, n:].reshape(b, 4, 4, 1)
    return ids, labels, t_labels, img_mask, img_label, m1, m2


def test_pretraining_checkpoint_into_the_pretraining_model(setup):
    tmp, data_dir, vocab, channels, table = setup
    ref = torch_model("pretrain", len(table), channels, seed=5)
    path = tmp / "pretrain_checkpoint.pt"
    pretraining_dict(ref, path)
    config = make_config("pretrain", data_dir)
    workdir = tmp / "pretrain_workdir"
    report = converter.convert_checkpoint(config, path, workdir, dict_json=tmp / "dict.json")
    assert report.step == 1234 and not report.fresh and not report.saved_data_iterator
    assert "tied" in " ".join(report.dropped) and "task_batch_num" in str(report.notes)
    params = compare.load_params(workdir)
    model = models.build(config.model, vocab_size=len(vocab), max_len=12)
    to_official = trunk_to_official(vocab, table)
    ids, labels, t_labels, img_mask, img_label, m1, m2 = pretraining_batch(vocab, channels,
                                                                            to_official)

    out_t = ref.pretrain_forward(t_tokens(m1), t_tokens(m2), torch.from_numpy(to_official[ids]))
    mlm_t = tref.mlm_token_losses(out_t.mlm_logits, torch.from_numpy(t_labels))
    t_mask = torch.from_numpy(img_mask)
    p = torch.nn.functional.normalize(out_t.regressed[t_mask], dim=-1)
    y = torch.nn.functional.normalize(torch.from_numpy(img_label)[t_mask], dim=-1)
    neg = torch.nn.functional.normalize(out_t.regressed[~t_mask], dim=-1)
    mvcl_rows_t = torch.nn.functional.cross_entropy(
        torch.cat([p @ y.t(), p @ neg.t()], 1), torch.arange(p.size(0)), reduction="none")
    fda_t = tref.fda_loss(out_t.visual, out_t.text_cls)
    total_t = mlm_t.mean() + mvcl_rows_t.mean() + fda_t
    ref.zero_grad()
    total_t.backward()

    def loss_fn(q):
        o = model.apply({"params": q}, m1, m2, ids, method="pretrain")
        mlm, keep = idc_pcl.token_cross_entropy(o.mlm_logits, labels)
        mvcl, masked = on_one_device(idc_pcl_pretraining.mvcl_row_losses, o.regressed,
                                     img_mask, img_label)
        fda = on_one_device(idc_pcl_pretraining.fda_metrics, o.visual, o.text_cls,
                            samples=len(ids) // 7)["loss"]
        total = jnp.sum(mlm) / jnp.sum(keep) + jnp.sum(mvcl) / jnp.sum(masked) + fda
        return total, (mlm, keep, mvcl, masked, fda)

    (total, (mlm, keep, mvcl, masked, fda)), grads = jax.jit(
        jax.value_and_grad(loss_fn, has_aux=True))(params)
    check("pretraining MLM per-token CE", np.asarray(mlm)[np.asarray(keep)], mlm_t)
    check("MVCL per-region NCE", np.asarray(mvcl)[np.asarray(masked)], mvcl_rows_t)
    check("FDA loss", fda, fda_t)
    check("pretraining total", total, total_t, rel=True)
    sizes = tables.Sizes(len(vocab), 12, channels, 4, 4, "test", checkpoint_stage="pretrain",
                          token_rows=idc_dict_json.dict_json_token_rows(
                              config.model, vocab, tmp / "dict.json", len(table)))
    # named_parameters() lists the tied Parameter once (img_project.0.weight): its grad sums
    # both uses, as our one img_project_0/kernel does. The pretraining pooler is unused.
    named = {k: (p.grad.numpy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
             for k, p in ref.named_parameters()}
    check_grads(grads, named, config, sizes)


def test_pretraining_checkpoint_into_fine_tuning_keeps_all_but_the_pooler(setup):
    tmp, data_dir, vocab, channels, table = setup
    ref = torch_model("pretrain", len(table), channels, seed=8)
    path = tmp / "pretrain_for_finetune.pt"
    pretraining_dict(ref, path, step=50)
    config = make_config("finetune", data_dir)
    workdir = tmp / "from_pretraining"
    report = converter.convert_checkpoint(config, path, workdir, dict_json=tmp / "dict.json",
                                          step=0)
    assert report.fresh == ["pooler_0/bias", "pooler_0/kernel"] and report.step == 0
    assert any("feat_regress.net.0.weight" in keys for keys in report.dropped.values())
    params = flax.traverse_util.flatten_dict(compare.load_params(workdir), sep="/")
    # Every other parameter is the pretraining one (rows permuted), the pooler is the
    # trainer's initialisation (2d -> 2).
    rows = trunk_to_official(vocab, table)
    np.testing.assert_array_equal(params["word_embedding/embedding"],
                                  ref.word_embedding.weight.detach().numpy()[rows])
    np.testing.assert_array_equal(params["encoder/norm/a_2"],
                                  ref.encoder.norm.a_2.detach().numpy())
    assert params["pooler_0/kernel"].shape == (2 * SIZES["hidden_dim"], 2)
    sizes = tables.Sizes(len(vocab), 12, channels, 4, 4, "test")
    model = converter.build_model(config, sizes)
    spec = registry.converter_for("idc_pcl")
    fresh = flax.traverse_util.flatten_dict(
        converter.init_params(config, model, spec, sizes, abstract=False), sep="/")
    np.testing.assert_array_equal(params["pooler_0/kernel"], fresh["pooler_0/kernel"])


def test_dict_json_words_the_dataset_lacks_are_dropped(setup):
    tmp, data_dir, vocab, channels, _ = setup
    extra = ("zebra", "teal", "quux")
    table = write_dict_json(tmp / "dict_extra.json", vocab, extra, seed=3)
    ref = torch_model("finetune", len(table), channels, seed=9)
    path = tmp / "extra.pt"
    torch.save(ref.state_dict(), path)
    config = make_config("finetune", data_dir)
    report = converter.convert_checkpoint(config, path, tmp / "extra_workdir",
                                          dict_json=tmp / "dict_extra.json")
    dropped = report.sizes.token_rows.dropped
    assert sorted(dropped) == sorted(extra)
    assert "dropped 3 tokens" in report.summary()
    params = compare.load_params(tmp / "extra_workdir")
    model = models.build(config.model, vocab_size=len(vocab), max_len=12)
    img1, img2 = pairs(3, (4, 4, channels), seed=10)
    ids = np.random.default_rng(11).integers(0, len(vocab), (3, 8))
    to_official = trunk_to_official(vocab, table)
    out = model.apply({"params": params}, img1, img2, ids, method="finetune")
    out_t = ref.finetune_forward(t_tokens(img1), t_tokens(img2),
                                 torch.from_numpy(to_official[ids]))
    check("logits at the kept rows", out.mlm_logits, out_t.mlm_logits[..., to_official])


def check_width_and_dict_json_errors(tmp: Path, data_dir: str, config, good: Path,
                                     table: dict) -> None:
    """A feature width other than the checkpoint's, no --dict_json, and three wrong dict.json
    files (workdirs e0..e4)."""
    wrong_width = make_config("finetune", data_dir)
    wrong_width.model.image_dim = 8
    with pytest.raises(ConversionError, match="image_dim = 8 but the features have 16"):
        converter.convert_checkpoint(wrong_width, good, tmp / "e0", dict_json=tmp / "dict.json")
    with pytest.raises(ConversionError, match="--dict_json"):
        converter.convert_checkpoint(config, good, tmp / "e1")
    bad = dict(table)
    bad["<MASK>"], bad["<CLS>"] = bad["<CLS>"], bad["<MASK>"]
    (tmp / "bad_mask.json").write_text(json.dumps(bad))
    with pytest.raises(ConversionError, match=r"'<MASK>' has id 4.*hard-codes <MASK> = 5"):
        converter.convert_checkpoint(config, good, tmp / "e2", dict_json=tmp / "bad_mask.json")
    short = {w: i for w, i in table.items() if i < len(table) - 1}
    (tmp / "short.json").write_text(json.dumps(short))
    with pytest.raises(ConversionError, match="not the dict.json of this checkpoint"):
        converter.convert_checkpoint(config, good, tmp / "e3", dict_json=tmp / "short.json")
    missing_word = {w: i for w, i in table.items() if i < len(table) - 1}
    missing_word["<new>"] = len(table) - 1
    (tmp / "missing_word.json").write_text(json.dumps(missing_word))
    lost = next(w for w, i in table.items() if i == len(table) - 1)
    with pytest.raises(ConversionError, match=f"1 words of the dataset vocabulary.*{lost}"):
        converter.convert_checkpoint(config, good, tmp / "e4",
                                     dict_json=tmp / "missing_word.json")


def test_errors_name_the_problem(setup):
    tmp, data_dir, vocab, channels, table = setup
    config = make_config("finetune", data_dir)
    ref = torch_model("finetune", len(table), channels, seed=12)
    state = ref.state_dict()
    good = tmp / "good.pt"
    torch.save(state, good)

    check_width_and_dict_json_errors(tmp, data_dir, config, good, table)

    broken = dict(state)
    del broken["encoder.layers.1.attn.out.bias"]
    broken["encoder.layers.0.feed_forward.w_1.weight"] = torch.zeros(3, 3)
    broken["extra.weight"] = torch.zeros(2)
    torch.save(broken, tmp / "broken.pt")
    with pytest.raises(KeyMismatchError) as info:
        converter.convert_checkpoint(config, tmp / "broken.pt", tmp / "e5",
                                     dict_json=tmp / "dict.json")
    message = str(info.value)
    assert "encoder.layers.1.attn.out.bias" in message and "extra.weight" in message
    assert "w_1.weight" in message and "(3, 3)" in message and "(64, 32)" in message

    pre = torch_model("pretrain", len(table), channels, seed=13)
    untied = dict(pre.state_dict())
    untied[idc_converter.TIED_KEY] = untied[idc_converter.TIED_KEY] + 1.0
    pretraining_dict_path = tmp / "untied.pt"
    torch.save({"global_step": 1, "model_state_dict": untied, "task_batch_num": {}},
               pretraining_dict_path)
    with pytest.raises(KeyMismatchError, match="tied weights"):
        converter.convert_checkpoint(config, pretraining_dict_path, tmp / "e6",
                                     dict_json=tmp / "dict.json")
    cpu_balance = make_config("finetune", data_dir)
    cpu_balance.model.image_feature_scale = 16.0
    with pytest.raises(WrongModelError, match=r"image_feature_scale is 16.0.*unscaled"):
        converter.convert_checkpoint(cpu_balance, good, tmp / "e9", dict_json=tmp / "dict.json")
    with pytest.raises(WrongModelError, match="fine-tuning checkpoint"):
        converter.convert_checkpoint(make_config("pretrain", data_dir), good, tmp / "e7",
                                     dict_json=tmp / "dict.json")
    torch.save({"change_detector_state": {}, "speaker_state": {}}, tmp / "dirl.pt")
    with pytest.raises(WrongModelError, match="not an IDC-PCL checkpoint"):
        converter.convert_checkpoint(config, tmp / "dirl.pt", tmp / "e8",
                                     dict_json=tmp / "dict.json")
    # Nothing half-written: no failed conversion left a checkpoint.
    assert not any((tmp / f"e{i}" / "checkpoints").exists() and
                   any((tmp / f"e{i}" / "checkpoints").iterdir()) for i in range(10))
