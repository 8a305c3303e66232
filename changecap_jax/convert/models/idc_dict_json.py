"""IDC-PCL's token order: the authors' ``dict.json`` (yaolinli/IDC) -> our token rows.

The official checkpoints number their token rows by ``dict.json`` (word -> id, the six specials
``<PAD> <BOS> <EOS> <UNK> <MASK> <CLS>`` among them, <BOS> = 1 and <MASK> = 5 hard-coded by the
official decoder: docs/official/ §5.1, I-Q8). Our model's rows follow the dataset vocabulary with
[MASK] and [CLS] appended, so the converter reorders the ``word_embedding`` and ``output_layer``
rows by :func:`dict_json_token_rows` (``--dict_json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_collections

from changecap_jax.convert.errors import ConversionError
from changecap_jax.convert.tables import TokenRows
from changecap_jax.convert.torch_checkpoint import IDC_STATE

IDC_SPECIALS = ("<PAD>", "<BOS>", "<EOS>", "<UNK>", "<MASK>", "<CLS>")  # dict.json, by name
IDC_FIXED_IDS = {"<BOS>": 1, "<MASK>": 5}  # hard-coded by the official decoder (I-Q8)
# Our specials (changecap_jax/data/vocab.py) and appended rows <- the dict.json tokens.
TRUNK_FROM_DICT = {"<NULL>": "<PAD>", "<UNK>": "<UNK>", "<START>": "<BOS>", "<END>": "<EOS>"}
LISTED_WORDS = 20


def read_dict_json(path: str | os.PathLike[str]) -> dict[str, int]:
    """The authors' ``dict.json`` (word -> id), checked: ids 0..V-1 each once, the six specials
    present, <BOS> = 1 and <MASK> = 5 (§5.1). Errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dict.json file {path} (--dict_json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path} (--dict_json) is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{path} (--dict_json) must be a JSON object word -> id, got a "
                              f"JSON {type(data).__name__}")
    for word, i in data.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise ConversionError(f"{path}: the id of {word!r} is {i!r}, not an integer")
    missing = [t for t in IDC_SPECIALS if t not in data]
    if missing:
        raise ConversionError(f"{path} lacks the special token(s) {missing}; the official "
                              f"dict.json has all of {list(IDC_SPECIALS)}")
    for token, want in IDC_FIXED_IDS.items():
        if data[token] != want:
            raise ConversionError(
                f"{path}: {token!r} has id {data[token]}, but the official decoder hard-codes "
                f"{token} = {want} (modules_finetune.py, reference I-Q8)")
    by_id: dict[int, list[str]] = {}
    for word, i in data.items():
        by_id.setdefault(i, []).append(word)
    shared = [(i, w) for i, w in sorted(by_id.items()) if len(w) > 1]
    outside = [(w[0], i) for i, w in sorted(by_id.items()) if not 0 <= i < len(data)]
    if shared or outside:
        detail = (f"id {shared[0][0]} is shared by {shared[0][1]}" if shared
                  else f"{outside[0][0]!r} has id {outside[0][1]}")
        raise ConversionError(f"{path}: the ids must be 0..{len(data) - 1}, each once; {detail}")
    return data


def dict_json_token_rows(model: ml_collections.ConfigDict, vocab: Any,
                         dict_json: str | os.PathLike[str], checkpoint_rows: int) -> TokenRows:
    """IDC-PCL's token permutation. The official rows follow dict.json; ours follow the
    dataset vocabulary (<NULL>, <UNK>, <START>, <END>, words) with [MASK] and [CLS] appended.
    Our row <- dict.json id: <NULL> <- <PAD>, <UNK> <- <UNK>, <START> <- <BOS>, <END> <- <EOS>,
    each word by its string, [MASK] <- <MASK>, [CLS] <- <CLS>. A dataset word absent from
    dict.json is an error; dict.json words absent from the dataset are dropped."""
    layout = tuple(model.get(k, d) for k, d in
                   (("bos_id", 2), ("eos_id", 3), ("mask_id", None), ("cls_id", None)))
    if layout != (2, 3, None, None):
        raise ConversionError(
            "the converter writes the trunk's token layout: config.model.bos_id = 2 (<START>), "
            "eos_id = 3 (<END>), mask_id = cls_id = None ([MASK], [CLS] appended); got "
            f"(bos_id, eos_id, mask_id, cls_id) = {layout}")
    official = read_dict_json(dict_json)
    if len(official) != checkpoint_rows:
        raise ConversionError(
            f"{dict_json} has {len(official)} ids but the checkpoint's "
            f"{IDC_STATE}:word_embedding.weight has {checkpoint_rows} rows: it is not the "
            "dict.json of this checkpoint")
    names = [TRUNK_FROM_DICT.get(vocab.id_to_word[i], vocab.id_to_word[i])
             for i in range(len(vocab))] + ["<MASK>", "<CLS>"]
    absent = [w for w in names if w not in official]
    if absent:
        shown = ", ".join(repr(w) for w in absent[:LISTED_WORDS])
        more = f" and {len(absent) - LISTED_WORDS} more" if len(absent) > LISTED_WORDS else ""
        raise ConversionError(
            f"{len(absent)} words of the dataset vocabulary are not in {dict_json}, so the "
            f"checkpoint has no rows for them: {shown}{more}")
    rows = tuple(official[w] for w in names)
    used = set(rows)
    dropped = tuple(w for w, i in sorted(official.items(), key=lambda kv: kv[1])
                    if i not in used)
    return TokenRows(rows, len(official), str(dict_json), dropped)
