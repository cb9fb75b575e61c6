# ruff: noqa: RUF001 -- full-width CJK marks and dashes are the point
"""Numbers, times, dates, currencies, percentages and units in the request's language, rewritten
where the model reads them wrongly or not at all (docs/text.md says what this relies on).

``auto`` rewrites: an ISO date into the language's written form; a time with seconds into hours,
minutes and seconds; a currency symbol, ``%`` and a few units into words after their number;
ordinal suffixes (``21st``, ``1er``, ``2º``) into ordinal words; a number with group separators
(``28,000``; ``28.000`` in German; ``28 000`` in French) into words; and in Chinese every
remaining number. ``all`` also writes every other number in words. A number num2words cannot say
in the language, or longer than ``MAX_DIGITS``, stays as written. Each pattern starts only where a
run of digits starts, so the passes are linear in the text's length.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from s2s_daemon.text import chinese
from s2s_daemon.text.languages import CJK, CURRENCIES, DATE_FORMAT, MONTHS, TIME_UNITS, UNITS, form

MAX_DIGITS = 15
"""Integers longer than this are left as written (a code, an id: no one says them as a number)."""

_N2W = {"en", "de", "fr", "es", "it", "pt", "ru", "ja", "ko"}
_N2W_ERRORS = (NotImplementedError, OverflowError, ValueError, ArithmeticError, KeyError, IndexError)
"""What num2words raises for a number or a language it cannot say."""

_GROUPED = {
    "en": ",",
    "zh": ",",
    "ja": ",",
    "ko": ",",
    "de": ".",
    "es": ".",
    "it": ".",
    "pt": ".",
    "fr": " ",
    "ru": " ",
}
"""Each language's thousands separator (a space includes the no-break ones)."""


def _number_pattern(language: str) -> tuple[str, str]:
    """(grouped integer, decimal part) for ``language``."""
    sep = _GROUPED[language]
    group = r"[ \u00a0\u202f]" if sep == " " else re.escape(sep)
    point = r"\." if sep in (",",) else ","
    return rf"\d{{1,3}}(?:{group}\d{{3}})+", rf"{point}\d+"


class _Patterns:
    """The compiled patterns of one language."""

    def __init__(self, language: str) -> None:
        grouped, fraction = _number_pattern(language)
        number = rf"(?:{grouped}|\d+)(?:{fraction})?"
        word = r"0-9A-Za-z_" if language in CJK else r"\w"  # CJK text has no spaces around its numbers
        start = rf"(?<![{word}.,])"
        end = rf"(?![{word}]|[.,]\d)"
        self.date = re.compile(rf"{start}(\d{{4}})-(\d{{2}})-(\d{{2}}){end}(?!-)")
        self.time = re.compile(rf"{start}(\d{{1,2}}):(\d{{2}}):(\d{{2}}){end}(?!:)")
        self.money_before = re.compile(rf"{start}(R\$|[$€£¥])\s?({number}){end}")
        self.money_after = re.compile(rf"{start}({number})\s?(€|\$|£|¥|EUR\b|USD\b|GBP\b)")
        units = "|".join(re.escape(u) for u in sorted(UNIT_NAMES, key=len, reverse=True))
        self.unit = re.compile(rf"{start}({number})\s?({units})(?![{word}/])")
        self.grouped = re.compile(rf"{start}(-?)({grouped})({fraction})?{end}")
        self.plain = re.compile(rf"{start}(-?)(\d+)({fraction})?{end}")
        self.zh_year = re.compile(r"(?<![0-9A-Za-z.,])(\d{4})(?:\s*([~～\-–—至到])\s*(\d{4}))?(?=\s*年)")
        self.ordinal = {
            "en": re.compile(rf"{start}(\d+)(st|nd|rd|th)\b"),
            "fr": re.compile(rf"{start}(\d+)(er|re|ère|e|ème|ᵉ)(?!\w)"),
        }.get(language, re.compile(rf"{start}(\d+)\.?([ºª])"))


