"""First-use preparation of the synthetic set's per-model files (data_prep/first_use.py): on a
fresh cache the step training asks for makes what the CHEERS model and IDC-PCL pretraining
read, building the dataset alone makes nothing (a missing file is named with its command), the
files are the ones the commands write, and an interrupted preparation leaves no file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from train_helpers import SMALL, tiny_run

from changecap_jax import experiment, parallel
from changecap_jax.data import datasets, entity_inputs, negatives
from changecap_jax.trainers import captioning, pretraining
from data_prep import first_use
from data_prep import retrieval as retrieval_command

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import cheers  # noqa: E402
from configs import idc_pcl as idc_config  # noqa: E402

FLAGS = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
         for k, v in SMALL.items()]
OPTIONS = [f"--option={flag[2:]}" for flag in FLAGS]  # data_prep.hard_negatives spells them so
SPLITS = ("train", "val", "test")


def _cheers_config(root: Path):
    config = tiny_run(cheers.get_config("synthetic"), str(root))
    config.model.update(hidden_dim=16, num_heads=2, word_dim=8, ffn_dim=32, hrd_layers=1,
                        decoder_layers=1)  # entity_dim stays the retrieval's 64
    return config


def _pretrain_config(root: Path):
    config = tiny_run(idc_config.get_config("pretrain"), str(root), batch_size=8)
    config.model.update(hidden_dim=16, num_heads=2, ffn_dim=32, cross_layers=1,
                        image_dim=SMALL["feature_shape"][-1])
    config.pretrain.update(fda_batch_size=8, val_batches=1)
    return config


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A fresh data dir prepared for the two trainers (the training command's step), and the
    two trainers constructed on it."""
    root = tmp_path_factory.mktemp("fresh")
    made = first_use.prepare(_cheers_config(root)) + first_use.prepare(_pretrain_config(root))
    cheers_trainer = captioning.Trainer(_cheers_config(root), tmp_path_factory.mktemp("cheers"),
                                        mesh=parallel.make_mesh(1))
    pretrainer = pretraining.PretrainTrainer(_pretrain_config(root),
                                             tmp_path_factory.mktemp("pretrain"),
                                             mesh=parallel.make_mesh(1))
    assert made == [str(cheers_trainer.dataset.directory / entity_inputs.RETRIEVAL_DIR),
                    *(str(negatives.negatives_path(cheers_trainer.dataset.directory, s))
                      for s in SPLITS)]
    assert first_use.prepare(_cheers_config(root)) == []  # made once
    return root, cheers_trainer, pretrainer


def test_building_the_run_prepares_nothing(tmp_path):
    """Only the training command's step prepares: building CHEERS' run on a fresh cache (what
    export, report and evaluation do) stops in one line naming the commands."""
    with pytest.raises(datasets.DatasetError,
                       match=r"python -m data_prep\.entities and then python -m "
                             r"data_prep\.retrieval .*makes them on first use"):
        experiment.build(_cheers_config(tmp_path), mesh=parallel.make_mesh(1))
    directory = next(tmp_path.glob("synthetic_change/*/*"))
    assert not (directory / "entities.json").exists()
    assert not (directory / entity_inputs.RETRIEVAL_DIR).exists()


def _files(directory: Path) -> dict[str, Path]:
    """The per-model files of a dataset directory, by name."""
    names = [entity_inputs.RETRIEVAL_DIR, "entities.json",
             *(negatives.negatives_path(directory, s).name for s in SPLITS)]
    return {name: directory / name for name in names}


def test_trainers_make_what_their_models_read(fresh):
    _, cheers_trainer, pretrainer = fresh
    directory = cheers_trainer.dataset.directory
    assert pretrainer.dataset.directory == directory
    assert all(path.exists() for path in _files(directory).values())
    entities = cheers_trainer.dataset.entities
    assert entities.k == 3 and entities.embeddings.shape[1] == 64
    record = cheers_trainer.dataset.split("train")[0]
    assert record["entities_semantic"].shape == (3, 64)
    assert set(pretrainer.negatives) == {"train", "val"}
    assert not list(directory.glob(".*")) and not list(directory.parent.glob("*.lock"))


def _command(module: str, root: Path, *flags: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--dataset=synthetic",
                           f"--data_dir={root}", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def test_first_use_files_equal_the_commands(fresh, tmp_path):
    root, cheers_trainer, _ = fresh
    directory = cheers_trainer.dataset.directory
    auto = tmp_path / "auto"
    auto.mkdir()
    for name, path in _files(directory).items():
        shutil.move(path, auto / name)
    _command("data_prep.entities", root, *FLAGS)
    argv = ["retrieval", "--dataset=synthetic", f"--data_dir={root}", *FLAGS]
    assert retrieval_command.main(argv, log=lambda line: None) == 0
    _command("data_prep.hard_negatives", root, *OPTIONS)
    made = _files(directory)
    for name in ("entities.json", *(negatives.negatives_path(directory, s).name
                                    for s in SPLITS)):
        assert made[name].read_bytes() == (auto / name).read_bytes(), name
    for name in ("meta.json", "texts.json"):
        assert (json.loads((made["entity_retrieval"] / name).read_text())
                == json.loads((auto / "entity_retrieval" / name).read_text())), name
    np.testing.assert_array_equal(np.load(made["entity_retrieval"] / "embeddings.npy"),
                                  np.load(auto / "entity_retrieval" / "embeddings.npy"))
    for split in SPLITS:
        got = _arrays(made["entity_retrieval"] / f"{split}.npz")
        want = _arrays(auto / "entity_retrieval" / f"{split}.npz")
        assert got.keys() == want.keys()
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{split} {key}")


def test_an_interrupted_preparation_leaves_no_file(fresh, monkeypatch):
    dataset = fresh[1].dataset
    paths = [negatives.negatives_path(dataset.directory, s) for s in SPLITS]
    kept = {path: path.read_bytes() for path in paths}
    for path in paths:
        path.unlink()
    dumps, calls = json.dumps, []

    def interrupted(*args, **kwargs):  # while the first file is being written
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return dumps(*args, **kwargs)

    monkeypatch.setattr(json, "dumps", interrupted)
    with pytest.raises(KeyboardInterrupt) as interruption:
        first_use.make_hard_negatives(dataset)
    monkeypatch.undo()
    assert any(entry.name == "write_negatives" for entry in interruption.traceback)
    assert not any(p.exists() for p in paths)
    assert not list(dataset.directory.glob(".*"))  # no temp file either
    assert first_use.make_hard_negatives(dataset) == [
        negatives.negatives_path(dataset.directory, s) for s in dataset.builder.info.splits]
    assert {path: path.read_bytes() for path in paths} == kept
