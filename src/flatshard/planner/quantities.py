"""Parsing and printing of the quantities people type: parameter counts, byte sizes, bandwidths.

[Note: planner units]
The documents count memory in decimal units: "4 x 7 x 10^9 = 28 GB", "16 x 13 = 208 GB". The planner
follows them: ``GB`` is 10^9 bytes and every byte figure it prints is decimal. ``GiB`` (2^30 bytes) is
accepted on input and means what it says. A board sold as "40GB" (the A100-40GB) carries 40 GiB of
HBM, about 42.9e9 bytes, so ``--gpu-mem 40GB`` is 7% conservative; pass ``40GiB`` for the board's
real capacity. A memory size typed without a unit (``--gpu-mem 40``) is an error, not 40 bytes.

Bandwidths are bytes per second per rank per direction (what nccl-tests calls bus bandwidth). A bare
number is GB/s. ``Gb/s`` and ``Gbps`` are *bits* per second (InfiniBand is sold that way: 200 Gb/s
is 25 GB/s).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from flatshard.planner.errors import PlanError

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_BYTES_EXAMPLE = "40GB (10^9 bytes) or 40GiB (2^30 bytes)"
_NUMBER = r"([+-]?[0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"


def _split(text: str, what: str, example: str) -> tuple[Decimal, str]:
    match = re.fullmatch(_NUMBER + r"\s*([A-Za-z/]*)", text.strip())
    if match is None:
        raise PlanError(f"cannot read {what} {text!r}", f"write it like {example}")
    return Decimal(match.group(1).replace("_", "")), match.group(2)


def _read(text: str | int | float, what: str, example: str, factors: dict[str, int], hint: str, noun: str) -> Decimal:
    """The number ``text`` stands for, exactly (decimal arithmetic: "6.7B" is 6,700,000,000)."""
    value, suffix = (Decimal(repr(text)), "") if isinstance(text, (int, float)) else _split(text, what, example)
    factor = factors.get(suffix.upper())
    if factor is None:
        raise PlanError(f"unknown {noun} {suffix!r} in {what} {text!r}", hint)
    if not value.is_finite():
        raise PlanError(f"{what} {text!r} is not a finite number", f"write it like {example}")
    return value * factor


def parse_count(text: str | int | float, what: str = "parameter count") -> int:
    """``"7e9"``, ``"7B"``, ``"175B"``, ``"350M"``, ``"6738415616"`` -> an exact integer count."""
    count = _read(text, what, "7e9, 7B, 175B or 350M", _COUNT_SUFFIX, "use K, M, B (10^9) or T", "suffix")
    if count < 0:
        raise PlanError(f"{what} {text!r} is negative", "pass a size >= 0, e.g. 7B")
    if count != count.to_integral_value():
        raise PlanError(f"{what} {text!r} is not a whole number", "pass e.g. 7B or 7000000000")
    return int(count)


def parse_bytes(text: str | int | float, what: str = "memory size") -> int:
    """``"40GB"`` -> 40e9, ``"40GiB"`` -> 40 * 2^30, ``"512B"`` -> 512. A string needs its unit (is
    ``"40"`` 40 bytes or 40 GB?); a Python int or float is bytes."""
    if isinstance(text, str) and _split(text, what, _BYTES_EXAMPLE)[1] == "":
        raise PlanError(
            f"{what} {text!r} has no unit", f"write {text.strip()}GB (10^9 bytes) or {text.strip()}GiB (2^30 bytes)"
        )
    size = _read(
        text,
        what,
        _BYTES_EXAMPLE,
        _BYTE_SUFFIX,
        "use B, MB, GB, TB, MiB, GiB or TiB",
        "unit",
    )
    if size < 0:
        raise PlanError(f"{what} {text!r} is negative", "pass a size >= 0, e.g. 80GB")
    return int(size.to_integral_value())


def parse_bandwidth(text: str | int | float, what: str = "bandwidth") -> float:
    """``"300"`` or ``"300GB/s"`` -> 300e9 bytes/s; ``"200Gb/s"`` or ``"200Gbps"`` -> 25e9 bytes/s."""
    value: float | Decimal
    if isinstance(text, (int, float)):
        value, suffix = float(text), "GB/s"
    else:
        value, suffix = _split(text, what, "300GB/s, 300 (GB/s) or 200Gb/s (bits)")
    suffix = suffix or "GB/s"
    bits = re.fullmatch(r"([KMGT])(?:b/s|bps|bit/s)", suffix)
    factor: float | None
    if bits:
        factor = _COUNT_SUFFIX[bits.group(1)] / 8
    else:
        unit = suffix.upper()[:-2] if suffix.upper().endswith("/S") else None
        factor = _BYTE_SUFFIX.get(unit) if unit else None
    if factor is None:
        raise PlanError(f"unknown unit {suffix!r} in {what} {text!r}", "use GB/s (bytes) or Gb/s (bits)")
    rate = float(value) * factor
    if not math.isfinite(rate) or rate <= 0:
        raise PlanError(f"{what} {text!r} must be positive", "pass e.g. 25GB/s")
    return rate


def fmt_bytes(n: float) -> str:
    """Decimal units, as the documents write them: 14.875 GB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n:.0f}"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