UNIT_NAMES = {unit: unit for unit in UNITS} | {"км/ч": "km/h", "км": "km", "кг": "kg", "см": "cm", "ГБ": "GB"}
"""How units are written (Russian writes its own abbreviations) -> the key of ``UNITS``."""

_COMPILED: dict[str, _Patterns] = {}


def _patterns(language: str) -> _Patterns:
    found = _COMPILED.get(language)
    if found is None:
        found = _COMPILED[language] = _Patterns(language)
    return found


def _value(written: str, language: str) -> Decimal | None:
    """The value of a number written in ``language``'s way, or None."""
    sep = _GROUPED[language]
    plain = re.sub(r"[ \u00a0\u202f]", "", written) if sep == " " else written.replace(sep, "")
    if sep != ",":
        plain = plain.replace(",", ".")
    if len(plain.split(".", 1)[0].lstrip("-")) > MAX_DIGITS:
        return None
    try:
        return Decimal(plain)
    except InvalidOperation:
        return None


def words(value: Decimal, language: str, *, to: str = "cardinal", currency: str = "EUR") -> str | None:
    """``value`` in words (num2words; our own for Chinese), or None where it cannot be said."""
    if language == "zh":
        sign = "负" if value < 0 else ""
        text = format(abs(value), "f")
        whole, _, fraction = text.partition(".")
        return sign + (chinese.decimal(whole, fraction) if fraction else chinese.cardinal(int(whole)))
    if language not in _N2W:
        return None
    from num2words import num2words  # imported by the first text with a number (its tables, per language)

    try:
        number: Decimal | int = int(value) if value == value.to_integral_value() and to != "currency" else value
        if to == "currency":
            return str(num2words(number, lang=language, to=to, currency=currency))
        return str(num2words(number, lang=language, to=to))
    except _N2W_ERRORS:
        return None


def rewrite_numbers(text: str, language: str, mode: str) -> str:
    """``text`` with what ``mode`` (``auto`` or ``all``) rewrites in ``language``."""
    if mode == "off" or language not in _GROUPED or not any(c.isdigit() for c in text):
        return text
    p = _patterns(language)
    text = p.date.sub(lambda m: _date(m, language), text)
    text = p.time.sub(lambda m: _time(m, language), text)
    text = p.money_before.sub(lambda m: _money(m.group(2), m.group(1), language) or m.group(0), text)
    text = p.money_after.sub(lambda m: _money(m.group(1), m.group(2), language) or m.group(0), text)
    text = p.unit.sub(lambda m: _unit(m, language), text)
    text = p.ordinal.sub(lambda m: _ordinal(m, language), text)
    text = p.grouped.sub(lambda m: _said(m, language) or m.group(0), text)
    if language == "zh":
        text = p.zh_year.sub(_zh_year, text)
    if language == "zh" or mode == "all":
        text = p.plain.sub(lambda m: _plain(m, language), text)
    return text


def _date(match: re.Match[str], language: str) -> str:
    year, month, day = (int(g) for g in match.groups())
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return match.group(0)
    names = MONTHS.get(language, MONTHS["en"]).split()
    day_text = "1er" if language == "fr" and day == 1 else str(day)
    return DATE_FORMAT[language].format(y=year, m=month, d=day_text, month=names[month - 1])


def _time(match: re.Match[str], language: str) -> str:
    hours, minutes, seconds = (int(g) for g in match.groups())
    if hours > 23 or minutes > 59 or seconds > 59:
        return match.group(0)
    if seconds == 0:
        return f"{hours}:{minutes:02d}"  # read as a time of day as it is
    h_forms, m_forms, s_forms, last = TIME_UNITS[language]
    parts = [form(h_forms, language, str(hours), hours)] if hours else []
    parts += [form(m_forms, language, str(minutes), minutes), form(s_forms, language, str(seconds), seconds)]
    if language in ("zh", "ja"):
        return "".join(parts)
    if not last:
        return " ".join(parts)
    return f"{', '.join(parts[:-1])} {last} {parts[-1]}"


