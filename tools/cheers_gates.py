"""How much a trained CHEERS model's gates vary (docs/ablations.md, "CHEERS, measured piece by
piece"): the CRE/DRE gates sigma(P_hat) (Eq. 3-5) over positions and over channels, and the
decoder gates alpha, beta (Eq. 14-15, after the model's ``gate_activation``).

    python -m tools.cheers_gates --workdir=DIR [--preset=synthetic/full]
        [--pairs=128]

Reads the workdir's latest checkpoint and the first ``--pairs`` test records (both streams).
A CRE/DRE gate whose spread over positions is far below its spread over channels is a fixed
per-channel gain: Eq. 4 then enhances no position more than another.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def _batch(records: Sequence[dict[str, Any]], length: int) -> dict[str, np.ndarray]:
    def caption(record: dict[str, Any], key: str) -> np.ndarray:
        ids = np.zeros(length, np.int32)
        first = np.asarray(record[key])[0][:length]
        ids[: len(first)] = first
        return ids

    stack = lambda key: np.stack([np.asarray(r[key], np.float32) for r in records])
    return {"before": stack("before"), "after_semantic": stack("after_semantic"),
            "after_distractor": stack("after_distractor"),
            "change_caption": np.stack([caption(r, "change_caption_ids") for r in records]),
            "no_change_caption": np.stack([caption(r, "no_change_caption_ids")
                                           for r in records]),
            "entities_semantic": stack("entities_semantic"),
            "entities_distractor": stack("entities_distractor")}


def gate_spread(workdir: str, preset: str = "synthetic/full",
                pairs: int = 128) -> dict[str, dict[str, float]]:
    """name -> {mean, std_positions, std_channels} (CRE/DRE, first HRD layer, semantic
    stream) or {mean, std} (decoder alpha_l / beta_l, semantic stream)."""
    import jax

    from changecap_jax import experiment
    from changecap_jax.io import checkpoints
    from configs import cheers as cheers_config

    config = cheers_config.get_config(preset)  # the workdir's model fields, as trained
    exp = experiment.build(config)
    model = exp.model
    source = exp.dataset.split("test")
    batch = _batch([source[i] for i in range(min(pairs, len(source)))], 12)
    variables = model.init(jax.random.key(0), batch, train=False)
    _, params = checkpoints.restore_params(workdir, variables["params"])
    _, state = model.apply({"params": params}, batch, train=False,
                           capture_intermediates=True, mutable=["intermediates"])
    inter = state["intermediates"]
    out: dict[str, dict[str, float]] = {}
    for name in ("image_cre", "image_dre", "entity_dre", "entity_cre"):
        if name not in inter.get("hrd_0", {}):
            continue
        _, p_hat = inter["hrd_0"][name]["__call__"][0]  # the first call: the semantic stream
        g = np.asarray(jax.nn.sigmoid(np.asarray(p_hat, np.float64)))
        out[name] = {"mean": float(g.mean()), "std_positions": float(g.std(axis=1).mean()),
                     "std_channels": float(g.std(axis=2).mean())}
    for layer in range(model.decoder_layers):
        node = inter.get(f"layer_{layer}", {})
        if "alpha" not in node:
            continue
        a, b = (np.asarray(node[n]["__call__"][0], np.float64) for n in ("alpha", "beta"))
        if model.gate_activation == "sigmoid":
            a, b = 1 / (1 + np.exp(-a)), 1 / (1 + np.exp(-b))
        elif model.gate_activation == "softmax":
            e = np.exp(np.concatenate([a, b], -1) - np.maximum(a, b))
            a, b = e[..., :1] / e.sum(-1, keepdims=True), e[..., 1:] / e.sum(-1, keepdims=True)
        out[f"alpha_{layer}"] = {"mean": float(a.mean()), "std": float(a.std())}
        out[f"beta_{layer}"] = {"mean": float(b.mean()), "std": float(b.std())}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cheers_gates",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--preset", default="synthetic/full",
                        help="configs/cheers.py preset the workdir was trained with")
    parser.add_argument("--pairs", type=int, default=128)
    args = parser.parse_args(argv)
    for name, stats in gate_spread(args.workdir, args.preset, args.pairs).items():
        print(f"{name:<11} " + "  ".join(f"{k} {v:.4f}" for k, v in stats.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
