"""What the device said when it refused a program for memory, read from its error.

Whether a program fits is the device's call, not a sum of XLA's memory analysis: on a TPU that
analysis counts temporaries the compiler's buffer assignment packs into less (the one-chip recipe's
step sums to 16.68 GiB and runs in 15.75). The device says no in two places, each with its own
figures:

- the compiler, after buffer assignment (the program's own peak), e.g.
    RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
    (19.76G) exceeds available HBM (15.75G).
  or, in other libtpu versions,
    RESOURCE_EXHAUSTED: ... Ran out of memory in memory space hbm. Used 17.14G of 15.48G hbm.
- the runtime, when an allocation at load or run finds no room, e.g.
    RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.39G. That was not
    possible. There are 2.30G free.

"G" is GiB there (XLA prints sizes in powers of 1024). A refusal without figures (a kernel's VMEM,
a message in another form) is still a refusal: its figures are None and its message is kept.
"""

from __future__ import annotations

import re

_SIZE = r"([\d.]+)\s*([KMGT]?)i?B?"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

# (what the figures are, when the device said it, the pattern: needed size first, then available)
_FORMS = (
    ("HLO temporaries", "compile", re.compile(r"temporaries \(" + _SIZE + r"\) exceeds available HBM \(" + _SIZE + r"\)")),
    ("the program's HBM", "compile", re.compile(r"memory space hbm\. Used " + _SIZE + " of " + _SIZE + " hbm")),
    ("one allocation", "run", re.compile(r"Attempting to allocate " + _SIZE + r"\. That was not possible\. "
                                         r"There are " + _SIZE + " free")),
)
_ANY_REFUSAL = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|Out of memory|VmemOom", re.I)


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit])


def device_refusal(error: BaseException | str, when: str | None = None) -> dict | None:
    """{"what", "when", "needed_bytes", "available_bytes", "message"} of a refusal for memory
    (None: the error is something else). `when` ("compile", "run") names where it was caught, for a
    message in no known form."""
    text = str(error)
    if not _ANY_REFUSAL.search(text):
        return None
    line = next((ln.strip() for ln in text.splitlines() if _ANY_REFUSAL.search(ln)), text.strip())
    for what, said_at, pattern in _FORMS:
        m = pattern.search(text)
        if m:
            return {"what": what, "when": said_at, "needed_bytes": _bytes(m.group(1), m.group(2)),
                    "available_bytes": _bytes(m.group(3), m.group(4)), "message": line[:400]}
    return {"what": None, "when": when, "needed_bytes": None, "available_bytes": None, "message": line[:400]}


def describe(refusal: dict) -> str:
    """One line: what the device refused, with its own figures where it gave them."""
    at = {"compile": "the compiler refused it", "run": "the runtime refused an allocation"}.get(
        refusal["when"], "the device refused it")
    if refusal["needed_bytes"] is None:
        return f"{at}: {refusal['message']}"
    gib = 2**30
    return (f"{at}: {refusal['what']} {refusal['needed_bytes'] / gib:.2f} GiB against "
            f"{refusal['available_bytes'] / gib:.2f} GiB available (the device's figures)")
