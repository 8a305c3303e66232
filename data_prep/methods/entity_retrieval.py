"""Change-entity retrieval for CHEERS (paper §3.1.2, Eq. 1): the top-k entities of every pair.

    python -m data_prep.retrieval --dataset=NAME [--data_dir=DIR] [--variant=V] \\
        [--backbone=auto|contrastive|clip] [--clip_path=LOCAL_DIR] [--k=3] \\
        [--difference=signed|absolute] [--batch_size=32] [--splits=train,val,test] \\
        [--overwrite]

needs the entity list of ``python -m data_prep.entities`` (``entities.json`` beside the
dataset) and writes ``<dataset directory>/entity_retrieval/`` (a temporary sibling directory
renamed at the end, so a crash never leaves half a result):

* ``meta.json``: format ``changecap_jax.entity_retrieval/1``, backbone (+ details: settings,
  training loss), k, difference, num_entities M, embedding_dim D, orientations, splits
  {split: N} and the accuracy (below);
* ``embeddings.npy`` (M, D) float32, L2-normalised: row e is entity id e of entities.json;
* ``texts.json``: the M entity strings in id order;
* ``<split>.npz``: ``record_ids`` int64 (N,) (row i is ``dataset.split(split)[i]``) and, per
  orientation o, ``ids_<o>`` int32 (N, k), ``scores_<o>`` float32 (N, k) and
  ``constrained_<o>`` bool (N, k).

This module is the method, ``data_prep/retrieval.py`` its command (``data_prep/first_use.py`` runs
it for the synthetic dataset on first use). ``changecap_jax/data/entity_inputs.py`` reads and
checks the output (``load_retrieval`` here), for the trainer and for the tests alike.

Retrieval (Eq. 1). With S_bef, S_aft (M,) the cosine similarities of the two images to the M
entity embeddings, an entity's score is S_bef - S_aft as printed (``difference="signed"``, the
paper preset) or |S_bef - S_aft| (``"absolute"``, the named switch: as printed, an entity that
appears only in the AFTER image scores low). Only entities with S_bef > mean(S_bef) or S_aft >
mean(S_aft) are eligible ("at least one of the two cosine similarity scores is higher than the
average", the means over the M entities of each image); the k best eligible ones are kept,
best first, ties to the lower id. When fewer than k are eligible the remaining slots take the
best ineligible ones, flagged False in ``constrained_<o>``, so every pair has k entities (the
model reads a fixed k; the flag keeps the distinction).

Orientations: ``semantic`` (before, after_semantic) and, where the dataset has distractors,
``distractor`` (before, after_distractor) and ``distractor_swapped`` (after_distractor,
before), since the training pipeline may swap those two images and Eq. 1 is not symmetric.

Backbones (one interface, :class:`Backbone`):

* ``clip``: the paper's. A local HuggingFace CLIP checkpoint (``transformers`` from
  ``requirements-torch.txt``; nothing is downloaded), run in PyTorch (CUDA when present) on the
  dataset's saved images, batched with a progress bar. Image embeddings are cached per split
  and image field in ``<dataset directory>/entity_retrieval.clip_cache/`` (rewritten
  atomically after every few batches), so an interrupted run continues where it stopped; the
  cache is removed once the result is written. Only the synthetic dataset keeps its images;
  the real datasets here store features only and cannot use it.
* ``contrastive`` (default where no CLIP checkpoint is given): a small image-text model
  trained here in JAX on the TRAIN split. Image encoder: each grid cell's features -> Dense +
  ReLU -> pooled over cells -> Dense -> L2 norm; ``pooling="mean"`` (the default) averages the
  cells, ``pooling="change"`` weighs them by a softmax over the cells of a small MLP of the
  pair's [|before - after|; before; after] at each cell, one weighting shared by both images
  of the pair, so each vector describes what stands where the pair differs (CLIP embeds an
  image alone; this is the substitute's choice, and Eq. 1 still ranks S_bef - S_aft of the two
  vectors). Text encoder: the mean of learned embeddings of
  the entity's whitespace words -> Dense -> L2 norm. Objective: for every train pair whose
  change captions name entities of the list, the Eq. 1 score of every entity (signed or
  absolute, as chosen) over a temperature is trained with softmax cross-entropy towards those
  entities (equal shares of the target: each reference names the changed object its own way,
  and the accuracy below counts any of them). Retrieval then ranks by exactly the trained
  score, constraint included, so the model learns what Eq. 1 needs rather than a generic
  image-text similarity that Eq. 1 would then have to turn into a change score.

Accuracy: for every split with change captions, the fraction of semantic pairs whose top-1
(top-3) retrieved entities hold the entity of ANY of the pair's reference captions, parsed
with the entity list's backend; pairs none of whose captions has an entity are excluded and
counted. Printed as a table and kept in meta.json with the chance levels 1/M and 3/M.

Measured (default synthetic set, moderate distractors, 1,603 distinct entity strings, exact
string match, contrastive, signed): test top-1 4.7%, top-3 8.3% (chance 0.06% / 0.19%); on
builder 2.0.0 3.7% / 8.7%, and 8.3% / 15.7% when any entity that picks out the changed object
counts (``data_prep/entity_recall.py``, docs/ablations.md "CHEERS, measured piece by piece"). The
grid features make the changed object hard to read from one pooled image (a linear probe on
pooled before-after features names its colour in 35% of the test pairs); the paraphrased
references (5.5 distinct entity strings per pair) cap the exact-string accuracy further.
``pooling="change"`` with the absolute difference and 3000 steps names the changed object in
35.5-37.2 % of the test pairs' top 3 over three model seeds (docs/ablations.md, "Change
pooling").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from changecap_jax import console
from changecap_jax.data import entity_inputs, image_files
from changecap_jax.io.jsonio import atomic_write, replaced_folder
from data_prep.methods import change_entities as entity_lib

FORMAT = entity_inputs.FORMAT
RETRIEVAL_DIR = entity_inputs.RETRIEVAL_DIR
CLIP_CACHE_DIR = RETRIEVAL_DIR + ".clip_cache"
BACKBONES = ("clip", "contrastive")
DEFAULT_K = 3  # entities kept per pair (CHEERS: 3)
DIFFERENCES = entity_inputs.DIFFERENCES
POOLINGS = ("mean", "change")  # the contrastive backbone's image pooling
ORIENTATION_IMAGES = {  # orientation -> (record field of the "before", of the "after")
    "semantic": ("before", "after_semantic"),
    "distractor": ("before", "after_distractor"),
    "distractor_swapped": ("after_distractor", "before"),
}
# The one reader of the output lives with the trainer's (changecap_jax/data/entity_inputs.py).
RetrievalError = entity_inputs.EntityInputError  # a ValueError naming the file and key
RetrievalData = entity_inputs.EntityInputs
SplitRetrieval = entity_inputs.SplitRetrieval
load_retrieval = entity_inputs.load


# ---------------------------------------------------------------------------------------------
# Eq. 1
# ---------------------------------------------------------------------------------------------


def retrieve(s_before: np.ndarray, s_after: np.ndarray, k: int,
             difference: str = "signed") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eq. 1 with the above-average constraint, for N pairs at once.

    Args: s_before, s_after (N, M) cosine similarities; k <= M; difference "signed"
    (S_bef - S_aft) or "absolute" (|S_bef - S_aft|).
    Returns: ids (N, k) int32 best first, scores (N, k) float32, constrained (N, k) bool
    (False for slots filled from ineligible entities when fewer than k are eligible).
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

    def take(a: np.ndarray) -> np.ndarray:
        return np.take_along_axis(a, order, axis=1)

    return order.astype(np.int32), take(score).astype(np.float32), take(eligible)


# ---------------------------------------------------------------------------------------------
# Backbones
# ---------------------------------------------------------------------------------------------


class Backbone(Protocol):
    """Embeds entity texts and images into one space (rows L2-normalised, float32)."""

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """M strings -> (M, D)."""
        ...

    def encode_pairs(self, split: str, first: str, second: str) -> tuple[np.ndarray, np.ndarray]:
        """The images in record fields ``first`` and ``second`` of every record of ``split``
        -> 2 x (N, D) (a backbone may weigh an image by its partner, as change pooling does)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What ran, for meta.json ``backbone_details``."""
        ...


def _l2(x: Any) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-8)


def _words(text: str) -> list[str]:
    return text.lower().split()


def _text(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def _each_field_once(memo: dict[tuple[str, str], np.ndarray],
                     encode_field: Callable[[str, str], np.ndarray], split: str, first: str,
                     second: str) -> tuple[np.ndarray, np.ndarray]:
    """``encode_pairs`` of a backbone whose vectors do not depend on the partner image: each
    record field of a split is embedded once (``before`` serves two orientations) and kept in
    ``memo``, (split, field) -> (N, D)."""
    for key in (first, second):
        if (split, key) not in memo:
            memo[(split, key)] = encode_field(split, key)
    return memo[(split, first)], memo[(split, second)]


class _SplitGrids:
    """Grid features of some records of a split, held in memory (float16) when they fit in
    ``max_bytes``, else read from the data source on every access: the small datasets train
    fast from memory, while a real dataset's train grids (layer-3 ResNet, tens of GB) stream."""

    def __init__(self, source: Any, rows: Sequence[int], keys: Sequence[str], max_bytes: int):
        self.source, self.rows, self.keys = source, np.asarray(rows), tuple(keys)
        self.arrays: dict[str, np.ndarray] | None = None
        if len(self.rows) == 0:
            return
        first = source[int(self.rows[0])]
        size = len(self.rows) * sum(2 * np.asarray(first[k]).size for k in self.keys)
        if size <= max_bytes:
            self.arrays = {k: np.empty((len(self.rows), *np.shape(first[k])), np.float16)
                           for k in self.keys}
            for j, i in enumerate(console.Progress(self.rows, desc="read grids",
                                                   dynamic_ncols=True, leave=False)):
                record = source[int(i)]
                for k in self.keys:
                    self.arrays[k][j] = record[k]

    def get(self, positions: Sequence[int]) -> dict[str, np.ndarray]:
        """float32 grids of ``self.rows[positions]``, per key."""
        positions = np.asarray(positions)
        if self.arrays is not None:
            return {k: a[positions].astype(np.float32) for k, a in self.arrays.items()}
        records = [self.source[int(self.rows[p])] for p in positions]
        return {k: np.stack([np.asarray(r[k], np.float32) for r in records])
                for k in self.keys}


