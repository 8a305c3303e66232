"""What the command knows about each official repository, one adapter per model.

An adapter says which official files to import and which yaml ``train.py`` reads, how the
official modules are built (in the official creation order, after ``torch.manual_seed``), how
one training iteration forms its losses (the loop body of the official training script, with
its hard-coded loss weights), what happens after ``optimizer.step()``, and which state_dicts
feed the project's converter (``changecap_jax/convert/models/``). Model sizes come from the
project config; everything about training (optimiser, schedule, clipping) from the official
``cfg``. Supported: DIRL+CCR (tuyunbin/DIRL, both decoder variants) and SCORER+CBR
(tuyunbin/SCORER). Loss terms use the project's names: ``caption``, the auxiliary losses of
``config.loss_weights`` and ``total``.

Section numbers (§) and quirk ids (S-Q) refer to docs/official/ (index: README.md there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from changecap_jax.commands.reproduce import official as off
from changecap_jax.convert import tables
from changecap_jax.convert.models.scorer import GENERATOR
from changecap_jax.convert.models.tuyunbin import DECODER, ENCODER
from changecap_jax.data.streams import STREAM_KEYS
from changecap_jax.models.layers import sinusoid_table


class ReproduceError(ValueError):
    """A config or input the official code cannot reproduce, with what to change."""


@dataclasses.dataclass
class TorchPair:
    """One caption stream's inputs, as the official dataset yields them (§2.5)."""

    after: Any  # (B, C, H, W) float32, after AddSpatialInfo where the script applies it
    labels: Any  # (B, L) int64 ids, START first
    targets: Any  # (B, L) int64 labels_with_ignore (-1 = ignored)
    masks: Any  # (B, L) float32, 1 on the first k positions (k = non-zero ids)


@dataclasses.dataclass
class TorchBatch:
    """One step's official inputs: the shared "before" grid and each stream's pair."""

    before: Any
    pairs: dict[str, TorchPair]  # "semantic" (the official "pos") first, then "distractor"


@dataclasses.dataclass
class OfficialModel:
    """The official modules of one run; ``trained`` are those whose parameters the optimiser
    holds (train.py: ``all_params = change_detector + speaker``)."""

    modules: dict[str, Any]
    spatial_info: Any | None
    lib: dict[str, Any]  # the imported official modules by dotted name
    weights: dict[str, float]  # the loss weights the official script hard-codes
    trained_names: tuple[str, ...] = ("change_detector", "speaker")

    @property
    def trained(self) -> list[Any]:
        """The modules whose parameters the optimiser holds."""
        return [self.modules[name] for name in self.trained_names]


