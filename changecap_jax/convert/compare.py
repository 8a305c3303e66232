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
  MLP outputs, ``ccr`` from t and v of that stream);
* ``"loss"`` — caption_ce + sum of ``config.loss_weights[name] * aux/name`` (the trainer's total).

PyTorch equivalents for DIRL+CCR (``tests/torch_reference/dirl.py``): ``DIRL(...).diff_bef`` ->
``encoder/semantic/diff_before``; ``CCRSpeaker.memory`` -> ``decoder.memory/semantic``;
``CCROutput.logits / t / v`` -> ``decoder/semantic/{logits,t,v}``; ``dirl_losses`` ``cap_pos`` /
``cap_neg`` / ``dirl_pos`` / ``ccr_neg`` / ``total`` -> ``caption_ce/semantic`` /
``caption_ce/distractor`` / ``aux/dirl/semantic`` / ``aux/ccr/distractor`` / ``loss``.

PyTorch equivalents for SCORER+CBR (``tests/torch_reference/scorer.py``):
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from changecap_jax import losses
from changecap_jax.convert import mapping

# Names for the fields of tuple outputs that are not NamedTuples: model -> module -> names.
TUPLE_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "dirl": {"decoder": ("logits", "t", "v")},
    "scorer": {"decoder": ("logits", "sentence")},
}


def _dirl_stream_aux(model: Any, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    aux = {}
    for stream in model.streams:
        aux[f"aux/dirl/{stream}"] = losses.barlow_correlation_loss(
            out[f"encoder/{stream}/mlp_before"], out[f"encoder/{stream}/mlp_after"],
            off_diagonal_weight=model.off_diagonal_weight)
        aux[f"aux/ccr/{stream}"] = losses.ccr_infonce_loss(
            out[f"decoder/{stream}/t"], out[f"decoder/{stream}/v"])
    return aux


def _scorer_stream_aux(model: Any, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """SCORER: the last layer's S1 / S2 (B, B) and L_sim per stream; L_cbr per stream is the
    output of the ``cbr`` call of that stream (``cbr/{stream}``)."""
    aux: dict[str, Any] = {}
    for stream in model.streams:
        prefix = f"encoder/{stream}/matching"
        sims = []
        for i, name in enumerate(("sim_before", "sim_after")):
            q, k = out[f"{prefix}/{i}/query"], out[f"{prefix}/{i}/key"]
            scale = out[f"{prefix}/{i}/logit_scale"]
            aux[f"encoder/{stream}/{name}"] = jnp.exp(scale) * losses.token_matching_similarity(
                jnp.asarray(q), jnp.asarray(k))
            sims.append(losses.matching_contrastive_loss(jnp.asarray(q), jnp.asarray(k),
                                                         jnp.asarray(scale)))
        if model.use_sim:
            aux[f"aux/sim/{stream}"] = 0.5 * (sims[0] + sims[1])
        if model.use_cbr:
            aux[f"aux/cbr/{stream}"] = out[f"cbr/{stream}"]
    return aux


# model -> (model, outputs so far) -> per-stream auxiliary losses (and derived outputs).
STREAM_AUX: dict[str, Callable[[Any, dict[str, np.ndarray]], dict[str, Any]]] = {
    "dirl": _dirl_stream_aux,
    "scorer": _scorer_stream_aux,
}


def load_params(workdir: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The ``params`` of ``workdir/checkpoints/<step>`` (latest by default), restored without a
    target (no model or dataset needed)."""
    import orbax.checkpoint as ocp

    from changecap_jax import checkpoints

    directory = Path(workdir).absolute() / "checkpoints"
    with ocp.CheckpointManager(directory, item_names=("state", "data")) as manager:
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
        ``python -m changecap_jax.convert``) or a Flax param tree.
      batch: the model's training batch in our layout, e.g. for DIRL ``before``,
        ``after_semantic``, ``after_distractor`` (B, H, W, C) float features without coordinate
        channels and ``change_caption``, ``no_change_caption`` (B, L) int ids (START = 2,
        END = 3, 0 = padding).
      step: checkpoint step when reading a workdir (latest by default).

    Returns:
      name -> NumPy array (see the module docstring for the names). Eval mode: no dropout.
    """
    from changecap_jax import models

    if isinstance(workdir_or_params, str | os.PathLike):
        params = load_params(workdir_or_params, step)
    else:
        params = jax.tree.map(jnp.asarray, dict(workdir_or_params))
    name = config.model.name
    spec = mapping.get_spec(name)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    caption_len = max((v.shape[1] for v in batch.values()
                       if v.ndim == 2 and jnp.issubdtype(v.dtype, jnp.integer)), default=1)
    max_len = max(config.decode.max_len or 0, caption_len)
    model = models.build(config.model, vocab_size=spec.vocab_size_of_params(params),
                         max_len=max_len)

    @jax.jit
    def run(params: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        return model.apply({"params": params}, batch, train=False,
                           capture_intermediates=lambda mdl, _: len(mdl.path) == 1,
                           mutable=["intermediates"])

    result, state = run(params, batch)
    # Calls are captured in the model's stream order (jit returns dicts with sorted keys).
    streams = tuple(getattr(model, "streams", ())) or tuple(result.caption_logits)
    fields = TUPLE_FIELDS.get(name, {})
    out: dict[str, np.ndarray] = {}
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(state["intermediates"]))
    for path, calls in flat.items():
        *modules, method = path
        calls = tuple(calls)
        labels = streams if len(calls) == len(streams) else [f"call{i}"
                                                             for i in range(len(calls))]
        for label, value in zip(labels, calls, strict=True):
            _add_value(out, _name(tuple(modules), method, label), value,
                       fields.get("/".join(modules)) if method == "__call__" else None)

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
    if name in STREAM_AUX:
        out.update({k: np.asarray(v) for k, v in STREAM_AUX[name](model, out).items()})
    return out
