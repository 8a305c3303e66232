"""Every intermediate of a (converted) checkpoint on one batch, to compare with PyTorch.

:func:`forward_outputs` runs the model's training forward pass in eval mode (dropout off) with
Flax's ``capture_intermediates`` and returns, as NumPy arrays under stable names:

* ``"{module}/{stream}/{field}"`` — the output of each top-level submodule's ``__call__`` per
  caption stream, e.g. ``encoder/semantic/diff_before`` (DIRL §4.1 step 4: X0 - X after the
  cross layers, (B, H*W, D)), ``encoder/semantic/mlp_before`` (the DIRL MLP head),
  ``decoder/semantic/logits``, ``decoder/semantic/t`` / ``v`` (the CCR sequence means, §4.2);
* ``"{module}.{method}/{stream}"`` — the other methods of those submodules, e.g.
  ``decoder.memory/semantic`` (``embed_fc`` memory, (B, H*W, D));
* ``"{module path}.{name}/{stream}"`` — values the model sows into ``'intermediates'``, e.g.
  ``decoder/layer_1.self_att_out/semantic``;
* ``"logits/{stream}"`` (B, L, V), ``"targets/{stream}"`` (B, L) (-1 = ignored),
  ``"caption_ce/{stream}"`` (torch ``CrossEntropyLoss(ignore_index=-1)``), ``"caption_ce"`` (their
  mean, as the trainer forms it);
* ``"aux/{name}"`` — each auxiliary loss as the model returns it (the mean over the streams) and,
  where the model's losses are per stream, ``"aux/{name}/{stream}"`` (DIRL: ``dirl`` from the
  MLP outputs, ``ccr`` from t and v of that stream), derived by the ``stream_aux`` of the
  model's converter (``changecap_jax/convert/models/``, docs/converters.md), which also names
  the fields of plain tuple outputs (``output_fields``);
* ``"loss"`` — caption_ce + sum of ``config.loss_weights[name] * aux/name`` (the trainer's total).

PyTorch equivalents for DIRL+CCR (``tools/torch_reference/dirl.py``):
``DIRL(...).diff_bef`` -> ``encoder/semantic/diff_before``; ``CCRSpeaker.memory`` ->
``decoder.memory/semantic``; ``CCROutput.logits / t / v`` -> ``decoder/semantic/{logits,t,v}``;
``dirl_losses`` ``cap_pos`` / ``cap_neg`` / ``dirl_pos`` / ``ccr_neg`` / ``total`` ->
``caption_ce/semantic`` / ``caption_ce/distractor`` / ``aux/dirl/semantic`` /
``aux/ccr/distractor`` / ``loss``.

PyTorch equivalents for SCORER+CBR (``tools/torch_reference/scorer.py``):
``ChangeDetector(...).memory`` -> ``encoder/{stream}/memory``; ``.sim_bef`` / ``.sim_aft`` (the
last layer's (B, B) S1 / S2) -> ``encoder/{stream}/sim_before`` / ``sim_after`` (formed from the
captured ``encoder/{stream}/matching/{0,1}/{query,key,logit_scale}``); ``.input_bef`` /
``.input_aft`` -> ``encoder/{stream}/tokens_before`` / ``tokens_after``; ``Speaker`` logits /
last-layer output -> ``decoder/{stream}/logits`` / ``sentence``; ``CBR.hallucinate`` ->
``cbr.hallucinate/{stream}``; ``scorer_losses`` ``cap_pos`` / ``sim_pos`` / ``cbr_neg`` / ``sim``
/ ``total`` -> ``caption_ce/semantic`` / ``aux/sim/semantic`` / ``aux/cbr/distractor`` /
``aux/sim`` / ``loss``. Features
are channels-last (B, H, W, C) here and channels-first in torch; coordinates are added by the
model (§2.3). Reference: ``docs/official/parity_checklist.md`` §7 item 7.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from changecap_jax import models
from changecap_jax.convert import registry
from changecap_jax.io import checkpoints, paths
from changecap_jax.models import contract, losses


def load_params(workdir: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The ``params`` of ``workdir/checkpoints/<step>`` (latest by default), restored without a
    target (no model or dataset needed)."""
    directory = paths.path(workdir) / "checkpoints"
    if not paths.is_remote(directory):
        directory = directory.absolute()
    with ocp.CheckpointManager(epath.Path(directory), item_names=("state", "data")) as manager:
        if manager.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        _, restored = checkpoints.restore(
            manager, lambda step, items: {"state": ocp.args.StandardRestore()}, step=step)
    state = restored["state"]
    params = state["params"] if isinstance(state, Mapping) else state.params
    return jax.tree.map(jnp.asarray, params)


