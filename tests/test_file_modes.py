"""Results are written with the user's umask (0644 / 0755 by default), not tempfile's private
0600 / 0700, and still atomically."""

import os
import stat

import numpy as np
import pytest

from changecap_jax.io.jsonio import atomic_write, staging_dir, write_json_atomic
from data_prep.methods import entity_retrieval as retrieval


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask, file_mode, dir_mode",
                         [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)])
def test_written_files_and_folders_follow_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    write_json_atomic(tmp_path / "metrics" / "val_100.json", {"CIDEr": 1.0})
    atomic_write(tmp_path / "params.bin", lambda fh: fh.write(b"x"), binary=True)
    retrieval._save_npz_atomic(tmp_path / "scores.npz", ids=np.arange(3))
    for name in ("metrics/val_100.json", "params.bin", "scores.npz"):
        assert _mode(tmp_path / name) == file_mode, name
    staged = staging_dir(tmp_path, "model")
    assert staged.name.startswith(".model.") and _mode(staged) == dir_mode
    # Nothing but the results: no temp file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["metrics", "params.bin", "scores.npz", staged.name])
