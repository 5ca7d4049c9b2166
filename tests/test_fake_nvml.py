"""NVML across driver generations, reserved memory and MIG, through a fake pynvml.

No GPU here: the driver's answers come from tests/fakes/fake_nvml.py, which
follows nvidia-ml-py 13.615's pynvml.py and uses its real exception and struct
classes. Each test states what a user of ``oomguard probe`` relies on.
"""

from __future__ import annotations

import json
import sys

import pynvml
import pytest
from fakes.fake_nvml import (
    FakeCudaDevice,
    FakeDriver,
    FakeGpu,
    FakeMig,
    GiB,
    MiB,
    install_fake_torch_cuda,
    make_fake_pynvml,
)

from oomguard.engine.cli.main import main
from oomguard.probes import nvml, probe

ME, OTHER, THIRD = 4242, 5151, 6161
GPU_UUID = "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
MIG_3G = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"
MIG_1G = "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb"
BUS = "00000000:3B:00.0"


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch):
    """Install a fake pynvml answering from the returned FakeDriver; this pid is ``ME``."""
    drv = FakeDriver()
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml(drv))
    monkeypatch.setattr(nvml, "_state", {"tried": False, "error": None, "module": None})
    monkeypatch.setattr(nvml, "_own_pids", lambda: {ME})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def reinstall() -> None:  # after changing drv.version: the symbols a driver has differ
        monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml(drv))
        monkeypatch.setattr(nvml, "_state", {"tried": False, "error": None, "module": None})

    drv.reinstall = reinstall  # type: ignore[attr-defined]
    return drv


def _a100(**kw: object) -> FakeGpu:
    return FakeGpu(uuid=GPU_UUID, pci_bus_id=BUS, **kw)


# --- the fake itself follows pynvml ------------------------------------------


def test_fake_nvml_raises_pynvmls_own_classes(driver) -> None:
    driver.version = "470.82.01"
    driver.gpus = [_a100()]
    driver.reinstall()
    nv = sys.modules["pynvml"]
    h = nv.nvmlDeviceGetHandleByIndex(0)
    # The unversioned wrapper's failure is not an NVMLError: `except NVMLError` misses it.
    with pytest.raises(pynvml.NVMLLibraryMismatchError) as info:
        nv.nvmlDeviceGetComputeRunningProcesses(h)
    assert not isinstance(info.value, pynvml.NVMLError)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetComputeRunningProcesses_v3(h)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(h)


def test_fake_nvml_memory_v1_folds_reserved_into_total_and_used(driver) -> None:
    driver.gpus = [_a100(reserved=520 * MiB, used=10 * GiB)]
    nv = sys.modules["pynvml"]
    h = nv.nvmlDeviceGetHandleByIndex(0)
    v1, v2 = nv.nvmlDeviceGetMemoryInfo(h), nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
    assert isinstance(v2, pynvml.c_nvmlMemory_v2_t) and isinstance(v1, pynvml.c_nvmlMemory_t)
    assert v2.total == v2.reserved + v2.used + v2.free and v1.total == v1.used + v1.free
    assert (v1.total, v1.free) == (v2.total, v2.free)


# --- item 3: process queries on every driver generation ----------------------


def test_fake_nvml_pre_r510_driver_answers_through_v2(driver) -> None:
    driver.version = "470.82.01"
    driver.gpus = [_a100(used=8 * GiB, processes=[(ME, 5 * GiB), (OTHER, 3 * GiB)])]
    driver.reinstall()
    dev = nvml.query(0)  # before: NVMLLibraryMismatchError escaped and crashed the probe
    assert isinstance(dev, nvml.NvmlDevice), dev
    assert dev.process_api == "nvmlDeviceGetComputeRunningProcesses_v2"
    assert (dev.process_bytes, dev.other_processes_bytes) == (5 * GiB, 3 * GiB)
    assert dev.memory_api == "nvmlDeviceGetMemoryInfo" and dev.reserved is None


@pytest.mark.parametrize("version", ["535.43.02", "535.54.03", "535.86.05"])
def test_fake_nvml_535_early_drivers_read_processes_correctly(driver, version: str) -> None:
    driver.version = version
    driver.gpus = [_a100(processes=[(ME, 5 * GiB), (OTHER, 3 * GiB), (THIRD, 2 * GiB)])]
    driver.reinstall()
    raw = sys.modules["pynvml"].nvmlDeviceGetComputeRunningProcesses_v3(
        sys.modules["pynvml"].nvmlDeviceGetHandleByIndex(0))
    assert [p.pid for p in raw] != [ME, OTHER, THIRD]  # the misparse the probe must avoid
    dev = nvml.query(0)
    assert dev.processes == {ME: 5 * GiB, OTHER: 3 * GiB, THIRD: 2 * GiB}
    assert dev.other_processes_bytes == 5 * GiB
    assert dev.process_api == "nvmlDeviceGetComputeRunningProcesses_v2"


def test_fake_nvml_current_driver_uses_v3(driver) -> None:
    driver.version = "535.104.05"
    driver.gpus = [_a100(processes=[(ME, 5 * GiB), (OTHER, 3 * GiB)])]
    driver.reinstall()
    dev = nvml.query(0)
    assert dev.process_api == "nvmlDeviceGetComputeRunningProcesses_v3"
    assert dev.processes == {ME: 5 * GiB, OTHER: 3 * GiB}


