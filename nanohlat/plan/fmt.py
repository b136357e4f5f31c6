"""Formatting for the printed plan: bytes, counts, FLOPs and seconds in human
units, and the aligned tables every sheet prints."""

from __future__ import annotations


GiB = 2**30


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    """A count in human units, 3 significant digits: 250k, 4.19M, 6.74B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def fmt_flop(f: float, unit: str = "FLOP") -> str:
    for prefix, size in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if f >= size:
            return f"{f / size:.4g} {prefix}{unit}"
    return f"{f:.3g} {unit}"


def fmt_seconds(s: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60), ("s", 1), ("ms", 1e-3)):
        if s >= size:
            return f"{s / size:.2f} {unit}"
    return f"{s * 1e6:.1f} us"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  " + "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                      for i, (c, w) in enumerate(zip(r, widths)))
    return [line(header).rstrip()] + [line(r).rstrip() for r in rows]
