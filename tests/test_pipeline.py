"""grain pipelines: seeded shuffling, process shares, eval padding, iterator state, errors."""

import itertools
import shutil

import numpy as np
import pytest

from changecap_jax.data import datasets, pipeline


def _ids(loader, num_batches):
    it = iter(loader)
    return [next(it)["id"].tolist() for _ in range(num_batches)]


def test_shuffle_deterministic_per_seed(small_synthetic):
    source = small_synthetic.split("train")
    a = _ids(pipeline.train_loader(source, global_batch_size=8, seed=3), 5)
    b = _ids(pipeline.train_loader(source, global_batch_size=8, seed=3), 5)
    c = _ids(pipeline.train_loader(source, global_batch_size=8, seed=4), 5)
    assert a == b and a != c


def test_each_epoch_is_a_new_permutation(small_synthetic):
    source = small_synthetic.split("train")
    n = len(source)  # 40 = 5 batches of 8
    ids = sum(_ids(pipeline.train_loader(source, global_batch_size=8, seed=0), 10), [])
    first, second = ids[:n], ids[n:]
    all_ids = sorted(int(source[i]["id"]) for i in range(n))
    assert sorted(first) == sorted(second) == all_ids
    assert first != second


def test_two_processes_get_disjoint_covering_shares(small_synthetic):
    source = small_synthetic.split("train")
    shares = []
    for p in range(2):
        loader = pipeline.train_loader(
            source, global_batch_size=8, seed=0, process_index=p, process_count=2)
        shares.append(set(sum(_ids(loader, 5), [])))  # 5 local batches of 4 = one epoch
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == {int(source[i]["id"]) for i in range(len(source))}


def test_train_batch_fields_and_swap(small_synthetic):
    source = small_synthetic.split("train")
    by_id = {int(source[i]["id"]): source[i] for i in range(len(source))}
    for swap_prob in (0.0, 1.0):
        loader = pipeline.train_loader(source, global_batch_size=4, seed=1, swap_prob=swap_prob)
        batch = next(iter(loader))
        assert batch["before"].shape == (4, 4, 4, 16) and batch["before"].dtype == np.float16
        for k, i in enumerate(batch["id"].tolist()):
            rec = by_id[i]
            before, distractor = rec["before"], rec["after_distractor"]
            if swap_prob:
                before, distractor = distractor, before
            np.testing.assert_array_equal(batch["before"][k], before)
            np.testing.assert_array_equal(batch["after_distractor"][k], distractor)
            np.testing.assert_array_equal(batch["after_semantic"][k], rec["after_semantic"])
            assert any((batch["change_caption"][k] == c).all() for c in rec["change_caption_ids"])
            assert any((batch["no_change_caption"][k] == c).all()
                       for c in rec["no_change_caption_ids"])


def test_swap_happens_about_half_the_time(small_synthetic):
    source = small_synthetic.split("train")
    by_id = {int(source[i]["id"]): source[i] for i in range(len(source))}
    loader = pipeline.train_loader(source, global_batch_size=8, seed=2)
    swapped = [
        not np.array_equal(b["before"][k], by_id[i]["before"])
        for b in itertools.islice(iter(loader), 25) for k, i in enumerate(b["id"].tolist())
    ]
    assert 0.35 < np.mean(swapped) < 0.65


def test_restored_iterator_resumes_with_the_next_batch(small_synthetic):
    source = small_synthetic.split("train")
    loader = pipeline.train_loader(source, global_batch_size=8, seed=5)
    it = iter(loader)
    for _ in range(7):  # crosses an epoch boundary
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = iter(pipeline.train_loader(source, global_batch_size=8, seed=5))
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def _assert_same_batches(got, want):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), k
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"batch {k} {key}")


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_workers_give_the_same_batches_and_portable_states(small_synthetic):
    """Worker processes read the batches of in-process reading (7 batches cross an epoch);
    a state saved with one worker count resumes with another, both ways."""
    source = small_synthetic.split("train")
    make = lambda workers: pipeline.train_loader(  # noqa: E731
        source, global_batch_size=8, seed=5, read=pipeline.ReadAhead(workers=workers))
    reference = _take(iter(make(0)), 10)
    with_two = iter(make(2))
    _assert_same_batches(_take(with_two, 7), reference[:7])
    in_process = iter(make(0))
    in_process.set_state(with_two.get_state())
    with_two.close()
    _assert_same_batches(_take(in_process, 2), reference[7:9])
    with_one = iter(make(1))
    with_one.set_state(in_process.get_state())
    _assert_same_batches(_take(with_one, 1), reference[9:])
    with_one.close()


def _dataloader(source, seed):
    """The loader this pipeline replaced: grain.DataLoader with the same sampler, no workers."""
    import grain

    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shuffle=True, num_epochs=None, seed=seed,
        shard_options=grain.sharding.ShardOptions(shard_index=0, shard_count=1,
                                                  drop_remainder=True))
    return grain.DataLoader(data_source=source, sampler=sampler, worker_count=0, operations=[
        pipeline.TrainPairs(0.5), grain.transforms.Batch(8, drop_remainder=True)])


