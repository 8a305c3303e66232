"""Extracts ResNet-101 grid features from a folder of images, as the official script does.

    python -m data_prep.extract_features --images=DIR --out=DIR --weights=PATH \\
        [--layer=3|4] [--batch_size=N] [--std_fix] [--resize_flavour=opencv|ipp] [--device=D]

One ``<image file name>.npy`` per image (e.g. ``CLEVR_default_000123.png.npy``), float32,
channels first: (1024, 14, 14) after layer3 (the official ``--model_stage 3``, the default) or
(2048, 7, 7) after layer4. Images are read as RGB, resized to 224 x 224 with OpenCV's bicubic
(``changecap_jax/features/preprocess.py``), scaled by 1/255 and normalised with the official
mean/std (std 0.224 for blue, the official typo; ``--std_fix`` uses 0.225).

``--weights`` is a local torchvision ResNet-101 state dict (nothing is downloaded). The run is
resumable: images whose ``.npy`` already exists with the right shape and dtype are skipped,
and each file is written to a temp file and renamed, so an interruption never leaves a
partial ``.npy``. CUDA is used when available.

The extraction is the library's (``changecap_jax/features/extract.py``, also what ``predict``
runs on new images); this is its command, and its names stay importable from here.
"""

from __future__ import annotations

import sys

from absl import flags

from changecap_jax import cli
from changecap_jax.features.extract import extract_directory
from changecap_jax.features.preprocess import ImageReadError
from changecap_jax.features.resnet import WeightsError


def _define_flags() -> None:
    # Defined only when run as a program, so importing this module (e.g. from a dataset
    # builder with its own absl flags) never clashes with other flag definitions.
    flags.DEFINE_string("images", None, "Folder of input images.", required=True)
    flags.DEFINE_string("out", None, "Folder for the <image name>.npy features.", required=True)
    flags.DEFINE_string("weights", None, "Local torchvision ResNet-101 state dict (.pth).",
                        required=True)
    flags.DEFINE_integer("layer", 3, "Cut after layer3 (1024x14x14) or layer4 (2048x7x7).",
                         lower_bound=3, upper_bound=4)
    flags.DEFINE_integer("batch_size", 128, "Images per forward pass.", lower_bound=1)
    flags.DEFINE_boolean("std_fix", False,
                         "Blue std 0.225 (ImageNet) instead of the official typo 0.224.")
    flags.DEFINE_enum("resize_flavour", "opencv", ["opencv", "ipp"],
                      "Without cv2: 'opencv' = OpenCV's own bicubic (bit-exact), 'ipp' = an "
                      "approximation of the IPP path of x86-64 PyPI opencv wheels.")
    flags.DEFINE_string("device", None, "torch device (default: cuda if available, else cpu).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    try:
        summary = extract_directory(
            f.images, f.out, f.weights, f.layer, f.batch_size, std_fix=f.std_fix,
            device=f.device, resize_flavour=f.resize_flavour)
    except (ImageReadError, WeightsError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"{summary.computed} image(s) extracted, {summary.skipped} already present, "
          f"{summary.total} in all -> {summary.out_dir}")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
