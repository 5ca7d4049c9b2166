"""GPU checks of the swallowed-OOM witness (engine/core/memory/swallowed.py), on a real CUDA device.

Each check prints one line, PASS or FAIL, with what it measured:

- ``num_ooms``: a workload that catches the allocator's ``OutOfMemoryError`` and returns a
  placeholder is an OOM for ``call_catching_oom`` (the allocator's count rose);
- ``spotter in backward``: with the CPU signal forced on (``set_spotter_mode("on")``), an OOM
  raised in the backward pass, which the autograd engine runs on its CUDA device thread, and
  caught by the workload, is seen by the dispatch mode itself (its text, not the count's);
- ``cost``: per call, ``call_catching_oom`` of a no-op on ``cuda:0`` (two reads of the
  allocator's nested stats) against a bare call, and one read of ``memory_stats`` (flattened
  in Python) and of ``memory_stats_as_nested_dict``; a tiny GPT-2's forward and backward on the GPU bare, with the
  witness (spotter off, the default without a budget) and with the spotter on;
- ``sys.monitoring`` (Python 3.12+ only): the cost on the CPU of noting exceptions through
  ``sys.monitoring`` RAISE events instead of a dispatch mode, for the record.

Run: ``python bench/gpu_check_swallowed.py`` (exit 1 if a check failed).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.core.memory.swallowed import set_spotter_mode

GiB = 1024**3


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int = 7, sync: bool = True) -> float:
    """Best of ``repeats`` blocks of the mean wall time per call (us), the device synchronised."""
    fn()
    best = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / calls * 1e6)
    return min(best)


def check_num_ooms(dev: torch.device) -> tuple[bool, str]:
    free, _ = torch.cuda.mem_get_info(dev)

    def swallows() -> dict[str, Any]:
        try:
            block = torch.empty(free * 2, dtype=torch.uint8, device=dev)
            return {"computed": True, "n": block.numel()}
        except Exception as e:  # noqa: BLE001 - the shape under test
            return {"computed": False, "error": str(e)[:40]}

    got = call_catching_oom(swallows, device=dev, workload="swallows")
    ok = isinstance(got, OOM) and got.caught_by_workload and "num_ooms" in got.message
    return ok, getattr(got, "message", repr(got))[:200]


def check_spotter_in_backward(dev: torch.device) -> tuple[bool, str]:
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    table = torch.randn(2 * GiB // 4 // 64, 64, device=dev, requires_grad=True)  # 2 GiB
    # A cap of 3 GiB: the forward of one row fits, the backward's dense 2 GiB gradient not.
    torch.cuda.set_per_process_memory_fraction(3 * GiB / total, dev)

    def backward_caught() -> str:
        loss = torch.nn.functional.embedding(torch.tensor([3], device=dev), table).sum()
        try:
            loss.backward()
            return "ok"
        except RuntimeError:
            return "skipped"

    set_spotter_mode("on")
    try:
        got = call_catching_oom(backward_caught, device=dev, workload="backward_caught")
    finally:
        set_spotter_mode("auto")
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        table.grad = None  # the 2 GiB table goes when this function returns
    ok = isinstance(got, OOM) and got.caught_by_workload and "CUDA out of memory" in got.message
    return ok, getattr(got, "message", repr(got))[:200]


def check_cost(dev: torch.device) -> tuple[bool, str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    def noop() -> None:
        return None

    bare = per_call_us(noop, 20000, sync=False)
    wrapped = per_call_us(lambda: call_catching_oom(noop, device=dev), 20000, sync=False)
    stats = per_call_us(lambda: torch.cuda.memory_stats(dev), 2000, sync=False)
    nested = per_call_us(lambda: torch.cuda.memory_stats_as_nested_dict(dev), 2000, sync=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                       n_positions=32)).to(dev)
    ids = torch.randint(0, 64, (4, 32), device=dev)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    plain = per_call_us(step, 50)
    off = per_call_us(lambda: call_catching_oom(step, device=dev), 50)
    set_spotter_mode("on")
    try:
        on = per_call_us(lambda: call_catching_oom(step, device=dev), 50)
    finally:
        set_spotter_mode("auto")
    return True, (f"call_catching_oom(noop, cuda) {wrapped - bare:.1f} us added per call "
                  f"(memory_stats {stats:.1f} us, memory_stats_as_nested_dict {nested:.1f} us "
                  f"a read); tiny GPT-2 fwd+bwd on the GPU: bare "
                  f"{plain:.0f} us, witness {off:.0f} us ({off / plain:.3f}x), spotter on "
                  f"{on:.0f} us ({on / plain:.3f}x)")


def check_sys_monitoring() -> tuple[bool, str]:
    if sys.version_info < (3, 12):
        return True, "skipped: Python < 3.12"
    from transformers import GPT2Config, GPT2LMHeadModel

    from oomguard.engine.core.memory.oom import is_oom

    mon = sys.monitoring
    tool = mon.PROFILER_ID if mon.get_tool(mon.PROFILER_ID) is None else 5
    seen: list[str] = []

    def on_raise(code: Any, offset: int, exc: BaseException) -> None:
        if isinstance(exc, RuntimeError) and is_oom(exc):
            seen.append(type(exc).__name__)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                       n_positions=32))
    ids = torch.randint(0, 64, (4, 32))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def monitored() -> None:
        mon.use_tool_id(tool, "oomguard-check")
        mon.register_callback(tool, mon.events.RAISE, on_raise)
        mon.set_events(tool, mon.events.RAISE)
        try:
            step()
        finally:
            mon.set_events(tool, 0)
            mon.register_callback(tool, mon.events.RAISE, None)
            mon.free_tool_id(tool)

    plain = statistics.median(per_call_us(step, 40, sync=False) for _ in range(3))
    moni = statistics.median(per_call_us(monitored, 40, sync=False) for _ in range(3))
    set_spotter_mode("on")
    try:
        spot = statistics.median(per_call_us(lambda: call_catching_oom(step, device="cpu"), 40,
                                             sync=False) for _ in range(3))
    finally:
        set_spotter_mode("auto")
    return True, (f"CPU tiny GPT-2 fwd+bwd, 1 thread, Python {sys.version.split()[0]}: bare "
                  f"{plain:.0f} us, sys.monitoring RAISE {moni:.0f} us ({moni / plain:.3f}x), "
                  f"dispatch-mode spotter {spot:.0f} us ({spot / plain:.3f}x)")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    dev = torch.device("cuda:0")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}")
    failed = 0
    for name, check in (("num_ooms", lambda: check_num_ooms(dev)),
                        ("spotter in backward", lambda: check_spotter_in_backward(dev)),
                        ("cost", lambda: check_cost(dev)),
                        ("sys.monitoring", check_sys_monitoring)):
        try:
            ok, measured = check()
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check
            ok, measured = False, f"{type(exc).__name__}: {exc}"[:300]
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {measured}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