_SYMBOLS = {"R$": "BRL", "$": "USD", "€": "EUR", "£": "GBP", "¥": "JPY", "EUR": "EUR", "USD": "USD", "GBP": "GBP"}


def _money(written: str, symbol: str, language: str) -> str | None:
    code = _SYMBOLS[symbol]
    if code == "JPY" and language == "zh":
        code = "CNY"
    value = _value(written, language)
    forms = CURRENCIES[code].get(language)
    if value is None or forms is None:
        return None
    if language == "zh" and value != value.to_integral_value():
        return form(forms, language, format(value.normalize(), "f"), float(value))  # 86.50 -> 86.5
    if value != value.to_integral_value() and code in ("USD", "EUR", "GBP"):
        said = words(value, language, to="currency", currency=code)
        if said is not None:
            return said
    whole = written
    point = "." if _GROUPED[language] == "," else ","
    if value == value.to_integral_value() and point in written:
        whole = written.rsplit(point, 1)[0]  # 5.00 $: five dollars
    return form(forms, language, whole, float(value))


def _unit(match: re.Match[str], language: str) -> str:
    written, unit = match.group(1), UNIT_NAMES[match.group(2)]
    forms = UNITS[unit].get(language)
    value = _value(written, language)
    if forms is None or value is None:
        return match.group(0)
    return form(forms, language, written, float(value))


def _ordinal(match: re.Match[str], language: str) -> str:
    digits, mark = match.group(1), match.group(2)
    if len(digits) > 6:
        return match.group(0)
    said = words(Decimal(digits), language, to="ordinal")
    if said is None:
        return match.group(0)
    feminine = mark in ("ª", "re", "ère")
    if language == "es" and not feminine and said in ("primero", "tercero") and _before_word(match):
        return said[:-1]  # el primer trimestre
    if feminine and language == "fr" and said == "premier":
        return "première"
    if feminine and language in ("es", "pt", "it") and said.endswith("o"):
        return " ".join(word[:-1] + "a" if word.endswith("o") else word for word in said.split())
    return said


def _before_word(match: re.Match[str]) -> bool:
    after = match.string[match.end() : match.end() + 2]
    return after[:1] == " " and after[1:].isalpha()


def _said(match: re.Match[str], language: str) -> str | None:
    sign, whole, fraction = match.group(1), match.group(2), match.group(3) or ""
    value = _value(sign + whole + fraction, language)
    return None if value is None else words(value, language)


def _before_measure(match: re.Match[str]) -> bool:
    after = match.string[match.end() : match.end() + 1]
    return bool(after) and "\u4e00" <= after <= "\u9fff" and after not in "月日号年楼层"


def _zh_year(match: re.Match[str]) -> str:
    first, second = match.group(1), match.group(3)
    if second is None:
        return chinese.digits(first)
    return f"{chinese.digits(first)}到{chinese.digits(second)}"


def _plain(match: re.Match[str], language: str) -> str:
    sign, whole, fraction = match.group(1), match.group(2), match.group(3) or ""
    if language == "zh" and not fraction and (len(whole) > 8 or (len(whole) > 1 and whole[0] == "0")):
        return sign + chinese.digits(whole)  # a telephone number, a code
    if language == "zh" and whole == "2" and not sign and not fraction and _before_measure(match):
        return "两"  # 两瓶, 两个: 2 before a measure word
    if len(whole) > MAX_DIGITS:
        return match.group(0)
    value = _value(sign + whole + fraction, language)
    if value is None:
        return match.group(0)
    if not sign and not fraction and len(whole) == 4 and 1100 <= int(whole) <= 2099 and language not in ("ja", "ko"):
        return words(value, language, to="year") or match.group(0)
    return words(value, language) or match.group(0)