def _name(path: tuple[str, ...], method: str, stream: str) -> str:
    module = "/".join(path)
    return f"{module}{'' if method == '__call__' else '.' + method}/{stream}"


def _add_value(out: dict[str, np.ndarray], name: str, value: Any,
               fields: tuple[str, ...] | None) -> None:
    if value is None:
        return
    if hasattr(value, "_fields"):  # NamedTuple
        for field, v in zip(value._fields, value, strict=True):
            _add_value(out, f"{name}/{field}", v, None)
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            label = fields[i] if fields and i < len(fields) else str(i)
            _add_value(out, f"{name}/{label}", v, None)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _add_value(out, f"{name}/{k}", v, None)
    else:
        out[name] = np.asarray(value)


def _captured_outputs(intermediates: Any, streams: tuple[str, ...],
                      output_fields: Mapping[str, tuple[str, ...]]) -> dict[str, np.ndarray]:
    """Every captured call and sown value under its name (module docstring); a module called
    once per stream gets the stream names, otherwise ``call{i}``."""
    out: dict[str, np.ndarray] = {}
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(intermediates))
    for path, calls in flat.items():
        *modules, method = path
        calls = tuple(calls)
        labels = streams if len(calls) == len(streams) else [f"call{i}"
                                                             for i in range(len(calls))]
        for label, value in zip(labels, calls, strict=True):
            _add_value(out, _name(tuple(modules), method, label), value,
                       output_fields.get("/".join(modules)) if method == "__call__" else None)
    return out


def _losses(config: ml_collections.ConfigDict, result: Any,
            streams: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Logits, targets and caption CE per stream, their mean, every auxiliary loss and the
    trainer's weighted total."""
    out: dict[str, np.ndarray] = {}
    ce = {}
    for stream in streams:
        logits, targets = result.caption_logits[stream], result.caption_targets[stream]
        out[f"logits/{stream}"] = np.asarray(logits)
        out[f"targets/{stream}"] = np.asarray(targets)
        ce[stream] = losses.caption_cross_entropy(logits, targets)
        out[f"caption_ce/{stream}"] = np.asarray(ce[stream])
    caption = sum(ce.values()) / len(ce)
    out["caption_ce"] = np.asarray(caption)
    total = caption
    for key, value in result.aux_losses.items():
        out[f"aux/{key}"] = np.asarray(value)
        total = total + config.loss_weights[key] * value
    out["loss"] = np.asarray(total)
    return out


def forward_outputs(
    config: ml_collections.ConfigDict,
    workdir_or_params: str | os.PathLike[str] | Mapping[str, Any],
    batch: Mapping[str, Any],
    *,
    step: int | None = None,
) -> dict[str, np.ndarray]:
    """Encoder outputs, decoder logits per stream, every auxiliary loss and the caption CE.

    Args:
      config: the run config (``model``, ``loss_weights``, ``decode.max_len``).
      workdir_or_params: a workdir holding ``checkpoints/`` (e.g. written by
        ``python -m changecap_jax convert``) or a Flax param tree.
      batch: the model's training batch in our layout, e.g. for DIRL ``before``,
        ``after_semantic``, ``after_distractor`` (B, H, W, C) float features without coordinate
        channels and ``change_caption``, ``no_change_caption`` (B, L) int ids (START = 2,
        END = 3, 0 = padding).
      step: checkpoint step when reading a workdir (latest by default).

    Returns:
      name -> NumPy array (see the module docstring for the names). Eval mode: no dropout.
    """
    if isinstance(workdir_or_params, str | os.PathLike):
        params = load_params(workdir_or_params, step)
    else:
        params = jax.tree.map(jnp.asarray, dict(workdir_or_params))
    model_converter = registry.converter_for(config.model.name)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    caption_len = max((v.shape[1] for v in batch.values()
                       if v.ndim == 2 and jnp.issubdtype(v.dtype, jnp.integer)), default=1)
    max_len = max(config.decode.max_len or 0, caption_len)
    model = models.build(config.model, vocab_size=model_converter.vocab_size_of_params(params),
                         max_len=max_len)

    @jax.jit
    def run(params: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        return model.apply({"params": params}, batch, train=False,
                           capture_intermediates=lambda mdl, _: len(mdl.path) == 1,
                           mutable=["intermediates"])

    result, state = run(params, batch)
    # Calls are captured in the model's stream order (jit returns dicts with sorted keys).
    streams = contract.model_streams(model)
    out = _captured_outputs(state["intermediates"], streams, model_converter.output_fields)
    out.update(_losses(config, result, streams))
    if model_converter.stream_aux is not None:
        out.update({k: np.asarray(v)
                    for k, v in model_converter.stream_aux(model, out).items()})
    return out
