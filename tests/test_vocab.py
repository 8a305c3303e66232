"""Caption tokenisation and vocabulary by the official rules (reference §2.4).

Section numbers (§) and quirk ids (S-Q, D-Q, I-Q) refer to docs/official/ (see its README.md).
"""

import json

import numpy as np
import pytest
from conftest import shared_file

from changecap_jax.data.vocab import (
    END_ID,
    PAD_ID,
    START_ID,
    UNK_ID,
    CaptionError,
    Vocabulary,
    max_caption_length,
    tokenize,
)

# Captions in the official CLEVR-Change style; together they use every word of the official
# 76-entry vocabulary (datasets.md §1.2 quotes the first five from real pairs).
OFFICIAL_STYLE = [
    "the tiny yellow cylinder turned brown",
    "the small yellow rubber cylinder left of the brown cube turned brown",
    "the red metallic cube changed its location",
    "the large brown rubber cube that is in front of the large blue matte cylinder is missing",
    "the tiny gray thing has been newly placed",
    "no change was made",
    "there is no change",
    "the two scenes seem identical",
    "the scene is the same as before",
    "the scene remains the same",
    "nothing has changed",
    "nothing was modified",
    "no change has occurred",
    "there is no difference",
    "the big green metal sphere has been added",
    "a cyan shiny ball appeared on the right side of the purple block",
    "the object behind the cyan cylinder has disappeared",
    "the small sphere is gone",
    "the large cube is no longer there",
    "the blue thing became metal",
    "the small cylinder moved to a different location",
]


def test_tokenize_rules():
    assert tokenize("the cube, the ball; gone.") == [
        "<START>", "the", "cube", ",", "the", "ball", ";", "gone", "<END>"]
    assert tokenize("is it gone?") == ["<START>", "is", "it", "gone", "<END>"]
    # No lowercasing; '.' inside a word is deleted too, as the official str.replace does.
    assert tokenize("The Cube.Moved") == ["<START>", "The", "CubeMoved", "<END>"]
    # Double and leading spaces give empty tokens, exactly like the official split(' ').
    assert tokenize(" a  b") == ["<START>", "", "a", "", "b", "<END>"]


@pytest.mark.parametrize("caption", ["", ".", "?.", "..."])
def test_empty_caption_is_an_error(caption):
    with pytest.raises(CaptionError, match="empty caption"):
        tokenize(caption)


def test_special_ids_and_code_point_order():
    vocab = Vocabulary.build(["b a", "B,", "Zed a"])
    assert vocab.word_to_id["<NULL>"] == PAD_ID == 0
    assert vocab.word_to_id["<UNK>"] == UNK_ID == 1
    assert vocab.word_to_id["<START>"] == START_ID == 2
    assert vocab.word_to_id["<END>"] == END_ID == 3
    # Code-point order: ',' < 'B' < 'Zed' < 'a' < 'b'.
    assert [vocab.id_to_word[i] for i in range(4, len(vocab))] == [",", "B", "Zed", "a", "b"]


def test_official_ordering_from_official_style_captions():
    official = json.loads(shared_file("clevr_change", "transformer_vocab.json").read_text())
    assert Vocabulary.build(OFFICIAL_STYLE).word_to_id == official


def test_encode_pads_and_marks_end():
    vocab = Vocabulary.build(["the cube moved"])
    ids = vocab.encode("the cube moved", max_len=7)
    w = vocab.word_to_id
    assert ids.tolist() == [START_ID, w["the"], w["cube"], w["moved"], END_ID, 0, 0]
    assert ids.dtype == np.int32
    assert vocab.decode(ids) == "the cube moved"


def test_unknown_words_train_error_eval_unk():
    vocab = Vocabulary.build(["the cube moved"])
    with pytest.raises(CaptionError, match="'sphere'"):
        vocab.encode("the sphere moved", 6)
    counter: dict[str, int] = {}
    ids = vocab.encode("the sphere moved", 6, allow_unk=True, unknown_counter=counter)
    assert ids[2] == UNK_ID and counter == {"sphere": 1}


def test_too_long_caption_is_an_error():
    vocab = Vocabulary.build(["a b c d"])
    assert max_caption_length(["a b c d"]) == 6
    with pytest.raises(CaptionError, match="more than max_len=5"):
        vocab.encode("a b c d", 5)


def test_save_load_roundtrip_official_format(tmp_path):
    vocab = Vocabulary.build(OFFICIAL_STYLE)
    path = tmp_path / "vocab.json"
    vocab.save(path)
    assert json.loads(path.read_text()) == vocab.word_to_id
    assert Vocabulary.load(path) == vocab
    assert not list(tmp_path.glob("*.tmp"))


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Vocabulary.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"<NULL>": 0, "<UNK>": 2}')
    with pytest.raises(ValueError, match="bad.json.*'<UNK>' to 1"):
        Vocabulary.load(bad)
