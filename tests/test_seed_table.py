"""The seed table: mean ± std over the runs of seed sweeps, and its one-line errors."""

import json
import statistics

import pytest

from tools import seed_table


def _metrics(total: float, per_group: float) -> dict:
    groups = {c: {"CIDEr": per_group + k} for k, c in enumerate(seed_table.COLUMNS[1:])}
    return {"CIDEr": total, **groups}


def _sweep(root, name, param, values):
    out = root / name
    rows = []
    for seed, (total, group) in values.items():
        path = out / f"{param}={seed}" / "metrics" / "test_1000.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_metrics(total, group)))
        rows.append({"value": seed, "metrics": {}, "step": 1000, "workdir": str(path.parent),
                     "metrics_file": str(path)})
    (out / "sweep.json").write_text(json.dumps({
        "param": param, "config": f"configs/{name}.py", "overrides": ["--config.x=1"],
        "split": "test", "metric": "CIDEr", "rows": rows}))
    return out


def test_rows_are_mean_and_sample_std_over_the_seeds(tmp_path, capsys):
    a = _sweep(tmp_path, "dirl", "seed", {1: (90.0, 10.0), 2: (100.0, 20.0), 3: (95.0, 60.0)})
    b = _sweep(tmp_path, "subtraction", "seed", {1: (80.0, 5.0), 2: (70.0, 7.0)})
    assert seed_table.main([str(a), str(b), "--columns=total,semantic,move"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| config | seeds | total | semantic | move |"
    move = [10.0 + 6, 20.0 + 6, 60.0 + 6]  # "move" is the 7th column after total
    assert lines[2] == ("| `configs/dirl.py --config.x=1` | 1, 2, 3 | 95.0 ± 5.0 | "
                        f"30.0 ± 26.5 | {statistics.fmean(move):.1f} ± "
                        f"{statistics.stdev(move):.1f} |")
    assert lines[3].startswith("| `configs/subtraction.py --config.x=1` | 1, 2 | 75.0 ± 7.1 |")


def test_a_sweep_of_another_field_is_refused_in_one_line(tmp_path, capsys):
    other = _sweep(tmp_path, "dirl", "model.num_heads", {4: (90.0, 10.0)})
    assert seed_table.main([str(other)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {other / 'sweep.json'} sweeps 'model.num_heads', not seed\n"


def test_a_run_without_the_metric_is_named(tmp_path, capsys):
    sweep = _sweep(tmp_path, "dirl", "seed", {1: (90.0, 10.0)})
    metrics = sweep / "seed=1" / "metrics" / "test_1000.json"
    data = json.loads(metrics.read_text())
    del data["color"]
    metrics.write_text(json.dumps(data))
    assert seed_table.main([str(sweep)]) == 2
    assert capsys.readouterr().err == f"error: {metrics} has no CIDEr for 'color'\n"


def test_a_missing_sweep_is_named(tmp_path, capsys):
    assert seed_table.main([str(tmp_path / "nowhere")]) == 2
    assert "sweep summary" in capsys.readouterr().err


@pytest.mark.parametrize("values,text", [([3.0], "3.0"), ([1.0, 3.0], "2.0 ± 1.4")])
def test_cell(values, text):
    assert seed_table.cell(values) == text


def test_a_group_slash_key_column_names_its_own_metric(tmp_path, capsys):
    sweep = _sweep(tmp_path, "dirl", "seed", {1: (90.0, 10.0), 2: (100.0, 20.0)})
    for seed, accuracy in ((1, 80.0), (2, 90.0)):
        metrics = sweep / f"seed={seed}" / "metrics" / "test_1000.json"
        data = json.loads(metrics.read_text())
        data["router"] = {"change_accuracy": accuracy, "type_accuracy": None}
        metrics.write_text(json.dumps(data))
    assert seed_table.main([str(sweep), "--columns=total,router/change_accuracy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| config | seeds | total | router/change_accuracy |"
    assert lines[2].endswith("| 95.0 ± 7.1 | 85.0 ± 7.1 |")
    assert seed_table.main([str(sweep), "--columns=router/type_accuracy"]) == 2
    assert capsys.readouterr().err.endswith("has no type_accuracy for 'router'\n")
