"""Tier 2: the measured `cpu` profile: plausible readings, cached on disk and reused."""

import json

import pytest

from fxpar.cost import calibrate
from fxpar.cost.collectives import MiB, gradient_bucket_bytes
from fxpar.cost.hardware import NOMINAL_CPU, hardware_profile


def test_cpu_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPAR_CACHE_DIR", str(tmp_path))
    calibrate.measure_cpu.cache_clear()
    try:
        profile = hardware_profile("cpu")
        readings = profile.measured
        assert 1e8 < readings["matmul_flops"] < 1e14
        assert 1e8 < readings["memory_bandwidth"] < 1e13
        assert 0 < readings["alpha"] < 0.05 and 1e6 < readings["link_bandwidth"] < 1e12
        (cache,) = tmp_path.glob("hardware-cpu-*.json")
        # A second process-start reads the file instead of measuring: change it and see.
        cache.write_text(json.dumps(readings | {"alpha": 1.0}))
        calibrate.measure_cpu.cache_clear()
        assert hardware_profile("cpu").intra_node.alpha == 1.0
    finally:
        calibrate.measure_cpu.cache_clear()


def test_nominal_cpu_is_fixed():
    assert hardware_profile("cpu", measured=False) is NOMINAL_CPU


def test_bucket_rule_keeps_latency_at_a_tenth_and_caps_at_ddp_default():
    link = NOMINAL_CPU.intra_node  # 50 us, 2 GB/s: M = n alpha bandwidth (1 - 0.1) / 0.1
    assert gradient_bucket_bytes(2, link) == pytest.approx(2 * 50e-6 * 2e9 * 9, rel=1e-6)
    assert gradient_bucket_bytes(64, hardware_profile("h100").inter_node) == 25 * MiB