@dataclasses.dataclass
class ContrastiveSettings:
    """The contrastive backbone's model and training settings (all kept in meta.json)."""

    dim: int = 64
    hidden: int = 128
    # How an image's cells become one vector: "mean" (every cell alike) or "change" (cells
    # weighted by where the pair differs; module docstring).
    pooling: str = "mean"
    steps: int = 400  # mean pooling: more fits the train split better and the test split worse
    batch_size: int = 128
    learning_rate: float = 3e-3
    temperature: float = 0.05
    seed: int = 0
    max_memory_bytes: int = 2 << 30  # train grids above this are read per batch


class ContrastiveBackbone:
    """The small JAX image-text model of the module docstring, trained on construction.

    Args: dataset (a ``datasets.PreparedDataset``, or anything with ``split(name)`` and
    ``meta.has_distractor``); the entity texts in id order; caption -> entity text (the
    entity list's ``captions``); the Eq. 1 difference to train for.
    """

    def __init__(self, dataset: Any, texts: Sequence[str], caption_entity: Mapping[str, str | None],
                 difference: str, settings: ContrastiveSettings | None = None):
        if difference not in DIFFERENCES:
            raise ValueError(f"difference must be one of {DIFFERENCES}, got {difference!r}")
        self.dataset, self.texts = dataset, list(texts)
        self.settings = settings or ContrastiveSettings()
        if self.settings.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.settings.pooling!r}")
        self.difference = difference
        self.word_index = {w: i + 1 for i, w in enumerate(
            sorted({w for t in self.texts for w in _words(t)}))}  # 0 = padding
        self._train_grids: _SplitGrids | None = None
        self._embedded: dict[tuple[str, str], np.ndarray] = {}  # mean pooling: (split, field)
        self.params, self.loss_history, self.num_pairs = self._train(caption_entity)

    # -- data --------------------------------------------------------------------------------

    def _token_matrix(self, texts: Sequence[str]) -> np.ndarray:
        width = max([1, *(len(_words(t)) for t in texts)])
        out = np.zeros((len(texts), width), np.int32)
        for i, t in enumerate(texts):
            ids = [self.word_index.get(w, 0) for w in _words(t)]  # unknown word: padding
            out[i, : len(ids)] = ids
        return out

    def _gold(self, caption_entity: Mapping[str, str | None]) -> tuple[list[int], np.ndarray]:
        """Train rows with at least one listed entity, and their entity ids (R, G), -1 pad."""
        index = {t: i for i, t in enumerate(self.texts)}
        source = self.dataset.split("train")
        rows, gold = [], []
        for i in range(len(source)):
            ids = sorted({index[t] for c in source[i]["change_captions"]
                          if (t := caption_entity.get(_text(c))) in index})
            if ids:
                rows.append(i)
                gold.append(ids)
        if not rows:
            raise ValueError("no train pair has a change caption whose entity is in the entity "
                             "list: the contrastive backbone has nothing to learn from")
        out = np.full((len(gold), max(map(len, gold))), -1, np.int32)
        for r, ids in enumerate(gold):
            out[r, : len(ids)] = ids
        return rows, out

    # -- model -------------------------------------------------------------------------------

    def _modules(self) -> tuple[Any, Any]:
        import flax.linen as nn
        import jax
        import jax.numpy as jnp

        s = self.settings

        def normalise(v):
            return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-8)

        class ImageEncoder(nn.Module):
            @nn.compact
            def __call__(self, first, second=None):  # (B, H, W, C) grids -> (B, D) each
                # Dense_0 and Dense_1 in this order: the mean-pooled model's names, so its
                # initial values (and stored retrievals) stay what they were.
                cells = nn.Dense(s.hidden)
                project = nn.Dense(s.dim)
                if s.pooling == "mean":
                    # A bag of local features: a camera move that only shifts objects barely
                    # changes the vector. Each image alone: ``second`` may be left out.
                    return tuple(normalise(project(nn.relu(cells(g)).mean(axis=(1, 2))))
                                 for g in (first, second) if g is not None)
                local = [nn.relu(cells(g)).reshape(g.shape[0], -1, s.hidden)
                         for g in (first, second)]
                # One weight per cell from how the pair differs there, shared by both
                # images, so each vector describes what stands where the change is.
                flat = [g.reshape(g.shape[0], -1, g.shape[-1]) for g in (first, second)]
                where = jnp.concatenate([jnp.abs(flat[0] - flat[1]), *flat], axis=-1)
                hidden = nn.relu(nn.Dense(s.hidden, name="change_hidden")(where))
                # The squared difference as a starting point (its scale learned, from 1):
                # without it two of three seeds never found the changed cells (docs/ablations.md).
                scale = self.param("change_scale", nn.initializers.ones, ())
                logits = (nn.Dense(1, name="change_logit")(hidden)[..., 0]
                          + scale * jnp.mean((flat[0] - flat[1]) ** 2, axis=-1))
                weights = jax.nn.softmax(logits, axis=-1)
                return tuple(normalise(project(jnp.einsum("bn,bnh->bh", weights, h)))
                             for h in local)

        class TextEncoder(nn.Module):
            vocab: int

            @nn.compact
            def __call__(self, tokens):  # (M, W) int, 0 = pad -> (M, D)
                emb = nn.Embed(self.vocab, s.dim)(tokens)
                real = (tokens > 0)[..., None]
                mean = (emb * real).sum(1) / jnp.maximum(real.sum(1), 1)
                return normalise(nn.Dense(s.dim)(mean))

        return ImageEncoder(), TextEncoder(len(self.word_index) + 1)

    def _train(self, caption_entity: Mapping[str, str | None]) -> tuple[Any, list[float], int]:
        import jax
        import jax.numpy as jnp
        import optax

        s = self.settings
        rows, gold = self._gold(caption_entity)
        self._train_grids = _SplitGrids(self.dataset.split("train"), rows,
                                        ("before", "after_semantic"), s.max_memory_bytes)
        tokens = jnp.asarray(self._token_matrix(self.texts))
        image_enc, text_enc = self._modules()
        key = jax.random.key(s.seed)
        sample = self._train_grids.get([0])["before"]
        params = {"image": image_enc.init(key, sample, sample)["params"],
                  "text": text_enc.init(jax.random.fold_in(key, 1), tokens)["params"]}
        optimizer = optax.adam(s.learning_rate)
        opt_state = optimizer.init(params)
        num_entities, absolute = len(self.texts), self.difference == "absolute"

        def loss_fn(params, before, after, gold):
            e = text_enc.apply({"params": params["text"]}, tokens)
            v_bef, v_aft = image_enc.apply({"params": params["image"]}, before, after)
            s_bef, s_aft = v_bef @ e.T, v_aft @ e.T
            score = jnp.abs(s_bef - s_aft) if absolute else s_bef - s_aft
            # Equal shares over the pair's entities; one_hot(-1) is a zero row (padding).
            target = jax.nn.one_hot(gold, num_entities).sum(axis=1)
            target = target / target.sum(axis=1, keepdims=True)
            return optax.softmax_cross_entropy(score / s.temperature, target).mean()

        @jax.jit
        def step(params, opt_state, before, after, gold):
            loss, grads = jax.value_and_grad(loss_fn)(params, before, after, gold)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        rng = np.random.default_rng(s.seed)
        history = []
        for _ in console.Progress(range(s.steps), desc="train retrieval model", dynamic_ncols=True):
            batch = rng.choice(len(rows), size=min(s.batch_size, len(rows)), replace=False)
            grids = self._train_grids.get(batch)
            params, opt_state, loss = step(params, opt_state, grids["before"],
                                           grids["after_semantic"], gold[batch])
            history.append(float(loss))
        return params, history, len(rows)

    # -- interface ---------------------------------------------------------------------------

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        _, text_enc = self._modules()
        return _l2(text_enc.apply({"params": self.params["text"]}, self._token_matrix(texts)))

    def encode_pairs(self, split: str, first: str, second: str) -> tuple[np.ndarray, np.ndarray]:
        """The images in record fields ``first`` and ``second`` of every record of ``split``,
        embedded as pairs (change pooling weighs the cells by the pair) -> 2 x (N, D)."""
        if self.settings.pooling == "mean":
            return _each_field_once(self._embedded, lambda sp, key: self._encode(sp, key)[0],
                                    split, first, second)
        bef, aft = self._encode(split, first, second)
        return bef, aft

    def _encode(self, split: str, *keys: str) -> list[np.ndarray]:
        """The image encoder over record fields ``keys`` (one, or a pair) of ``split``."""
        import jax

        image_enc, _ = self._modules()
        apply = jax.jit(lambda p, *grids: image_enc.apply({"params": p}, *grids))
        source = self.dataset.split(split)
        # Grids already in memory for training are reused; anything else streams.
        cached = self._train_grids
        full = (split == "train" and cached is not None and cached.arrays is not None
                and set(keys) <= set(cached.keys) and len(cached.rows) == len(source))
        grids = cached if full else _SplitGrids(source, range(len(source)), keys, 0)
        out: list[list[np.ndarray]] = [[] for _ in keys]
        for chunk in _chunks(len(source), 256):
            got = grids.get(chunk)
            for side, vectors in zip(out, apply(self.params["image"], *(got[k] for k in keys)),
                                     strict=True):
                side.append(np.asarray(vectors))
        return [_l2(np.concatenate(side)) if side
                else np.zeros((0, self.settings.dim), np.float32) for side in out]

    def describe(self) -> dict[str, Any]:
        h = self.loss_history
        return {"name": "contrastive", **dataclasses.asdict(self.settings),
                "difference_trained": self.difference, "train_pairs": self.num_pairs,
                "loss_first": float(np.mean(h[:10])) if h else None,
                "loss_final": float(np.mean(h[-20:])) if h else None,
                "loss_every_50_steps": [float(np.mean(h[i:i + 50])) for i in range(0, len(h), 50)]}


