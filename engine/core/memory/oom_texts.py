"""Every text that says "out of memory": one table for exceptions and for the stderr of a child
that died, read by :func:`~oomguard.engine.core.memory.oom.is_oom` and by the child launcher
(:func:`~oomguard.engine.core.child.oom_evidence`). It imports nothing, so a process that has
not imported torch can read it.
"""

from __future__ import annotations

from typing import NamedTuple


class OomText(NamedTuple):
    """One row of :data:`OOM_TABLE`: ``text`` in the message of an exception of
    one of ``types`` is an OOM; with ``evidence`` only while a memory limit is near."""

    text: str  # lower-case; matched case-insensitively as a substring of str(exc)
    types: tuple[type[BaseException], ...]
    evidence: bool
    why: str
    # Which limit is the evidence: "host" (memory_limit_near) or "cuda" (cuda_memory_near_limit).
    near: str = "host"
    # Also the text a child process prints on stderr as it dies for want of memory.
    stderr: bool = False


_RT = (RuntimeError,)  # torch.OutOfMemoryError is a RuntimeError too
# Every message oomguard recognises (tests/test_oom.py checks each row). A row with evidence
# also has causes a smaller size does not cure.
OOM_TABLE: tuple[OomText, ...] = (
    OomText("cuda out of memory", _RT, False, "torch.OutOfMemoryError's text on CUDA"),
    OomText("cuda error: out of memory", _RT, False, "runtime error surfaced by a kernel launch"),
    OomText("cuda driver error: out of memory", _RT, False, "expandable segments: cuMemCreate"),
    OomText("cuda runtime error (2) : out of memory", _RT, False, "legacy THC wording"),
    OomText("cuda failure 'out of memory'", _RT, False, "NCCL's ncclUnhandledCudaError"),
    OomText("triton error [cuda]: out of memory", _RT, False, "Triton kernel launch"),
    OomText("cublas_status_alloc_failed", _RT, False, "cuBLAS workspace allocation"),
    OomText("cudnn_status_alloc_failed", _RT, False, "cuDNN < 9 allocation failure"),
    OomText("cudnn_status_not_enough_workspace", _RT, False, "cuDNN workspace"),
    OomText("cudnn_status_internal_error_device_allocation_failed", _RT, False,
            "cuDNN >= 9 (torch >= 2.4) device allocation failure"),
    OomText("cudnn_status_internal_error_host_allocation_failed", _RT, False,
            "cuDNN >= 9 host allocation failure"),
    # Not memory: cuDNN's fixed batch limits (BatchNorm above 65535 in eval), cured by a
    # smaller size, so no evidence is asked, as in accelerate.
    OomText("cudnn_status_not_supported", _RT, False, "cuDNN size limit (accelerate parity)"),
    OomText("cufft_alloc_failed", _RT, False, "cuFFT plan allocation"),
    OomText("cusolver_status_alloc_failed", _RT, False, "cuSOLVER handle allocation"),
    OomText("mps backend out of memory", _RT, False, "Apple MPS"),
    # MPSAllocator.mm's check against maxBufferLength: a smaller batch cures it.
    OomText("invalid buffer size: ", _RT, False, "Apple MPS buffer above maxBufferLength"),
    OomText("hip out of memory", _RT, False, "ROCm"),
    OomText("xpu out of memory", _RT, False, "Intel XPU"),
    OomText("npu out of memory", _RT, False, "Ascend NPU (torch_npu)"),
    OomText("mlu out of memory", _RT, False, "Cambricon MLU (torch_mlu)"),
    OomText("musa out of memory", _RT, False, "Moore Threads MUSA (torch_musa)"),
    OomText("sdaa out of memory", _RT, False, "Tecorigin SDAA (torch_sdaa)"),
    OomText("out of memory. tried to allocate", _RT, False, "forks of CUDA's caching allocator"),
    OomText("pt_devmem allocation failed", _RT, False, "Intel Gaudi HPU"),
    OomText("defaultcpuallocator: can't allocate memory", _RT, False, "CPU, under RLIMIT_DATA"),
    OomText("failed to allocate memory", _RT, False, "c10 / oneDNN scratchpad"),
    OomText("out of memory trying to allocate", _RT, False, "c10 allocators"),
    # The rows below also have causes that are not memory. docs/measurements.md#onednn-primitive
    OomText("could not create a primitive", _RT, True, "oneDNN building a kernel", stderr=True),
    # its scratchpad allocated when the kernel runs (an LSTM step under a budget)
    OomText("could not execute a primitive", _RT, True, "oneDNN running a kernel", stderr=True),
    # The next four: docs/measurements.md#cpu-oom-without-memoryerror. A thread's 8 MiB
    # stack counts against RLIMIT_DATA; with no limit near this is a thread limit.
    OomText("can't start new thread", _RT, True, "threading.Thread.start"),
    # A C function failed an allocation without setting MemoryError (or has a bug).
    OomText("returned null without setting an", (SystemError,), True, "an import, a C function"),
    # dlopen cannot map a C extension's writable segments; also a noexec mount.
    OomText("failed to map segment from shared object", (ImportError,), True, "an import (dlopen)"),
    OomText("cannot map zero-fill pages", (ImportError,), True, "an import (dlopen)"),
    # A system call refused memory (ENOMEM: mmap, a read into a new buffer, fork); also a
    # kernel short of its own memory, hence evidence.
    OomText("[errno 12] cannot allocate memory", (OSError,), True, "a system call (ENOMEM)"),
    # cuDNN v8/v9 swallows each plan's OutOfMemoryError (Conv_v8.cpp try_plans): a full
    # device ends here, as does an unsupported layout.
    OomText("unable to find an engine to execute this computation", _RT, True,
            "cuDNN v8/v9 API: every plan failed", "cuda"),
    # cublasCreate on a full device; also a broken CUDA install.
    OomText("cublas_status_not_initialized", _RT, True, "cuBLAS handle creation", "cuda"),
    # The allocator's OOM path queries NVML before raising; where NVML refuses (MIG without
    # root, WSL2, containers) one of three TORCH_INTERNAL_ASSERTs replaces the OOM.
    OomText("nvml_success == r internal assert failed", _RT, True,
            "CUDA OOM whose NVML process query failed (pytorch#112377)", "cuda"),
    OomText("nvml_success == driverapi::get()->nvmlinit_v2_() internal assert failed", _RT, True,
            "CUDA OOM whose nvmlInit failed", "cuda"),
    OomText("nvml_success == driverapi::get()->nvmldevicegethandlebypcibusid_v2_(", _RT, True,
            "CUDA OOM whose NVML device lookup failed", "cuda"),
    # Only on a dying child's stderr: libgomp exits with code 1 when a thread's stack does
    # not fit (docs/measurements.md#minimum-cpu-budget).
    OomText("libgomp: out of memory", (), False, "gomp_malloc: Out of memory allocating N bytes",
            stderr=True),
    OomText("libgomp: thread creation failed", (), False, "a thread's stack", stderr=True),
    OomText("std::bad_alloc", (), False, "a C++ allocation failure nothing caught (SIGABRT)",
            stderr=True),
)


def stderr_oom(text: str) -> OomText | None:
    """The first row whose text a dying child printed on stderr (``text``, any case), or None."""
    lower = text.lower()
    return next((row for row in OOM_TABLE if row.stderr and row.text in lower), None)