def caption_masks(ids: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """1 on the first k positions, k = the row's non-zero ids (official dataset, §2.5)."""
    length = (ids != 0).sum(axis=1, keepdims=True)
    return (np.arange(ids.shape[1])[None, :] < length).astype(dtype)


def caption_targets(ids: np.ndarray) -> np.ndarray:
    """``labels_with_ignore``: ids outside the mask set to -1, the first position dropped and
    a -1 appended (official dataset, §2.5)."""
    labels = np.where(caption_masks(ids) > 0, ids, -1).astype(np.int64)
    return np.concatenate([labels[:, 1:], np.full((len(ids), 1), -1, np.int64)], axis=1)


def tensor_batch(batch: dict[str, np.ndarray], streams: tuple[str, ...],
                spatial_info: Any | None) -> TorchBatch:
    """Our host batch as the official loop receives it (channels first, int64 ids,
    ``labels_with_ignore``, masks in the grids' dtype; AddSpatialInfo when given)."""
    import torch

    def grid(x: np.ndarray) -> Any:
        t = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
        return spatial_info(t) if spatial_info is not None else t

    pairs = {}
    for stream in streams:
        after_key, caption_key = STREAM_KEYS[stream]
        ids = batch[caption_key]
        pairs[stream] = TorchPair(
            grid(batch[after_key]), torch.from_numpy(ids.astype(np.int64)),
            torch.from_numpy(caption_targets(ids)),
            torch.from_numpy(caption_masks(ids, batch["before"].dtype)))
    return TorchBatch(grid(batch["before"]), pairs)



@dataclasses.dataclass
class OfficialSide:
    """The official modules with their optimiser and schedule, and the steps taken.
    ``scheduler`` (torch's, stepped at each epoch's end) or ``lr_at`` (the official loop's
    lr of a 0-based step, set before ``optimizer.step()``) is the schedule."""

    adapter: Adapter
    model: OfficialModel
    cfg: Any
    optimizer: Any
    scheduler: Any
    steps_per_epoch: int
    step: int = 0
    lr_at: Callable[[int], float] | None = None


def disable_dropout(modules: list[Any]) -> None:
    """Dropout probability 0 in every ``nn.Dropout`` and ``nn.MultiheadAttention``; the
    modules stay in train mode, as the official loop runs them."""
    import torch

    for module in modules:
        module.train()
        for sub in module.modules():
            if isinstance(sub, torch.nn.Dropout):
                sub.p = 0.0
            elif isinstance(sub, torch.nn.MultiheadAttention):
                sub.dropout = 0.0


def build_modules(adapter: Adapter, config: ml_collections.ConfigDict, root: Path,
                  lib: dict[str, Any], overrides: list[tuple[str, Any]]
                  ) -> tuple[Any, OfficialModel, Any]:
    """The official cfg (the script's yaml, then ``overrides``), modules (after the script's
    seed, ``config.seed``) and optimiser (``build_optimizer`` on the trained modules)."""
    import torch

    cfg = off.load_cfg(lib["configs.config_transformer"], root, adapter.yaml(config.model),
                       overrides)
    torch.manual_seed(config.seed)  # train.py seeds torch with 1111, as config.seed
    model = adapter.build(lib, cfg, config.model)
    params = [p for m in model.trained for p in m.parameters()]
    return cfg, model, lib["utils.utils"].build_optimizer(params, cfg)


def clip_gradients(model: OfficialModel, cfg: Any) -> None:
    """train.py's clipping: each trained module's norm separately, unless grad_clip is -1."""
    import torch

    if cfg.train.grad_clip != -1.0:
        for module in model.trained:
            torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.train.grad_clip)


def _halves(values: list[Any]) -> Any:
    """The official pair mean: ``0.5 * pos + 0.5 * neg`` on CLEVR-Change, the value alone
    with one pair."""
    return values[0] if len(values) == 1 else 0.5 * values[0] + 0.5 * values[1]


def _numpy_state(module: Any) -> dict[str, np.ndarray]:
    """A module's state_dict as NumPy copies."""
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