def test_order_and_checkpoints_of_the_former_dataloader_carry_over(small_synthetic):
    source = small_synthetic.split("train")
    old = iter(_dataloader(source, seed=5))
    expected = _take(old, 10)
    _assert_same_batches(_take(iter(pipeline.train_loader(source, global_batch_size=8, seed=5)),
                               10), expected)
    old = iter(_dataloader(source, seed=5))
    _take(old, 7)
    resumed = iter(pipeline.train_loader(source, global_batch_size=8, seed=5))
    resumed.set_state(old.get_state())
    _assert_same_batches(_take(resumed, 3), expected[7:])
    other_seed = iter(pipeline.train_loader(source, global_batch_size=8, seed=6))
    with pytest.raises(ValueError, match="seed=5.*seed=6"):
        other_seed.set_state(old.get_state())


def test_state_of_another_data_order_is_refused(small_synthetic):
    source = small_synthetic.split("train")
    saved = iter(pipeline.train_loader(source, global_batch_size=8, seed=5))
    next(saved)
    for kwargs, message in [(dict(global_batch_size=8, seed=6), "seed was 5, is 6"),
                            (dict(global_batch_size=4, seed=5), "global_batch was 8, is 4")]:
        other = iter(pipeline.train_loader(source, **kwargs))
        with pytest.raises(ValueError, match=message):
            other.set_state(saved.get_state())


def test_processes_read_slices_of_the_same_global_batches(small_synthetic):
    """Process p of n reads the p-th slice of each global batch: the record ids of the n
    processes' batches k, in process order, are one process's batch k (any n)."""
    source = small_synthetic.split("train")
    whole = _ids(pipeline.train_loader(source, global_batch_size=8, seed=2), 7)
    for count in (2, 4):
        shares = [_ids(pipeline.train_loader(source, global_batch_size=8, seed=2,
                                             process_index=p, process_count=count), 7)
                  for p in range(count)]
        assert [sum((s[k] for s in shares), []) for k in range(7)] == whole


def test_a_state_resumes_on_another_number_of_processes(small_synthetic):
    source = small_synthetic.split("train")
    four = iter(pipeline.train_loader(source, global_batch_size=8, seed=2, process_index=3,
                                      process_count=4))
    _take(four, 6)
    one = iter(pipeline.train_loader(source, global_batch_size=8, seed=2))
    one.set_state(four.get_state())
    expected = _ids(pipeline.train_loader(source, global_batch_size=8, seed=2), 8)[6:]
    assert [next(one)["id"].tolist() for _ in range(2)] == expected


def test_a_state_of_the_per_process_order_of_before(small_synthetic):
    """Format 1 (one order per process) resumes where it had one process (the orders agree);
    with several processes it is refused in one sentence."""
    source = small_synthetic.split("train")
    loader = pipeline.train_loader(source, global_batch_size=8, seed=2)
    v1 = {"format": pipeline.FORMAT_V1, "next_batch": 3, "records": len(source),
          "local_batch": 8, "seed": 2, "process_index": 0, "process_count": 1}
    assert loader.next_batch_of(v1) == 3
    with pytest.raises(ValueError, match="one data order per process"):
        loader.next_batch_of({**v1, "local_batch": 4, "process_count": 2})


def test_config_data_block_is_checked():
    assert pipeline.read_ahead(None, training=True) == pipeline.ReadAhead()
    data = {"workers": 3, "eval_workers": 1, "threads": 2, "prefetch": 4}
    assert pipeline.read_ahead(data, training=True) == pipeline.ReadAhead(3, 2, 4)
    assert pipeline.read_ahead(data, training=False) == pipeline.ReadAhead(1, 2, 4)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['worker'\]"):
        pipeline.read_ahead({"worker": 2}, training=True)
    with pytest.raises(ValueError, match="config.data.prefetch must be an integer >= 0, got -1"):
        pipeline.read_ahead({"prefetch": -1}, training=True)


def test_eval_with_workers_equals_in_process(small_synthetic):
    source = small_synthetic.split("val")  # 12 examples: the last batch of 5 is padded
    batches = {workers: list(pipeline.eval_batches(
        source, global_batch_size=5, read=pipeline.ReadAhead(workers=workers)))
        for workers in (0, 2)}
    assert len(batches[0]) == 3 and batches[0][-1]["mask"].tolist() == [1, 1, 0, 0, 0]
    for a, b in zip(batches[2], batches[0], strict=True):
        assert a.keys() == b.keys()
        for key in b:
            if b[key].dtype == object:  # references: lists of byte strings per example
                assert [list(x) for x in a[key]] == [list(x) for x in b[key]], key
            else:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_grids_reach_the_devices_unchanged(dtype):
    import jax
    import ml_dtypes
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    kind = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    devices = np.array(jax.devices())
    local = {"before": np.arange(len(devices) * 6, dtype=np.float32).reshape(-1, 2, 3)
             .astype(kind) / 7}
    arrays = pipeline.to_global(local, NamedSharding(Mesh(devices, ("data",)),
                                                     PartitionSpec("data")))
    assert arrays["before"].dtype == kind  # the cast to float32 happens in the model
    np.testing.assert_array_equal(np.asarray(arrays["before"]), local["before"])


