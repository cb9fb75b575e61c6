"""The languages the text stage knows (the ten Qwen3-TTS speaks) and the words it uses in each.

A request's language is a code (``en``), a name (``English``) or ``auto``. With ``auto`` the stage
guesses from the script of each piece it reads: kana is Japanese, Hangul Korean, Han without kana
Chinese, Cyrillic Russian; Latin text stays unknown (English, German or French cannot be told
apart from letters), and an unknown language gets no rewritten numbers (the text as written).
"""

from __future__ import annotations

from s2s_daemon.pipeline.vocabulary import LANGUAGE_ALIASES

LANGUAGES = ("en", "de", "fr", "es", "it", "pt", "ru", "zh", "ja", "ko")
"""The languages covered, as ISO 639-1 codes."""
CJK = ("zh", "ja", "ko")

_BY_NAME = {
    "english": "en",
    "german": "de",
    "french": "fr",
    "spanish": "es",
    "italian": "it",
    "portuguese": "pt",
    "russian": "ru",
    "chinese": "zh",
    "japanese": "ja",
    "korean": "ko",
}


def language_code(value: str | None) -> str | None:
    """``en``, ``English``, ``zh-CN``... as a code of ``LANGUAGES``; None for ``auto``, nothing or
    a language not covered (the stage then guesses from the script)."""
    if value is None:
        return None
    key = value.strip().lower().replace("_", "-")
    name = LANGUAGE_ALIASES.get(key, key)
    return _BY_NAME.get(name)


def guess_language(text: str) -> str | None:
    """The language the script of ``text`` shows (its letters counted once), or None (Latin, none)."""
    han = kana = hangul = cyrillic = latin = 0
    for char in text:
        if char < "\u0400":
            latin += char.isalpha()
        elif char <= "\u04ff":
            cyrillic += 1
        elif "\u3040" <= char <= "\u30ff":
            kana += 1
        elif "\uac00" <= char <= "\ud7a3" or "\u1100" <= char <= "\u11ff":
            hangul += 1
        elif "\u4e00" <= char <= "\u9fff" or "\u3400" <= char <= "\u4dbf":
            han += 1
    if kana:
        return "ja"
    best = max((hangul, "ko"), (han, "zh"), (cyrillic, "ru"), (latin, ""))
    return best[1] or None if best[0] else None


def is_cjk(char: str) -> bool:
    """A Han or kana character or a full-width mark: text written without spaces (not Korean's)."""
    return char >= "\u2e80" and (char <= "\u9fff" or "\uf900" <= char <= "\ufaff" or "\uff00" <= char <= "\uffef")


DOT = {"en": "dot", "de": "Punkt", "fr": "point", "es": "punto", "it": "punto", "pt": "ponto", "ru": "точка"}
DOT |= {"zh": "点", "ja": "ドット", "ko": "닷"}
"""How a person says the dot of a host name."""
AT = {"en": "at", "de": "at", "fr": "arobase", "es": "arroba", "it": "chiocciola", "pt": "arroba", "ru": "собака"}
AT |= {"zh": "at", "ja": "アットマーク", "ko": "골뱅이"}
"""How a person says the ``@`` of an e-mail address."""

CODE_NOTE = {
    "en": "Code block skipped.",
    "de": "Codeblock übersprungen.",
    "fr": "Bloc de code omis.",
    "es": "Bloque de código omitido.",
    "it": "Blocco di codice omesso.",
    "pt": "Bloco de código omitido.",
    "ru": "Блок кода пропущен.",
    "zh": "此处省略代码。",
    "ja": "コードは省略します。",
    "ko": "코드는 생략합니다.",
}
"""Said where a code block is (``code_blocks: skip``)."""

MONTHS = {
    "en": "January February March April May June July August September October November December",
    "de": "Januar Februar März April Mai Juni Juli August September Oktober November Dezember",
    "fr": "janvier février mars avril mai juin juillet août septembre octobre novembre décembre",
    "es": "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre",
    "it": "gennaio febbraio marzo aprile maggio giugno luglio agosto settembre ottobre novembre dicembre",
    "pt": "janeiro fevereiro março abril maio junho julho agosto setembro outubro novembro dezembro",
    "ru": "января февраля марта апреля мая июня июля августа сентября октября ноября декабря",
}
DATE_FORMAT = {
    "en": "{month} {d}, {y}",
    "de": "{d}. {month} {y}",
    "fr": "{d} {month} {y}",
    "es": "{d} de {month} de {y}",
    "it": "{d} {month} {y}",
    "pt": "{d} de {month} de {y}",
    "ru": "{d} {month} {y} года",
    "zh": "{y}年{m}月{d}日",
    "ja": "{y}年{m}月{d}日",
    "ko": "{y}년 {m}월 {d}일",
}
"""An ISO date (year-month-day) as the language writes it, the digits kept."""

Forms = tuple[str, ...]
"""Templates with ``{n}``: one (zh, ja, ko), singular and plural, or Russian's one, few and many."""