class Adapter:
    """The shared part; subclasses fill in the model-specific methods."""

    name = ""
    repository = ""
    fixed_widths = ""  # what the official code hard-codes, for error messages
    # Converter sources held in the official snapshot; the others are extra states.
    snapshot_sources: tuple[str, ...] = (ENCODER, DECODER)
    pretraining = False  # True: run_steps / task_summary are the adapter's (idc_pretrain.py)
    # The official loop's ``zero_grad()`` as the authors' torch ran it: False = torch >= 2.0's
    # default (gradients set to None, so Adam skips a parameter the step does not reach);
    # True = torch 1.x's (gradients zeroed in place, so Adam updates every parameter).
    zero_grads_in_place = False

    def script(self, model: ml_collections.ConfigDict) -> str:
        """The official training script of this config (for messages)."""
        raise NotImplementedError

    def yaml(self, model: ml_collections.ConfigDict) -> str:
        """The yaml that script reads, relative to the checkout."""
        raise NotImplementedError

    def module_names(self, model: ml_collections.ConfigDict) -> tuple[str, ...]:
        """The official modules to import (dotted names)."""
        raise NotImplementedError

    def official_weights(self, model: ml_collections.ConfigDict) -> dict[str, float]:
        """The auxiliary loss weights the script hard-codes, by our loss names."""
        raise NotImplementedError

    def loss_terms(self, config: ml_collections.ConfigDict) -> tuple[str, ...]:
        """The loss terms of a table row: caption, the config's auxiliary losses, total."""
        return ("caption", *config.loss_weights, "total")

    def fit_config(self, config: ml_collections.ConfigDict) -> list[str]:
        """Checks ``config`` against what the official code can build; sets the widths it
        hard-codes. Returns notes on what it changed."""
        raise NotImplementedError

    def build(self, lib: dict[str, Any], cfg: Any,
              model: ml_collections.ConfigDict) -> OfficialModel:
        """The official modules, created in the official order (the caller seeds torch)."""
        raise NotImplementedError

    def losses(self, official: OfficialModel, batch: TorchBatch) -> dict[str, Any]:
        """The loop body's loss tensors: caption, each auxiliary loss, total."""
        raise NotImplementedError

    def after_step(self, official: OfficialModel) -> None:
        """What the official loop does after ``optimizer.step()`` (nothing by default)."""

    def build_side(self, config: ml_collections.ConfigDict, root: Path, lib: dict[str, Any],
                   sizes: tables.Sizes, official_cfg: list[tuple[str, Any]],
                   steps_per_epoch: int) -> OfficialSide:
        """The official cfg (the script's yaml with the config's sizes, then
        ``official_cfg``), modules with dropout off, ``build_optimizer`` and ``StepLR``."""
        import torch

        overrides = self.cfg_overrides(config, sizes.feature_channels, sizes.vocab_size,
                                       sizes.max_len) + list(official_cfg)
        cfg, model, optimizer = build_modules(self, config, root, lib, overrides)
        disable_dropout(list(model.modules.values()))
        scheduler = torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=cfg.train.optim.step_size, gamma=cfg.train.optim.gamma)
        return OfficialSide(self, model, cfg, optimizer, scheduler, steps_per_epoch)

    def import_lib(self, root: Path, model: ml_collections.ConfigDict) -> dict[str, Any]:
        """The official modules the run needs, imported from the checkout at ``root``."""
        return off.import_official(root, self.module_names(model))

    def parse_official_cfg(self, text: str) -> tuple[str, Any]:
        """One ``--official_cfg=KEY=VALUE``."""
        return off.parse_cfg_override(text)

    def clip(self, side: OfficialSide) -> None:
        """The official loop's gradient clipping (train.py's, by default)."""
        clip_gradients(side.model, side.cfg)

    def fit_sizes(self, sizes: tables.Sizes, model: Any) -> tables.Sizes:
        """The sizes the converter's table needs (unchanged by default)."""
        return sizes

    def torch_batch(self, batch: dict[str, np.ndarray], model: Any, streams: tuple[str, ...],
                    spatial_info: Any | None, inputs_key: Any) -> Any:
        """Our host batch as the official loop receives it; ``inputs_key`` is our step's
        ``"inputs"`` rng (for inputs our step draws itself)."""
        return tensor_batch(batch, streams, spatial_info)

    def extra_fields(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """Fields beside the streams' that our model reads from the host batch (none by
        default; a plug-in's labels)."""
        return {}

    def pe_table(self, shape: tuple[int, ...]) -> np.ndarray:
        """The official positional-encoding buffer of ``shape`` in float64 (--precision)."""
        return sinusoid_table(shape[-2], shape[-1], np.float64).reshape(shape)

    def sources(self, official: OfficialModel) -> dict[str, Any]:
        """Converter source (``ENCODER`` ...) -> the official module holding it."""
        return {ENCODER: official.modules["change_detector"],
                DECODER: official.modules["speaker"]}

    def states(self, official: OfficialModel) -> dict[str, dict[str, np.ndarray]]:
        """Converter sources -> {torch key: array} (the state_dicts)."""
        return {k: _numpy_state(m) for k, m in self.sources(official).items()}

    def gradients(self, official: OfficialModel) -> dict[str, dict[str, np.ndarray]]:
        """Converter sources -> {torch key: gradient} of the parameters that have one."""
        return {k: {n: p.grad.detach().cpu().numpy().copy() for n, p in m.named_parameters()
                    if p.grad is not None} for k, m in self.sources(official).items()}

    def cfg_overrides(self, config: ml_collections.ConfigDict, feature_channels: int,
                      vocab_size: int, max_len: int) -> list[tuple[str, Any]]:
        """The official ``cfg`` keys that carry the model sizes of ``config``."""
        m = config.model
        enc, dec = "model.transformer_encoder.", "model.transformer_decoder."
        feat = feature_channels + (2 if m.use_coordinates else 0)
        return [
            (enc + "feat_dim", feat), (enc + "att_dim", m.hidden_dim),
            (enc + "emb_dim", m.hidden_dim), (enc + "att_head", m.num_heads),
            (enc + "att_layer", m.encoder_layers), (dec + "word_dim", m.word_dim),
            (dec + "att_dim", m.hidden_dim), (dec + "att_head", m.num_heads),
            (dec + "att_layer", m.decoder_layers), (dec + "vocab_size", vocab_size),
            (dec + "seq_length", max_len),
        ]

    def differences(self, config: ml_collections.ConfigDict, cfg: Any) -> list[str]:
        """Where ``config`` trains differently from the official ``cfg`` and script."""
        out = optimizer_differences(config.optim, cfg)
        weights = self.official_weights(config.model)
        if dict(config.loss_weights) != weights:
            out.append(f"loss weights: config {dict(config.loss_weights)}, official "
                       f"{weights} ({self.script(config.model)})")
        return out


def optimizer_differences(optim: ml_collections.ConfigDict, cfg: Any) -> list[str]:
    """config.optim vs the official ``cfg.train`` (``build_optimizer``, StepLR, clipping)."""
    o = cfg.train.optim
    out = []
    if o.type != "adam":
        out.append(f"official optimiser {o.type!r}, config Adam")
    pairs = [("learning_rate", optim.learning_rate, "lr", o.lr),
             ("b1", optim.b1, "alpha", o.alpha), ("b2", optim.b2, "beta", o.beta),
             ("eps", optim.eps, "epsilon", o.epsilon),
             ("weight_decay", optim.get("weight_decay", 0.0), "weight_decay", o.weight_decay),
             ("decay_factor", optim.decay_factor, "gamma", o.gamma),
             ("decay_every_epochs", optim.decay_every_epochs, "step_size", o.step_size)]
    for ours, value, theirs, official in pairs:
        if not math.isclose(float(value), float(official), rel_tol=1e-12):
            out.append(f"optim.{ours} = {value}, official train.optim.{theirs} = {official}")
    if optim.get("schedule", "step_lr") != "step_lr":
        out.append(f"optim.schedule = {optim.schedule!r}, official StepLR per epoch")
    clip = float(cfg.train.grad_clip)
    if (optim.grad_clip_norm or 0.0) != (0.0 if clip == -1.0 else clip):
        out.append(f"optim.grad_clip_norm = {optim.grad_clip_norm} (global norm), official "
                   f"train.grad_clip = {clip} (-1 = off; else the encoder's and the decoder's "
                   "norms are clipped separately)")
    return out


def official_widths(m: ml_collections.ConfigDict) -> list[str]:
    """Sets the DIRL decoder's MLP and FFN widths to 4 x hidden (the official att_dim rule);
    returns a note for each width changed."""
    notes = []
    for field in ("mlp_hidden_dim", "ffn_dim"):
        if m[field] != 4 * m.hidden_dim:
            notes.append(f"model.{field} {m[field]} -> {4 * m.hidden_dim} (the official "
                         "width is 4 x att_dim)")
            m[field] = 4 * m.hidden_dim
    return notes


def torch_pairs_mean(per_stream: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{stream: {term: tensor}} -> {term: official pair mean}."""
    terms = next(iter(per_stream.values()))
    return {t: _halves([per_stream[s][t] for s in per_stream]) for t in terms}


class DirlAdapter(Adapter):
    """tuyunbin/DIRL: ``train_clevr_change.py`` (CCR_no_init decoder, both pairs) and
    ``train.py`` (CLEVR-DC: CCR decoder, one pair)."""

    name = "dirl"
    repository = "tuyunbin/DIRL"
    fixed_widths = ("models/DIRL.py fixes the grid tables at 14 rows and the MLP at 4 x att_dim; "
                    "models/CCR*.py the FFN at 4 x att_dim")
    WEIGHTS = {"clevr_change": {"dirl": 0.5, "ccr": 0.3},  # train_clevr_change.py:181
               "clevr_dc": {"dirl": 0.03, "ccr": 0.05}}  # train.py:171

    def script(self, model: ml_collections.ConfigDict) -> str:
        return "train_clevr_change.py" if model.variant == "clevr_change" else "train.py"

    def yaml(self, model: ml_collections.ConfigDict) -> str:
        name = "transformer_clevr_change" if model.variant == "clevr_change" else "transformer_dc"
        return f"configs/dynamic/{name}.yaml"

    def module_names(self, model: ml_collections.ConfigDict) -> tuple[str, ...]:
        decoder = "models.CCR_no_init" if model.variant == "clevr_change" else "models.CCR"
        return ("configs.config_transformer", "utils.utils", "models.DIRL", decoder)

    def official_weights(self, model: ml_collections.ConfigDict) -> dict[str, float]:
        return dict(self.WEIGHTS[model.variant])

    def fit_config(self, config: ml_collections.ConfigDict) -> list[str]:
        m = config.model
        cc = m.variant == "clevr_change"
        if m.pairs != ("both" if cc else "semantic_only") or bool(m.use_coordinates) != cc:
            raise ReproduceError(
                f"the official {self.script(m)} trains variant {m.variant!r} with pairs="
                f"{'both' if cc else 'semantic_only'} and use_coordinates={cc}; the config "
                f"has pairs={m.pairs!r}, use_coordinates={m.use_coordinates}")
        notes = official_widths(m)
        if m.off_diagonal_weight != 0.003:
            notes.append(f"model.off_diagonal_weight = {m.off_diagonal_weight}; the official "
                         "models/DIRL.py hard-codes 0.003")
        return notes

    def build(self, lib: dict[str, Any], cfg: Any,
              model: ml_collections.ConfigDict) -> OfficialModel:
        """train_clevr_change.py / train.py:83-89: DIRL, then CCR; AddSpatialInfo is applied on
        CLEVR-Change only."""
        dirl = lib["models.DIRL"]
        decoder = lib[self.module_names(model)[-1]]
        modules = {"change_detector": dirl.DIRL(cfg), "speaker": decoder.CCR(cfg)}
        spatial = dirl.AddSpatialInfo() if model.variant == "clevr_change" else None
        return OfficialModel(modules, spatial, lib, self.official_weights(model))

    def losses(self, official: OfficialModel, batch: TorchBatch) -> dict[str, Any]:
        """train_clevr_change.py:162-181 / train.py:156-171."""
        encoder, speaker = official.modules["change_detector"], official.modules["speaker"]
        per_stream = {}
        for stream, pair in batch.pairs.items():
            diff_bef, diff_aft, dirl = encoder(batch.before, pair.after)
            caption, _, ccr = speaker._forward(diff_bef, diff_aft, pair.labels, pair.masks,
                                               labels_with_ignore=pair.targets)
            per_stream[stream] = {"caption": caption, "dirl": dirl, "ccr": ccr}
        out = torch_pairs_mean(per_stream)
        w = official.weights
        out["total"] = out["caption"] + w["dirl"] * out["dirl"] + w["ccr"] * out["ccr"]
        return out


class ScorerAdapter(Adapter):
    """tuyunbin/SCORER ``train.py`` (CLEVR-Change, both pairs, CBR outside the optimiser)."""

    name = "scorer"
    repository = "tuyunbin/SCORER"
    fixed_widths = ("models/CBR.py hard-codes 512 channels, 8 heads and a 14x14 grid; "
                    "models/SCORER.py the grid tables at 14 rows")
    WEIGHTS = {"sim": 0.1, "cbr": 0.001}  # train.py:191

    def script(self, model: ml_collections.ConfigDict) -> str:
        return "train.py"

    def yaml(self, model: ml_collections.ConfigDict) -> str:
        return "configs/dynamic/transformer.yaml"

    def module_names(self, model: ml_collections.ConfigDict) -> tuple[str, ...]:
        return ("configs.config_transformer", "utils.utils", "models.SCORER",
                "models.transformer_decoder", "models.CBR")

    def official_weights(self, model: ml_collections.ConfigDict) -> dict[str, float]:
        return dict(self.WEIGHTS)

    def fit_config(self, config: ml_collections.ConfigDict) -> list[str]:
        m = config.model
        wanted = {"pairs": "both", "use_coordinates": True, "use_sim": True, "use_cbr": True}
        wrong = {k: m[k] for k, v in wanted.items() if m[k] != v}
        if wrong:
            raise ReproduceError(f"the official SCORER train.py trains {wanted}; the config "
                                 f"has {wrong}")
        notes = []
        if m.cbr_mean_by_length:
            notes.append("model.cbr_mean_by_length = True; the official CBR divides by the "
                         "padded length (S-Q8)")
        if tuple(config.optim.frozen) != ("cbr",):
            notes.append(f"optim.frozen = {tuple(config.optim.frozen)}; the official "
                         "optimiser never updates CBR (train.py:114)")
        return notes

    def build(self, lib: dict[str, Any], cfg: Any,
              model: ml_collections.ConfigDict) -> OfficialModel:
        """train.py:84-93: ChangeDetector, Speaker, CBR in that order, then AddSpatialInfo."""
        scorer = lib["models.SCORER"]
        modules = {"change_detector": scorer.ChangeDetector(cfg),
                   "speaker": lib["models.transformer_decoder"].Speaker(cfg),
                   "generator": lib["models.CBR"].CBR(cfg)}
        return OfficialModel(modules, scorer.AddSpatialInfo(), lib, self.official_weights(model))

    def losses(self, official: OfficialModel, batch: TorchBatch) -> dict[str, Any]:
        """train.py:162-191 (``loss_fcn = CrossEn()`` of utils/utils.py)."""
        encoder, speaker = official.modules["change_detector"], official.modules["speaker"]
        generator = official.modules["generator"]
        cross_entropy = official.lib["utils.utils"].CrossEn()
        per_stream = {}
        for stream, pair in batch.pairs.items():
            memory, sim1, sim2, bef, aft = encoder(batch.before, pair.after)
            caption, _, _, sent = speaker._forward(memory, pair.labels, pair.masks,
                                                   labels_with_ignore=pair.targets)
            per_stream[stream] = {
                "caption": caption,
                "sim": (cross_entropy(sim1) + cross_entropy(sim2)) / 2.0,
                "cbr": generator(bef, sent, aft, pair.masks)}
        out = torch_pairs_mean(per_stream)
        w = official.weights
        out["total"] = out["caption"] + w["sim"] * out["sim"] + w["cbr"] * out["cbr"]
        return out

    def after_step(self, official: OfficialModel) -> None:
        """train.py:219-226: clamp the last SCORER layer's and CBR's logit scales <= ln 100."""
        import torch

        encoder, generator = official.modules["change_detector"], official.modules["generator"]
        torch.clamp_(encoder.scorer[-1].attention.logit_scale.data, max=np.log(100))
        torch.clamp_(generator.contra.logit_scale.data, max=np.log(100))

    def sources(self, official: OfficialModel) -> dict[str, Any]:
        return {**super().sources(official), GENERATOR: official.modules["generator"]}