class ClipBackbone:
    """A local HuggingFace CLIP checkpoint in PyTorch, on the dataset's saved images.

    ``cache_dir``: where image embeddings are kept between batches (resuming an interrupted
    run); ``stop_after_batches``: raise KeyboardInterrupt after that many image batches, as an
    interruption would (for tests and for checking the resume on a real run).
    """

    def __init__(self, dataset: Any, clip_path: str | Path, *, batch_size: int = 32,
                 cache_dir: Path | None = None, stop_after_batches: int | None = None,
                 cache_every: int = 4):
        # Checked first: this error does not depend on torch being installed.
        source = dataset.split("train")
        if len(source) == 0 or image_files.image_paths(dataset, source[0]) is None:
            raise ValueError(
                f"dataset {dataset.name!r} ({dataset.directory}) has no saved image files, and "
                "the CLIP backbone embeds the raw images (only the synthetic dataset keeps them "
                "beside its records; the real datasets store features only): use "
                "--backbone=contrastive, which is trained on the features")
        try:
            import torch
            from transformers import CLIPModel, CLIPProcessor
        except ImportError as e:
            raise ImportError(
                f"the CLIP backbone needs PyTorch and HuggingFace transformers ({e}): "
                "pip install -r requirements-torch.txt (or pip install torch "
                "transformers==4.57.1), or use --backbone=contrastive") from e
        self.clip_path = Path(clip_path)
        if not self.clip_path.is_dir():
            raise FileNotFoundError(f"--clip_path {self.clip_path} is not a directory (a CLIP "
                                    "checkpoint saved with save_pretrained)")
        self.dataset, self.batch_size = dataset, batch_size
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = CLIPModel.from_pretrained(self.clip_path, local_files_only=True)
        self.model = self.model.to(self.device).eval()
        self.processor = CLIPProcessor.from_pretrained(self.clip_path, local_files_only=True)
        self.cache_dir, self.cache_every = cache_dir, cache_every
        self.stop_after_batches = stop_after_batches
        self._batches = 0  # image batches embedded by this object, for stop_after_batches
        self._embedded: dict[tuple[str, str], np.ndarray] = {}  # (split, field) -> (N, D)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = []
        with torch.no_grad():
            for chunk in _chunks(len(texts), self.batch_size):
                inputs = self.processor(text=[texts[i] for i in chunk], return_tensors="pt",
                                        padding=True, truncation=True).to(self.device)
                out.append(self.model.get_text_features(**inputs).float().cpu().numpy())
        return _l2(np.concatenate(out))

    def _load_cache(self, path: Path | None, record_ids: np.ndarray) -> list[np.ndarray]:
        """Embeddings of a previous run of this checkpoint over the same records, if any."""
        if path is None or not path.exists():
            return []
        with np.load(path) as data:
            model, ids, emb = str(data["model"]), data["record_ids"], data["embeddings"]
        if model != str(self.clip_path.resolve()) or not np.array_equal(
                ids, record_ids[: len(ids)]) or len(ids) != len(emb):
            logging.warning("ignoring %s: it is from another checkpoint or dataset build", path)
            return []
        logging.info("resuming from %s: %d images already embedded", path, len(emb))
        return [emb]

    def encode_pairs(self, split: str, first: str, second: str) -> tuple[np.ndarray, np.ndarray]:
        # CLIP embeds each image alone.
        return _each_field_once(self._embedded, self.encode_images, split, first, second)

    def encode_images(self, split: str, key: str) -> np.ndarray:
        import torch
        from PIL import Image

        source = self.dataset.split(split)
        n = len(source)
        record_ids = np.array([int(source[i]["id"]) for i in range(n)], np.int64)
        cache = self.cache_dir / f"{split}_{key}.npz" if self.cache_dir else None
        rows = self._load_cache(cache, record_ids)
        done = sum(len(r) for r in rows)

        def save() -> None:
            if cache is not None and rows:
                emb = np.concatenate(rows)
                _save_npz_atomic(cache, embeddings=emb, record_ids=record_ids[: len(emb)],
                                 model=np.array(str(self.clip_path.resolve())))

        bar = console.Progress(total=n, initial=done, desc=f"CLIP {split}/{key}",
                               dynamic_ncols=True)
        unsaved = 0
        try:
            with torch.no_grad():
                for chunk in _chunks(n - done, self.batch_size):
                    if (self.stop_after_batches is not None
                            and self._batches >= self.stop_after_batches):
                        raise KeyboardInterrupt(
                            f"stopped after {self._batches} batches (stop_after_batches)")
                    images = []
                    for i in chunk:
                        path = image_files.image_paths(self.dataset, source[done + i])[key]
                        with Image.open(path) as im:
                            images.append(im.convert("RGB"))
                    inputs = self.processor(images=images, return_tensors="pt").to(self.device)
                    rows.append(self.model.get_image_features(**inputs).float().cpu().numpy())
                    self._batches += 1
                    unsaved += 1
                    bar.update(len(images))
                    if unsaved >= self.cache_every:
                        save()
                        unsaved = 0
        finally:
            # Interrupted or not, what was embedded is kept for the next run.
            if unsaved:
                save()
            bar.close()
        dim = int(self.model.config.projection_dim)
        return _l2(np.concatenate(rows)) if rows else np.zeros((0, dim), np.float32)

    def describe(self) -> dict[str, Any]:
        return {"name": "clip", "path": str(self.clip_path.resolve()),
                "model_type": self.model.config.model_type,
                "projection_dim": int(self.model.config.projection_dim),
                "device": self.device, "batch_size": self.batch_size}