def test_fake_nvml_unreported_process_memory_is_unknown_not_zero(driver) -> None:
    driver.gpus = [_a100(processes=[(ME, None), (OTHER, 3 * GiB), (THIRD, None)])]
    dev = nvml.query(0)
    assert dev.pid_matched and dev.process_bytes is None
    assert dev.other_processes_bytes is None and dev.unknown_pids == [THIRD]
    assert dev.other_processes_known_bytes == 3 * GiB  # a lower bound, said as such


# --- item 4: the total is what CUDA can use, and says where it came from -------


def _torch_sees(monkeypatch, *, total_memory: int, uuid: str, free: int = 0) -> None:
    install_fake_torch_cuda(monkeypatch, [FakeCudaDevice(
        name="NVIDIA A100-SXM4-40GB", total_memory=total_memory, uuid=uuid, pci_bus_id=0x3B,
        free=free, fraction=1.0)])


def test_fake_probe_total_excludes_driver_reserved_memory(driver, monkeypatch, capsys) -> None:
    driver.gpus = [_a100(reserved=520 * MiB, used=2 * GiB, processes=[(ME, 2 * GiB)])]
    _torch_sees(monkeypatch, total_memory=40 * GiB - 520 * MiB, uuid=GPU_UUID[4:])
    snap = probe("cuda:0")
    assert snap.total_bytes == 40 * GiB - 520 * MiB  # before: 40 GiB, NVML v1's total
    assert snap.free_bytes == 40 * GiB - 520 * MiB - 2 * GiB
    assert snap.sources["total"] == "NVML nvmlDeviceGetMemoryInfo_v2 total - reserved"
    assert snap.sources["free"] == "NVML nvmlDeviceGetMemoryInfo_v2 free"
    assert snap.extra["nvml_reserved"] == 520 * MiB
    assert main(["probe", "--device", "cuda:0", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["total_bytes"] == 40 * GiB - 520 * MiB
    assert row["sources"]["total"] == snap.sources["total"]


def test_fake_probe_without_memory_v2_takes_torchs_total(driver, monkeypatch) -> None:
    driver.version = "470.82.01"
    driver.gpus = [_a100(reserved=520 * MiB, processes=[(ME, 1 * GiB)])]
    driver.reinstall()
    _torch_sees(monkeypatch, total_memory=40 * GiB - 520 * MiB, uuid=GPU_UUID[4:])
    snap = probe("cuda:0")  # before: NVMLLibraryMismatchError
    assert snap.total_bytes == 40 * GiB - 520 * MiB
    assert snap.sources["total"].startswith("torch.cuda.get_device_properties total_memory")
    assert snap.sources["free"] == "NVML nvmlDeviceGetMemoryInfo free"
    assert snap.sources["process"].startswith("nvmlDeviceGetComputeRunningProcesses_v2")


# --- item 5: a MIG slice is the slice, not the card ----------------------------


def _mig_a100() -> FakeGpu:
    return _a100(reserved=520 * MiB, used=30 * GiB, mig_slots=7, migs={
        0: FakeMig(MIG_3G, "3g.20gb", total=19968 * MiB, used=12 * GiB,
                   processes=[(OTHER, 12 * GiB)]),
        2: FakeMig(MIG_1G, "1g.5gb", total=4864 * MiB, reserved=64 * MiB, used=3 * GiB,
                   processes=[(ME, 2 * GiB), (THIRD, 1 * GiB)])})


def test_fake_probe_mig_slice_reports_its_own_memory_and_profile(driver, monkeypatch) -> None:
    driver.gpus = [_mig_a100()]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_1G)
    # torch's UUID of a MIG device is the slice's; its PCI bus id is the parent's.
    _torch_sees(monkeypatch, total_memory=4800 * MiB, uuid=MIG_1G[4:])
    snap = probe("cuda:0")
    assert snap.total_bytes == 4800 * MiB  # before: 40 GiB, the whole card by bus id
    assert snap.free_bytes == 4864 * MiB - 64 * MiB - 3 * GiB
    assert snap.extra["mig_profile"] == "1g.5gb" and snap.extra["nvml_mapped_by"] == "mig uuid"
    assert snap.sources["total"] == "NVML nvmlDeviceGetMemoryInfo_v2 (MIG 1g.5gb) total - reserved"
    # Tenants of other slices are not "other processes" of this one.
    assert (snap.process_bytes, snap.other_processes_bytes) == (2 * GiB, 1 * GiB)


def test_fake_nvml_mig_slice_found_from_visible_devices_alone(driver) -> None:
    driver.gpus = [_mig_a100()]
    dev, how = nvml.query_for_torch_index(0, uuid=None, pci_bus_id="0000:3b:00")
    assert dev is None and "MIG mode" in how  # never the parent by bus id
    migs = nvml.mig_devices()
    assert [(m.uuid, m.mig_index) for m in migs] == [(MIG_3G, 0), (MIG_1G, 2)]
    assert nvml.match_mig(migs, 0, uuid=None, cuda_visible_devices="MIG-cba663e8")[1] == (
        "CUDA_VISIBLE_DEVICES MIG uuid")


def test_fake_probe_unmatched_mig_falls_back_to_cudas_own_figures(driver, monkeypatch) -> None:
    driver.gpus = [_mig_a100()]
    _torch_sees(monkeypatch, total_memory=4800 * MiB, uuid="00000000-0000-0000-0000-000000000000",
                free=1800 * MiB)
    snap = probe("cuda:0")
    assert (snap.total_bytes, snap.free_bytes) == (4800 * MiB, 1800 * MiB)
    assert snap.sources["total"] == "torch.cuda.mem_get_info" and "MIG" in snap.extra["nvml"]
