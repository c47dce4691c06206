"""Tier 2: the measured `cpu` profile: plausible readings, cached on disk and reused, never
cached under load, written atomically, and measurable from a script without a main guard."""

import json
import logging
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import fxpar
from fxpar.cost import calibrate
from fxpar.cost.collectives import MiB, collective_time, gradient_bucket_bytes
from fxpar.cost.hardware import NOMINAL_CPU, PROFILES
from fxpar.cost.ops import op_counts
from fxpar.cost.profiles import hardware_profile

# Readings as `calibrate_cpu` returns them, for the tests of the caching policy.
FAKE = {"matmul_flops": 1e11, "memory_bandwidth": 4e10, "attention_flops": 5e10,
        "elementwise_bandwidth": 2e10, "pointwise_bandwidth": 2e10, "activation_bandwidth": 8e9, "norm_bandwidth": 3e10,
        "loss_bandwidth": 1e10, "op_overhead": 2e-6, "optimizer_tensor_overhead": 2e-5,
        "alpha": 5e-5, "link_bandwidth": 1.5e9, "sync_wait": 3e-4, "shared_wait": 9e-4, "threads": 1,
        "cores": 2, "load_average": 0.5, "matmul_table": [[64, 64, 64, 2e10], [1024, 256, 256, 9e10]]}


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPAR_CACHE_DIR", str(tmp_path))
    calibrate.measure_cpu.cache_clear()
    yield tmp_path
    calibrate.measure_cpu.cache_clear()


