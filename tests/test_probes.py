"""Probes: real figures on this host; GPU branches through fakes named as such."""

from __future__ import annotations

import resource
import sys
import types
from pathlib import Path

import pytest
import torch

from oomguard.engine.cli.probe import probe_table
from oomguard.probes import PeakMeter, nvml, nvml_ids, probe, probe_all
from oomguard.probes import cuda as cuda_backend
from oomguard.probes.host import proc_status

MiB = 1024**2
HAS_CUDA = torch.cuda.is_available()


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


# --- host ------------------------------------------------------------------


def test_cpu_probe_figures_agree_with_proc_meminfo() -> None:
    snap = probe("cpu")
    mem_total, mem_avail = _meminfo("MemTotal"), _meminfo("MemAvailable")
    assert snap.available and snap.device == "cpu"
    # A cgroup or rlimit can only lower the figures below what the kernel reports.
    assert 0 < snap.total_bytes <= mem_total
    assert 0 < snap.free_bytes <= snap.total_bytes
    if snap.extra["limited_by"] == "MemAvailable":
        assert snap.total_bytes == mem_total
        assert abs(snap.free_bytes - mem_avail) < 0.05 * mem_total
    assert abs(snap.process_bytes - proc_status("VmRSS")) < 64 * MiB
    assert set(snap.sources) >= {"total", "free", "process"}


@pytest.mark.slow
def test_rlimit_data_lowers_free_bytes() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = proc_status("VmData") + 512 * MiB
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        snap = probe("cpu")
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    assert snap.extra["limited_by"] == "RLIMIT_DATA"
    assert snap.sources["free"] == "RLIMIT_DATA - VmData"
    assert 448 * MiB < snap.free_bytes <= 512 * MiB
    assert probe("cpu").free_bytes > 1024 * MiB  # restored: the limit is gone again


