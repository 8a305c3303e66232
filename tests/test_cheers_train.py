"""CHEERS on the trunk: retrieved entities through the pipeline, 8 devices = 1, evaluation
output with the entities, clear errors, and no model name in the trunk's code."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import flax
import numpy as np
import pytest
from entity_helpers import write_retrieval
from train_helpers import SMALL, assert_eight_devices_equal_one, tiny_run

from changecap_jax import exported_model, models
from changecap_jax.commands import predict
from changecap_jax.data import datasets, pipeline
from changecap_jax.trainers import captioning

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import cheers  # noqa: E402

ENTITY_DIM = 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cheers_data")
    dataset = datasets.prepare("synthetic", root, "moderate", SMALL)
    write_retrieval(dataset, k=3, dim=ENTITY_DIM)
    return str(root)


def tiny_cheers(data_dir: str, preset: str = "synthetic", **overrides):
    config = cheers.get_config(preset)
    config.model.update(hidden_dim=16, num_heads=2, word_dim=8, ffn_dim=32,
                        entity_dim=ENTITY_DIM, hrd_layers=1, decoder_layers=1)
    return tiny_run(config, data_dir, **{"num_train_steps": 2, **overrides})


def test_eight_devices_equal_one(data_dir, tmp_path):
    # One pair per example halves the compile time; the distractor stream's entities are
    # checked by the pipeline and evaluation tests.
    config = tiny_cheers(data_dir)
    config.model.pairs = "semantic_only"
    assert config.model.dropout_rate == 0.0  # per-device masks could not equal one device's
    metrics = assert_eight_devices_equal_one(config, tmp_path)
    assert set(metrics) >= {"loss/consistency", "loss/infonce", "loss/caption_semantic"}
    assert metrics["loss/consistency"] > 0 and metrics["loss/infonce"] > 0


@pytest.mark.parametrize("swap_prob", [0.0, 1.0])
def test_distractor_entities_follow_the_swap(data_dir, swap_prob):
    dataset = datasets.attach_conditioning(
        datasets.prepare("synthetic", data_dir, "moderate", SMALL), {"entities": (2, ENTITY_DIM)})
    source = dataset.split("train")
    batch = next(iter(pipeline.train_loader(source, global_batch_size=8, seed=3,
                                            swap_prob=swap_prob,
                                            pair_fields=dataset.pair_fields)))
    orientation = "distractor_swapped" if swap_prob else "distractor"
    for row, record_id in enumerate(batch["id"]):
        record = next(source[i] for i in range(len(source))
                      if int(source[i]["id"]) == int(record_id))
        np.testing.assert_array_equal(batch["entity_ids_semantic"][row],
                                      record["entity_ids_semantic"])
        np.testing.assert_array_equal(batch["entity_ids_distractor"][row],
                                      record[f"entity_ids_{orientation}"])
        np.testing.assert_array_equal(batch["entities_distractor"][row],
                                      dataset.entities.embeddings[record[
                                          f"entity_ids_{orientation}"]])
    assert batch["entities_semantic"].shape == (8, 2, ENTITY_DIM)
    assert not any(k.endswith("_swapped") for k in batch)


def test_evaluation_lists_the_entities(data_dir, tmp_path):
    # Evaluation of the initial parameters: what is tested is which entities each pair got,
    # not the captions (training through the trunk is the 8-device test's step).
    config = tiny_cheers(data_dir)
    trainer = captioning.Trainer(config, tmp_path)
    state = trainer.init_state()
    metrics = trainer.evaluate(state, "test", 0)
    assert np.isfinite(metrics["CIDEr"])
    entries = json.loads((tmp_path / "captions" / "test_0.json").read_text())
    texts = json.loads((trainer.dataset.entities.directory / "texts.json").read_text())
    ids = np.load(trainer.dataset.entities.directory / "test.npz")
    source = trainer.dataset.split("test")
    assert len(entries) == 2 * len(source)
    by_id = {e["image_id"]: e for e in entries}
    for i in range(len(source)):
        image_id = source[i]["image_id"].decode()
        assert by_id[image_id]["entities"] == [texts[j] for j in ids["ids_semantic"][i]]
        assert by_id[image_id + "_n"]["entities"] == [texts[j] for j in ids["ids_distractor"][i]]
    # Export knows the entity input's shape; predict refuses (it has no retrieval step).
    shapes = exported_model.parameter_shapes(trainer.model, trainer.dataset.meta, trainer.max_len)
    assert shapes == {
        "/".join(k): v.shape for k, v in flax.traverse_util.flatten_dict(state.params).items()}
    exported = exported_model.ExportedModel(tmp_path, config, state.params, trainer.dataset.vocab,
                                    trainer.dataset.meta, {}, {}, 0)
    with pytest.raises(predict.PredictError, match="entities"):
        predict.Predictor(exported)


def test_baseline_ablation_needs_no_retrieval(tmp_path):
    root = tmp_path / "data"
    datasets.prepare("synthetic", root, "moderate", SMALL)  # no entity_retrieval/
    trainer = captioning.Trainer(tiny_cheers(str(root), "synthetic/baseline"), tmp_path / "w")
    assert trainer.dataset.entities is None
    # Without first-use preparation (the real datasets' case) the error names the commands.
    config = tiny_cheers(str(root))
    config.dataset.build_if_missing = False
    with pytest.raises(datasets.DatasetError, match="data_prep.retrieval"):
        captioning.Trainer(config, tmp_path / "w2")


def test_entity_width_mismatch_names_the_field(data_dir, tmp_path):
    config = tiny_cheers(data_dir)
    config.model.entity_dim = 5
    with pytest.raises(datasets.DatasetError, match="entity_dim=8"):
        captioning.Trainer(config, tmp_path)
    config = tiny_cheers(data_dir)
    config.model.num_entities = 4  # the retrieval kept 3
    with pytest.raises(datasets.DatasetError, match="--k=4"):
        captioning.Trainer(config, tmp_path)


def test_ablation_presets():
    for name, switches in cheers.ABLATIONS.items():
        config = cheers.get_config(f"synthetic/{name}")
        assert {k: config.model[k] for k in switches} == switches
        models.build(config.model, vocab_size=20, max_len=12)
    assert cheers.get_config("synthetic").model.use_gate  # full by default
    with pytest.raises(ValueError, match="baseline"):
        cheers.get_config("synthetic/nope")
    paper = cheers.get_config("spot_the_diff")
    assert (paper.batch_size, paper.optim.learning_rate, paper.model.pairs) == (
        96, 5e-4, "semantic_only")
    assert dict(paper.loss_weights) == {"consistency": 0.75, "infonce": 0.5}


# The places where a model is named: its model file, its pretraining losses, its converter,
# its official-code adapter, its torch reference, its diagnostic tools, the registries and the
# GPU check's list of the presets it times. Every other module is trunk.
PER_MODEL_FILES = {"changecap_jax/models/__init__.py", "changecap_jax/convert/registry.py",
                   "changecap_jax/commands/gpu_check/plan.py",
                   "changecap_jax/commands/reproduce/adapters.py",
                   "changecap_jax/commands/reproduce/idc_pcl.py",
                   "changecap_jax/commands/reproduce/idc_pretrain.py",
                   "changecap_jax/commands/reproduce/medic.py",
                   "changecap_jax/commands/reproduce/registry.py",
                   "changecap_jax/models/idc_pcl_pretraining.py",
                   *(f"changecap_jax/models/{name}.py" for name in
                     ("dirl", "scorer", "subtraction", "cheers", "idc_pcl")),
                   *(f"changecap_jax/convert/models/{name}.py" for name in
                     ("dirl", "scorer", "idc_pcl", "tuyunbin"))}
TRUNK_FILES = tuple(sorted(
    rel for rel in (p.relative_to(ROOT).as_posix() for p in (ROOT / "changecap_jax").rglob("*.py"))
    if rel not in PER_MODEL_FILES))


def _code_words(path: Path) -> set[str]:
    """Identifiers, attribute names and non-docstring string constants of a module."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            words.add(node.name)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings):
            words.add(node.value)
    return {w.lower() for w in words}


def test_no_model_name_in_the_trunk():
    names = {n.lower() for n in models.MODELS} | {c.__name__.lower()
                                                  for c in models.MODELS.values()}
    for rel in TRUNK_FILES:
        words = _code_words(ROOT / rel)
        hits = sorted(w for w in words for n in names if n in w.replace("-", "_").split("_")
                      or n == w)
        assert not hits, f"{rel} names models in its code: {hits}"