UNITS: dict[str, dict[str, Forms]] = {
    "%": {
        "en": ("{n} percent",),
        "de": ("{n} Prozent",),
        "fr": ("{n} pour cent",),
        "es": ("{n} por ciento",),
        "it": ("{n} per cento",),
        "pt": ("{n} por cento",),
        "ru": ("{n} процент", "{n} процента", "{n} процентов"),
        "zh": ("百分之{n}",),
        "ja": ("{n}パーセント",),
        "ko": ("{n}퍼센트",),
    },
    "°C": {
        "en": ("{n} degree Celsius", "{n} degrees Celsius"),
        "de": ("{n} Grad Celsius",),
        "fr": ("{n} degré Celsius", "{n} degrés Celsius"),
        "es": ("{n} grado Celsius", "{n} grados Celsius"),
        "it": ("{n} grado Celsius", "{n} gradi Celsius"),
        "pt": ("{n} grau Celsius", "{n} graus Celsius"),
        "ru": ("{n} градус Цельсия", "{n} градуса Цельсия", "{n} градусов Цельсия"),
        "zh": ("{n}摄氏度",),
        "ja": ("摂氏{n}度",),
        "ko": ("섭씨 {n}도",),
    },
    "°F": {
        "en": ("{n} degree Fahrenheit", "{n} degrees Fahrenheit"),
        "de": ("{n} Grad Fahrenheit",),
        "fr": ("{n} degré Fahrenheit", "{n} degrés Fahrenheit"),
        "es": ("{n} grado Fahrenheit", "{n} grados Fahrenheit"),
        "it": ("{n} grado Fahrenheit", "{n} gradi Fahrenheit"),
        "pt": ("{n} grau Fahrenheit", "{n} graus Fahrenheit"),
        "ru": ("{n} градус по Фаренгейту", "{n} градуса по Фаренгейту", "{n} градусов по Фаренгейту"),
        "zh": ("{n}华氏度",),
        "ja": ("華氏{n}度",),
        "ko": ("화씨 {n}도",),
    },
    "km/h": {
        "en": ("{n} kilometer per hour", "{n} kilometers per hour"),
        "de": ("{n} Kilometer pro Stunde",),
        "fr": ("{n} kilomètre par heure", "{n} kilomètres par heure"),
        "es": ("{n} kilómetro por hora", "{n} kilómetros por hora"),
        "it": ("{n} chilometro orario", "{n} chilometri orari"),
        "pt": ("{n} quilômetro por hora", "{n} quilômetros por hora"),
        "ru": ("{n} километр в час", "{n} километра в час", "{n} километров в час"),
        "zh": ("每小时{n}公里",),
        "ja": ("時速{n}キロ",),
        "ko": ("시속 {n}킬로미터",),
    },
    "km": {
        "en": ("{n} kilometer", "{n} kilometers"),
        "de": ("{n} Kilometer",),
        "fr": ("{n} kilomètre", "{n} kilomètres"),
        "es": ("{n} kilómetro", "{n} kilómetros"),
        "it": ("{n} chilometro", "{n} chilometri"),
        "pt": ("{n} quilômetro", "{n} quilômetros"),
        "ru": ("{n} километр", "{n} километра", "{n} километров"),
        "zh": ("{n}公里",),
        "ja": ("{n}キロメートル",),
        "ko": ("{n}킬로미터",),
    },
    "kg": {
        "en": ("{n} kilogram", "{n} kilograms"),
        "de": ("{n} Kilogramm",),
        "fr": ("{n} kilogramme", "{n} kilogrammes"),
        "es": ("{n} kilogramo", "{n} kilogramos"),
        "it": ("{n} chilogrammo", "{n} chilogrammi"),
        "pt": ("{n} quilograma", "{n} quilogramas"),
        "ru": ("{n} килограмм", "{n} килограмма", "{n} килограммов"),
        "zh": ("{n}公斤",),
        "ja": ("{n}キログラム",),
        "ko": ("{n}킬로그램",),
    },
    "cm": {
        "en": ("{n} centimeter", "{n} centimeters"),
        "de": ("{n} Zentimeter",),
        "fr": ("{n} centimètre", "{n} centimètres"),
        "es": ("{n} centímetro", "{n} centímetros"),
        "it": ("{n} centimetro", "{n} centimetri"),
        "pt": ("{n} centímetro", "{n} centímetros"),
        "ru": ("{n} сантиметр", "{n} сантиметра", "{n} сантиметров"),
        "zh": ("{n}厘米",),
        "ja": ("{n}センチメートル",),
        "ko": ("{n}센티미터",),
    },
    "GB": {
        "en": ("{n} gigabyte", "{n} gigabytes"),
        "de": ("{n} Gigabyte",),
        "fr": ("{n} gigaoctet", "{n} gigaoctets"),
        "es": ("{n} gigabyte", "{n} gigabytes"),
        "it": ("{n} gigabyte",),
        "pt": ("{n} gigabyte", "{n} gigabytes"),
        "ru": ("{n} гигабайт", "{n} гигабайта", "{n} гигабайт"),
        "zh": ("{n}GB",),
        "ja": ("{n}ギガバイト",),
        "ko": ("{n}기가바이트",),
    },
}
"""Symbols and units after a number: the forms of their words, per language."""

