"""``benchmark --compare_official``: the official train step imported from a checkout.

The official repositories are not part of the test data, so these tests build a miniature
checkout with the official layout and interfaces (config module with a global ``cfg`` and
``merge_cfg_from_file``, namespace packages ``configs``/``models``/``utils``, modules that call
``.cuda()``); what they check is the import (the project's own ``configs`` package wins again
afterwards, nothing is written into the checkout), the step (both pairs, the loss weights, the
optimiser step), the alternating timing and the errors. The real checkouts were compared by
hand (docs/performance.md, "Against the official code")."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from changecap_jax import benchmark, benchmark_official  # noqa: E402
from changecap_jax import synthetic_inputs as si  # noqa: E402
from configs import dirl  # noqa: E402

GRID, HIDDEN, VOCAB, CAPTION = (3, 3, 6), 16, 76, 24

CONFIG_MODULE = '''
import json

class AttrDict(dict):
    __getattr__ = dict.__getitem__

def _wrap(value):
    return AttrDict({k: _wrap(v) for k, v in value.items()}) if isinstance(value, dict) else value

cfg = AttrDict(train=AttrDict(grad_clip=-1.0, lr=0.01))

def merge_cfg_from_file(path):
    with open(path) as fh:  # the test's yaml is JSON, which YAML reads too
        cfg.update(_wrap(json.load(fh)))
'''

DIRL_MODULE = '''
import torch
from torch import nn

class AddSpatialInfo(nn.Module):
    def forward(self, x):
        b, _, h, w = x.shape
        rows = torch.linspace(-1, 1, h)[None, None, :, None].expand(b, 1, h, w)
        cols = torch.linspace(-1, 1, w)[None, None, None, :].expand(b, 1, h, w)
        return torch.cat([x, rows, cols], 1)

class DIRL(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        enc = cfg.model.transformer_encoder
        self.proj = nn.Linear(enc.feat_dim, enc.att_dim)

    def forward(self, before, after):
        x = self.proj(before.flatten(2).transpose(1, 2)).cuda()  # as the official code
        y = self.proj(after.flatten(2).transpose(1, 2)).cuda()
        return x - y, y - x, ((x - y) ** 2).mean()
'''

CCR_MODULE = '''
import torch
from torch import nn

class CCR(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dec = cfg.model.transformer_decoder
        self.out = nn.Linear(2 * cfg.model.transformer_encoder.att_dim, dec.vocab_size)

    def _forward(self, diff_before, diff_after, seq, mask, labels_with_ignore=None):
        memory = torch.cat([diff_before, diff_after], -1).mean(1)
        logits = self.out(memory)[:, None].expand(-1, seq.shape[1], -1)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels_with_ignore.reshape(-1), ignore_index=-1)
        return loss, None, memory.pow(2).mean()
'''

UTILS_MODULE = '''
import torch

def build_optimizer(params, cfg):
    return torch.optim.Adam(params, lr=cfg.train.lr)

def set_mode(mode, models):
    for m in models:
        m.train(mode == "train")
'''


def fake_checkout(root: Path, feat_dim: int = GRID[-1] + 2) -> Path:
    files = {
        "configs/config_transformer.py": CONFIG_MODULE,
        "models/DIRL.py": DIRL_MODULE,
        "models/CCR_no_init.py": CCR_MODULE,
        "utils/utils.py": UTILS_MODULE,
        "configs/dynamic/transformer_clevr_change.yaml": json.dumps({"model": {
            "transformer_encoder": {"feat_dim": feat_dim, "att_dim": HIDDEN},
            "transformer_decoder": {"vocab_size": VOCAB, "seq_length": CAPTION}}}),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def small_dirl():
    config = dirl.get_config("clevr_change")
    config.model.update(hidden_dim=HIDDEN, num_heads=2, mlp_hidden_dim=16, ffn_dim=16,
                        word_dim=8, encoder_layers=1, decoder_layers=1)
    config.batch_size = config.eval_batch_size = 8
    return config


def test_benchmark_times_the_official_step(tmp_path):
    checkout = fake_checkout(tmp_path / "DIRL")
    project_configs = sys.modules["configs"]
    results = benchmark.run(small_dirl(), steps=2, decode_batches=0, synthetic_inputs=True,
                            shapes=si.InputShapes(GRID, VOCAB, CAPTION), matmul_size=0,
                            compare_official=str(checkout))
    assert results["official_steps"] == 2
    assert results["official_over_jax"] == pytest.approx(
        results["official_step_s"] / results["official_jax_step_s"])
    assert math.isfinite(results["official_loss_first_step"])
    assert results["official_repo"] == str(checkout.resolve())
    assert any(line.startswith("official step (") for line in benchmark.report_lines(results))
    # The project's configs package is back; nothing was written into the checkout.
    assert sys.modules["configs"] is project_configs
    assert not [p for p in checkout.rglob("__pycache__")]
    assert str(checkout) not in sys.path


def test_official_step_trains_both_pairs_with_the_scripts_weights(tmp_path):
    checkout = fake_checkout(tmp_path / "DIRL")
    shapes = si.InputShapes(GRID, VOCAB, CAPTION)
    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal((4, *GRID), dtype=np.float32)
             for k in ("before", "after_semantic", "after_distractor")}
    for k in ("change_caption", "no_change_caption"):
        ids = rng.integers(4, VOCAB, (4, shapes.caption_len)).astype(np.int32)
        ids[:, 0], ids[:, 6], ids[:, 7:] = 2, 3, 0
        batch[k] = ids
    step = benchmark_official.OfficialStep("dirl", checkout, batch, HIDDEN, VOCAB)
    # The loss by hand at the initial weights: per pair speaker + 0.5 dirl + 0.3 ccr
    # (train_clevr_change.py), the pairs averaged 0.5 / 0.5.
    with torch.no_grad(), benchmark_official._cpu_cuda_calls():
        before, *afters = (step.spatial(x) for x in step.images)
        by_hand = 0.0
        for after, (seq, targets, mask) in zip(afters, step.captions, strict=True):
            diff_b, diff_a, dirl_loss = step.detector(before, after)
            caption, _, ccr = step.speaker._forward(diff_b, diff_a, seq, mask,
                                                    labels_with_ignore=targets)
            by_hand += 0.5 * float(caption + 0.5 * dirl_loss + 0.3 * ccr)
    cuda = torch.Tensor.cuda
    weight = step.detector.proj.weight.detach().clone()
    assert step() == pytest.approx(by_hand, rel=1e-6)
    assert torch.Tensor.cuda is cuda  # the no-op .cuda() lasts for the official code only
    assert not torch.equal(weight, step.detector.proj.weight)  # the optimiser stepped
    assert step() != pytest.approx(by_hand, rel=1e-6)  # from the updated weights
    # Targets as the official loader builds them: the next word inside START..END, else -1.
    seq, targets, mask = step.captions[0]
    assert mask[0].tolist() == [1.0] * 7 + [0.0] * (CAPTION - 7)
    assert targets[0, :6].tolist() == seq[0, 1:7].tolist() and (targets[0, 6:] == -1).all()


def test_errors_name_the_file_and_the_key(tmp_path):
    config = small_dirl()
    with pytest.raises(benchmark_official.OfficialError, match="missing .*models/DIRL.py"):
        benchmark_official.check_checkout(config, tmp_path)
    checkout = fake_checkout(tmp_path / "DIRL", feat_dim=99)
    batch = {"before": np.zeros((1, *GRID), np.float32),
             "change_caption": np.zeros((1, CAPTION), np.int32)}
    with pytest.raises(benchmark_official.OfficialError,
                       match=r"transformer_clevr_change.yaml: model.transformer_encoder.feat_dim "
                             r"is 99, the benchmark's feature channels \+ 2 coordinates 8"):
        benchmark_official.OfficialStep("dirl", checkout, batch, HIDDEN, VOCAB)
    config.model.pairs = "semantic_only"
    with pytest.raises(benchmark_official.OfficialError, match="clevr_change preset"):
        benchmark_official.check_checkout(config, checkout)
