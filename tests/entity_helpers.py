"""Retrieved-entity files for tests, written in ``data/entity_inputs.py``'s format.

The ids are random (a fixed seed), so models train on them without meaning: the trainer and
pipeline tests only need well-formed inputs. ``data_prep.retrieval`` makes real ones.
"""

from __future__ import annotations

import json

import numpy as np

from changecap_jax.data import entity_inputs


def write_retrieval(dataset, *, k: int = 3, dim: int = 8, num_entities: int = 11,
                    seed: int = 0) -> None:
    """Writes ``<dataset directory>/entity_retrieval`` for every split of ``dataset``."""
    rng = np.random.default_rng(seed)
    out = dataset.directory / entity_inputs.RETRIEVAL_DIR
    out.mkdir(exist_ok=True)
    orientations = (entity_inputs.ORIENTATIONS if dataset.meta.has_distractor
                    else ("semantic",))
    splits = {}
    for split in dataset.builder.info.splits:
        source = dataset.split(split) if dataset.entities is None else None
        n = len(source)
        arrays = {"record_ids": np.array([int(source[i]["id"]) for i in range(n)])}
        for o in orientations:
            arrays[f"ids_{o}"] = np.stack([rng.permutation(num_entities)[:k]
                                           for _ in range(n)]).astype(np.int32)
            arrays[f"scores_{o}"] = -np.sort(-rng.random((n, k)), axis=1).astype(np.float32)
            arrays[f"constrained_{o}"] = np.ones((n, k), bool)
        np.savez(out / f"{split}.npz", **arrays)
        splits[split] = n
    embeddings = rng.normal(size=(num_entities, dim)).astype(np.float32)
    np.save(out / "embeddings.npy", embeddings / np.linalg.norm(embeddings, axis=1,
                                                                keepdims=True))
    (out / "texts.json").write_text(json.dumps([f"entity {i}" for i in range(num_entities)]))
    (out / "meta.json").write_text(json.dumps({
        "format": entity_inputs.FORMAT, "backbone": "test", "k": k, "difference": "signed",
        "num_entities": num_entities, "embedding_dim": dim, "orientations": list(orientations),
        "splits": splits}))
