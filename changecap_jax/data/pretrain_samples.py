"""IDC-PCL pretraining samples (reference §5.1): one sample per image pair.

The official ``train.json`` lists every pair on its own line, semantic and non-semantic alike,
and each task's DataLoader shuffles those lines. Here a record of a trunk dataset holds an
example's pairs together, so :class:`PairSamples` flattens a split into one sample per pair:
sample ``i`` is pair ``i % S`` (S = 1 or 2 streams: the semantic pair, then the distractor pair
where the dataset has one) of record ``i // S``. A task's batch is then drawn from the pairs
independently, as officially: the two pairs of one example rarely meet in one batch (which
matters to MVCL, whose negatives span the batch: two pairs share their img1).

A sample holds ``img1`` (before), ``img2`` (the pair's after image), ``ids`` (one of the pair's
captions, drawn anew at each visit as the fine-tuning pipeline does; the official files hold one
sample per sentence) and, for FDA, ``negatives`` (K, L): the pair's hard negatives of
``<split>_neg_tfidf6.json`` encoded like its captions (unknown words -> <UNK>, cut to L). The
negatives are joined by (image_id, semantic), the key :func:`negatives.negatives_by_pair` gives.

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from changecap_jax.data.negatives import NegativesFileError
from changecap_jax.data.streams import BEFORE, STREAMS
from changecap_jax.data.vocab import Vocabulary

NegativesByPair = Mapping[tuple[str, "bool | None"], Sequence[str]]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PairSamples:
    """A random-access source of one sample per pair of a split (module docstring).

    ``negatives`` (optional): (image_id, semantic) -> the pair's negative captions; ``origin``
    names their file in errors."""

    def __init__(self, source: Any, streams: Sequence[str], *,
                 negatives: NegativesByPair | None = None, vocab: Vocabulary | None = None,
                 origin: str = "the hard-negatives file"):
        unknown = sorted(set(streams) - set(STREAMS))
        if unknown or not streams:
            raise ValueError(f"streams {tuple(streams)} must be a non-empty subset of "
                             f"{tuple(STREAMS)}")
        if negatives is not None and vocab is None:
            raise ValueError("negatives need the vocabulary that encodes them")
        self._source, self.streams = source, tuple(streams)
        self._negatives, self._vocab, self._origin = negatives, vocab, origin

    def __len__(self) -> int:
        return len(self._source) * len(self.streams)

    def __repr__(self) -> str:
        # grain checks a restored iterator against repr(data source): it must be stable.
        joined = f", negatives from {self._origin}" if self._negatives is not None else ""
        return f"PairSamples({self._source!r}, streams={self.streams}{joined})"

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self._source[index // len(self.streams)]
        stream = STREAMS[self.streams[index % len(self.streams)]]
        sample = {"img1": record[BEFORE], "img2": record[stream.after],
                  "captions": np.asarray(record[stream.record_captions]),
                  "image_id": _text(record["image_id"])}
        if self._negatives is not None:
            sample["negatives"] = self._encode(sample["image_id"], stream.semantic,
                                               sample["captions"].shape[-1])
        return sample

    def _encode(self, image_id: str, semantic: bool, length: int) -> np.ndarray:
        key = (image_id, semantic)
        if key not in self._negatives:
            kind = "semantic" if semantic else "distractor"
            raise NegativesFileError(
                f"{self._origin} has no negatives for the {kind} pair of record {image_id!r} "
                "(was it made for another build of this dataset? run "
                "python -m data_prep.hard_negatives again)")
        return np.stack([self._vocab.encode(c, length, allow_unk=True, truncate=True)
                         for c in self._negatives[key]])


class PickCaption(grain.transforms.RandomMap):
    """Draws the sample's caption uniformly from its pair's captions (seeded by grain)."""

    def random_map(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        out = dict(sample)
        captions = out.pop("captions")
        out["ids"] = captions[rng.integers(len(captions))].astype(np.int32)
        return out


def sample_loader(samples: Any, *, global_batch_size: int, seed: int,
                  process_index: int = 0, process_count: int = 1,
                  pick_caption: bool = True) -> grain.DataLoader:
    """An endless loader of this process's share of each global batch of samples: a new
    seeded shuffle every pass, which is the official loader restarted on exhaustion.
    ``samples``: :class:`PairSamples` or a cross-task source's (``data/extra_source.py``);
    ``pick_caption``: draw each visit's caption (sources whose samples have ``captions``)."""
    if global_batch_size % process_count:
        raise ValueError(f"global batch of {global_batch_size} samples is not divisible by "
                         f"the {process_count} processes")
    if len(samples) < global_batch_size:
        raise ValueError(f"the split has {len(samples)} samples (pairs), fewer than the global "
                         f"batch of {global_batch_size}")
    sampler = grain.samplers.IndexSampler(
        num_records=len(samples),
        shard_options=grain.sharding.ShardOptions(
            shard_index=process_index, shard_count=process_count, drop_remainder=True),
        shuffle=True, num_epochs=None, seed=seed)
    return grain.DataLoader(
        data_source=samples, sampler=sampler, worker_count=0,
        operations=[*([PickCaption()] if pick_caption else []),
                    grain.transforms.Batch(global_batch_size // process_count,
                                           drop_remainder=True)])