def _save_npz_atomic(path: Path, **arrays: np.ndarray) -> None:
    atomic_write(path, lambda fh: np.savez(fh, **arrays), binary=True)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


def caption_entities(captions: Sequence[str], backend: str,
                     spacy_model: str | None = None) -> dict[str, str | None]:
    """caption -> its entity text (None when it has none), with the entity list's backend."""
    return entity_lib.extract_entities(list(captions), backend=backend,
                                       spacy_model=spacy_model).captions


def retrieval_accuracy(ids: np.ndarray, texts: Sequence[str],
                       references: Sequence[Sequence[str]],
                       entity_of: Mapping[str, str | None]) -> dict[str, float | int | None]:
    """Top-1 / top-3 hit rates of retrieved ``ids`` (N, k) against the references' entities;
    pairs whose references name no entity are excluded (and counted)."""
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
    return {"top1": hits1 / n if n else None, "top3": hits3 / n if n else None,
            "n": n, "excluded": excluded}


def _make_backbone(dataset: Any, name: str, clip_path: str | None, difference: str,
                   extraction: entity_lib.EntityExtraction,
                   contrastive: ContrastiveSettings | None,
                   clip_options: Mapping[str, Any] | None) -> Backbone:
    if name == "clip":
        if not clip_path:
            raise ValueError("--backbone=clip needs --clip_path=LOCAL_DIR (a CLIP checkpoint "
                             "saved with save_pretrained; nothing is downloaded)")
        return ClipBackbone(dataset, clip_path, cache_dir=dataset.directory / CLIP_CACHE_DIR,
                            **dict(clip_options or {}))
    if name == "contrastive":
        return ContrastiveBackbone(dataset, extraction.texts, extraction.captions, difference,
                                   contrastive)
    raise ValueError(f"backbone must be auto, clip or contrastive, got {name!r}")


