"""GPU failures that mean "out of memory", by their printed messages; the evidence
(a CUDA device near its limit) comes from a fake torch.cuda (tests/fakes/fake_nvml.py)."""

from __future__ import annotations

import pytest
from fakes.fake_nvml import FakeCudaDevice, GiB, install_fake_torch_cuda

from oomguard.engine.core.memory.oom import cuda_memory_near_limit, is_oom

# As torch prints them: AT_CUDNN_CHECK writes "cuDNN error: " + cudnnGetErrorString(status);
# cuDNN 9 (torch >= 2.4) names its allocation failures CUDNN_STATUS_INTERNAL_ERROR_*.
CUDNN9_ALLOCATION = [
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
]
# MPSAllocator.mm: TORCH_CHECK(size < m_max_buffer_size, "Invalid buffer size: ", format_size(size))
MPS_SIZE_LIMIT = ["Invalid buffer size: 24.00 GB"]
# Under memory pressure, but also for other causes: OOMs only with evidence.
NEEDS_EVIDENCE = [
    # aten/src/ATen/native/cudnn/Conv_v8.cpp after every plan failed (OOMs swallowed)
    "FIND was unable to find an engine to execute this computation",
    "GET was unable to find an engine to execute this computation",
    # CUDA_CHECK of cublasCreate when the device is full
    "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
]


@pytest.mark.parametrize("text", CUDNN9_ALLOCATION + MPS_SIZE_LIMIT)
def test_fake_cudnn9_and_mps_limits_are_ooms_without_evidence(text: str) -> None:
    assert is_oom(RuntimeError(text), memory_constrained=False)


def _device(**kw: object) -> FakeCudaDevice:
    base = dict(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, uuid="0" * 8, free=40 * GiB,
                reserved=10 * GiB, fraction=1.0)
    base.update(kw)
    return FakeCudaDevice(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", NEEDS_EVIDENCE)
def test_fake_gpu_failures_count_only_near_a_cuda_limit(text: str, monkeypatch) -> None:
    exc = RuntimeError(text)
    install_fake_torch_cuda(monkeypatch, [_device()])  # half the device free: not memory
    assert not cuda_memory_near_limit() and not is_oom(exc)
    # The device is full (other processes): cudaMemGetInfo free under 10% of total.
    install_fake_torch_cuda(monkeypatch, [_device(free=2 * GiB)])
    assert is_oom(exc)
    # An oomguard fraction cap of 20 GiB with 19 GiB reserved: the allocator is at its limit.
    install_fake_torch_cuda(monkeypatch, [_device(fraction=0.25, reserved=19 * GiB)])
    assert is_oom(exc)
    # A full device this process has no context on is not evidence about this process.
    install_fake_torch_cuda(monkeypatch, [_device(free=1 * GiB, context=False)])
    assert not is_oom(exc)
    assert is_oom(exc, memory_constrained=True) and not is_oom(exc, memory_constrained=False)


def test_fake_gpu_evidence_is_not_host_evidence(monkeypatch) -> None:
    # A full GPU says nothing about a failed thread start (a host row).
    install_fake_torch_cuda(monkeypatch, [_device(free=1 * GiB)])
    assert not is_oom(RuntimeError("can't start new thread"))