CURRENCIES: dict[str, dict[str, Forms]] = {
    "USD": {
        "en": ("{n} dollar", "{n} dollars"),
        "de": ("{n} Dollar",),
        "fr": ("{n} dollar", "{n} dollars"),
        "es": ("{n} dólar", "{n} dólares"),
        "it": ("{n} dollaro", "{n} dollari"),
        "pt": ("{n} dólar", "{n} dólares"),
        "ru": ("{n} доллар", "{n} доллара", "{n} долларов"),
        "zh": ("{n}美元",),
        "ja": ("{n}ドル",),
        "ko": ("{n}달러",),
    },
    "EUR": {
        "en": ("{n} euro", "{n} euros"),
        "de": ("{n} Euro",),
        "fr": ("{n} euro", "{n} euros"),
        "es": ("{n} euro", "{n} euros"),
        "it": ("{n} euro",),
        "pt": ("{n} euro", "{n} euros"),
        "ru": ("{n} евро",),
        "zh": ("{n}欧元",),
        "ja": ("{n}ユーロ",),
        "ko": ("{n}유로",),
    },
    "GBP": {
        "en": ("{n} pound", "{n} pounds"),
        "de": ("{n} Pfund",),
        "fr": ("{n} livre", "{n} livres"),
        "es": ("{n} libra", "{n} libras"),
        "it": ("{n} sterlina", "{n} sterline"),
        "pt": ("{n} libra", "{n} libras"),
        "ru": ("{n} фунт", "{n} фунта", "{n} фунтов"),
        "zh": ("{n}英镑",),
        "ja": ("{n}ポンド",),
        "ko": ("{n}파운드",),
    },
    "JPY": {
        "en": ("{n} yen",),
        "de": ("{n} Yen",),
        "fr": ("{n} yen", "{n} yens"),
        "es": ("{n} yen", "{n} yenes"),
        "it": ("{n} yen",),
        "pt": ("{n} iene", "{n} ienes"),
        "ru": ("{n} иена", "{n} иены", "{n} иен"),
        "zh": ("{n}日元",),
        "ja": ("{n}円",),
        "ko": ("{n}엔",),
    },
    "CNY": {"zh": ("{n}元",)},
    "BRL": {"pt": ("{n} real", "{n} reais"), "en": ("{n} real", "{n} reais"), "es": ("{n} real", "{n} reales")},
}
"""Currencies by ISO code: the forms of an amount's words (``¥`` is yuan in Chinese, yen elsewhere)."""

TIME_UNITS: dict[str, tuple[Forms, Forms, Forms, str]] = {
    "en": (("{n} hour", "{n} hours"), ("{n} minute", "{n} minutes"), ("{n} second", "{n} seconds"), "and"),
    "de": (("{n} Stunde", "{n} Stunden"), ("{n} Minute", "{n} Minuten"), ("{n} Sekunde", "{n} Sekunden"), "und"),
    "fr": (("{n} heure", "{n} heures"), ("{n} minute", "{n} minutes"), ("{n} seconde", "{n} secondes"), "et"),
    "es": (("{n} hora", "{n} horas"), ("{n} minuto", "{n} minutos"), ("{n} segundo", "{n} segundos"), "y"),
    "it": (("{n} ora", "{n} ore"), ("{n} minuto", "{n} minuti"), ("{n} secondo", "{n} secondi"), "e"),
    "pt": (("{n} hora", "{n} horas"), ("{n} minuto", "{n} minutos"), ("{n} segundo", "{n} segundos"), "e"),
    "ru": (
        ("{n} час", "{n} часа", "{n} часов"),
        ("{n} минута", "{n} минуты", "{n} минут"),
        ("{n} секунда", "{n} секунды", "{n} секунд"),
        "",
    ),
    "zh": (("{n}点",), ("{n}分",), ("{n}秒",), ""),
    "ja": (("{n}時",), ("{n}分",), ("{n}秒",), ""),
    "ko": (("{n}시간",), ("{n}분",), ("{n}초",), ""),
}
"""A time with seconds (``15:16:36``): hours, minutes and seconds, and the word before the last."""


def form(forms: Forms, language: str, written: str, value: float) -> str:
    """The form of ``forms`` for the number ``value`` (written as ``written``) in ``language``."""
    if len(forms) == 1:
        chosen = forms[0]
    elif len(forms) == 3:  # Russian: one, few, many; a fraction takes the few form
        whole = int(value)
        if whole != value:
            chosen = forms[1]
        elif whole % 10 == 1 and whole % 100 != 11:
            chosen = forms[0]
        elif 2 <= whole % 10 <= 4 and not 12 <= whole % 100 <= 14:
            chosen = forms[1]
        else:
            chosen = forms[2]
    else:
        one = value < 2 if language == "fr" else value == 1
        chosen = forms[0] if one else forms[1]
    return chosen.format(n=written)
