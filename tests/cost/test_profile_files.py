"""Tier 2: hardware profiles as files (`cost.profile_files`): written by the calibration, read
by the estimate, compile and the CLI, and refused with the field named when wrong."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.cost import calibrate
from fxpar.cost.hardware import NOMINAL_CPU, PROFILES
from fxpar.cost.matmul_table import MatmulTable
from fxpar.cost.profile_files import load_profile, save_profile
from fxpar.cost.profiles import hardware_profile

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

TABLE = ((64, 64, 64, 2e10), (1024, 256, 256, 9e10))
MACHINE = replace(NOMINAL_CPU, cores=2, threads=1, shared_wait=9e-4, measured={"matmul_flops": 5e10},
                  intra_node=replace(NOMINAL_CPU.intra_node, wait=3e-4),
                  matmul_tables={"fp32": MatmulTable(TABLE), "bf16": MatmulTable(TABLE)})
# Readings as `calibrate_cpu` returns them: the command's test reads them, measures nothing.
FAKE = {"matmul_flops": 1e11, "memory_bandwidth": 4e10, "attention_flops": 5e10,
        "elementwise_bandwidth": 2e10, "pointwise_bandwidth": 2e10, "activation_bandwidth": 8e9, "norm_bandwidth": 3e10,
        "loss_bandwidth": 1e10, "op_overhead": 2e-6, "optimizer_tensor_overhead": 2e-5,
        "alpha": 5e-5, "link_bandwidth": 1.5e9, "sync_wait": 3e-4, "shared_wait": 9e-4, "threads": 1,
        "cores": 2, "load_average": 0.5, "matmul_table": [list(p) for p in TABLE]}


def test_a_profile_survives_its_file(tmp_path):
    for hardware in (MACHINE, hardware_profile("h200")):
        path = save_profile(hardware, tmp_path / f"{hardware.name}.json")
        assert load_profile(path) == hardware
        assert hardware_profile(str(path)) == hardware


def test_a_file_without_a_links_wait_reads_as_no_wait(tmp_path):
    """Profile files written before links had a wait (the shipped h200's) still read."""
    path = save_profile(MACHINE, tmp_path / "machine.json")
    data = json.loads(path.read_text())
    del data["intra_node"]["wait"], data["shared_wait"]
    path.write_text(json.dumps(data))
    loaded = load_profile(path)
    assert loaded.intra_node.wait == 0 and loaded.shared_wait is None


def test_the_estimate_and_compile_price_with_the_file(tmp_path):
    path = str(save_profile(replace(PROFILES["h100"], name="h100-copy", matmul_efficiency=0.4), tmp_path / "p.json"))
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 16))
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    program = fxpar.compile(model, "dp=2", example_inputs=(tokens, tokens), hardware=path)
    from_file, nominal = program.estimate(path), program.estimate("h100")
    assert from_file.hardware == "h100-copy"
    assert from_file.time["compute"] > nominal.time["compute"]  # half the matmul rate
    assert from_file.memory == nominal.memory


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("memory_bandwidth"), r"missing fields \['memory_bandwidth'\]"),
    (lambda d: d.update(matmul_rate=1.0), r"unknown fields \['matmul_rate'\]"),
    (lambda d: d.update(format="fxpar-hardware/0"), "format 'fxpar-hardware/0', expected 'fxpar-hardware/1'"),
    (lambda d: d.update(op_overhead=-1), "op_overhead must be a number >= 0, got -1"),
    (lambda d: d["intra_node"].pop("alpha"), "intra_node must be"),
    (lambda d: d["peak_flops"].update(bf16="fast"), "peak_flops.bf16 must be a number"),
    (lambda d: d["matmul_tables"].update(fp32={"points": [[64, 64, 1e10]]}), r"matmul_tables.fp32 must be"),
    (lambda d: d["matmul_tables"]["fp32"]["points"].append([8, 8, 8, -1]), r"matmul_tables.fp32 must be a number"),
])
def test_a_wrong_file_is_refused_naming_the_field(tmp_path, edit, message):
    data = json.loads(save_profile(MACHINE, tmp_path / "p.json").read_text())
    edit(data)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        hardware_profile(str(tmp_path / "p.json"))


def test_a_missing_file_says_how_to_write_one(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist\. Fix: write one with `python -m fxpar.cost.calibrate -o"):
        hardware_profile(str(tmp_path / "absent.json"))


def test_calibrate_writes_the_profile_it_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FXPAR_CACHE_DIR", str(tmp_path))
    calibrate.measure_cpu.cache_clear()
    calibrate.write_cache(FAKE)
    try:
        assert calibrate.main(["-o", str(tmp_path / "here.json")]) == 0
        assert load_profile(tmp_path / "here.json") == calibrate.measure_cpu()
    finally:
        calibrate.measure_cpu.cache_clear()
    assert "price with it: program.estimate(" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        calibrate.main(["-o", str(tmp_path / "here.txt")])