def test_peak_meter_measures_a_touched_200_mib_allocation() -> None:
    torch.ones(4, 4).sum()  # warm-up: thread pools are not part of the measurement
    meter = PeakMeter("cpu")
    meter.reset()
    x = torch.ones(200 * MiB // 4, dtype=torch.float32)  # written, so resident
    del x
    peak = meter.read()
    assert abs(peak - 200 * MiB) < 0.10 * 200 * MiB, peak / MiB


# --- no GPU here: answers, not crashes ---------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="this host has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", torch.device("cuda", 1)])
def test_no_cuda_is_an_answer_with_a_reason(device: object) -> None:
    snap = probe(device)
    assert snap.available is False
    assert snap.total_bytes is None and snap.free_bytes is None
    assert "\n" not in snap.reason
    assert "built without CUDA" in snap.reason or "no NVIDIA driver" in snap.reason


def test_mps_probe_answers() -> None:
    snap = probe("mps")
    if torch.backends.mps.is_available():
        assert snap.available and snap.total_bytes > 0
    else:
        assert snap.available is False and "MPS" in snap.reason


def test_nvml_without_driver_is_a_reason_not_an_exception() -> None:
    reason = nvml.unavailable_reason()
    if reason is None:
        pytest.skip("NVML works on this host")
    assert "NVMLError" in reason or "pynvml" in reason
    assert nvml.device_count() == 0 and nvml.identities() == []
    assert isinstance(nvml.query(0), str)
    assert nvml.query_for_torch_index(0) == (None, f"NVML: {reason}")


def test_probe_all_lists_the_host_first_and_formats() -> None:
    snaps = probe_all()
    assert snaps[0].device == "cpu" and snaps[0].available
    if HAS_CUDA:
        assert [s.device for s in snaps[1:1 + torch.cuda.device_count()]] == [
            f"cuda:{i}" for i in range(torch.cuda.device_count())]
    table = probe_table(snaps)
    assert table.splitlines()[0].split()[:4] == ["device", "name", "total", "free"]
    assert len(table.splitlines()) == len(snaps) + 1
    assert all(isinstance(s.to_dict(), dict) for s in snaps)


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:x", "xla", "meta", ""])
def test_unknown_device_raises_one_line_value_error(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        probe(bad)
    assert "\n" not in str(info.value) and repr(bad) in str(info.value)


# --- CUDA_VISIBLE_DEVICES -> NVML mapping (pure; fakes of NVML devices) --------

FAKE_GPUS = [  # (uuid, pci bus id) as NVML reports them, in NVML (PCI) order
    ("GPU-aaaa1111-0000-0000-0000-000000000000", "00000000:1B:00.0"),
    ("GPU-bbbb2222-0000-0000-0000-000000000000", "00000000:3B:00.0"),
    ("GPU-bbbb3333-0000-0000-0000-000000000000", "00000000:86:00.0"),
    ("GPU-dddd4444-0000-0000-0000-000000000000", "00000001:AF:00.0"),
]


@pytest.mark.parametrize(("cvd", "expected"), [
    (None, [0, 1, 2, 3]),  # unset: every device
    ("", []),  # set but empty: none
    ("2,0", [2, 0]),  # torch's cuda:0 is NVML 2
    (" 3 , 1 ", [3, 1]),
    ("0,7,1", [0]),  # CUDA stops at the first invalid entry
    ("-1", []),
    ("1,1", [1]),  # a repeat ends the list
    ("GPU-dddd4444-0000-0000-0000-000000000000,0", [3, 0]),
    ("GPU-aaaa", [0]),  # a unique UUID prefix
    ("GPU-bbbb,0", []),  # an ambiguous prefix names no device
    ("MIG-1234,0", []),
])
def test_fake_nvml_maps_visible_devices(cvd: str | None, expected: list[int]) -> None:
    assert nvml_ids.map_visible_devices(cvd, FAKE_GPUS) == expected


def test_fake_nvml_maps_torch_device_by_uuid_before_visible_devices() -> None:
    # torch prints the UUID bare and lower-case; CUDA_VISIBLE_DEVICES would say 0.
    index, how = nvml.nvml_index_for(0, FAKE_GPUS, cuda_visible_devices="0",
                                     uuid="DDDD4444-0000-0000-0000-000000000000")
    assert (index, how) == (3, "uuid")


def test_fake_nvml_maps_torch_device_by_pci_bus_id() -> None:
    pci = nvml_ids.pci_bus_id_from_ints(1, 0xAF, 0)  # torch's pci_domain/bus/device ids
    assert pci == "0001:af:00"
    assert nvml.nvml_index_for(0, FAKE_GPUS, cuda_visible_devices=None, pci_bus_id=pci) == (
        3, "pci bus id")


def test_fake_nvml_falls_back_to_visible_devices_then_says_why_not() -> None:
    assert nvml.nvml_index_for(1, FAKE_GPUS, cuda_visible_devices="2,1,0") == (
        1, "CUDA_VISIBLE_DEVICES")
    assert nvml.nvml_index_for(1, FAKE_GPUS, cuda_visible_devices=None) == (1, "index order")
    index, why = nvml.nvml_index_for(2, FAKE_GPUS, cuda_visible_devices="2,1")
    assert index is None and "cuda:2" in why


@pytest.mark.parametrize(("raw", "norm"), [
    ("00000000:3B:00.0", "0000:3b:00"), ("0000:3b:00.0", "0000:3b:00"), ("3b:00.0", "0000:3b:00"),
    ("nonsense", None),
])
def test_pci_bus_ids_normalise(raw: str, norm: str | None) -> None:
    assert nvml_ids.normalize_pci_bus_id(raw) == norm


# --- NVML queries and the CUDA merge, through a fake pynvml -------------------


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(my_pid: int, fail_init: bool = False) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVMLError = _FakeNVMLError
    proc = types.SimpleNamespace

    def init() -> None:
        if fail_init:
            raise _FakeNVMLError("Driver Not Loaded")

    m.nvmlInit = init
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"Fake H100"
    m.nvmlDeviceGetUUID = lambda h: FAKE_GPUS[h][0]
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=FAKE_GPUS[h][1].encode())
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=80 * 1024 * MiB, free=50 * 1024 * MiB, used=30 * 1024 * MiB)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        proc(pid=my_pid, usedGpuMemory=10 * 1024 * MiB),
        proc(pid=99991, usedGpuMemory=15 * 1024 * MiB),
        proc(pid=99992, usedGpuMemory=None)]  # WDDM / no permission: unknown

    def graphics(h: int) -> list:
        raise _FakeNVMLError("Not Supported")

    m.nvmlDeviceGetGraphicsRunningProcesses = graphics
    m.nvmlSystemGetDriverVersion = lambda: "999.1"
    return m


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch):
    def install(**kw: object) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(**kw))
        monkeypatch.setattr(nvml, "_state", {"tried": False, "error": None, "module": None})
    return install


