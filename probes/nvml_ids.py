"""Pure identity rules for NVML devices: bus ids, UUIDs, ``CUDA_VISIBLE_DEVICES``, MIG, drivers.

No driver is needed: these map what torch knows of a device (index, UUID, PCI
bus id, the environment) to NVML's numbering, and say which driver versions
answer which process query wrongly. :mod:`oomguard.probes.nvml` asks the driver.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_PCI_RE = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?$")


def normalize_pci_bus_id(bus_id: str) -> str | None:
    """``"00000000:3B:00.0"`` or ``"0000:3b:00.0"`` -> ``"0000:3b:00"`` (None if unparsable):
    NVML writes an 8-digit domain, CUDA a 4-digit one; a GPU is one PCI function."""
    m = _PCI_RE.match(bus_id.strip())
    if m is None:
        return None
    return pci_bus_id_from_ints(*(int(g, 16) if g else 0 for g in m.groups()))


def pci_bus_id_from_ints(domain: int, bus: int, device: int) -> str:
    """The normalised bus id from torch's ``pci_domain_id``/``pci_bus_id``/``pci_device_id``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def normalize_uuid(uuid: str) -> str:
    """Lower-case UUID without the ``GPU-``/``MIG-`` prefix (torch prints it bare, NVML with it)."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith(("gpu-", "mig-")) else u


def map_visible_devices(cuda_visible_devices: str | None,
                        nvml_devices: Sequence[tuple[str, str]]) -> list[int]:
    """NVML indices of the devices CUDA exposes, in torch's order, from ``CUDA_VISIBLE_DEVICES``
    (None: every device) and ``(uuid, pci_bus_id)`` per NVML index. Entries are integers (PCI
    order: prefer :func:`match_device`), ``GPU-`` UUIDs or unique prefixes; as in CUDA, parsing
    stops at the first entry that names no whole GPU."""
    n = len(nvml_devices)
    if cuda_visible_devices is None:
        return list(range(n))
    uuids = [normalize_uuid(u) for u, _ in nvml_devices]
    out: list[int] = []
    for raw in cuda_visible_devices.split(","):
        token = raw.strip()
        index: int | None = None
        if re.fullmatch(r"[0-9]+", token):
            index = int(token) if int(token) < n else None
        elif token.lower().startswith("gpu-"):
            want = normalize_uuid(token)
            hits = [i for i, u in enumerate(uuids) if u.startswith(want)]
            index = hits[0] if len(hits) == 1 else None
        if index is None or index in out:
            break
        out.append(index)
    return out


def match_device(nvml_devices: Sequence[tuple[str, str]], *, uuid: str | None = None,
                 pci_bus_id: str | None = None) -> int | None:
    """The NVML index whose UUID (preferred) or PCI bus id equals the given one, or None."""
    uuids = [normalize_uuid(u) for u, _ in nvml_devices]
    if uuid and normalize_uuid(uuid) in uuids:
        return uuids.index(normalize_uuid(uuid))
    want = normalize_pci_bus_id(pci_bus_id) if pci_bus_id else None
    buses = [normalize_pci_bus_id(p) for _, p in nvml_devices]
    return buses.index(want) if want is not None and want in buses else None


def nvml_index_for(torch_index: int, nvml_devices: Sequence[tuple[str, str]], *,
                   cuda_visible_devices: str | None, uuid: str | None = None,
                   pci_bus_id: str | None = None) -> tuple[int | None, str]:
    """Map torch's ``cuda:torch_index`` to an NVML index; return (index or None, how): by
    torch's own identity of the device (UUID, then PCI bus id: exact whatever
    ``CUDA_DEVICE_ORDER`` is), else by parsing ``CUDA_VISIBLE_DEVICES``."""
    by_id = match_device(nvml_devices, uuid=uuid, pci_bus_id=pci_bus_id)
    if by_id is not None:
        how = "uuid" if uuid and normalize_uuid(nvml_devices[by_id][0]) == normalize_uuid(uuid) \
            else "pci bus id"
        return by_id, how
    visible = map_visible_devices(cuda_visible_devices, nvml_devices)
    if 0 <= torch_index < len(visible):
        src = "CUDA_VISIBLE_DEVICES" if cuda_visible_devices is not None else "index order"
        return visible[torch_index], src
    return None, (f"cuda:{torch_index} is not among the {len(visible)} device(s) NVML "
                  f"matches to CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")


@dataclass(frozen=True)
class MigIdentity:
    """One MIG device: its ``MIG-`` UUID, its parent's NVML index and its MIG index there."""

    uuid: str
    parent_index: int
    mig_index: int


def match_mig(migs: Sequence[MigIdentity], torch_index: int, *, uuid: str | None,
              cuda_visible_devices: str | None) -> tuple[MigIdentity | None, str]:
    """The MIG device that is torch's ``cuda:torch_index``, or (None, why not): by torch's UUID
    of it, else the ``torch_index``-th ``MIG-`` entry (a unique prefix) of ``CUDA_VISIBLE_DEVICES``."""
    if uuid:
        want = normalize_uuid(uuid)
        for m in migs:
            if normalize_uuid(m.uuid) == want:
                return m, "mig uuid"
    tokens = [t.strip() for t in (cuda_visible_devices or "").split(",")]
    tokens = [t for t in tokens if t.lower().startswith("mig-")]
    if 0 <= torch_index < len(tokens):
        want = normalize_uuid(tokens[torch_index])
        hits = [m for m in migs if normalize_uuid(m.uuid).startswith(want)]
        if len(hits) == 1:
            return hits[0], "CUDA_VISIBLE_DEVICES MIG uuid"
    return None, "no MIG device matches"


_MISPARSE_V3 = ((535, 43), (535, 86))  # inclusive, by (major, minor)


def misparses_v3(driver: str | None) -> bool:
    """Whether this driver fills ``_v3`` process lists with a struct pynvml does not read:
    drivers 535.43-535.86 wrote ``nvmlProcessInfo_v3_t`` (32 bytes) where nvidia-ml-py reads
    the 24-byte v2 struct, so every entry after the first is read at the wrong offset."""
    m = re.match(r"^(\d+)\.(\d+)", driver or "")
    return m is not None and _MISPARSE_V3[0] <= (int(m[1]), int(m[2])) <= _MISPARSE_V3[1]
