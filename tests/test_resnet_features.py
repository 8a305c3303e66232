"""ResNet-101 grid-feature extraction: network, weights loading, official preprocessing, CLI.

No pretrained weights can be downloaded here, so the network tests use random weights saved in
torchvision's state-dict format and compare against a direct functional computation written
from torchvision's architecture. The resize tests use hand-computed values, an independent
straightforward implementation of the cubic kernel, and outputs recorded from real
``cv2.resize`` (opencv-python-headless 4.10.0, 4.14.0 and 5.0.0, with ``cv2.ipp.setUseIPP(
False)``; all three gave the same values).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (optional: pip install -r requirements-torch.txt)")
F = torch.nn.functional

from changecap_jax.features import extract, preprocess, resnet  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BLOCKS = {1: 3, 2: 4, 3: 23, 4: 3}
PLANES = {1: 64, 2: 128, 3: 256, 4: 512}


# ---------------------------------------------------------------------------------------------
# Helpers and fixtures


def _expected_torchvision_keys() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision resnet101's state-dict keys and shapes, in order, from its architecture."""

    def bn(prefix: str, c: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{prefix}.weight", (c,)), (f"{prefix}.bias", (c,)),
                (f"{prefix}.running_mean", (c,)), (f"{prefix}.running_var", (c,)),
                (f"{prefix}.num_batches_tracked", ())]

    keys = [("conv1.weight", (64, 3, 7, 7)), *bn("bn1", 64)]
    inplanes = 64
    for layer, blocks in BLOCKS.items():
        planes = PLANES[layer]
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            keys += [(f"{p}.conv1.weight", (planes, inplanes, 1, 1)), *bn(f"{p}.bn1", planes),
                     (f"{p}.conv2.weight", (planes, planes, 3, 3)), *bn(f"{p}.bn2", planes),
                     (f"{p}.conv3.weight", (4 * planes, planes, 1, 1)),
                     *bn(f"{p}.bn3", 4 * planes)]
            if b == 0:
                keys += [(f"{p}.downsample.0.weight", (4 * planes, inplanes, 1, 1)),
                         *bn(f"{p}.downsample.1", 4 * planes)]
            inplanes = 4 * planes
    keys += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return keys


def _direct_features(sd: dict, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """conv1 -> bn1 -> relu -> maxpool -> layer1..4 written with torch.nn.functional from the
    state dict alone (torchvision: stride on the 3x3 conv, BN eps 1e-5); outputs of layer3/4."""

    def bn(t: torch.Tensor, p: str) -> torch.Tensor:
        return F.batch_norm(t, sd[f"{p}.running_mean"], sd[f"{p}.running_var"],
                            sd[f"{p}.weight"], sd[f"{p}.bias"], training=False, eps=1e-5)

    x = F.conv2d(x, sd["conv1.weight"], stride=2, padding=3)
    x = F.max_pool2d(F.relu(bn(x, "bn1")), kernel_size=3, stride=2, padding=1)
    outs = {}
    for layer, blocks in BLOCKS.items():
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            stride = 2 if (b == 0 and layer > 1) else 1
            y = F.relu(bn(F.conv2d(x, sd[f"{p}.conv1.weight"]), f"{p}.bn1"))
            y = F.conv2d(y, sd[f"{p}.conv2.weight"], stride=stride, padding=1)
            y = F.relu(bn(y, f"{p}.bn2"))
            y = bn(F.conv2d(y, sd[f"{p}.conv3.weight"]), f"{p}.bn3")
            if b == 0:
                idt = F.conv2d(x, sd[f"{p}.downsample.0.weight"], stride=stride)
                idt = bn(idt, f"{p}.downsample.1")
            else:
                idt = x
            x = F.relu(y + idt)
        outs[layer] = x
    return outs


def _write_images(folder: Path, count: int, size: tuple[int, int] = (48, 64),
                  start: int = 0) -> list[Path]:
    """Structured RGB PNGs named as CLEVR's, each clearly different from the others."""
    folder.mkdir(parents=True, exist_ok=True)
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    paths = []
    for i in range(start, start + count):
        img = np.stack([127 + 120 * np.sin((3 + i) * xx + i), 127 + 120 * np.cos((2 + i) * yy),
                        255 * ((xx + yy * i) % 1.0)], axis=-1)
        path = folder / f"CLEVR_default_{i:06d}.png"
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def two_images(tmp_path_factory) -> list[Path]:
    return _write_images(tmp_path_factory.mktemp("images"), 2)


@pytest.fixture(scope="module")
def direct_features(random_weights, two_images) -> dict[int, np.ndarray]:
    sd = torch.load(random_weights, weights_only=True)
    x = torch.from_numpy(preprocess.preprocess_batch(two_images))
    with torch.no_grad():
        outs = _direct_features(sd, x)
    return {k: v.numpy() for k, v in outs.items()}


class _TinyExtractor(torch.nn.Module):
    """Stands in for the truncated ResNet (same output shape, image-dependent), fast; records
    the batch size of every call."""

    layer = 3

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.proj = torch.nn.Conv2d(3, 1024, kernel_size=1)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return torch.relu(self.proj(F.adaptive_avg_pool2d(x, 14)))


def _state_with(overrides: dict | None = None, drop: tuple[str, ...] = ()) -> dict:
    """A full-size ResNet-101 state dict that costs nothing to save (expanded zeros)."""
    state = {k: torch.zeros(()).expand(shape) for k, shape in _expected_torchvision_keys()}
    for k in drop:
        del state[k]
    state.update(overrides or {})
    return state


# ---------------------------------------------------------------------------------------------
# Network and weights


@pytest.mark.torch
def test_state_dict_keys_are_torchvision_resnet101():
    model = resnet.ResNet()
    got = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert got == _expected_torchvision_keys()
    assert len(got) == 626
    shapes = dict(got)
    assert shapes["fc.weight"] == (1000, 2048)
    assert shapes["layer3.22.bn3.running_var"] == (1024,)
    assert sum(p.numel() for p in model.parameters()) == 44_549_160  # torchvision's count
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)


