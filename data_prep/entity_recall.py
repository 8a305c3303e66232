"""Recall@k of the retrieved change entities on the synthetic set (docs/models.md, CHEERS).

    python -m data_prep.entity_recall [--data_dir=DIR] [--variant=moderate] \\
        [--splits=test,train] [--ks=1,3,5,10] [--json=OUT.json]

CHEERS (paper §3.1.2, Eq. 1) reads the top-k entities that ``data_prep.retrieval`` ranks for a
pair; the model's preset reads k = 3. This module asks how often those k entities name the
object that really changed. The synthetic records know it: a record's ``id`` regenerates its
:class:`~changecap_jax.data.synthetic.scenes.Example` (``builder.make_example``), which holds the
changed object (``changed_index_before``; the ``after`` scene's ``changed_index_after`` for an
"add") and the scene it is described in (the change captions describe it in the before scene,
an added object in the after scene).

An entity text ("small red metallic cube", "red thing") is parsed with the synthetic caption
words (``scenes.SIZE_WORDS``, ``COLORS``, ``MATERIAL_WORDS``, ``SHAPE_WORDS``,
``GENERIC_WORDS``) into the attributes it mentions; a text with any other word, or with no
noun, parses to nothing. An entity **refers to** an object of a scene when every attribute it
mentions matches that object and no other object of the scene: the "true entity" of a pair is
any entity that refers to its changed object (the paraphrased references name one object in
many ways, so many entities can be true at once). Per attribute, an entity **names the
colour** (size, material, shape) of the changed object when it mentions that attribute with
the object's value.

Measured per orientation (``semantic``: the changed pair; ``distractor``: the same before
image against the unchanged after view):

* ``refers@k``: the fraction of pairs whose top-k entities hold a true entity; for distractor
  pairs the changed object is that of the semantic view of the same example (nothing changed
  in the distractor view, so this is what the entity path suggests wrongly);
* ``<attribute>@k``: top-k entities name the changed object's attribute value;
* ``chance_refers@k``: the same recall for k entities drawn uniformly at random (exact:
  1 - C(M - m, k) / C(M, k) per pair, m the pair's true entities among M);
* the Eq. 1 score of the top-1 entity (mean per orientation) and the AUROC with which that
  score separates semantic from distractor pairs (0.5: it does not).

The ranking for k above the stored retrieval's k comes from re-running the retrieval with the
stored retrieval's settings (the contrastive backbone is retrained with its seed; the top
entries must equal the stored ids, which is checked and reported as ``stored_prefix_agrees``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from changecap_jax.data.synthetic import scenes

ATTRIBUTES = ("size", "color", "material", "shape")
_WORD_ATTRIBUTE: dict[str, tuple[str, str]] = {
    **{w: ("size", v) for v, ws in scenes.SIZE_WORDS.items() for w in ws},
    **{c: ("color", c) for c in scenes.COLORS},
    **{w: ("material", v) for v, ws in scenes.MATERIAL_WORDS.items() for w in ws},
    **{w: ("shape", v) for v, ws in scenes.SHAPE_WORDS.items() for w in ws},
}
_GENERIC = frozenset(scenes.GENERIC_WORDS)


def parse_entity(text: str) -> dict[str, str] | None:
    """The attributes an entity text mentions ({"color": "red", ...}), or None when it has a
    word outside the synthetic caption words, mentions an attribute twice or has no noun (a
    shape word or "thing" / "object")."""
    attrs: dict[str, str] = {}
    noun = False
    for word in text.lower().split():
        if word in _GENERIC:
            if noun:
                return None
            noun = True
            continue
        if word not in _WORD_ATTRIBUTE:
            return None
        attribute, value = _WORD_ATTRIBUTE[word]
        if attribute in attrs:
            return None
        attrs[attribute] = value
        noun = noun or attribute == "shape"
    return attrs if noun else None


def _attribute_table(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(M, 4) value strings ("" = not mentioned) and (M,) parsed flags of entity texts."""
    table = np.full((len(texts), len(ATTRIBUTES)), "", dtype=object)
    parsed = np.zeros(len(texts), bool)
    for e, text in enumerate(texts):
        attrs = parse_entity(text)
        if attrs is None:
            continue
        parsed[e] = True
        for a, name in enumerate(ATTRIBUTES):
            table[e, a] = attrs.get(name, "")
    return table, parsed


def _consistent(table: np.ndarray, parsed: np.ndarray, obj: scenes.SceneObject) -> np.ndarray:
    values = np.array(obj.attributes, dtype=object)
    return parsed & np.all((table == "") | (table == values), axis=1)


