"""Change-entity retrieval for CHEERS (paper §3.1.2, Eq. 1): the top-k entities of every pair.

    python -m data_prep.retrieval --dataset=NAME [--data_dir=DIR] [--variant=V] \\
        [--backbone=auto|contrastive|clip] [--clip_path=LOCAL_DIR] [--k=3] \\
        [--difference=signed|absolute] [--overwrite]

needs the entity list of ``python -m data_prep.entities`` (``entities.json`` beside the
dataset) and writes ``<dataset directory>/entity_retrieval/`` in the format
``changecap_jax/data/entity_inputs.py`` reads (meta.json, embeddings.npy, texts.json,
``<split>.npz``), atomically (a temporary sibling directory renamed at the end).

Retrieval (Eq. 1). With S_bef, S_aft (M,) the cosine similarities of the two images to the M
entity embeddings, an entity's score is S_bef - S_aft as printed (``difference="signed"``, the
paper preset) or |S_bef - S_aft| (``"absolute"``, the named switch: as printed, an entity that
appears only in the AFTER image scores low). Only entities with S_bef > mean(S_bef) or S_aft >
mean(S_aft) are eligible ("at least one of the two cosine similarity scores is higher than the
average"); the k best eligible ones are kept, best first, ties to the lower id. When fewer than
k are eligible the remaining slots take the best ineligible ones, flagged False in
``constrained_<o>``, so every pair has k entities.

Orientations: ``semantic`` (before, after_semantic) and, where the dataset has distractors,
``distractor`` (before, after_distractor) and ``distractor_swapped`` (after_distractor,
before), since the training pipeline may swap those two images and Eq. 1 is not symmetric.

Backbones (one interface, :class:`Backbone`):

* ``clip``: the paper's. A local HuggingFace CLIP checkpoint (``transformers`` from
  ``requirements-torch.txt``; nothing is downloaded), run in PyTorch (CUDA when present) on the
  dataset's saved images, batched with a progress bar; image embeddings are cached per split
  in ``<dataset directory>/entity_retrieval.clip_cache/`` every few batches, so an
  interrupted run continues where it stopped. Datasets whose records name no image files
  (the real ones here store features only) cannot use it.
* ``contrastive`` (default where no CLIP checkpoint is given, e.g. the synthetic dataset): a
  small image-text model trained here in JAX on the TRAIN split. Image encoder: a grid's
  features -> Dense + ReLU -> mean over cells -> Dense -> L2 norm. Text encoder: the mean of
  learned word embeddings of the entity's words -> Dense -> L2 norm. Objective: for every train
  pair whose change caption has an entity, the Eq. 1 score of every entity (signed or
  absolute as chosen) over a temperature is trained with softmax cross-entropy to pick the
  caption's entity. Retrieval then ranks by exactly the trained score, so the backbone learns
  what Eq. 1 needs rather than a generic image-text similarity.

The command prints, and meta.json keeps, the retrieval accuracy: the fraction of semantic
pairs whose top-1 (top-3) retrieved entities contain the entity of one of the pair's
reference captions (parsed with the entity list's backend; pairs without one are excluded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from changecap_jax.data import entity_inputs
from data_prep import entities as entity_lib

Difference = str  # "signed" | "absolute"
DIFFERENCES = ("signed", "absolute")


# ---------------------------------------------------------------------------------------------
# Eq. 1
# ---------------------------------------------------------------------------------------------


def retrieve(s_before: np.ndarray, s_after: np.ndarray, k: int,
             difference: Difference = "signed") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eq. 1 with the above-average constraint, for N pairs at once.

    Args: s_before, s_after (N, M) cosine similarities; k <= M.
    Returns: ids (N, k) int32 best first, scores (N, k) float32, constrained (N, k) bool
    (False for slots filled from ineligible entities).
    """
    s_before, s_after = np.asarray(s_before, np.float64), np.asarray(s_after, np.float64)
    if s_before.ndim != 2 or s_before.shape != s_after.shape:
        raise ValueError(f"similarities must both be (N, M), got {s_before.shape} and "
                         f"{s_after.shape}")
    if difference not in DIFFERENCES:
        raise ValueError(f"difference must be one of {DIFFERENCES}, got {difference!r}")
    n, m = s_before.shape
    if not 1 <= k <= m:
        raise ValueError(f"k must be in [1, {m}] (the number of entities), got {k}")
    score = s_before - s_after
    if difference == "absolute":
        score = np.abs(score)
    eligible = ((s_before > s_before.mean(axis=1, keepdims=True))
                | (s_after > s_after.mean(axis=1, keepdims=True)))
    entity = np.broadcast_to(np.arange(m), (n, m))
    # np.lexsort sorts by the LAST key first: eligible first, then score down, then id up.
    order = np.lexsort((entity, -score, ~eligible), axis=-1)[:, :k]
    take = lambda a: np.take_along_axis(a, order, axis=1)
    return order.astype(np.int32), take(score).astype(np.float32), take(eligible)