@pytest.mark.torch
@pytest.mark.parametrize("layer,shape", [(3, (1024, 14, 14)), (4, (2048, 7, 7))])
def test_loaded_weights_give_the_direct_computation(random_weights, two_images, direct_features,
                                                    layer, shape):
    model = resnet.load_resnet101(random_weights, layer)
    assert not model.training
    assert list(dict(model.named_children())) == (
        ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"][:4 + layer])
    out = list(extract.extract_features(two_images, model, layer, batch_size=1))
    assert [p for p, _ in out] == two_images
    feats = np.stack([f for _, f in out])
    assert feats.dtype == np.float32 and feats.shape == (2, *shape)
    want = direct_features[layer]
    np.testing.assert_allclose(feats, want, rtol=1e-5, atol=1e-5)
    assert feats.min() >= 0.0
    # The images differ, so must their features (a wiring bug could wash the input out).
    assert np.abs(feats[0] - feats[1]).mean() > 0.05 * np.abs(feats).mean()


# ---------------------------------------------------------------------------------------------
# Preprocessing


def _keys_kernel(d: float, a: float = -0.75) -> float:
    d = abs(d)
    if d <= 1:
        return (a + 2) * d**3 - (a + 3) * d**2 + 1
    if d < 2:
        return a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a
    return 0.0


def _reference_resize(img: np.ndarray, out_w: int, out_h: int) -> np.ndarray:
    """Straightforward per-pixel OpenCV-style cubic: half-pixel centres, replicated border,
    weights quantised to 1/2048 (round half even); returns the exact value before rounding."""
    h, w = img.shape[:2]

    def taps(o: int, src: int, dst: int) -> list[tuple[int, int]]:
        f = (o + 0.5) * src / dst - 0.5
        s = math.floor(f)
        t = f - s
        return [(min(max(s - 1 + j, 0), src - 1), round(_keys_kernel(t + 1 - j) * 2048))
                for j in range(4)]

    out = np.zeros((out_h, out_w) + img.shape[2:], dtype=np.float64)
    for oy in range(out_h):
        for ox in range(out_w):
            acc = 0
            for yy, wy in taps(oy, h, out_h):
                row = sum(wx * img[yy, xx].astype(np.int64) for xx, wx in taps(ox, w, out_w))
                acc = acc + wy * row
            out[oy, ox] = acc / 2.0**22
    return out


@pytest.mark.torch
def test_resize_hand_computed_values():
    # Width 4 -> 2: source x = 2d + 0.5, weights (-3, 19, 19, -3)/32 on x-1 .. x+2 (clamped).
    # d=0: (-3*10 + 19*10 + 19*20 - 3*30)/32 = 14.0625; d=1: (-60+570+760-120)/32 = 35.9375.
    row = np.array([[10, 20, 30, 40]], dtype=np.uint8)
    assert preprocess.resize_cubic_numpy(row, 2, 1).tolist() == [[14, 36]]
    rgb = np.repeat(row[:, :, None], 3, axis=2)
    assert preprocess.resize_cubic_numpy(rgb, 2, 1).tolist() == [[[14] * 3, [36] * 3]]
    # Same size is a copy (as cv::resize); a constant image stays constant.
    img = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert np.array_equal(preprocess.resize_cubic_numpy(img, 4, 3), img)
    const = np.full((30, 45, 3), 77, dtype=np.uint8)
    assert (preprocess.resize_cubic_numpy(const, 224, 224) == 77).all()


@pytest.mark.torch
@pytest.mark.parametrize("shape,out_wh", [((7, 9, 3), (5, 4)), ((5, 6), (13, 11)),
                                          ((10, 10, 3), (3, 10)), ((9, 20, 3), (17, 6))])
def test_resize_matches_independent_reference(shape, out_wh):
    rng = np.random.default_rng(sum(shape))
    img = rng.integers(0, 256, size=shape, dtype=np.uint8)
    got = preprocess.resize_cubic_numpy(img, *out_wh)
    exact = _reference_resize(img, *out_wh)
    # Away from exact .5 ties (tested below) the result is the rounded, saturated value.
    clear = np.abs(exact - np.floor(exact) - 0.5) > 1e-3
    assert clear.mean() > 0.95
    want = np.clip(np.floor(exact + 0.5), 0, 255)
    np.testing.assert_array_equal(got[clear], want[clear])
    assert got.shape == tuple(reversed(out_wh)) + shape[2:] and got.dtype == np.uint8


@pytest.mark.torch
def test_resize_ties_follow_opencv_simd_and_scalar_paths():
    # Period-2 row (10, 23), width 2N -> N: every interior output is exactly 16.5. OpenCV's
    # vector kernel (first multiple of 8 values of a row) rounds half to even -> 16; the
    # scalar tail (FixedPtCast, +2**21 >> 22) rounds half up -> 17. Checked against cv2.
    def run(n: int) -> list[int]:
        row = np.array([[10, 23] * n], dtype=np.uint8)
        return preprocess.resize_cubic_numpy(row, n, 1)[0].tolist()

    assert run(4) == [18, 17, 17, 15]
    assert run(16) == [18] + [16] * 14 + [15]
    assert run(20) == [18] + [16] * 15 + [17, 17, 17, 15]


@pytest.mark.torch
def test_resize_matches_recorded_cv2_outputs():
    # opencv/opencv#22477: OpenCV's own code gives 155 at [0, 1] (the IPP path gives 156).
    img = np.array([[0, 255, 0], [255, 0, 255]], dtype=np.uint8)
    got = preprocess.resize_cubic_numpy(img, 4, 3, inv_scale_x=1.5, inv_scale_y=1.5)
    assert got.tolist() == [[0, 155, 255, 26], [127, 128, 127, 127], [255, 99, 0, 229]]
    yy, xx = np.mgrid[0:6, 0:9]
    img = np.stack([(xx * 29 + yy * 41) % 256, (xx * xx * 7 + yy * 13) % 256,
                    ((xx + 1) * (yy + 2) * 11) % 256], axis=-1).astype(np.uint8)
    want = [[[17, 4, 32], [73, 38, 78], [124, 114, 121], [182, 205, 178], [199, 146, 147]],
            [[79, 23, 54], [135, 57, 132], [186, 134, 231], [79, 34, 78], [54, 181, 84]],
            [[144, 44, 77], [212, 78, 184], [193, 155, 8], [36, 63, 152], [102, 206, 187]],
            [[221, 64, 99], [47, 98, 196], [48, 175, 118], [108, 83, 93], [164, 99, 125]]]
    assert preprocess.resize_cubic_numpy(img, 5, 4).tolist() == want


@pytest.mark.torch
def test_resize_ipp_flavour_rounds_the_unquantised_kernel():
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, size=(12, 18, 3), dtype=np.uint8)
    got = preprocess.resize_cubic_numpy(img, 7, 5, flavour="ipp")
    h, w = img.shape[:2]
    exact = np.zeros((5, 7, 3))
    for oy in range(5):
        fy = (oy + 0.5) * h / 5 - 0.5
        for ox in range(7):
            fx = (ox + 0.5) * w / 7 - 0.5
            for j in range(4):
                for i in range(4):
                    y = min(max(math.floor(fy) - 1 + j, 0), h - 1)
                    x = min(max(math.floor(fx) - 1 + i, 0), w - 1)
                    wgt = (_keys_kernel(fy - math.floor(fy) + 1 - j)
                           * _keys_kernel(fx - math.floor(fx) + 1 - i))
                    exact[oy, ox] += wgt * img[y, x]
    clear = np.abs(exact - np.floor(exact) - 0.5) > 1e-3
    np.testing.assert_array_equal(got[clear], np.clip(np.rint(exact), 0, 255)[clear])
    with pytest.raises(ValueError, match="flavour"):
        preprocess.resize_cubic_numpy(img, 7, 5, flavour="pillow")