def true_entities(texts: Sequence[str], obj: scenes.SceneObject,
                  scene: Sequence[scenes.SceneObject],
                  table: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """(M,) bool: entity e refers to ``obj`` in ``scene`` (matches it and no other object).
    ``table``: :func:`_attribute_table` of ``texts``, when already computed."""
    table, parsed = table if table is not None else _attribute_table(texts)
    hit = _consistent(table, parsed, obj)
    for other in scene:
        if other is not obj and other.attributes != obj.attributes:
            hit &= ~_consistent(table, parsed, other)
    return hit


def changed_object(example: scenes.Example) -> tuple[scenes.SceneObject,
                                                      tuple[scenes.SceneObject, ...]]:
    """The changed object of an example and the scene its captions describe it in."""
    if example.change_type == "add":
        return example.after[example.changed_index_after], example.after
    return example.before[example.changed_index_before], example.before


def recall_at_k(ranked: np.ndarray, relevant: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """Fraction of rows whose first k ranked ids hold a relevant one, per k.

    Args: ranked (N, K) entity ids best first; relevant (N, M) bool; every k <= K.
    """
    ranked, relevant = np.asarray(ranked), np.asarray(relevant, bool)
    if ranked.ndim != 2 or relevant.ndim != 2 or len(ranked) != len(relevant):
        raise ValueError(f"ranked (N, K) and relevant (N, M) must share N; got {ranked.shape}, "
                         f"{relevant.shape}")
    hits = np.take_along_axis(relevant, ranked.astype(np.int64), axis=1)  # (N, K)
    out = {}
    for k in ks:
        if not 1 <= k <= ranked.shape[1]:
            raise ValueError(f"k={k} is outside 1..{ranked.shape[1]} (the ranked entities)")
        out[int(k)] = float(hits[:, :k].any(axis=1).mean()) if len(ranked) else math.nan
    return out


def chance_recall_at_k(relevant: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """The expected :func:`recall_at_k` of k entities drawn uniformly without replacement."""
    relevant = np.asarray(relevant, bool)
    m_total = relevant.shape[1]
    counts = relevant.sum(axis=1)
    out = {}
    for k in ks:
        miss = [math.comb(m_total - int(m), k) / math.comb(m_total, k) for m in counts]
        out[int(k)] = float(1 - np.mean(miss)) if len(miss) else math.nan
    return out


def auroc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a positive score > a negative one), ties counted half (Mann-Whitney U / (n_p n_n))."""
    pos, neg = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if not len(pos) or not len(neg):
        return math.nan
    both = np.concatenate([pos, neg])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    sorted_vals = both[order]
    # average ranks over ties
    start = 0
    while start < len(both):
        stop = start
        while stop + 1 < len(both) and sorted_vals[stop + 1] == sorted_vals[start]:
            stop += 1
        ranks[order[start:stop + 1]] = (start + stop) / 2 + 1
        start = stop + 1
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def split_recall(texts: Sequence[str], examples: Sequence[scenes.Example],
                 ranked: Mapping[str, np.ndarray], scores: Mapping[str, np.ndarray],
                 ks: Sequence[int]) -> dict[str, Any]:
    """The measures of the module docstring for one split.

    Args: the M entity texts in id order; the split's examples, row i = ranked row i;
    orientation -> (N, K) ids best first and (N, K) Eq. 1 scores; the ks.
    """
    table = _attribute_table(texts)
    values, parsed = table
    relevant = np.zeros((len(examples), len(texts)), bool)
    names = {a: np.zeros((len(examples), len(texts)), bool) for a in ATTRIBUTES}
    change_types = []
    for i, ex in enumerate(examples):
        obj, scene = changed_object(ex)
        relevant[i] = true_entities(texts, obj, scene, table)
        for a, name in enumerate(ATTRIBUTES):
            names[name][i] = parsed & (values[:, a] == obj.attributes[a])
        change_types.append(ex.change_type)
    change_types = np.array(change_types)
    out: dict[str, Any] = {"pairs": len(examples), "entities": len(texts),
                           "parsed_entities": int(parsed.sum()),
                           "true_entities_per_pair": float(relevant.sum(1).mean())}
    for o, ids in ranked.items():
        row: dict[str, Any] = {"refers": recall_at_k(ids, relevant, ks)}
        for name in ATTRIBUTES:
            row[name] = recall_at_k(ids, names[name], ks)
        row["by_change_type"] = {t: recall_at_k(ids[change_types == t],
                                                relevant[change_types == t], ks)
                                 for t in scenes.CHANGE_TYPES if (change_types == t).any()}
        row["top1_score_mean"] = float(np.mean(scores[o][:, 0]))
        out[o] = row
    out["chance_refers"] = chance_recall_at_k(relevant, ks)
    if "semantic" in scores and "distractor" in scores:
        out["top1_score_auroc_semantic_vs_distractor"] = auroc(scores["semantic"][:, 0],
                                                               scores["distractor"][:, 0])
    return out


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def measure(dataset: Any, splits: Sequence[str], ks: Sequence[int]) -> dict[str, Any]:
    """Re-ranks ``splits`` of a prepared synthetic dataset (with its stored retrieval's
    settings, to max(ks) entities) and measures them (:func:`split_recall`)."""
    from changecap_jax.data import entity_inputs
    from changecap_jax.data.synthetic import builder as synthetic_builder
    from data_prep.methods import change_entities as entity_lib
    from data_prep.methods import entity_retrieval as er

    meta = json.loads((dataset.directory / er.RETRIEVAL_DIR / "meta.json").read_text())
    stored = entity_inputs.load(dataset.directory)
    extraction = entity_lib.load_entities(dataset.directory / entity_lib.ENTITIES_FILE)
    texts = extraction.texts
    if meta["backbone"] != "contrastive":
        raise ValueError("re-ranking is implemented for the contrastive backbone only")
    details = meta["backbone_details"]
    settings = er.ContrastiveSettings(**{f: details[f] for f in
                                         er.ContrastiveSettings.__dataclass_fields__
                                         if f in details})
    model = er.ContrastiveBackbone(dataset, texts, extraction.captions, meta["difference"],
                                   settings)
    entity_emb = model.encode_texts(texts)
    orientations = [o for o in ("semantic", "distractor") if o in meta["orientations"]]
    config = dataset.builder.builder_config
    results: dict[str, Any] = {"k_stored": meta["k"], "difference": meta["difference"]}
    for split in splits:
        source = dataset.split(split)
        arrays = er._retrieve_split(model, source, split, entity_emb, orientations, max(ks),
                                    meta["difference"])
        kept = stored.split(split, len(source))
        agree = all(np.array_equal(arrays[f"ids_{o}"][:, : meta["k"]], kept.ids[o])
                    for o in orientations)
        examples = [synthetic_builder.make_example(config, int(i))
                    for i in arrays["record_ids"]]
        res = split_recall(texts, examples, {o: arrays[f"ids_{o}"] for o in orientations},
                           {o: arrays[f"scores_{o}"] for o in orientations}, ks)
        res["stored_prefix_agrees"] = bool(agree)
        # What the model reads: the stored top-k, measured as they are.
        stored_ks = [k for k in ks if k <= meta["k"]]
        res["stored"] = split_recall(texts, examples, kept.ids, kept.scores, stored_ks)
        results[split] = res
    return results


def format_results(results: Mapping[str, Any], ks: Sequence[int]) -> str:
    """A small text table of :func:`measure`'s result."""
    head = " ".join(f"@{k:<5}" for k in ks)
    lines = [f"{'split':<6} {'pairs':<11} {'measure':<10} {head}"]
    for split, res in results.items():
        if not isinstance(res, dict):
            continue
        pct = lambda d: " ".join(f"{100 * d[k]:5.1f}%" for k in ks)
        for o in ("semantic", "distractor"):
            if o not in res:
                continue
            lines.append(f"{split:<6} {o:<11} {'refers':<10} {pct(res[o]['refers'])}")
            for a in ATTRIBUTES:
                lines.append(f"{'':<6} {'':<11} {a:<10} {pct(res[o][a])}")
            if o == "semantic":
                for t, r in res[o]["by_change_type"].items():
                    lines.append(f"{'':<6} {'':<11} {'refers/' + t:<10} {pct(r)}")
        lines.append(f"{'':<6} {'chance':<11} {'refers':<10} {pct(res['chance_refers'])}")
        if "stored" in res:
            st = res["stored"]
            got = "; ".join(f"{o} refers " + ", ".join(f"@{k} {100 * v:.1f}%"
                                                       for k, v in st[o]["refers"].items())
                            for o in ("semantic", "distractor") if o in st)
            lines.append(f"{split}: the stored top-{results['k_stored']} (what the model "
                         f"reads): {got}")
        lines.append(f"{split}: {res['pairs']} pairs, {res['entities']} entities "
                     f"({res['parsed_entities']} parsed), {res['true_entities_per_pair']:.1f} "
                     f"true entities per pair; top-1 Eq. 1 score semantic "
                     f"{res['semantic']['top1_score_mean']:.3f}"
                     + (f", distractor {res['distractor']['top1_score_mean']:.3f}, AUROC "
                        f"{res['top1_score_auroc_semantic_vs_distractor']:.3f}"
                        if "distractor" in res else "")
                     + f"; stored top-{results['k_stored']} reproduced: "
                       f"{res['stored_prefix_agrees']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from changecap_jax.data import datasets

    parser = argparse.ArgumentParser(prog="python -m data_prep.entity_recall",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--variant", default="")
    parser.add_argument("--splits", default="test,train")
    parser.add_argument("--ks", default="1,3,5,10")
    parser.add_argument("--json", default=None, help="Also write the result here.")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    try:
        dataset = datasets.prepare("synthetic", args.data_dir, args.variant,
                                   build_if_missing=False)
        results = measure(dataset, args.splits.split(","), ks)
    except (datasets.DatasetError, OSError, ValueError) as e:
        # One line, as the other preparation commands report a user error.
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_results(results, ks))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