# ---------------------------------------------------------------------------------------------
# Backbones
# ---------------------------------------------------------------------------------------------


class Backbone(Protocol):
    """Embeds entity texts and images into one space (rows L2-normalised, float32)."""

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray: ...

    def encode_images(self, split: str, key: str) -> np.ndarray:
        """(N,) records of ``split`` -> (N, D): the image in record field ``key``."""
        ...

    def describe(self) -> dict[str, Any]: ...


def _l2(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-8)


def _words(text: str) -> list[str]:
    return text.lower().split()


def _text(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


@dataclasses.dataclass
class ContrastiveSettings:
    dim: int = 64
    hidden: int = 128
    steps: int = 400
    batch_size: int = 128
    learning_rate: float = 3e-3
    temperature: float = 0.05
    seed: int = 0


class ContrastiveBackbone:
    """The small JAX image-text model of the module docstring, trained on construction."""

    def __init__(self, dataset: Any, texts: Sequence[str], caption_entity: Mapping[str, str],
                 difference: Difference, settings: ContrastiveSettings | None = None):
        self.dataset, self.texts = dataset, list(texts)
        self.settings = settings or ContrastiveSettings()
        self.difference = difference
        self._grids: dict[tuple[str, str], np.ndarray] = {}
        self.word_index = {w: i + 1 for i, w in enumerate(
            sorted({w for t in self.texts for w in _words(t)}))}  # 0 = padding
        self.params, self.loss_history = self._train(caption_entity)

    # -- data --------------------------------------------------------------------------------

    def grids(self, split: str, key: str) -> np.ndarray:
        if (split, key) not in self._grids:
            source = self.dataset.split(split)
            self._grids[(split, key)] = np.stack(
                [np.asarray(source[i][key], np.float32) for i in range(len(source))])
        return self._grids[(split, key)]

    def _token_matrix(self, texts: Sequence[str]) -> np.ndarray:
        width = max(len(_words(t)) for t in texts)
        out = np.zeros((len(texts), width), np.int32)
        for i, t in enumerate(texts):
            ids = [self.word_index.get(w, 0) for w in _words(t)]
            out[i, : len(ids)] = ids
        return out

    # -- model -------------------------------------------------------------------------------

    def _modules(self):
        import flax.linen as nn
        import jax.numpy as jnp

        s = self.settings

        class ImageEncoder(nn.Module):
            @nn.compact
            def __call__(self, grid):  # (B, H, W, C)
                h = nn.relu(nn.Dense(s.hidden)(grid))
                v = nn.Dense(s.dim)(h.mean(axis=(1, 2)))
                return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-8)

        class TextEncoder(nn.Module):
            vocab: int

            @nn.compact
            def __call__(self, tokens):  # (M, W) int, 0 = pad
                emb = nn.Embed(self.vocab, s.dim)(tokens)
                real = (tokens > 0)[..., None]
                mean = (emb * real).sum(1) / jnp.maximum(real.sum(1), 1)
                t = nn.Dense(s.dim)(mean)
                return t / jnp.maximum(jnp.linalg.norm(t, axis=-1, keepdims=True), 1e-8)

        return ImageEncoder(), TextEncoder(len(self.word_index) + 1)

    def _train(self, caption_entity: Mapping[str, str]) -> tuple[Any, list[float]]:
        import jax
        import jax.numpy as jnp
        import optax

        s = self.settings
        index = {t: i for i, t in enumerate(self.texts)}
        source = self.dataset.split("train")
        rows, targets = [], []
        for i in range(len(source)):
            for caption in source[i]["change_captions"]:
                text = caption_entity.get(_text(caption))
                if text in index:
                    rows.append(i)
                    targets.append(index[text])
                    break
        if not rows:
            raise ValueError("no train pair has a caption whose entity is in the entity list")
        before = self.grids("train", "before")[rows]
        after = self.grids("train", "after_semantic")[rows]
        targets = np.asarray(targets, np.int32)
        tokens = jnp.asarray(self._token_matrix(self.texts))
        image_enc, text_enc = self._modules()
        key = jax.random.key(s.seed)
        params = {"image": image_enc.init(key, before[:1])["params"],
                  "text": text_enc.init(jax.random.fold_in(key, 1), tokens)["params"]}
        optimizer = optax.adam(s.learning_rate)
        opt_state = optimizer.init(params)
        absolute = self.difference == "absolute"

        def loss_fn(params, b, a, y):
            e = text_enc.apply({"params": params["text"]}, tokens)
            s_bef = image_enc.apply({"params": params["image"]}, b) @ e.T
            s_aft = image_enc.apply({"params": params["image"]}, a) @ e.T
            score = jnp.abs(s_bef - s_aft) if absolute else s_bef - s_aft
            return optax.softmax_cross_entropy_with_integer_labels(score / s.temperature,
                                                                   y).mean()

        @jax.jit
        def step(params, opt_state, b, a, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, b, a, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        rng = np.random.default_rng(s.seed)
        history = []
        for _ in tqdm(range(s.steps), desc="train retrieval model", dynamic_ncols=True):
            batch = rng.choice(len(rows), size=min(s.batch_size, len(rows)), replace=False)
            params, opt_state, loss = step(params, opt_state, before[batch], after[batch],
                                           targets[batch])
            history.append(float(loss))
        return params, history

    # -- interface ---------------------------------------------------------------------------

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        _, text_enc = self._modules()
        return _l2(text_enc.apply({"params": self.params["text"]},
                                  self._token_matrix(texts)))

    def encode_images(self, split: str, key: str) -> np.ndarray:
        image_enc, _ = self._modules()
        grids = self.grids(split, key)
        return _l2(np.concatenate([
            np.asarray(image_enc.apply({"params": self.params["image"]}, grids[i:i + 512]))
            for i in range(0, len(grids), 512)]))

    def describe(self) -> dict[str, Any]:
        return {"name": "contrastive", **dataclasses.asdict(self.settings),
                "difference_trained": self.difference,
                "final_loss": float(np.mean(self.loss_history[-20:]))}


class ClipBackbone:
    """A local HuggingFace CLIP checkpoint in PyTorch, on the dataset's saved images."""

    def __init__(self, dataset: Any, clip_path: str | Path, *, batch_size: int = 32,
                 cache_dir: Path | None = None, max_batches: int | None = None):
        try:
            import torch
            from transformers import CLIPModel, CLIPProcessor
        except ImportError as e:
            raise ImportError("the CLIP backbone needs torch and transformers: pip install -r "
                              "requirements-torch.txt") from e
        from changecap_jax.data import datasets

        self.dataset, self.clip_path, self.batch_size = dataset, Path(clip_path), batch_size
        source = dataset.split("train")
        if len(source) == 0 or datasets.image_paths(dataset, source[0]) is None:
            raise ValueError(
                f"dataset {dataset.name!r} in {dataset.directory} keeps no image files, and the "
                "CLIP backbone embeds images; use --backbone=contrastive (trained on its "
                "features)")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = CLIPModel.from_pretrained(self.clip_path, local_files_only=True)
        self.model = self.model.to(self.device).eval()
        self.processor = CLIPProcessor.from_pretrained(self.clip_path, local_files_only=True)
        self.cache_dir = cache_dir
        self.max_batches = max_batches  # tests: stop early, as an interrupted run would

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                inputs = self.processor(text=list(texts[i:i + self.batch_size]),
                                        return_tensors="pt", padding=True).to(self.device)
                out.append(self.model.get_text_features(**inputs).float().cpu().numpy())
        return _l2(np.concatenate(out))

    def encode_images(self, split: str, key: str) -> np.ndarray:
        import torch
        from PIL import Image

        from changecap_jax.data import datasets

        source = self.dataset.split(split)
        n = len(source)
        cache = (self.cache_dir / f"{split}_{key}.npz") if self.cache_dir else None
        done, rows = 0, []
        if cache is not None and cache.exists():
            with np.load(cache) as data:
                # Only a cache of this very checkpoint and batch layout is reused.
                if str(data["model"]) == str(self.clip_path.resolve()):
                    rows = [data["embeddings"]]
                    done = len(rows[0])
        batches = 0
        bar = tqdm(total=n, initial=done, desc=f"CLIP {split}/{key}", dynamic_ncols=True)
        with torch.no_grad():
            for start in range(done, n, self.batch_size):
                if self.max_batches is not None and batches >= self.max_batches:
                    raise KeyboardInterrupt(f"stopped after {batches} batches (max_batches)")
                images = []
                for i in range(start, min(n, start + self.batch_size)):
                    with Image.open(datasets.image_paths(self.dataset, source[i])[key]) as im:
                        images.append(im.convert("RGB"))
                inputs = self.processor(images=images, return_tensors="pt").to(self.device)
                rows.append(self.model.get_image_features(**inputs).float().cpu().numpy())
                batches += 1
                bar.update(len(images))
                if cache is not None:  # resumable: everything embedded so far, atomically
                    _save_npz_atomic(cache, embeddings=np.concatenate(rows),
                                     model=np.array(str(self.clip_path.resolve())))
        bar.close()
        return _l2(np.concatenate(rows)) if rows else np.zeros((0, 0), np.float32)

    def describe(self) -> dict[str, Any]:
        return {"name": "clip", "path": str(self.clip_path.resolve()),
                "device": self.device, "batch_size": self.batch_size}


def _save_npz_atomic(path: Path, **arrays: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
        np.savez(f, **arrays)
    Path(f.name).replace(path)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

ORIENTATION_IMAGES = {  # orientation -> (record field of the "before", of the "after")
    "semantic": ("before", "after_semantic"),
    "distractor": ("before", "after_distractor"),
    "distractor_swapped": ("after_distractor", "before"),
}


def caption_entities(captions: Sequence[str], backend: str,
                     spacy_model: str | None = None) -> dict[str, str | None]:
    """caption -> its entity text (None when it has none), with the entity list's backend."""
    return entity_lib.extract_entities(list(captions), backend=backend,
                                       spacy_model=spacy_model).captions


def retrieval_accuracy(ids: np.ndarray, texts: Sequence[str],
                       references: Sequence[Sequence[str]],
                       entity_of: Mapping[str, str | None]) -> dict[str, float | int]:
    """Top-1 / top-3 hit rates of retrieved ``ids`` (N, k) against the references' entities."""
    hits1 = hits3 = n = excluded = 0
    for row, refs in zip(ids, references, strict=True):
        gold = {entity_of.get(r) for r in refs} - {None}
        if not gold:
            excluded += 1
            continue
        n += 1
        got = [texts[int(i)] for i in row]
        hits1 += got[0] in gold
        hits3 += bool(gold & set(got[:3]))
    return {"top1": hits1 / n if n else float("nan"), "top3": hits3 / n if n else float("nan"),
            "n": n, "excluded": excluded}


def run_retrieval(dataset: Any, *, backbone: str = "auto", clip_path: str | None = None,
                  k: int = 3, difference: Difference = "signed",
                  splits: Sequence[str] | None = None, overwrite: bool = False,
                  contrastive: ContrastiveSettings | None = None,
                  clip_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Writes ``<dataset directory>/entity_retrieval`` (see the module docstring); returns
    its meta.json content."""
    entities_path = dataset.directory / entity_lib.ENTITIES_FILE
    if not entities_path.exists():
        raise FileNotFoundError(
            f"{entities_path} does not exist: extract the change entities first with "
            f"python -m data_prep.entities --dataset={dataset.name} "
            f"--data_dir={dataset.directory.parents[2]}")
    out = dataset.directory / entity_inputs.RETRIEVAL_DIR
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    extraction = entity_lib.load_entities(entities_path)
    texts = [e.text for e in extraction.entities]
    if backbone == "auto":
        backbone = "clip" if clip_path else "contrastive"
    splits = list(splits or dataset.builder.info.splits)
    if backbone == "clip":
        if not clip_path:
            raise ValueError("--backbone=clip needs --clip_path=LOCAL_DIR (a saved CLIP model)")
        model: Backbone = ClipBackbone(
            dataset, clip_path,
            cache_dir=dataset.directory / f"{entity_inputs.RETRIEVAL_DIR}.clip_cache",
            **dict(clip_options or {}))
    elif backbone == "contrastive":
        model = ContrastiveBackbone(dataset, texts,
                                    {c: t for c, t in extraction.captions.items() if t},
                                    difference, contrastive)
    else:
        raise ValueError(f"backbone must be auto, clip or contrastive, got {backbone!r}")

    entity_emb = model.encode_texts(texts)
    orientations = (entity_inputs.ORIENTATIONS if dataset.meta.has_distractor
                    else ("semantic",))
    tmp = Path(tempfile.mkdtemp(prefix=".entity_retrieval.", dir=dataset.directory))
    try:
        accuracy, sizes = {}, {}
        for split in splits:
            source = dataset.split(split)
            images = {key: model.encode_images(split, key)
                      for key in sorted({f for o in orientations for f in ORIENTATION_IMAGES[o]})}
            arrays = {"record_ids": np.array([int(source[i]["id"])
                                              for i in range(len(source))], np.int64)}
            for o in orientations:
                bef, aft = ORIENTATION_IMAGES[o]
                ids, scores, constrained = retrieve(images[bef] @ entity_emb.T,
                                                    images[aft] @ entity_emb.T, k, difference)
                arrays.update({f"ids_{o}": ids, f"scores_{o}": scores,
                               f"constrained_{o}": constrained})
            np.savez(tmp / f"{split}.npz", **arrays)
            sizes[split] = len(source)
            refs = [[_text(c) for c in source[i]["change_captions"]] for i in range(len(source))]
            entity_of = caption_entities([r for rs in refs for r in rs], extraction.backend,
                                         extraction.spacy_model)
            accuracy[split] = retrieval_accuracy(arrays["ids_semantic"], texts, refs, entity_of)
        np.save(tmp / "embeddings.npy", entity_emb.astype(np.float32))
        (tmp / "texts.json").write_text(json.dumps(texts))
        meta = {"format": entity_inputs.FORMAT, "backbone": backbone,
                "backbone_details": model.describe(), "k": k, "difference": difference,
                "num_entities": len(texts), "embedding_dim": int(entity_emb.shape[1]),
                "orientations": list(orientations), "splits": sizes, "accuracy": accuracy,
                "chance_top1": 1 / len(texts), "chance_top3": min(1.0, 3 / len(texts))}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        # The embedding cache of an interrupted CLIP run is spent once the result is written.
        shutil.rmtree(dataset.directory / f"{entity_inputs.RETRIEVAL_DIR}.clip_cache",
                      ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def format_accuracy(meta: Mapping[str, Any]) -> str:
    lines = [f"{'split':<8} {'top-1':>7} {'top-3':>7} {'pairs':>6} {'no entity':>9}"]
    for split, a in meta["accuracy"].items():
        lines.append(f"{split:<8} {100 * a['top1']:>6.1f}% {100 * a['top3']:>6.1f}% "
                     f"{a['n']:>6} {a['excluded']:>9}")
    lines.append(f"chance: top-1 {100 * meta['chance_top1']:.2f}%, top-3 "
                 f"{100 * meta['chance_top3']:.2f}% ({meta['num_entities']} entities)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("data_dir", None, "Where the dataset was built (default: the user "
                        "cache folder).")
    flags.DEFINE_string("dataset", None, "Dataset name, e.g. clevr_change or synthetic.",
                        required=True)
    flags.DEFINE_string("variant", "", "Built variant; synthetic: the distractor strength.")
    flags.DEFINE_enum("backbone", "auto", ["auto", "contrastive", "clip"],
                      "auto: clip when --clip_path is given, else contrastive.")
    flags.DEFINE_string("clip_path", None, "Local HuggingFace CLIP checkpoint directory.")
    flags.DEFINE_integer("k", 3, "Entities kept per pair (CHEERS: 3).")
    flags.DEFINE_enum("difference", "signed", list(DIFFERENCES),
                      "Eq. 1 as printed (signed) or its absolute value.")
    flags.DEFINE_list("splits", [], "Splits to process (default: all).")
    flags.DEFINE_integer("batch_size", 32, "CLIP batch size.")
    flags.DEFINE_integer("steps", ContrastiveSettings.steps, "Contrastive training steps.")
    flags.DEFINE_bool("overwrite", False, "Replace an existing entity_retrieval/.")
    flags.DEFINE_integer("seed", 0, "Synthetic dataset seed.")
    flags.DEFINE_integer("num_train", 3000, "Synthetic train examples.")
    flags.DEFINE_integer("num_val", 300, "Synthetic val examples.")
    flags.DEFINE_integer("num_test", 600, "Synthetic test examples.")
    flags.DEFINE_list("feature_shape", ["8", "8", "64"], "Synthetic feature shape H,W,C.")


def main(argv: Sequence[str], log: Callable[[str], None] = print) -> None:
    import sys

    from absl import app, flags

    from changecap_jax.data import datasets

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    FLAGS = flags.FLAGS
    options = None
    if FLAGS.dataset == "synthetic":
        options = {"seed": FLAGS.seed, "num_train": FLAGS.num_train, "num_val": FLAGS.num_val,
                   "num_test": FLAGS.num_test,
                   "feature_shape": tuple(int(v) for v in FLAGS.feature_shape)}
    try:
        dataset = datasets.prepare(FLAGS.dataset, FLAGS.data_dir, FLAGS.variant, options,
                                   build_if_missing=False)
        meta = run_retrieval(
            dataset, backbone=FLAGS.backbone, clip_path=FLAGS.clip_path, k=FLAGS.k,
            difference=FLAGS.difference, splits=FLAGS.splits or None,
            overwrite=FLAGS.overwrite,
            contrastive=dataclasses.replace(ContrastiveSettings(), steps=FLAGS.steps),
            clip_options={"batch_size": FLAGS.batch_size})
    except (datasets.DatasetError, FileNotFoundError, FileExistsError, ValueError,
            ImportError) as e:
        sys.exit(f"error: {e}")
    log(f"entity retrieval ({meta['backbone']}, k={meta['k']}, {meta['difference']}) of "
        f"{FLAGS.dataset}: {meta['num_entities']} entities")
    log(format_accuracy(meta))
    log(f"written: {dataset.directory / entity_inputs.RETRIEVAL_DIR}")


if __name__ == "__main__":
    from absl import app

    logging.getLogger().setLevel(logging.INFO)
    _define_flags()
    app.run(main)
