"""What the GPU check runs: the models and presets, the parts and their shares of the time
budget, the cards' bfloat16 peaks. Imported by the parent process: no JAX here."""

from __future__ import annotations

import dataclasses
import time

# model config -> its paper preset (the check times these) and its CPU preset (--tiny).
PAPER_PRESETS = {"dirl": "clevr_change", "scorer": "clevr_change",
                 "subtraction": "clevr_change", "cheers": "clevr_change",
                 "idc_pcl": "finetune/clevr_change"}
TINY_PRESETS = {"dirl": "synthetic", "scorer": "synthetic", "subtraction": "synthetic",
                "cheers": "synthetic", "idc_pcl": "finetune/synthetic"}
TRAINED = ("dirl", "synthetic")  # the model the training part trains, and its preset
# bfloat16 first, for every model, then float32: a GPU trains in bfloat16, so a budget spent
# early leaves the float32 jobs out rather than some models.
DTYPES = ("bfloat16", "float32")

# Dense bfloat16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets, matched
# against jax's device_kind in this order (the first substring found wins).
BF16_PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
                    ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0))

# The parts in the order they run, each with its share of the time left when it starts (a
# part that ends early leaves its time to the next ones).
PART_SHARES = {"environment": 0.04, "steps": 0.50, "training": 0.25, "features": 0.06,
               "largest_batch": 0.15}


def bf16_peak_tflops(device_kind: str) -> float | None:
    """The card's dense bfloat16 peak, or None for a device this table does not know."""
    for name, peak in BF16_PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return peak
    return None


@dataclasses.dataclass
class Settings:
    """The sizes of one run: the full check on a GPU host, or ``--tiny`` (CI, a CPU)."""

    presets: dict[str, str]
    batch: int  # global batch of the timed steps
    decode_pairs: int
    steps: int  # timed steps after the compile
    decode_batches: int  # timed decodes after the compile
    train_steps: int  # DIRL+CCR training steps, each backend
    train_batch: int
    train_examples: int  # synthetic pairs made in memory
    feature_images: int
    largest_batch_cap: int  # the largest batch the search tries
    min_job_s: float  # a job is not started with less time than this left in its part


def settings(tiny: bool, models: list[str] | None = None) -> Settings:
    presets = TINY_PRESETS if tiny else PAPER_PRESETS
    if models:
        presets = {m: presets[m] for m in models}
    if tiny:
        return Settings(presets, batch=8, decode_pairs=8, steps=2, decode_batches=1,
                        train_steps=3, train_batch=8, train_examples=16, feature_images=1,
                        largest_batch_cap=16, min_job_s=0.0)
    return Settings(presets, batch=128, decode_pairs=128, steps=10, decode_batches=3,
                    train_steps=300, train_batch=64, train_examples=1536, feature_images=8,
                    largest_batch_cap=2048, min_job_s=40.0)


class Clock:
    """The whole check's deadline, and each part's share of the time left."""

    def __init__(self, budget_s: float, shares: dict[str, float] = PART_SHARES):
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.shares = dict(shares)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def part_deadline(self, part: str) -> float:
        """When ``part`` must end: its share of the time left among the parts still to run
        (this one and those after it)."""
        names = list(self.shares)
        rest = sum(self.shares[n] for n in names[names.index(part):])
        return time.monotonic() + self.left() * self.shares[part] / rest

    def elapsed(self) -> float:
        return time.monotonic() - self.start