@pytest.mark.parametrize("process_count,global_batch", [(1, 5), (1, 12), (2, 4), (2, 10)])
def test_eval_visits_every_example_once(small_synthetic, process_count, global_batch):
    source = small_synthetic.split("val")  # 12 examples
    seen, counts = [], set()
    for p in range(process_count):
        batches = list(pipeline.eval_batches(
            source, global_batch_size=global_batch, process_index=p,
            process_count=process_count))
        counts.add(len(batches))
        for b in batches:
            assert b["mask"].dtype == np.bool_
            assert len(b["id"]) == global_batch // process_count
            seen.extend(b["id"][b["mask"]].tolist())
    assert len(counts) == 1  # every process runs the same number of batches
    expected = sorted(int(source[i]["id"]) for i in range(len(source)))
    assert sorted(seen) == expected
    total = counts.pop() * global_batch
    assert total - len(source) < global_batch  # padding only in the last batch


def test_eval_batch_keeps_references_on_host(small_synthetic):
    batch = next(pipeline.eval_batches(small_synthetic.split("test"), global_batch_size=4))
    assert batch["change_captions"].dtype == object
    assert isinstance(batch["change_captions"][0][0], bytes)
    assert set(pipeline.device_fields(batch)) >= {"before", "after_semantic", "mask", "id"}
    assert not set(pipeline.device_fields(batch)) & set(pipeline.HOST_FIELDS)


def test_to_global_shards_the_batch_over_devices(small_synthetic):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))
    loader = pipeline.train_loader(
        small_synthetic.split("train"), global_batch_size=len(devices), seed=0)
    local = next(iter(loader))
    arrays = pipeline.to_global(local, NamedSharding(mesh, PartitionSpec("data")))
    assert arrays["before"].shape == local["before"].shape
    assert len(arrays["before"].sharding.device_set) == len(devices)
    np.testing.assert_array_equal(np.asarray(arrays["change_caption"]), local["change_caption"])


def test_batch_size_errors(small_synthetic):
    source = small_synthetic.split("train")
    with pytest.raises(ValueError, match="not divisible by the number of processes 3"):
        pipeline.train_loader(source, global_batch_size=8, seed=0, process_count=3)
    with pytest.raises(ValueError, match="fewer than the global batch size 64"):
        pipeline.train_loader(source, global_batch_size=64, seed=0)


def test_missing_data_dir_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(datasets.DatasetError, match=f"data dir {missing} does not exist"):
        datasets.prepare("synthetic", missing, build_if_missing=False)
    with pytest.raises(datasets.DatasetError, match=r"dataset 'clevr' is not built in .*datasets "
                                                    r"built there: none; built on first use: "
                                                    r"\['synthetic'\]"):
        datasets.prepare("clevr", tmp_path)


def test_unbuilt_dataset_is_named(tmp_path):
    with pytest.raises(datasets.DatasetError, match="is not built in .*data_prep.build synthetic"):
        datasets.prepare("synthetic", tmp_path, build_if_missing=False)


def _copy(dataset, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(dataset.builder._data_dir_root, root)
    from conftest import SMALL
    return datasets.prepare("synthetic", root, "moderate", SMALL, build_if_missing=False)


def test_truncated_record_file_is_named(small_synthetic, tmp_path):
    copy = _copy(small_synthetic, tmp_path)
    path = next(copy.directory.glob("*-train.array_record-*"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(datasets.DatasetError, match=f"{path.name}.*truncated or corrupt"):
        copy.split("train")


def test_corrupt_record_file_is_named(small_synthetic, tmp_path):
    copy = _copy(small_synthetic, tmp_path)
    path = next(copy.directory.glob("*-val.array_record-*"))
    data = bytearray(path.read_bytes())
    data[100:4000] = bytes(len(data[100:4000]))  # zero a stretch of record bytes
    path.write_bytes(bytes(data))
    with pytest.raises(datasets.DatasetError, match=path.name):
        source = copy.split("val")
        for i in range(len(source)):
            source[i]


def test_missing_vocabulary_is_named(small_synthetic, tmp_path):
    copy = _copy(small_synthetic, tmp_path)
    (copy.directory / "vocab.json").unlink()
    from conftest import SMALL
    with pytest.raises(datasets.DatasetError, match="vocab.json does not exist"):
        datasets.prepare("synthetic", tmp_path / "copy", "moderate", SMALL,
                         build_if_missing=False)


def test_feature_shape_mismatch_is_named(small_synthetic):
    with pytest.raises(datasets.DatasetError, match=r"expects features of shape \(8, 8, 64\) "
                                                    r"but .* stores \(4, 4, 16\)"):
        datasets.check_feature_shape(small_synthetic, (8, 8, 64), "model")


def test_verify_catches_a_flipped_byte(small_synthetic, tmp_path):
    copy = _copy(small_synthetic, tmp_path)
    datasets.verify(copy)  # intact
    path = next(copy.directory.glob("*-test.array_record-*"))
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(datasets.DatasetError, match=f"{path.name} is missing or corrupt"):
        datasets.verify(copy)