@pytest.mark.torch
def test_normalize_official_std_and_switch():
    img = np.zeros((2, 3, 3), dtype=np.uint8)
    img[0, 1] = (0, 128, 255)
    out = preprocess.normalize(img)
    assert out.dtype == np.float32 and out.shape == (3, 2, 3)  # channels first
    np.testing.assert_allclose(out[:, 0, 1], [-0.485 / 0.229, (128 / 255 - 0.456) / 0.224,
                                              (1 - 0.406) / 0.224], rtol=1e-6)
    assert out[2, 0, 1] == pytest.approx(2.6517857, rel=1e-6)  # std 0.224, the official typo
    fixed = preprocess.normalize(img, std_fix=True)
    assert fixed[2, 0, 1] == pytest.approx(2.64, rel=1e-6)  # std 0.225
    np.testing.assert_array_equal(fixed[:2], out[:2])  # red and green unchanged
    # float64 arithmetic then float32, exactly as the official batch code.
    x = img.transpose(2, 0, 1)[None].astype(np.float32) / 255.0
    mean = np.array(preprocess.MEAN).reshape(1, 3, 1, 1)
    ref = ((x - mean) / np.array(preprocess.STD_OFFICIAL).reshape(1, 3, 1, 1)).astype(np.float32)
    np.testing.assert_array_equal(preprocess.normalize(img[None]), ref)