def test_fake_nvml_query_splits_this_process_from_others(fake_nvml, monkeypatch) -> None:
    fake_nvml(my_pid=4242)
    monkeypatch.setattr(nvml.os, "getpid", lambda: 4242)
    dev = nvml.query(1)
    assert isinstance(dev, nvml.NvmlDevice)
    assert (dev.name, dev.uuid, dev.pci_bus_id) == ("Fake H100", FAKE_GPUS[1][0], "00000000:3B:00.0")
    assert dev.pid_matched and dev.process_bytes == 10 * 1024 * MiB
    # One other pid's usage is unknown (None): the sum is unknown, 15 GiB a lower bound.
    assert dev.other_processes_bytes is None and dev.unknown_pids == [99992]
    assert dev.other_processes_known_bytes == 15 * 1024 * MiB
    assert nvml.driver_version() == "999.1"


def test_fake_nvml_init_failure_is_remembered_as_a_reason(fake_nvml) -> None:
    fake_nvml(my_pid=1, fail_init=True)
    assert "Driver Not Loaded" in nvml.unavailable_reason()
    assert nvml.query(0).startswith("NVML: ")
    assert nvml.device_count() == 0


def test_fake_cuda_probe_merges_nvml_and_allocator(fake_nvml, monkeypatch) -> None:
    fake_nvml(my_pid=4242)
    monkeypatch.setattr(nvml.os, "getpid", lambda: 4242)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda = cuda_backend
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "has_context", lambda i: True)
    monkeypatch.setattr(cuda, "identity", lambda i: {"name": "Fake H100", "total": 80 * 1024 * MiB})
    stats = {"allocated": 6 * 1024 * MiB, "reserved": 8 * 1024 * MiB, "peak_allocated": 7 * 1024 * MiB,
             "peak_reserved": 9 * 1024 * MiB, "fraction_cap": 80 * 1024 * MiB}
    monkeypatch.setattr(cuda, "allocator_stats", lambda i: dict(stats))
    snap = probe("cuda")
    assert snap.available and snap.device == "cuda:0" and snap.name == "Fake H100"
    assert snap.extra["nvml_index"] == 1 and snap.extra["nvml_mapped_by"] == "CUDA_VISIBLE_DEVICES"
    assert (snap.total_bytes, snap.free_bytes) == (80 * 1024 * MiB, 50 * 1024 * MiB)
    assert snap.process_bytes == 10 * 1024 * MiB and snap.other_processes_bytes is None
    assert snap.extra["other_processes_at_least"] == 15 * 1024 * MiB
    assert snap.extra["reserved"] == 8 * 1024 * MiB
    assert snap.extra["free_in_allocator_cache"] == 2 * 1024 * MiB
    assert snap.sources["free"].startswith("NVML")
    # A fraction budget of 12 GiB with 8 GiB reserved leaves 4 GiB: that is the free figure.
    stats["fraction_cap"] = 12 * 1024 * MiB
    snap = probe("cuda:0")
    assert snap.free_bytes == 4 * 1024 * MiB and snap.extra["limited_by"] == "per-process fraction"
    assert probe("cuda:1").available is False  # torch sees one device
