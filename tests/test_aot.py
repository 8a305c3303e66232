"""``python -m changecap_jax aot``: a preset's programs compiled for a TPU slice (or GPUs) on
this CPU.

The slice names, the fit arithmetic and the one-line refusals run everywhere; the compiles
need libtpu (requirements-aot.txt) and skip with that message without it: one refusal
of a batch that does not fit on a 4-chip slice (exit 2, one line) and one compile of the train
step and decoding on a 16-chip slice of 4 hosts, both of the tiny DIRL preset (about 40 s each
on 2 cores); the same compile on the 4-chip slice is marked slow. The GPU compile (8 H100s on
2 hosts, about 30 s) needs JAX's CUDA plugin (requirements-aot.txt, which CI installs) and
skips without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from changecap_jax.commands import aot, aot_programs, aot_table, gpu_specs, interconnect, tpu_specs

REPO = Path(__file__).resolve().parents[1]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason=f"libtpu is not installed (pip install {aot.LIBTPU_PIN}, "
    "requirements-aot.txt): the aot compiles are skipped")
HAS_CUDA_PLUGIN = aot.cuda_plugin_installed()
needs_cuda_plugin = pytest.mark.skipif(
    not HAS_CUDA_PLUGIN, reason=f"JAX's CUDA plugin is not installed (pip install "
    f"{aot.CUDA_PLUGIN_PINS}): the GPU compile is skipped")


def _aot(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "changecap_jax", "aot",
                           "--config=configs/dirl.py", *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ))


@pytest.mark.parametrize("name, libtpu_name, chips, options", [
    ("v5e:2x2", "v5e:2x2", 4, {}),
    ("v5e:4x4", "v5e:4x4", 16, {}),
    ("v4:2x2x1", "v4:2x2x1", 4, {"chip_config_name": "megacore"}),
    ("v4-8", "v4:2x2x1", 4, {"chip_config_name": "megacore"}),
    ("v5p-16", "v5p:2x2x2", 8, {"chip_config_name": "megacore"}),
    ("v5litepod-8", "v5e:2x4", 8, {"chips_per_host_bounds": (2, 4, 1)}),
    ("v6e-8", "v6e:2x4", 8, {"chips_per_host_bounds": (2, 4, 1)}),
])
def test_slice_names(name, libtpu_name, chips, options):
    topology = tpu_specs.resolve_topology(name)
    assert (topology.name, topology.chips, topology.options) == (libtpu_name, chips, options)


@pytest.mark.parametrize("name", ["v9:2x2", "v5e:2x2x1", "v4:2x2", "v5litepod-12", "tpu"])
def test_unknown_slice_names_are_user_errors(name):
    with pytest.raises(tpu_specs.TopologyError):
        tpu_specs.resolve_topology(name)


@pytest.mark.parametrize("name, hosts, chips", [
    ("h100:8", 1, 8), ("h100:2x8", 2, 16), ("a100:1", 1, 1), ("h200:4x4", 4, 16)])
def test_gpu_names(name, hosts, chips, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    topology = aot.resolve_topology(name)
    card = gpu_specs.CARDS[name.partition(":")[0]]
    assert (topology.platform, topology.chips) == ("cuda", chips)
    assert topology.options["topology"] == f"1x{hosts}x{chips // hosts}"
    assert f'device_description_str: "{card.chip.device_kind}"' in topology.options[
        "target_config"]
    assert topology.chip.hbm_available == int(0.75 * card.chip.hbm_bytes)


@pytest.mark.parametrize("name", ["h100:0", "h100:2x", "h100:17", "h100:x8", "h100"])
def test_bad_gpu_names_are_user_errors(name):
    with pytest.raises(tpu_specs.TopologyError):
        aot.resolve_topology(name)


def test_a_gpu_gets_the_memory_pool_the_run_will_have(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert aot.resolve_topology("h100:8").chip.hbm_available == int(0.95 * 80 * 2**30)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "2")
    with pytest.raises(tpu_specs.TopologyError):
        aot.resolve_topology("h100:8")


def _program(batch: int = 64, batch_bytes: int = 2**20) -> aot_programs.Program:
    return aot_programs.Program("train_step", None, (), batch, "examples", batch_bytes)


def test_the_fit_estimate_takes_the_batch_and_temporaries_as_proportional():
    chip = tpu_specs.CHIPS["v5e"]
    gib = 2**30
    memory = {"arguments": gib + 2**20, "outputs": gib, "aliased": gib, "temporaries": 3 * gib,
              "generated_code": 0}
    memory["total"] = memory["arguments"] + memory["temporaries"]
    measured = {"memory": memory, "flops": 1e12, "bytes_accessed": 8.19e9, "dot_flops": 1.5e12,
                "loops_counted_once": 0, "lower_s": 1.0, "compile_s": 1.0}
    r = aot_programs.analyse(_program(), measured, chip, chips=4)  # 16 examples per chip
    per_example = (2**20 + 3 * gib) / 16
    assert r["largest_batch_estimate"] == int((chip.hbm_available - gib) // per_example) * 4
    assert r["fits"] and r["hbm_used"] == 4 * gib + 2**20
    # The larger FLOP count (the traced one: a loop XLA counted once); 8.19 GB at 819 GB/s:
    # 10 ms, above 1.5 TFLOP at 197 TFLOP/s (7.6 ms).
    assert r["flops"] == 1.5e12 and r["bound_by"] == "memory"
    assert r["roofline_s"] == pytest.approx(0.01) and r["roofline_per_s"] == pytest.approx(6400)


def test_a_gpus_float32_programs_are_bounded_by_its_tf32_peak():
    chip = gpu_specs.CARDS["h100"].chip
    memory = {"arguments": 0, "outputs": 0, "aliased": 0, "temporaries": 2**30,
              "generated_code": 0, "total": 2**30}
    measured = {"memory": memory, "flops": 494.5e12, "bytes_accessed": 0.0, "dot_flops": 0.0,
                "loops_counted_once": 0, "lower_s": 1.0, "compile_s": 1.0}
    f32 = aot_programs.analyse(_program(), measured, chip, chips=8, compute_dtype="float32")
    bf16 = aot_programs.analyse(_program(), measured, chip, chips=8)
    assert f32["roofline_s"] == pytest.approx(1.0) and bf16["roofline_s"] == pytest.approx(0.5)
    # A TPU's float32 matmuls run as one bf16 pass: the same peak.
    tpu = tpu_specs.CHIPS["v5e"]
    assert tpu.peak_flop_per_s("float32") == tpu.peak_flop_per_s("bfloat16")


def test_the_docs_table_has_a_row_per_program(tmp_path):
    chip = tpu_specs.CHIPS["v6e"]
    memory = {"arguments": 2**30, "outputs": 0, "aliased": 0, "temporaries": 2**30,
              "generated_code": 0, "total": 2**31}
    measured = {"memory": memory, "flops": 9.18e11, "bytes_accessed": 1e9, "dot_flops": 0.0,
                "loops_counted_once": 0, "lower_s": 2.0, "compile_s": 3.0}
    results = {"preset": "configs/dirl.py:clevr_change", "compute_dtype": "bfloat16",
               "accelerator_type": "v6e-16", "topology": "v6e:4x4", "chips": 16, "hosts": 2,
               "programs": [aot_programs.analyse(_program(128), measured, chip, chips=16)]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    lines = aot_table.table([str(path)]).splitlines()
    assert len(lines) == 3 and lines[1].count("|") == lines[0].count("|")
    assert lines[2].startswith("| dirl.py:clevr_change bfloat16 | v6e-16 (16 chips, 2 hosts) | "
                               "train_step | 128 (8) | 2.00 of 31.25 GiB | 918 | - | none | "
                               "1.0 ms (compute) | 128,000 |")


def test_a_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_payload():
    # 8 chips on one ICI at 200 GB/s each way: 2 * 7/8 * 100 MB = 175 MB in 0.875 ms.
    ici = interconnect.Interconnect(8, 1, 200e9, "ICI")
    comm = interconnect.allreduce(100e6, ici)
    assert comm["intra_bytes"] == pytest.approx(175e6) and comm["inter_bytes"] == 0
    assert comm["seconds"] == pytest.approx(875e-6) and comm["bound_by"] == "ICI"
    # 2 hosts of 8 GPUs: NVLink at 450 GB/s each way (175 MB: 0.389 ms); between the hosts
    # each host sends 2 * 1/2 * 100 MB = 100 MB through 3200 Gb/s = 400 GB/s (0.25 ms); at
    # 800 Gb/s (100 GB/s) the network bounds it: 1 ms.
    gpus = interconnect.Interconnect(8, 2, 450e9, "NVLink", 400e9, "network")
    comm = interconnect.allreduce(100e6, gpus)
    assert comm["inter_bytes"] == pytest.approx(100e6)
    assert comm["seconds"] == pytest.approx(175e6 / 450e9) and comm["bound_by"] == "NVLink"
    slow = dataclasses.replace(gpus, network_bytes_per_s=100e9)
    assert interconnect.allreduce(100e6, slow)["seconds"] == pytest.approx(1e-3)
    assert interconnect.allreduce(100e6, slow)["bound_by"] == "network"
    assert interconnect.ring_bytes(100e6, 1) == 0  # one device: nothing to reduce


def test_the_topologies_carry_their_published_interconnects(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    v5e = aot.resolve_topology("v5e:4x4").fabric()  # ICI spans the slice's 4 hosts
    assert (v5e.devices_per_host, v5e.hosts, v5e.link_bytes_per_s) == (16, 1, 200e9)
    h100 = aot.resolve_topology("h100:2x8").fabric()
    assert (h100.devices_per_host, h100.hosts, h100.link_bytes_per_s) == (8, 2, 450e9)
    assert h100.network_bytes_per_s == 400e9 and "assumed" in h100.network
    assert aot.resolve_topology("h100:2x8", 1600).fabric().network_bytes_per_s == 200e9
    with pytest.raises(tpu_specs.TopologyError):
        aot.resolve_topology("h100:2x8", 0)
    # What the compiler lets a program use never exceeds the capacity recorded.
    for chip in tpu_specs.CHIPS.values():
        assert chip.hbm_available <= chip.hbm_bytes and chip.link_bytes_per_s > 0


def test_the_compiled_all_reduces_are_counted_from_the_hlo():
    class Compiled:
        def as_text(self) -> str:
            return (
                "  %all-reduce = f32[512,512]{1,0} all-reduce(f32[512,512]{1,0} %p), "
                "replica_groups={{0,1}}, to_apply=%add\n"
                "  %ars = (f32[8]{0}, bf16[4,4]{1,0}) all-reduce-start(f32[8]{0} %a, "
                "bf16[4,4]{1,0} %b), replica_groups={{0,1}}\n"
                "  %ard = (f32[8]{0}, bf16[4,4]{1,0}) all-reduce-done(%ars)\n"
                "  %s = f32[] add(f32[] %all-reduce.1, f32[] %x)\n")

    # 512*512*4 + 8*4 + 16*2; the -done repeats the -start, an operand named so is no op.
    assert aot_programs.all_reduce_bytes(Compiled()) == 512 * 512 * 4 + 32 + 32


def _measured(flops: float | None, bytes_accessed: float | None) -> dict:
    memory = {"arguments": 0, "outputs": 0, "aliased": 0, "temporaries": 2**30,
              "generated_code": 0, "total": 2**30}
    return {"memory": memory, "flops": flops, "bytes_accessed": bytes_accessed,
            "dot_flops": 0.0, "loops_counted_once": 0, "lower_s": 1.0, "compile_s": 1.0}


def test_the_roofline_is_the_largest_of_compute_memory_and_communication():
    chip = tpu_specs.CHIPS["v5e"]  # 197 TFLOP/s, 819 GB/s, ICI 200 GB/s each way
    ici = aot.resolve_topology("v5e:2x2").fabric()
    # 400 MB of gradients over 4 chips: 2 * 3/4 * 400 MB = 600 MB at 200 GB/s = 3 ms, under
    # 1.97 TFLOP at 197 TFLOP/s (10 ms): compute bounds this one.
    program = dataclasses.replace(_program(), gradient_bytes=400_000_000, param_count=10**8)
    r = aot_programs.analyse(program, _measured(1.97e12, 8.19e8), chip, chips=4, fabric=ici)
    assert r["roofline_comm_s"] == pytest.approx(3e-3) and r["bound_by"] == "compute"
    assert r["roofline_s"] == pytest.approx(10e-3)
    # Little compute and traffic: the all-reduce bounds the step.
    r = aot_programs.analyse(program, _measured(1.97e11, 8.19e8), chip, chips=4, fabric=ici)
    assert r["bound_by"] == "communication" and r["roofline_s"] == pytest.approx(3e-3)
    assert r["roofline_per_s"] == pytest.approx(64 / 3e-3) and r["param_count"] == 10**8
    # HBM traffic above both.
    r = aot_programs.analyse(program, _measured(1.97e11, 8.19e9), chip, chips=4, fabric=ici)
    assert r["bound_by"] == "memory" and r["roofline_s"] == pytest.approx(10e-3)
    assert not r["warnings"]
    # Decoding updates nothing: no all-reduce.
    r = aot_programs.analyse(_program(), _measured(1.97e11, 8.19e8), chip, chips=4, fabric=ici)
    assert r["all_reduce"] is None and r["roofline_comm_s"] == 0


def test_a_missing_cost_analysis_is_a_printed_warning(monkeypatch, capsys):
    import jax
    import jax.numpy as jnp

    # Neither the executable's own analysis nor jaxlib's private fallback answers.
    monkeypatch.setattr(aot_programs, "xla_cost",
                        lambda c: {"flops": None, "bytes_accessed": None})
    monkeypatch.setattr(aot_programs, "module_cost",
                        lambda c: {"flops": None, "bytes_accessed": None})
    fn = jax.jit(lambda a: a @ a)
    spec = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    program = aot_programs.Program("train_step", fn, (spec,), 64, "examples", 0)
    measured = aot_programs.compile_program(program)
    assert measured["cost_source"] is None
    chip = tpu_specs.CHIPS["v5e"]
    r = aot_programs.analyse(program, measured, chip, chips=1)
    assert r["warnings"] and "no XLA cost analysis" in r["warnings"][0]
    results = {"preset": "p", "accelerator_type": None, "topology": "v5e:1x1", "chips": 1,
               "device_kind": "TPU v5 lite", "chip": "v5e", "hosts": 1,
               "compute_dtype": "float32", "hbm_bytes": chip.hbm_bytes,
               "hbm_available": chip.hbm_available, "hbm_bytes_per_s": chip.hbm_bytes_per_s,
               "bf16_flop_per_s": chip.bf16_flop_per_s, "chip_source": chip.source,
               "link": "ICI", "link_bytes_per_s": chip.link_bytes_per_s, "programs": [r]}
    lines = aot.report_lines(results)
    assert any(line.startswith("  warning: train_step: no XLA cost analysis") for line in lines)
    assert any("? ms HBM traffic (no cost analysis)" in line for line in lines)
    assert aot.cost_warnings(results) == r["warnings"]
    # The table marks the bound too.
    assert "no cost analysis" in aot_table.rows(results)[0]


def test_the_compilers_refusal_becomes_one_line_saying_by_how_much():
    error = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
             "temporaries (17.75G) exceeds available HBM (15.75G).\nmore detail")
    line = aot_programs.refusal_message(_program(batch=4096), error)
    assert "\n" not in line and "4096 examples does not fit" in line
    assert "17.75 GiB" in line and "2.00 GiB over the 15.75 GiB available" in line


def test_an_unknown_slice_is_one_line_and_exit_2():
    result = _aot("--topology=v9z:2x2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "unknown topology 'v9z:2x2'" in result.stderr


def test_without_a_compiler_the_command_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(aot.LibtpuMissingError, match="pip install libtpu==0.0.42.1"):
        aot.check_libtpu()
    with pytest.raises(aot.CudaPluginMissingError, match="pip install jax-cuda13-plugin"):
        aot.check_cuda_plugin()


@needs_libtpu
def test_a_batch_that_does_not_fit_is_refused_with_one_line():
    # 2^20 examples of the tiny preset: terabytes of temporaries per chip.
    result = _aot("--topology=v5e:2x2", "--programs=train_step", "--batch_size=1048576")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train_step at global batch 1048576")
    assert "over the 15.75 GiB available" in lines[0]


@needs_libtpu
@pytest.mark.parametrize("topology, hosts", [
    ("v5e:4x4", 4), pytest.param("v5e:2x2", 1, marks=pytest.mark.slow)])
def test_the_tiny_preset_compiles_for_a_slice(tmp_path, topology, hosts):
    programs = "train_step,decode"
    out = tmp_path / "aot.json"
    result = _aot(f"--topology={topology}", f"--programs={programs}", "--batch_size=32",
                  "--eval_batch_size=32", f"--json={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    r = json.loads(out.read_text())
    assert (r["topology"], r["hosts"], r["device_kind"]) == (topology, hosts, "TPU v5 lite")
    assert [p["program"] for p in r["programs"]] == programs.split(",")
    for p in r["programs"]:
        assert p["fits"] and 0 < p["hbm_used"] < p["hbm_available"]
        assert p["flops"] > 0 and p["bytes_accessed"] > 0 and p["roofline_per_s"] > 0
        assert p["largest_batch_estimate"] >= 32
        assert p["param_count"] > 0 and not p["warnings"]
    step = r["programs"][0]
    # Float32 gradients: 4 bytes a parameter, all-reduced over the slice's ICI.
    assert step["gradient_bytes"] == 4 * step["param_count"]
    assert step["all_reduce"]["intra_bytes"] == pytest.approx(
        2 * (r["chips"] - 1) / r["chips"] * step["gradient_bytes"])
    assert step["roofline_s"] == max(step["roofline_compute_s"], step["roofline_memory_s"],
                                     step["roofline_comm_s"])
    # The compiled step's all-reduces carry at least the gradients.
    assert step["compiled_all_reduce_bytes"] >= step["gradient_bytes"]
    assert r["programs"][1]["all_reduce"] is None  # decoding
    assert "HBM per chip" in result.stdout and "roofline" in result.stdout
    assert "parameters: " in result.stdout and "gradient all-reduce" in result.stdout
    assert "ms all-reduce" in result.stdout and "ICI 200 GB/s" in result.stdout


@needs_cuda_plugin
def test_the_tiny_preset_compiles_for_gpus(tmp_path):
    out = tmp_path / "aot.json"
    result = _aot("--topology=h100:2x4", "--programs=train_step,decode", "--batch_size=32",
                  "--eval_batch_size=32", f"--json={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    r = json.loads(out.read_text())
    assert (r["platform"], r["hosts"], r["device_kind"]) == ("cuda", 2, "NVIDIA H100 80GB HBM3")
    assert [p["program"] for p in r["programs"]] == ["train_step", "decode"]
    for p in r["programs"]:
        # No cost analysis from the plugin's executable: aot_programs.module_cost's.
        assert p["fits"] and 0 < p["hbm_used"] < p["hbm_available"]
        assert p["xla_flops"] > 0 and p["bytes_accessed"] > 0 and p["roofline_per_s"] > 0
        assert p["cost_source"] == "module_cost" and not p["warnings"]
    # Two hosts: NVLink within each, the assumed network between them.
    comm = r["programs"][0]["all_reduce"]
    assert comm["inter_bytes"] == pytest.approx(r["programs"][0]["gradient_bytes"])
    assert "assumed" in r["network"] and "between hosts" in result.stdout
