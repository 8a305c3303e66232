"""The official image preprocessing of the ResNet-101 feature extraction, in NumPy.

The official script (SCORER ``scripts/extract_features.py``) does, per image::

    img = imageio.imread(path, pilmode="RGB")                       # uint8 H x W x 3
    img = cv2.resize(img, (224, 224), interpolation=cv2.INTER_CUBIC)  # aspect ratio not kept
    batch = (batch.astype(float32) / 255.0 - mean) / std            # float64 arithmetic
    torch.FloatTensor(batch)                                        # -> float32, N x 3 x H x W

with mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.224): the last value is a typo for
0.225 that a faithful re-extraction keeps (``STD_OFFICIAL``); ``std_fix=True`` selects the
ImageNet value (``STD_IMAGENET``).

``cv2`` is an optional dependency. When it is importable, ``resize_cubic`` calls
``cv2.resize``; otherwise it runs ``resize_cubic_numpy``, a re-implementation of OpenCV's own
(non-IPP) ``INTER_CUBIC`` path for uint8 images, written from a reading of
``modules/imgproc/src/resize.cpp`` (``cv::hal::resize``, ``interpolateCubic``,
``HResizeCubic``, ``VResizeCubic``, ``VResizeCubicVec_32s8u``, ``FixedPtCast``):

* source coordinate of output pixel ``d``: ``f = float32((d + 0.5) * scale - 0.5)`` computed in
  double and cast to float, ``scale = src_size / dst_size`` (double); ``s = floor(f)``,
  ``t = f - s`` (float32);
* the four weights of source pixels ``s-1 .. s+2`` from the Keys kernel with ``A = -0.75``,
  evaluated in float32 exactly as ``interpolateCubic`` writes it (the 4th weight is
  ``1 - w0 - w1 - w2``), then quantised to int16 as ``rint(w * 2048)`` (11 fractional bits,
  ``saturate_cast<short>``: round half to even). The quantised weights are not renormalised;
* border: source indices outside the image are clamped (replicate);
* horizontal pass: exact integer sums ``sum(pixel * ialpha)``;
* vertical pass on the interleaved row of ``width * channels`` values: OpenCV's SIMD kernel
  (``VResizeCubicVec_32s8u``) handles the first multiple of 8 values (128-bit lanes, the x86
  SSE baseline), in float32: ``b_k = beta_k / 2**22``, ``acc = S3*b3``, then ``acc = S_k*b_k +
  acc`` for k = 2, 1, 0 (separate multiply and add: no FMA at the SSE3 baseline), rounded half
  to even (``v_round``) and saturated to [0, 255]; the remaining values go through the scalar
  ``FixedPtCast<int, uchar, 22>``: ``(sum(S_k * beta_k) + 2**21) >> 22`` (round half up),
  saturated to [0, 255]. A 224-wide RGB row has 672 values, so it is all SIMD.
* same input and output size: a plain copy (as ``cv::resize``).

Checked against ``cv2.resize`` of opencv-python-headless 4.10.0, 4.14.0 and 5.0.0 (x86-64)
with ``cv2.ipp.setUseIPP(False)``: bit-identical on 80 random and smooth images (down- and
upscaling, 1 and 3 channels, 480x320 -> 224x224 included).

With IPP on (the default of x86-64 PyPI wheels: from 4.3 on, going by the versions reported
in opencv/opencv#22477; so most likely what the official features saw) uint8 ``INTER_CUBIC``
goes to Intel IPP instead, which differs from OpenCV's own code by one grey level on about 4%
of the pixels. ``flavour="ipp"`` approximates that path (about 2 pixels in 100 000 still
differ by one). ARM (NEON) builds fuse the multiply-adds of the vector kernel; not modelled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from PIL import Image

from changecap_jax.errors import UserError

try:  # Optional: the official pipeline used OpenCV; use it when it is installed.
    import cv2 as _cv2
except ImportError:  # pragma: no cover - depends on the install
    _cv2 = None

IMAGE_SIZE = 224
MEAN = (0.485, 0.456, 0.406)
STD_OFFICIAL = (0.229, 0.224, 0.224)  # sic: the official typo (blue should be 0.225)
STD_IMAGENET = (0.229, 0.224, 0.225)

_COEF_BITS = 11
_COEF_SCALE = 1 << _COEF_BITS  # INTER_RESIZE_COEF_SCALE
_SIMD_LANES = 8  # v_int16 lanes of 128-bit SIMD (OpenCV's x86 SSE baseline, NEON)


class ImageReadError(UserError, OSError):
    """An image file that cannot be read or decoded; the message names the file."""


def cv2_available() -> bool:
    """Whether ``cv2`` is importable (then ``resize_cubic`` uses it)."""
    return _cv2 is not None


def read_rgb(path: str | os.PathLike) -> np.ndarray:
    """Reads any PIL-readable image (png, jpg, first frame of a gif, ...) as uint8 H x W x 3.

    Like ``imageio.imread(path, pilmode="RGB")``: PIL's ``convert("RGB")``, which drops an
    alpha channel (CLEVR's PNGs are RGBA) without compositing.
    """
    try:
        with Image.open(path) as im:
            im.seek(0)
            rgb = im.convert("RGB")
            rgb.load()
    except Exception as e:  # PIL raises many types: OSError, SyntaxError, ValueError, ...
        raise ImageReadError(f"cannot read image {os.fspath(path)}: {e}") from e
    return np.asarray(rgb, dtype=np.uint8)


def _cubic_weights(t: np.ndarray) -> np.ndarray:
    """OpenCV's ``interpolateCubic`` in float32, same operation order: (n,) -> (n, 4)."""
    f = np.float32
    a = f(-0.75)
    x = t.astype(np.float32)
    one = f(1.0)
    xp1 = x + one
    xm1 = one - x
    w0 = ((a * xp1 - f(5.0) * a) * xp1 + f(8.0) * a) * xp1 - f(4.0) * a
    w1 = ((a + f(2.0)) * x - (a + f(3.0))) * x * x + one
    w2 = ((a + f(2.0)) * xm1 - (a + f(3.0))) * xm1 * xm1 + one
    w3 = one - w0 - w1 - w2
    return np.stack([w0, w1, w2, w3], axis=1).astype(np.float32)


def _axis_taps(src_size: int, dst_size: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Source indices (dst, 4), clamped, and int16 weights (dst, 4) for one axis."""
    d = np.arange(dst_size, dtype=np.float64)
    f = ((d + 0.5) * scale - 0.5).astype(np.float32)
    s = np.floor(f)
    t = (f - s).astype(np.float32)
    s = s.astype(np.int64)
    weights = np.rint(_cubic_weights(t) * np.float32(_COEF_SCALE))
    weights = np.clip(weights, -32768, 32767).astype(np.int64)
    idx = np.clip(s[:, None] + np.arange(-1, 3)[None, :], 0, src_size - 1)
    return idx, weights


def _ipp_taps(src_size: int, dst_size: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Clamped source indices and float32 Keys weights (A = -0.75) computed in float64."""
    f = (np.arange(dst_size, dtype=np.float64) + 0.5) * scale - 0.5
    s = np.floor(f)
    t = f - s
    dist = np.abs(np.stack([t + 1.0, t, 1.0 - t, 2.0 - t], axis=1))
    a = -0.75
    near = ((a + 2.0) * dist - (a + 3.0)) * dist * dist + 1.0
    far = ((a * dist - 5.0 * a) * dist + 8.0 * a) * dist - 4.0 * a
    weights = np.where(dist <= 1.0, near, np.where(dist < 2.0, far, 0.0)).astype(np.float32)
    idx = np.clip(s.astype(np.int64)[:, None] + np.arange(-1, 3)[None, :], 0, src_size - 1)
    return idx, weights


def _resize_ipp_like(img: np.ndarray, width: int, height: int, sx: float, sy: float
                     ) -> np.ndarray:
    """An approximation of IPP's uint8 cubic resize (B=0, C=0.75), found empirically.

    Unquantised float32 weights; horizontal sums formed exactly and rounded to float32; the
    vertical sum accumulated in float32 with fused multiply-adds in tap order; rounded half to
    even and saturated. Against ``cv2.resize`` of opencv-python-headless 4.10/4.14/5.0 with
    IPP on (x86-64), 480x320 -> 224x224, it differed by one grey level on about 3 pixels in
    100 000 (near-ties whose float rounding IPP resolves differently), where OpenCV's own path
    (``flavour="opencv"``) differs from IPP on about 4 pixels in 100.
    """
    xidx, alpha = _ipp_taps(img.shape[1], width, sx)
    yidx, beta = _ipp_taps(img.shape[0], height, sy)
    src = img.astype(np.float64)
    rows = np.einsum("hwkc,wk->hwc", src[:, xidx, :], alpha.astype(np.float64))
    rows = rows.astype(np.float32)
    taps = rows[yidx].astype(np.float64)  # (height, 4, width, cn)
    b = beta.astype(np.float64)[:, :, None, None]
    acc = (taps[:, 0] * b[:, 0]).astype(np.float32)
    for k in (1, 2, 3):  # fma(S_k, b_k, acc): exact product + acc, one rounding to float32
        acc = (taps[:, k] * b[:, k] + acc.astype(np.float64)).astype(np.float32)
    return np.clip(np.rint(acc), 0, 255).astype(np.uint8)


def resize_cubic_numpy(
    image: np.ndarray,
    width: int,
    height: int,
    *,
    inv_scale_x: float | None = None,
    inv_scale_y: float | None = None,
    flavour: str = "opencv",
) -> np.ndarray:
    """OpenCV's uint8 ``INTER_CUBIC`` resize in NumPy; see the module docstring.

    ``image`` is uint8 H x W or H x W x C; returns uint8 ``height`` x ``width`` (x C). The
    scale factors default to ``width / W`` and ``height / H``, as when ``cv2.resize`` is given
    a destination size; pass them to reproduce ``cv2.resize(img, None, fx=..., fy=...)`` with
    the matching (rounded) destination size.

    ``flavour="opencv"`` (default) is OpenCV's own code path, bit-exact; ``"ipp"`` approximates
    the Intel IPP path that x86-64 PyPI wheels take by default (see ``_resize_ipp_like``).
    """
    img = np.asarray(image)
    if img.dtype != np.uint8:
        raise TypeError(f"resize_cubic_numpy expects a uint8 image, got {img.dtype}")
    if img.ndim not in (2, 3):
        raise ValueError(f"expected an H x W or H x W x C image, got shape {img.shape}")
    squeeze = img.ndim == 2
    if squeeze:
        img = img[:, :, None]
    src_h, src_w, cn = img.shape
    if min(src_h, src_w, width, height) <= 0:
        raise ValueError(f"cannot resize {img.shape[:2]} to {(height, width)}")
    if (height, width) == (src_h, src_w):
        out = img.copy()
        return out[:, :, 0] if squeeze else out
    sx = 1.0 / (inv_scale_x if inv_scale_x is not None else width / src_w)
    sy = 1.0 / (inv_scale_y if inv_scale_y is not None else height / src_h)
    if flavour == "ipp":
        out = _resize_ipp_like(img, width, height, sx, sy)
        return out[:, :, 0] if squeeze else out
    if flavour != "opencv":
        raise ValueError(f"unknown resize flavour {flavour!r}; expected 'opencv' or 'ipp'")
    out = _resize_opencv(img, width, height, sx, sy)
    return out[:, :, 0] if squeeze else out


def _resize_opencv(img: np.ndarray, width: int, height: int, sx: float, sy: float
                   ) -> np.ndarray:
    """OpenCV's own uint8 ``INTER_CUBIC`` of an H x W x C image, inverse scales ``sx``, ``sy``
    (the module docstring's two passes)."""
    src_h, src_w, cn = img.shape
    xidx, alpha = _axis_taps(src_w, width, sx)
    yidx, beta = _axis_taps(src_h, height, sy)

    # Horizontal pass, exact in integers: rows (src_h, width, cn).
    src = img.astype(np.int64)
    rows = np.einsum("hwkc,wk->hwc", src[:, xidx, :], alpha)
    rows = rows.reshape(src_h, width * cn)

    # Vertical pass: S_k are the 4 source rows of each output row, (height, 4, width * cn).
    taps = rows[yidx]
    n_vec = (width * cn) // _SIMD_LANES * _SIMD_LANES
    out = np.empty((height, width * cn), dtype=np.int64)

    # SIMD part, float32: acc = S3*b3; acc = S_k*b_k + acc for k = 2, 1, 0; round half even.
    s_f = taps[:, :, :n_vec].astype(np.float32)
    b_f = (beta.astype(np.float32) * np.float32(1.0 / (_COEF_SCALE * _COEF_SCALE)))[:, :, None]
    acc = s_f[:, 3] * b_f[:, 3]
    for k in (2, 1, 0):
        acc = s_f[:, k] * b_f[:, k] + acc
    out[:, :n_vec] = np.rint(acc).astype(np.int64)

    # Scalar tail: FixedPtCast<int, uchar, 22>, i.e. (sum + 2**21) >> 22.
    tail = np.einsum("hkx,hk->hx", taps[:, :, n_vec:], beta)
    shift = 2 * _COEF_BITS
    out[:, n_vec:] = (tail + (1 << (shift - 1))) >> shift

    return np.clip(out, 0, 255).astype(np.uint8).reshape(height, width, cn)


def resize_cubic(
    image: np.ndarray, size: int = IMAGE_SIZE, *, use_cv2: bool | None = None,
    flavour: str = "opencv",
) -> np.ndarray:
    """Resizes uint8 H x W x 3 to ``size`` x ``size`` as the official ``cv2.resize`` call.

    Uses ``cv2`` when importable (``use_cv2=None``; then cv2's own IPP setting decides the
    path and ``flavour`` is ignored); ``use_cv2=False`` forces the NumPy re-implementation in
    the given ``flavour``; ``True`` requires cv2.
    """
    if use_cv2 is None:
        use_cv2 = _cv2 is not None
    if use_cv2:
        if _cv2 is None:
            raise ImportError("use_cv2=True but cv2 (opencv-python) is not installed")
        return _cv2.resize(image, (size, size), interpolation=_cv2.INTER_CUBIC)
    return resize_cubic_numpy(image, size, size, flavour=flavour)


def normalize(images: np.ndarray, std_fix: bool = False) -> np.ndarray:
    """uint8 (N, H, W, 3) or (H, W, 3) -> float32 (N, 3, H, W) or (3, H, W), the official way.

    ``x.astype(float32) / 255.0`` (float32), minus the float64 mean and divided by the float64
    std (so float64), then cast to float32. ``std_fix`` selects std 0.225 for blue instead of
    the official 0.224.
    """
    x = np.asarray(images)
    if x.shape[-1] != 3:
        raise ValueError(f"expected RGB images (..., H, W, 3), got shape {x.shape}")
    single = x.ndim == 3
    if single:
        x = x[None]
    std = STD_IMAGENET if std_fix else STD_OFFICIAL
    mean64 = np.array(MEAN, dtype=np.float64).reshape(1, 3, 1, 1)
    std64 = np.array(std, dtype=np.float64).reshape(1, 3, 1, 1)
    batch = x.transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    out = ((batch - mean64) / std64).astype(np.float32)
    return out[0] if single else out


def preprocess_image(
    path: str | os.PathLike, size: int = IMAGE_SIZE, std_fix: bool = False,
    use_cv2: bool | None = None, flavour: str = "opencv",
) -> np.ndarray:
    """One image file -> float32 (3, size, size) network input, as the official script."""
    resized = resize_cubic(read_rgb(path), size, use_cv2=use_cv2, flavour=flavour)
    return normalize(resized, std_fix=std_fix)


def preprocess_batch(
    paths: Sequence[str | os.PathLike], size: int = IMAGE_SIZE, std_fix: bool = False,
    use_cv2: bool | None = None, flavour: str = "opencv",
) -> np.ndarray:
    """Image files -> float32 (N, 3, size, size); normalised as one batch like the official."""
    resized = [resize_cubic(read_rgb(p), size, use_cv2=use_cv2, flavour=flavour) for p in paths]
    return normalize(np.stack(resized), std_fix=std_fix)