def test_cpu_profile_is_measured_once_and_cached(fresh_cache, monkeypatch):
    monkeypatch.setattr(calibrate.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    profile = hardware_profile("cpu")
    readings = profile.measured
    assert 1e8 < readings["matmul_flops"] < 1e14
    assert 1e8 < readings["memory_bandwidth"] < 1e13
    assert 0.05 < profile.attention_efficiency < 2
    assert 0.02 < profile.elementwise_efficiency < 2
    assert all(1e8 < profile.elementwise_bandwidth(kind) < 1e13 for kind in calibrate.CLASSES)
    assert 1e-8 < readings["op_overhead"] < 1e-3
    assert len(readings["matmul_table"]) == 36 and all(1e8 < p[3] < 1e14 for p in readings["matmul_table"])
    assert profile.matmul_tables["fp32"].points == tuple(map(tuple, readings["matmul_table"]))
    assert 0 <= readings["optimizer_tensor_overhead"] < 1e-2
    assert 0 < readings["alpha"] < 0.05 and 1e6 < readings["link_bandwidth"] < 1e12
    assert 0 <= readings["sync_wait"] < 0.05 and profile.intra_node.wait == readings["sync_wait"]
    assert readings["shared_wait"] is None or 0 <= readings["shared_wait"] < 0.1
    assert profile.comm_overlap == 0.0  # gloo and compute share the cores
    (cache,) = fresh_cache.glob("hardware-cpu-*.json")
    # A second process-start reads the file instead of measuring: change it and see.
    cache.write_text(json.dumps(readings | {"alpha": 1.0}))
    calibrate.measure_cpu.cache_clear()
    assert hardware_profile("cpu").intra_node.alpha == 1.0


def test_a_reading_under_load_is_used_but_not_cached(fresh_cache, monkeypatch, caplog):
    loaded = FAKE | {"load_average": 7.5}
    monkeypatch.setattr(calibrate, "calibrate_cpu", lambda: dict(loaded))
    with caplog.at_level(logging.WARNING, logger=calibrate.__name__):
        profile = calibrate.measure_cpu()
    assert profile.measured == loaded
    assert list(fresh_cache.iterdir()) == []
    assert "measured under load" in caplog.text and "not caching" in caplog.text


def test_a_cache_from_before_a_reading_existed_is_measured_again(fresh_cache, monkeypatch):
    old = {k: FAKE[k] for k in ("matmul_flops", "memory_bandwidth", "alpha", "link_bandwidth")}
    calibrate.write_cache(old)
    monkeypatch.setattr(calibrate, "calibrate_cpu", lambda: dict(FAKE))
    profile = calibrate.measure_cpu()
    assert profile.op_overhead == FAKE["op_overhead"]
    assert profile.attention_efficiency == profile.elementwise_efficiency == pytest.approx(0.5)
    (cache,) = fresh_cache.glob("hardware-cpu-*.json")
    assert json.loads(cache.read_text()) == FAKE


def test_the_cache_is_written_atomically(fresh_cache, monkeypatch):
    cache = calibrate.write_cache(FAKE)
    assert [p.name for p in fresh_cache.iterdir()] == [cache.name]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        calibrate.write_cache(FAKE | {"alpha": 1.0})
    assert [p.name for p in fresh_cache.iterdir()] == [cache.name]  # no temporary left over
    assert json.loads(cache.read_text()) == FAKE  # the old file, whole


def test_the_op_overhead_probe_counts_its_ops_as_the_estimate_does():
    """The op overhead is the probe block's seconds over its ops as `op_counts` counts them:
    the count the calibration divides by is the one the estimate multiplies by."""
    program = fxpar.compile(calibrate.TinyBlock(), "dp=1", example_inputs=(torch.randn(2, 4, 8),))
    assert sum(op_counts(program.captured.graph_module)) == calibrate.TinyBlock.COUNTED


def test_link_calibration_runs_from_a_script_without_a_main_guard(tmp_path):
    """multiprocessing's spawn re-imported the calling script; child processes do not."""
    script = tmp_path / "no_guard.py"
    script.write_text("from fxpar.cost.calibrate import _gloo_link\nprint(_gloo_link(2))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("link_bandwidth") == 1  # measured once, not re-run by a child


def test_gpu_profiles_overlap_communication_and_cpu_does_not():
    assert all(p.comm_overlap == 1.0 for p in PROFILES.values())
    assert all(0.5 <= p.attention_efficiency <= 0.75 for p in PROFILES.values())
    assert NOMINAL_CPU.comm_overlap == 0.0


def test_nominal_cpu_is_fixed():
    assert hardware_profile("cpu", measured=False) is NOMINAL_CPU


def test_bucket_rule_keeps_latency_at_a_tenth_and_caps_at_ddp_default():
    link = NOMINAL_CPU.intra_node  # 50 us, 2 GB/s: M = n alpha bandwidth (1 - 0.1) / 0.1
    assert gradient_bucket_bytes(2, link) == pytest.approx(2 * 50e-6 * 2e9 * 9, rel=1e-6)
    assert gradient_bucket_bytes(64, hardware_profile("h100").inter_node) == 25 * MiB


def test_ranks_sharing_the_cores_each_compute_at_their_share_of_the_rate():
    """Four 1-thread ranks on two cores take turns: half the rate each, and half the link's
    bandwidth (`Hardware.shared_by`);
    no more ranks than cores, or a device of its own (cores None), change nothing."""
    machine = replace(NOMINAL_CPU, cores=2, threads=1)
    assert machine.shared_by(2) is machine and PROFILES["h100"].shared_by(64) is PROFILES["h100"]
    shared = machine.shared_by(4)
    assert shared.matmul_rate("fp32") == machine.matmul_rate("fp32") / 2
    assert shared.elementwise_bandwidth() == machine.elementwise_bandwidth() / 2
    assert shared.op_overhead == 2 * machine.op_overhead
    assert shared.optimizer_tensor_overhead == 2 * machine.optimizer_tensor_overhead
    # gloo over loopback copies on the same cores: half the bandwidth; no shared wait measured.
    assert shared.intra_node == replace(machine.intra_node, bandwidth=machine.intra_node.bandwidth / 2)


def test_ranks_taking_turns_on_the_cores_wait_longer_for_each_other():
    """A call's wait for its peers goes from the link's own (one rank per core) to the shared
    wait measured at twice as many ranks as cores, linearly in ranks per core; each call pays
    it once, whatever its kind or group, besides its alpha steps and bytes."""
    link = replace(NOMINAL_CPU.intra_node, wait=3e-4)
    machine = replace(NOMINAL_CPU, cores=2, threads=1, intra_node=link, inter_node=link, shared_wait=9e-4)
    assert machine.shared_by(2).intra_node.wait == 3e-4
    assert machine.shared_by(4).intra_node.wait == pytest.approx(9e-4)
    assert machine.shared_by(8).inter_node.wait == pytest.approx(3e-4 + 3 * 6e-4)
    assert machine.shared_by(4).intra_node.alpha == link.alpha
    assert machine.shared_by(8).intra_node.bandwidth == link.bandwidth / 4
    quiet = replace(link, wait=0.0)
    for kind, n in (("all_reduce", 2), ("all_reduce", 8), ("send", 2), ("all_gather", 4)):
        assert float(collective_time(kind, 4096, n, link)) == pytest.approx(
            float(collective_time(kind, 4096, n, quiet)) + 3e-4)
    assert collective_time("recv", 4096, 2, link) == 0  # a transfer is timed on its sending side
