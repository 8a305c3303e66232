"""IDC-PCL Flax port (changecap_jax/models/idc_pcl.py) against the independent torch reference
(tools/torch_reference/idc_pcl.py), both written from the notes of docs/official/idc_pcl.md §5.

Checked: the reference's state_dict keys, order and shapes equal Appendix C at the default sizes
(V = 100, parsed from the markdown; meta tensors, no memory); the Flax param tree maps 1:1 onto
them (tied weight = one param); random-weight parity at small sizes (hidden 64, 4 heads,
2 cross-modal blocks, FFN 128, 32-d features on a 3x3 grid, vocabulary 30, captions of 12),
float32 on CPU, eval mode: fine-tuning hidden states / MLM logits / distractor logits / summed
loss, pretraining MLM logits / MVCL regression / FDA vectors and the three losses within 1e-5,
gradients within 1e-4 of each tensor's largest entry; cached greedy decoding equals the torch
full recompute; the teacher-forced ``decode`` and its sown attention equal the recompute.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from changecap_jax.convert.models import idc_pcl as idc_converter  # noqa: E402
from changecap_jax.decoding import search  # noqa: E402
from changecap_jax.models import idc_pcl, idc_pcl_pretraining  # noqa: E402
from changecap_jax.models.base import ATTENTION  # noqa: E402
from changecap_jax.models.idc_pcl_pretraining import on_one_device  # noqa: E402
from tools.torch_reference import idc_pcl as tref  # noqa: E402

pytestmark = pytest.mark.torch

REFERENCE_MD = Path(__file__).resolve().parents[1] / "docs" / "official" / "idc_pcl.md"
D, HEADS, FF, C, GRID, V, L, LAYERS, CLS_ID = 64, 4, 128, 32, 3, 30, 12, 2, 6
N = GRID * GRID
TOL, GRAD_TOL = 1e-5, 1e-4
REPORT: dict[str, float] = {}
# The official dict.json layout (§5.1): BOS 1, MASK 5 and CLS inside the vocabulary.
OFFICIAL_TOKENS = dict(bos_id=tref.BOS_ID, mask_id=tref.MASK_ID, cls_id=CLS_ID)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for name, value in REPORT.items():
        print(f"IDC-PCL max |diff| {name}: {value:.3g}")


def torch_model(stage: str, seed: int = 0) -> tref.IDCPCL:
    torch.manual_seed(seed)
    model = tref.IDCPCL(V, CLS_ID, stage, n_embs=D, img_embs=C, dim_ff=FF, n_head=HEADS,
                        n_block=LAYERS, dropout=0.2)
    with torch.no_grad():  # non-trivial LN / bias values, so a mix-up cannot hide
        for name, p in model.named_parameters():
            if name.endswith(("a_2", "b_2")) or name == "feat_regress.bias":
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def flax_model(stage: str) -> idc_pcl.IDCPCL:
    return idc_pcl.IDCPCL(vocab_size=V, stage=stage, hidden_dim=D, image_dim=C, ffn_dim=FF,
                          num_heads=HEADS, cross_layers=LAYERS, dropout_rate=0.2,
                          **OFFICIAL_TOKENS)


def params_of(model: tref.IDCPCL) -> dict:
    return {"params": idc_converter.load_torch_state_dict(model.state_dict())}


def inputs(b: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    img1 = rng.random((b, GRID, GRID, C), dtype=np.float32)  # channels-last grids
    img2 = rng.random((b, GRID, GRID, C), dtype=np.float32)
    ids = rng.integers(0, V, size=(b, L)).astype(np.int64)
    ids[:, 0] = tref.BOS_ID
    return img1, img2, ids


def t_tokens(x: np.ndarray):
    return torch.from_numpy(x.reshape(x.shape[0], -1, x.shape[-1]))


def check(name: str, ours, ref, tol: float = TOL, *, rel: bool = False) -> None:
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref.detach().numpy() if hasattr(ref, "detach") else ref, np.float64)
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    d = float(np.max(np.abs(ours - ref)))
    limit = tol * max(float(np.max(np.abs(ref))), 1e-30) if rel else tol
    REPORT[name] = max(REPORT.get(name, 0.0), d / (limit / tol))
    assert d <= limit, f"{name}: max |diff| {d:.3g} > {limit:.3g}"


def check_grad(name: str, ours, ref) -> None:
    """Within GRAD_TOL of the tensor's largest entry; a gradient that is zero in exact
    arithmetic (k_linear.bias: softmax ignores a per-query constant) is float noise on both
    sides, so it is held to 1e-7 absolute instead."""
    if float(np.max(np.abs(np.asarray(ref)))) < 1e-7:
        assert float(np.max(np.abs(np.asarray(ours)))) < 1e-7, name
        return
    check(name, ours, ref, GRAD_TOL, rel=True)


def flat(tree: dict) -> dict[tuple[str, ...], np.ndarray]:
    return {tuple(k.key for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


# ---- keys and shapes (§6, Appendix C) ---------------------------------------------------------


def appendix_c() -> tuple[list[tuple[str, tuple[int, ...]]], int, int]:
    text = REFERENCE_MD.read_text().split("## Appendix C", 1)[1]
    body = text.split("[IDC pretrain (V=100)]", 1)[1]
    rows = re.findall(r"^\s+([\w.]+)\s+\(([\d, ]*)\)\s*$", body.split("(unique params")[0], re.M)
    counts = re.search(r"\(unique params (\d+) sd elems (\d+)\)", body)
    keys = [(k, tuple(int(s) for s in shape.replace(" ", "").split(",") if s)) for k, shape in rows]
    return keys, int(counts.group(1)), int(counts.group(2))


def test_torch_reference_state_dict_equals_appendix_c():
    listed, unique, elems = appendix_c()
    assert len(listed) == 103
    with torch.device("meta"):
        pre = tref.IDCPCL(100, CLS_ID, "pretrain")
        fine = tref.IDCPCL(100, CLS_ID, "finetune")
    got = [(k, tuple(v.shape)) for k, v in pre.state_dict().items()]
    assert got == listed  # keys, order and shapes
    assert sum(p.numel() for p in pre.parameters()) == unique  # the tied weight counted once
    assert sum(v.numel() for v in pre.state_dict().values()) == elems
    assert pre.feat_regress.weight is pre.img_project[0].weight
    # Fine-tune: minus feat_regress.* (6 keys), pooler.0.weight (2, 1024) (Appendix C note).
    want = [(k, (2, 1024) if k == "pooler.0.weight" else s) for k, s in listed
            if not k.startswith("feat_regress.")]
    assert [(k, tuple(v.shape)) for k, v in fine.state_dict().items()] == want
    assert sum(p.numel() for p in fine.parameters()) == 16_820_738 + 1025 * 100  # §6


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_flax_params_map_one_to_one_at_default_sizes(stage):
    with torch.device("meta"):
        ref = tref.IDCPCL(100, CLS_ID, stage)
    model = idc_pcl.IDCPCL(vocab_size=100, stage=stage, **OFFICIAL_TOKENS)
    img = jnp.zeros((1, 7, 7, 2048))
    shapes = jax.eval_shape(functools.partial(model.init, method=stage), jax.random.key(0),
                            img, img, jnp.zeros((1, 40), int))
    ours = {tuple(k.key for k in path): v.shape
            for path, v in jax.tree_util.tree_leaves_with_path(shapes["params"])}
    expected = {}
    for key, value in ref.state_dict().items():
        path = idc_converter.torch_key_to_flax(key)
        if path is None or key == idc_converter.TIED_KEY:
            assert key in (idc_converter.PE_KEY, idc_converter.TIED_KEY)
            continue
        shape = tuple(value.shape)
        expected[path] = shape[::-1] if path[-1] == "kernel" else shape
    assert ours == expected
    n_params = sum(int(np.prod(s)) for s in ours.values())
    assert n_params == (17_087_490 if stage == "pretrain" else 16_820_738) + 1025 * 100


def test_loader_checks_tie_and_sinusoid():
    sd = {k: v.detach().clone() for k, v in torch_model("pretrain").state_dict().items()}
    check("sinusoid table (200 x 64)", idc_pcl.idc_sinusoid_table(200, D),
          sd[idc_converter.PE_KEY][0], 1e-6)
    assert idc_converter.torch_key_to_flax("module.encoder.layers.1.sublayer.0.norm.a_2") == (
        "encoder", "layers_1", "sublayer_0", "norm", "a_2")
    untied = dict(sd)
    untied[idc_converter.TIED_KEY] = untied[idc_converter.TIED_KEY] + 1.0
    with pytest.raises(ValueError, match="tied"):
        idc_converter.load_torch_state_dict(untied)
    bad_pe = dict(sd)
    bad_pe[idc_converter.PE_KEY] = bad_pe[idc_converter.PE_KEY] + 1e-3
    with pytest.raises(ValueError, match="sinusoid"):
        idc_converter.load_torch_state_dict(bad_pe)


# ---- fine-tuning (§5.2, §5.4) -----------------------------------------------------------------


def test_finetune_forward_loss_and_gradients():
    ref = torch_model("finetune")
    model = flax_model("finetune")
    variables = params_of(ref)
    img1, img2, ids = inputs(4, seed=1)
    rng = np.random.default_rng(2)
    labels = np.where(rng.random(ids.shape) < 0.3, rng.integers(0, V, ids.shape), -1)
    labels[:, 1] = 3  # at least one labelled token per row
    diff_labels = np.array([0, 1, 1, 0])

    out_t = ref.finetune_forward(t_tokens(img1), t_tokens(img2), torch.from_numpy(ids))
    loss_t = tref.finetune_loss(out_t, torch.from_numpy(labels), torch.from_numpy(diff_labels))
    loss_t.backward()

    def loss_fn(params):
        o = model.apply({"params": params}, img1, img2, ids, method="finetune")
        mlm, diff = idc_pcl.finetune_loss(o.mlm_logits, labels, o.distractor_logits, diff_labels)
        return mlm + diff, o

    # One compiled program for outputs, loss and gradients (the CPU test budget is tight).
    (loss, out), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(variables["params"])
    check("finetune hidden", out.hidden, out_t.hidden)
    check("finetune MLM logits", out.mlm_logits, out_t.mlm_logits)
    check("finetune distractor logits", out.distractor_logits, out_t.distractor_logits)
    check("finetune summed loss", loss, loss_t, rel=True)
    ref_grads = flat(idc_converter.load_torch_state_dict(
        {k: p.grad for k, p in ref.named_parameters()}))
    ours = flat(grads)
    assert ours.keys() == ref_grads.keys()
    for path, g in ours.items():
        check_grad("finetune grads (rel. to max)", g, ref_grads[path])


def test_train_mode_uses_dropout():
    model = flax_model("finetune")
    variables = params_of(torch_model("finetune"))
    img1, img2, ids = inputs(2, seed=3)

    @jax.jit
    def train_forward(key):
        return model.apply(variables, img1, img2, ids, train=True, rngs={"dropout": key},
                           method="finetune")

    # rbg keys: threefry dropout masks make this small program slow to compile on CPU.
    keys = jax.random.key(0, impl="rbg"), jax.random.key(1, impl="rbg")
    a, b = train_forward(keys[0]), train_forward(keys[1])
    assert np.all(np.isfinite(np.asarray(a.mlm_logits)))
    assert not np.allclose(np.asarray(a.mlm_logits), np.asarray(b.mlm_logits))


# ---- pretraining (§5.2, §5.3) -----------------------------------------------------------------


def test_pretrain_forward_losses_and_gradients():
    ref = torch_model("pretrain")
    model = flax_model("pretrain")
    variables = params_of(ref)
    b = 14  # two FDA groups of 7
    img1, img2, ids = inputs(b, seed=4)
    rng = np.random.default_rng(5)
    labels = np.where(rng.random(ids.shape) < 0.2, rng.integers(0, V, ids.shape), -1)
    labels[:, 2] = 7
    # MVM: mask ~15 % of one image's regions (zeroed inputs); labels = unmasked originals.
    region = rng.random((b, N)) < 0.15
    region[:, 0] = True
    first = rng.random(b) < 0.5
    img_mask = np.concatenate([region & first[:, None], region & ~first[:, None]], 1)
    img_label = np.concatenate([img1.reshape(b, N, C), img2.reshape(b, N, C)], 1)
    m1 = img1 * ~img_mask[:, :N].reshape(b, GRID, GRID, 1)
    m2 = img2 * ~img_mask[:, N:].reshape(b, GRID, GRID, 1)

    out_t = ref.pretrain_forward(t_tokens(m1), t_tokens(m2), torch.from_numpy(ids))
    losses_t = (
        tref.pretrain_mlm_loss(out_t.mlm_logits, torch.from_numpy(labels)),
        tref.mvcl_loss(out_t.regressed, torch.from_numpy(img_mask), torch.from_numpy(img_label)),
        tref.fda_loss(out_t.visual, out_t.text_cls),
    )
    sum(losses_t).backward()

    def loss_fn(params):
        o = model.apply({"params": params}, m1, m2, ids, method="pretrain")
        parts = (on_one_device(idc_pcl_pretraining.mlm_metrics, o.mlm_logits, labels)["loss"],
                 on_one_device(idc_pcl_pretraining.mvcl_metrics, o.regressed, img_mask,
                               img_label)["loss"],
                 on_one_device(idc_pcl_pretraining.fda_metrics, o.visual, o.text_cls,
                               samples=b // 7)["loss"])
        return sum(parts), (parts, o)

    grads, (ours, out) = jax.jit(jax.grad(loss_fn, has_aux=True))(variables["params"])
    for field in ("hidden", "mlm_logits", "regressed", "visual", "text_cls"):
        check(f"pretrain {field}", getattr(out, field), getattr(out_t, field))
    for name, a, t in zip(("MLM", "MVCL", "FDA"), ours, losses_t, strict=True):
        check(f"pretrain {name} loss", a, t)
    grads = flat(grads)
    # named_parameters() lists the tied Parameter once: its grad sums both uses.
    ref_grads = flat(idc_converter.load_torch_state_dict(
        {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}))
    assert ("pooler_0", "kernel") not in ref_grads  # unused by the CLEVR tasks (§5.2)
    for path, g in ref_grads.items():
        check_grad("pretrain grads (rel. to max)", grads[path], g)
    assert not np.any(grads[("pooler_0", "kernel")])


# ---- decoding (§5.5) --------------------------------------------------------------------------


def test_cached_greedy_equals_torch_full_recompute():
    ref = torch_model("finetune", seed=7)
    model = flax_model("finetune")
    variables = params_of(ref)
    img1, img2, _ = inputs(6, seed=8)
    want = ref.greedy(t_tokens(img1), t_tokens(img2), max_len=L).numpy()
    # The trunk's cached greedy loop under the model's rules (no UNK ban, all L - 1 steps).
    got = np.asarray(search.greedy_decode(model, variables, img1, img2, max_len=L).ids)
    assert got.shape == (6, L) and np.all(got[:, 0] == tref.BOS_ID)
    assert len(np.unique(got[:, 1:])) > 1  # a non-degenerate decode
    np.testing.assert_array_equal(got, want)


def test_teacher_forced_decode_and_sown_attention_equal_recompute():
    ref = torch_model("finetune", seed=9)
    model = flax_model("finetune")
    variables = params_of(ref)
    img1, img2, ids = inputs(3, seed=10)
    apply = jax.jit(model.apply, static_argnames=("method", "mutable"))
    memory = apply(variables, img1, img2, method="encode")
    logits, state = apply(variables, memory, ids, method="decode", mutable=(ATTENTION,))
    sown = jax.tree_util.tree_leaves(state[ATTENTION])
    assert len(sown) == LAYERS and sown[0].shape == (3, HEADS, L, 2 * N + 2)
    order = np.r_[1 : N + 1, N + 2 : 2 * N + 2, 0, N + 1]  # before, after, CLS1, CLS2
    for t in range(L):
        prefix = np.concatenate([ids[:, : t + 1], np.full((3, 1), tref.MASK_ID)], 1)
        out_t = ref.finetune_forward(t_tokens(img1), t_tokens(img2), torch.from_numpy(prefix))
        check("decode logits vs recompute", logits[:, t], out_t.mlm_logits[:, -1])
        for layer, probs in zip(ref.encoder.layers, sown, strict=True):
            want = layer.attn.last_probs[:, :, -1, : 2 * N + 2][..., order]
            check("sown attention vs recompute", probs[:, :, t], want)
    # The cached step gives the same rows.
    _, cache = model.apply(variables, memory, L, method="init_cache", mutable=["cache"])
    cache = cache["cache"]
    for t in range(L - 1):
        step, mutated = apply({**variables, "cache": cache}, jnp.asarray(ids[:, t]),
                              jnp.int32(t), method="decode_step", mutable=("cache",))
        cache = mutated["cache"]
        check("decode_step vs decode", step, logits[:, t])
