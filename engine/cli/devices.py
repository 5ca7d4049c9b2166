"""The budget a command's trials run under (the device is resolved by
:func:`oomguard.probes.device.resolve_device`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomguard.engine.util.units import parse_size

if TYPE_CHECKING:
    import torch

DEFAULT_CPU_BUDGET = "2GiB"


def default_budget(dev: torch.device, given: int | None) -> int | None:
    """The budget a search runs under: the one given; on CPU 2 GiB (None where the OS
    cannot cap host memory); on CUDA None, so trials meet the device's own limit,
    whatever the warm-up left free (a number probed before the warm-up counted the
    model twice); on MPS the probed recommended working set left, since MPS's default
    cap (1.7x that) lets a process swap before it runs out."""
    if given is not None:
        return given
    if dev.type == "cpu":
        from oomguard.engine.core.memory.budget import host_budgets_available

        return parse_size(DEFAULT_CPU_BUDGET) if host_budgets_available() else None
    if dev.type == "cuda":
        return None
    from oomguard.probes import probe

    return probe(dev).free_bytes


def budget_free_limit(device: str) -> str:
    """What limits trials that run without a budget, in words, for the search's first line:
    the device's own limit on a GPU; on the host, the RAM guard (a share of the available
    RAM, estimated and not enforced), with why there is no budget."""
    if not str(device).startswith("cpu"):
        return "the device's own limit"
    from oomguard.engine.core.memory.ramguard import DEFAULT_FRACTION
    from oomguard.engine.util.units import fmt_bytes
    from oomguard.probes import host

    why = host.host_budget_unavailable() or "no budget given"
    free = host.host_memory().get("free")
    if not free:
        return f"no budget ({why}; available RAM unknown: bounded by --max-size only)"
    return (f"a RAM guard at {DEFAULT_FRACTION:.0%} of the RAM available after the warm-up "
            f"({fmt_bytes(free)} now; estimated, not enforced; {why})")