@pytest.mark.torch
def test_read_rgb_formats(tmp_path):
    rgba = np.random.default_rng(0).integers(0, 256, size=(4, 5, 4), dtype=np.uint8)
    rgba[..., 3] = 0
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    got = preprocess.read_rgb(tmp_path / "a.png")
    assert got.dtype == np.uint8 and got.shape == (4, 5, 3)
    np.testing.assert_array_equal(got, rgba[..., :3])  # alpha dropped, not composited
    Image.fromarray(np.full((6, 7, 3), 90, np.uint8)).save(tmp_path / "b.jpg", quality=95)
    assert np.abs(preprocess.read_rgb(tmp_path / "b.jpg").astype(int) - 90).max() <= 2
    frames = [Image.new("RGB", (3, 2), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "c.gif", save_all=True, append_images=frames[1:])
    gif = preprocess.read_rgb(tmp_path / "c.gif")
    assert gif.shape == (2, 3, 3) and (gif == [255, 0, 0]).all()  # first frame
    Image.fromarray(np.full((3, 3), 60, np.uint8), "L").save(tmp_path / "d.png")
    assert (preprocess.read_rgb(tmp_path / "d.png") == 60).all()


# ---------------------------------------------------------------------------------------------
# Files, order, resumption


@pytest.mark.torch
def test_official_file_order(tmp_path):
    names = ["CLEVR_default_10.png", "CLEVR_default_9.png", "CLEVR_default_000011.png"]
    assert extract.sort_image_names(names) == [
        "CLEVR_default_9.png", "CLEVR_default_10.png", "CLEVR_default_000011.png"]
    assert extract.sort_image_names(["b_2.png", "a.png", "c_1.png"]) == ["a.png", "b_2.png",
                                                                    "c_1.png"]
    assert extract.sort_image_names(["x_b.png", "x_a.png"]) == ["x_a.png", "x_b.png"]
    _write_images(tmp_path, 2, size=(8, 8))
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".hidden.png").write_bytes(b"")
    assert [p.name for p in extract.list_images(tmp_path)] == [
        "CLEVR_default_000000.png", "CLEVR_default_000001.png"]
    assert extract.feature_path("out", tmp_path / "CLEVR_default_000000.png") == Path(
        "out/CLEVR_default_000000.png.npy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images"):
        extract.list_images(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        extract.list_images(tmp_path / "absent")


@pytest.mark.torch
def test_resume_recomputes_only_the_missing_file(tmp_path):
    images = _write_images(tmp_path / "img", 3, size=(24, 32))
    out = tmp_path / "feat"
    model = _TinyExtractor()
    first = extract.extract_directory(tmp_path / "img", out, model, 3, batch_size=2, progress=False)
    assert (first.computed, first.skipped, model.calls) == (3, 0, [2, 1])
    files = [extract.feature_path(out, p) for p in images]
    before = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in files}
    arrays = [np.load(f) for f in files]
    assert all(a.shape == (1024, 14, 14) and a.dtype == np.float32 for a in arrays)
    assert not np.array_equal(arrays[0], arrays[1])

    files[1].unlink()
    model.calls.clear()
    second = extract.extract_directory(tmp_path / "img", out, model, 3, batch_size=2,
                                  progress=False)
    assert (second.computed, second.skipped, model.calls) == (1, 2, [1])
    for f in (files[0], files[2]):
        assert (f.stat().st_mtime_ns, f.read_bytes()) == before[f]
    np.testing.assert_array_equal(np.load(files[1]), arrays[1])
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in files)  # no temps

    model.calls.clear()
    third = extract.extract_directory(tmp_path / "img", out, model, 3, progress=False)
    assert (third.computed, third.skipped, model.calls) == (0, 3, [])


