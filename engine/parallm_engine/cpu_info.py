"""What this CPU is (vendor and feature flags), read once: below both ``backend`` (which BLAS, which
backend) and ``native`` (the kernels' build key), so neither has to import the other for it."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_features() -> tuple[str, frozenset[str]]:
    """(vendor id, feature flags) of this CPU from /proc/cpuinfo, read once; ("", {}) where unreadable."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if vendor and flags:
                    break
    except OSError:
        pass
    return vendor, frozenset(flags)
