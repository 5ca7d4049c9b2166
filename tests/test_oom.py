"""OOM classification on real messages, and a real CPU OOM caught and cleaned up."""

from __future__ import annotations

import resource

import numpy as np
import pytest
import torch
from conftest import in_fresh_process

from oomguard.engine.core.budget import budget
from oomguard.engine.core.oom import OOM, call_catching_oom, is_oom, memory_limit_near
from oomguard.probes.host import proc_status

MiB = 1024**2

# Messages as the allocators and libraries print them (sizes vary, the words do not).
OOM_TEXTS = [
    # CUDA caching allocator, torch < 2.1 format
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.77 GiB total capacity; "
    "14.50 GiB already allocated; 3.12 MiB free; 14.80 GiB reserved in total by PyTorch) If "
    "reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.",
    # CUDA caching allocator, torch >= 2.1 format
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory "
    "in use. Of the allocated memory 77.50 GiB is allocated by PyTorch, and 120.00 MiB is "
    "reserved by PyTorch but unallocated.",
    # cudaErrorMemoryAllocation surfaced by C10_CUDA_CHECK (context creation, kernels)
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
    "other API call, so the stacktrace below might be incorrect.\nFor debugging consider "
    "passing CUDA_LAUNCH_BLOCKING=1",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`",
    "MPS backend out of memory (MPS allocated: 18.13 GB, other allocations: 3.40 MB, max "
    "allowed: 18.13 GB). Tried to allocate 256 bytes on shared pool. Use "
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
    "(may cause system failure).",
    "HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 63.98 GiB "
    "of which 1.23 GiB is free.",
    "XPU out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 15.11 GiB.",
    # The CPU allocator under RLIMIT_DATA
    "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 536870912 bytes. Error code 12 (Cannot allocate memory)",
]

NOT_OOM = [
    RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors "
                 "might be asynchronously reported at some other API call"),
    RuntimeError("CUDA error: device-side assert triggered\nCompile with "
                 "`TORCH_USE_CUDA_DSA` to enable device-side assertions."),
    RuntimeError("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1269, "
                 "internal error, NCCL version 2.14.3\nncclInternalError: Internal check failed."),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    RuntimeError("CUDA error: misaligned address"),
    IndexError("index 10 is out of bounds for dimension 0 with size 4"),
    RuntimeError("index 10 is out of bounds for dimension 0 with size 4"),
    ValueError("the dataset ran out of memory budget: pass a CUDA out of memory value"),
    KeyError("out of memory"),
    RuntimeError("Expected all tensors to be on the same device, but found at least two "
                 "devices, cuda:0 and cpu!"),
    RuntimeError("CUDA error: no kernel image is available for execution on the device"),
]


@pytest.mark.parametrize("text", OOM_TEXTS)
def test_real_oom_messages_are_ooms(text: str) -> None:
    assert is_oom(RuntimeError(text))


@pytest.mark.parametrize("exc", NOT_OOM, ids=lambda e: f"{type(e).__name__}:{str(e)[:30]}")
def test_look_alikes_are_not_ooms(exc: BaseException) -> None:
    assert not is_oom(exc)


def test_oom_types_are_ooms_whatever_their_text() -> None:
    assert is_oom(torch.OutOfMemoryError("anything"))
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"))
    assert is_oom(MemoryError())


def test_cuda_driver_api_oom_message() -> None:
    assert is_oom(RuntimeError("CUDA driver error: out of memory"))
    assert is_oom(RuntimeError("cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/THCCachingAllocator.cpp:510"))
    assert is_oom(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1269, unhandled cuda error, NCCL version 2.18.1\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'"))
    assert is_oom(RuntimeError("Triton Error [CUDA]: out of memory"))


def test_onednn_primitive_failure_counts_only_under_a_budget() -> None:
    exc = RuntimeError("could not create a primitive")
    assert not is_oom(exc)
    assert not is_oom(exc, memory_constrained=False)
    assert is_oom(exc, memory_constrained=True)
    torch.ones(4, 4).sum()
    with budget(256 * MiB):
        assert is_oom(exc)
    assert not is_oom(exc)


def test_onednn_primitive_failure_counts_near_an_rlimit_set_by_someone_else() -> None:
    exc = RuntimeError("could not create a primitive")
    vm_data = proc_status("VmData")
    before = resource.getrlimit(resource.RLIMIT_DATA)
    try:  # no allocation happens between setting and restoring the limit
        resource.setrlimit(resource.RLIMIT_DATA, (int(vm_data * 1.05), before[1]))
        near = is_oom(exc), memory_limit_near()
        resource.setrlimit(resource.RLIMIT_DATA, (int(vm_data * 2), before[1]))
        far = is_oom(exc), memory_limit_near()
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)
    assert near == (True, True) and far == (False, False)
    assert not is_oom(exc)


def _oom_caught_and_memory_returned() -> dict:
    torch.ones(4, 4).sum()  # warm-up before the budget (docs/measurements.md#minimum-cpu-budget)
    baseline = proc_status("VmRSS")

    def step() -> float:
        held = torch.ones(64 * MiB // 4)  # alive in this frame when the OOM hits
        huge = torch.ones(1024 * MiB // 4)
        return float(held.sum() + huge.sum())

    with budget(256 * MiB):
        result = call_catching_oom(step, device="cpu")
        after = proc_status("VmRSS")
        again = call_catching_oom(lambda: float(torch.ones(16 * MiB // 4).sum()), device="cpu")
    return {"oom": isinstance(result, OOM), "message": getattr(result, "message", ""),
            "grew": after - baseline, "again": again}


@pytest.mark.integration
def test_real_cpu_oom_under_budget_is_caught_and_memory_returns() -> None:
    seen = in_fresh_process(_oom_caught_and_memory_returned)
    assert seen["oom"] and "DefaultCPUAllocator" in seen["message"]
    assert seen["again"] == 16 * MiB // 4
    assert seen["grew"] < 16 * MiB, seen["grew"] / MiB  # the 64 MiB held at the OOM is gone


def _numpy_oom() -> str | None:
    torch.ones(4, 4).sum()
    with budget(128 * MiB):
        result = call_catching_oom(lambda: np.ones(512 * MiB // 8).sum())
    return result.message if isinstance(result, OOM) else None


@pytest.mark.integration
def test_real_numpy_memory_error_under_budget_is_an_oom() -> None:
    message = in_fresh_process(_numpy_oom)
    assert message is not None and message.startswith("MemoryError")


def test_errors_that_are_not_ooms_propagate_from_call_catching_oom() -> None:
    def bad() -> None:
        torch.ones(4, 3) @ torch.ones(5, 6)

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        call_catching_oom(bad)