@pytest.mark.torch
def test_incomplete_outputs_are_recomputed(tmp_path):
    images = _write_images(tmp_path / "img", 3, size=(16, 16))
    out = tmp_path / "feat"
    out.mkdir()
    good = np.ones((1024, 14, 14), np.float32)
    np.save(extract.feature_path(out, images[0]), good)
    np.save(extract.feature_path(out, images[1]), np.ones((2048, 7, 7), np.float32))  # wrong layer
    full = extract.feature_path(out, images[2])
    np.save(full, good)
    full.write_bytes(full.read_bytes()[:1000])  # truncated
    assert extract.is_complete(extract.feature_path(out, images[0]), (1024, 14, 14))
    assert not extract.is_complete(full, (1024, 14, 14))
    model = _TinyExtractor()
    summary = extract.extract_directory(tmp_path / "img", out, model, 3, progress=False)
    assert (summary.computed, summary.skipped, model.calls) == (2, 1, [2])
    for p in images:
        assert extract.is_complete(extract.feature_path(out, p), (1024, 14, 14))


@pytest.mark.torch
def test_atomic_save_leaves_no_partial_file(tmp_path):
    target = tmp_path / "x.png.npy"
    with pytest.raises(ValueError):
        extract.save_npy_atomic(target, np.array([object()]))  # np.save refuses object arrays
    assert list(tmp_path.iterdir()) == []
    extract.save_npy_atomic(target, np.arange(3, dtype=np.float32))
    assert np.load(target).tolist() == [0, 1, 2] and len(list(tmp_path.iterdir())) == 1


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.torch
def test_missing_weights_file(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(resnet.WeightsError, match="nope.pth.*does not exist"):
        resnet.load_resnet101(missing)
    with pytest.raises(resnet.WeightsError, match="nope.pth"):
        extract.extract_features([tmp_path / "a.png"], missing)


@pytest.mark.torch
def test_foreign_or_truncated_weights_file(tmp_path):
    text = tmp_path / "weights.txt"
    text.write_text("these are not weights\n")
    with pytest.raises(resnet.WeightsError, match=r"weights\.txt is not a readable PyTorch"):
        resnet.load_resnet101(text)
    ckpt = tmp_path / "small.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, ckpt)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    with pytest.raises(resnet.WeightsError, match=r"truncated\.pth is not a readable PyTorch"):
        resnet.load_resnet101(truncated)
    listed = tmp_path / "list.pth"
    torch.save([1, 2, 3], listed)
    with pytest.raises(resnet.WeightsError, match=r"list\.pth holds a list"):
        resnet.load_resnet101(listed)


@pytest.mark.torch
def test_wrong_shaped_key_is_named_with_both_shapes(tmp_path):
    path = tmp_path / "bad_shape.pth"
    torch.save(_state_with({"layer3.5.conv2.weight": torch.zeros(256, 256, 1, 1)}), path)
    with pytest.raises(resnet.WeightsError) as err:
        resnet.load_resnet101(path)
    msg = str(err.value)
    assert "bad_shape.pth" in msg and "'layer3.5.conv2.weight'" in msg
    assert "(256, 256, 1, 1)" in msg and "(256, 256, 3, 3)" in msg


@pytest.mark.torch
def test_missing_and_unexpected_keys(tmp_path):
    path = tmp_path / "w.pth"
    torch.save(_state_with(drop=("layer4.2.bn3.running_var",)), path)
    with pytest.raises(resnet.WeightsError, match="missing.*'layer4.2.bn3.running_var'"):
        resnet.load_resnet101(path)
    torch.save(_state_with({"head.weight": torch.zeros(3)}), path)
    with pytest.raises(resnet.WeightsError, match="unexpected.*'head.weight'"):
        resnet.load_resnet101(path)
    # Older torchvision checkpoints have no num_batches_tracked; DataParallel adds "module.".
    state = {f"module.{k}": v for k, v in _state_with().items()
             if not k.endswith("num_batches_tracked")}
    torch.save(state, path)
    model = resnet.load_resnet101(path, layer=4)
    assert model.output_shape == (2048, 7, 7)


@pytest.mark.torch
def test_unreadable_image_is_named_and_earlier_outputs_kept(tmp_path):
    images = _write_images(tmp_path / "img", 1, size=(16, 16))
    bad = tmp_path / "img" / "CLEVR_default_000001.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(preprocess.ImageReadError, match="CLEVR_default_000001.png"):
        preprocess.read_rgb(bad)
    out = tmp_path / "feat"
    with pytest.raises(preprocess.ImageReadError, match="CLEVR_default_000001.png"):
        extract.extract_directory(tmp_path / "img", out, _TinyExtractor(), 3, batch_size=1,
                             progress=False)
    assert sorted(p.name for p in out.iterdir()) == [f"{images[0].name}.npy"]


@pytest.mark.torch
def test_cli_extracts_with_real_weights_and_reports_errors(tmp_path, random_weights,
                                                           direct_features, two_images):
    img_dir = tmp_path / "img"
    img_dir.mkdir()
    (img_dir / two_images[1].name).write_bytes(two_images[1].read_bytes())
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(out: Path, weights: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "data_prep.extract_features", f"--images={img_dir}",
               f"--out={out}", f"--weights={weights}", "--layer=3", "--batch_size=4"]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)

    run = cli(tmp_path / "feat", random_weights)
    assert run.returncode == 0, run.stderr
    assert "1 image(s) extracted, 0 already present" in run.stdout
    feat = np.load(tmp_path / "feat" / f"{two_images[1].name}.npy")
    np.testing.assert_allclose(feat, direct_features[3][1], rtol=1e-5, atol=1e-5)

    run = cli(tmp_path / "feat2", tmp_path / "missing.pth")
    assert run.returncode != 0 and "missing.pth" in run.stderr
    assert "Traceback" not in run.stderr  # a clear message, not a stack trace
