"""What this process's memory mappings say about an address (/proc/self/smaps)."""

from __future__ import annotations


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` ("hg": advised for huge pages)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