def _retrieve_split(model: Backbone, source: Any, split: str, entity_emb: np.ndarray,
                    orientations: Sequence[str], k: int,
                    difference: str) -> dict[str, np.ndarray]:
    arrays = {"record_ids": np.array([int(source[i]["id"]) for i in range(len(source))],
                                     np.int64)}
    for o in orientations:
        bef, aft = model.encode_pairs(split, *ORIENTATION_IMAGES[o])
        ids, scores, constrained = retrieve(bef @ entity_emb.T, aft @ entity_emb.T, k,
                                            difference)
        arrays.update({f"ids_{o}": ids, f"scores_{o}": scores, f"constrained_{o}": constrained})
    return arrays


def _split_accuracy(source: Any, ids: np.ndarray, texts: Sequence[str],
                    extraction: entity_lib.EntityExtraction) -> dict[str, Any]:
    refs = [[_text(c) for c in source[i]["change_captions"]] for i in range(len(source))]
    entity_of = caption_entities([r for rs in refs for r in rs], extraction.backend,
                                 extraction.spacy_model)
    return retrieval_accuracy(ids, texts, refs, entity_of)


def _checked_request(dataset: Any, out: Path, k: int, difference: str,
                     splits: Sequence[str] | None, overwrite: bool) -> tuple[Any, list[str]]:
    """(the dataset's entity extraction, the splits to retrieve for), once the request is
    checked: entities extracted, ``out`` free (or ``overwrite``), a known difference, k within
    the entities, known splits."""
    entities_path = dataset.directory / entity_lib.ENTITIES_FILE
    if not entities_path.exists():
        raise FileNotFoundError(
            f"{entities_path} does not exist: extract the change entities first with "
            f"python -m data_prep.entities --dataset={dataset.name} --data_dir=<the data "
            "directory the dataset was built in> (and the same --variant and build flags)")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    if difference not in DIFFERENCES:
        raise ValueError(f"difference must be one of {DIFFERENCES}, got {difference!r}")
    extraction = entity_lib.load_entities(entities_path)
    texts = extraction.texts
    if not 1 <= k <= len(texts):
        raise ValueError(f"k must be in [1, {len(texts)}] (the entities of {entities_path}), "
                         f"got {k}")
    all_splits = list(dataset.builder.info.splits)
    splits = list(splits or all_splits)
    if unknown := sorted(set(splits) - set(all_splits)):
        raise ValueError(f"unknown splits {unknown}; the dataset has {all_splits}")
    return extraction, splits


