"""Process and device memory figures for the memory event."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import psutil

from s2s_daemon.pipeline.vocabulary import DeviceMemory

MIB = 1024.0 * 1024.0


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    rss_mib: float
    """Resident set size now, mebibytes."""
    peak_rss_mib: float
    """Resident high-water mark since start, mebibytes."""


_SELF = psutil.Process()


def process_memory() -> ProcessMemory:
    rss = _SELF.memory_info().rss / MIB
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    peak = maxrss / MIB if sys.platform == "darwin" else maxrss / 1024.0
    return ProcessMemory(round(rss, 1), round(max(peak, rss), 1))


def memory_payload(site_id: str, ts_ms: int, device: DeviceMemory) -> dict[str, object]:
    proc = process_memory()
    return {
        "siteId": site_id,
        "ts": ts_ms,
        "rssMiB": proc.rss_mib,
        "peakRssMiB": proc.peak_rss_mib,
        "deviceKind": device.kind,
        "deviceAllocatedMiB": round(device.allocated_mib, 1),
        "devicePeakMiB": round(device.peak_mib, 1),
    }
