"""Arabic numbers as Mandarin reads them (num2words has no Chinese).

Cardinals up to 10^16 the way they are said (``2350`` -> 两千三百五十, ``1005`` -> 一千零五,
``15`` -> 十五); a year or a code digit by digit (``2005`` -> 二零零五); a decimal with 点 and
its digits one by one (``3.14`` -> 三点一四).
"""

from __future__ import annotations

DIGITS = "零一二三四五六七八九"
_SMALL = ("", "十", "百", "千")
_LARGE = ("", "万", "亿", "万亿")
MAX_DIGITS = 16
"""Longer integers are read digit by digit."""


def digits(text: str) -> str:
    """``2005`` -> 二零零五 (every character of ``text`` a digit)."""
    return "".join(DIGITS[ord(c) - 48] for c in text)


def _section(value: int) -> str:
    """0 < ``value`` < 10000 as 千百十 and digits, with 零 for the gaps inside it."""
    out: list[str] = []
    gap = False
    for power in (3, 2, 1, 0):
        digit = value // 10**power % 10
        if digit == 0:
            gap = bool(out)
            continue
        if gap:
            out.append("零")
            gap = False
        word = "两" if digit == 2 and power == 3 else DIGITS[digit]
        out.append(word + _SMALL[power])
    return "".join(out)


def cardinal(value: int) -> str:
    """A non-negative integer as it is said; digit by digit past ``MAX_DIGITS``."""
    if value == 0:
        return "零"
    if len(str(value)) > MAX_DIGITS:
        return digits(str(value))
    sections: list[str] = []
    index = 0
    while value:
        value, part = divmod(value, 10000)
        if part:
            text = "两" if part == 2 and index else _section(part)
            if value and part < 1000:
                text = "零" + text  # 10005: 一万零五
            sections.append(text + _LARGE[index])
        index += 1
    result = "".join(reversed(sections)).replace("零零", "零")
    if result.startswith("一十"):
        result = result[1:]
    return result


def decimal(whole: str, fraction: str) -> str:
    """``3``, ``14`` -> 三点一四."""
    return f"{cardinal(int(whole))}点{digits(fraction)}"