def run_retrieval(dataset: Any, *, backbone: str = "auto", clip_path: str | None = None,
                  k: int = DEFAULT_K, difference: str = "signed",
                  splits: Sequence[str] | None = None, overwrite: bool = False,
                  contrastive: ContrastiveSettings | None = None,
                  clip_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Writes ``<dataset directory>/entity_retrieval`` (see the module docstring) and returns
    its meta.json content. ``dataset`` is a ``datasets.PreparedDataset``."""
    out = dataset.directory / RETRIEVAL_DIR
    extraction, splits = _checked_request(dataset, out, k, difference, splits, overwrite)
    texts = extraction.texts
    if backbone == "auto":
        backbone = "clip" if clip_path else "contrastive"
    model = _make_backbone(dataset, backbone, clip_path, difference, extraction, contrastive,
                           clip_options)

    entity_emb = model.encode_texts(texts)
    orientations = [o for o in ORIENTATION_IMAGES
                    if o == "semantic" or dataset.meta.has_distractor]
    with replaced_folder(dataset.directory, RETRIEVAL_DIR) as tmp:
        accuracy, sizes = {}, {}
        for split in splits:
            source = dataset.split(split)
            arrays = _retrieve_split(model, source, split, entity_emb, orientations, k,
                                     difference)
            np.savez(tmp / f"{split}.npz", **arrays)
            sizes[split] = len(source)
            accuracy[split] = _split_accuracy(source, arrays["ids_semantic"], texts, extraction)
        np.save(tmp / "embeddings.npy", entity_emb.astype(np.float32))
        (tmp / "texts.json").write_text(json.dumps(texts))
        meta = {"format": FORMAT, "backbone": backbone, "backbone_details": model.describe(),
                "k": k, "difference": difference, "num_entities": len(texts),
                "embedding_dim": int(entity_emb.shape[1]), "orientations": orientations,
                "splits": sizes, "accuracy": accuracy, "chance_top1": 1 / len(texts),
                "chance_top3": min(1.0, 3 / len(texts)),
                "entities": {"file": entity_lib.ENTITIES_FILE, "backend": extraction.backend}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, allow_nan=False))
    # The embedding cache of an interrupted CLIP run is spent once the result is written.
    shutil.rmtree(dataset.directory / CLIP_CACHE_DIR, ignore_errors=True)
    return meta


def format_accuracy(meta: Mapping[str, Any]) -> str:
    """The accuracy of meta.json as a small table."""
    def pct(x: float | None) -> str:
        return f"{100 * x:6.1f}%" if x is not None else "     - "

    lines = [f"{'split':<8} {'top-1':>7} {'top-3':>7} {'pairs':>6} {'no entity':>9}"]
    for split, a in meta["accuracy"].items():
        lines.append(f"{split:<8} {pct(a['top1'])} {pct(a['top3'])} {a['n']:>6} "
                     f"{a['excluded']:>9}")
    lines.append(f"chance: top-1 {100 * meta['chance_top1']:.2f}%, top-3 "
                 f"{100 * meta['chance_top3']:.2f}% ({meta['num_entities']} entities)")
    return "\n".join(lines)
