"""LaTeX and text normalisation of an extracted answer (string to string; no sympy).

What goes: math delimiters, `\\left`/`\\right`, spacing commands, `\\displaystyle`, degree marks, percent signs
and words, dollar signs, thousands separators (`{,}`, `,\\!`), trailing units in words (`125 miles`,
`15 cm^2`), `x \\in` before a set. What is rewritten: `\\dfrac`/`\\tfrac`/`\\cfrac` -> `\\frac`, `\\frac12` ->
`\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`, relation commands -> one symbol each (`\\geq`, `>=` -> `≥`),
`\\cdot`/`\\times` -> `*`, `\\approx` -> `=`, `\\text{...}` and friends -> their words.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf|mathit|mathsf|operatorname|"
                       r"mathbb|boldsymbol|hbox)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"(?<!\\)\\(?:q?quad|displaystyle|textstyle|[,;:! >]|hspace\{[^{}]*\})|~")
_REPLACE = [
    (re.compile(r"\\(?:geqslant|geq|ge)(?![a-zA-Z])|>="), "≥"),
    (re.compile(r"\\(?:leqslant|leq|le)(?![a-zA-Z])|<="), "≤"),
    (re.compile(r"\\(?:neq|ne)(?![a-zA-Z])|!=|\\not\s*="), "≠"),
    (re.compile(r"\\gt(?![a-zA-Z])"), ">"),
    (re.compile(r"\\lt(?![a-zA-Z])"), "<"),
    (re.compile(r"\\(?:approx|simeq|thickapprox)(?![a-zA-Z])"), "="),
    (re.compile(r"\\(?:cdot|times|ast)(?![a-zA-Z])"), "*"),
    (re.compile(r"\\div(?![a-zA-Z])"), "/"),
    (re.compile(r"\\[dtc]frac(?![a-zA-Z])"), r"\\frac"),
    (re.compile(r"\\(?:varepsilon)(?![a-zA-Z])"), r"\\epsilon"),
    (re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|biggl|biggr)(?![a-zA-Z])\s*\.?"), ""),
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])"), ""),
    (re.compile(r"\\%|%"), ""),
    (re.compile(r"\\\$"), ""),
    (re.compile(r"(?<!\\)\$"), " "),
    (re.compile(r"\\[()\[\]]"), " "),
    (re.compile(r"\{\s*,\s*\}|,\\!\s*(?=\d{3})"), ""),  # thousands separators
]
_FRAC_SHORT = [
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*\{([^{}]*)\}\s*([0-9a-zA-Z])"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*([a-zA-Z])\s*([0-9a-zA-Z])"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\sqrt\s*([0-9a-zA-Z])"), r"\\sqrt{\1}"),
]
_UNIT_TAIL = re.compile(r"^(.*?[\d})\]])\s*((?:[A-Za-z]{2,}|[A-Za-z](?=\s*(?:\^|[²³])))(?:\s+[A-Za-z]{2,})*)"
                        r"\s*(?:\^\s*\{?\d\}?|[²³])?$")
_NOT_UNITS = {"and", "or", "sin", "cos", "tan", "log", "ln", "exp", "pi", "sqrt", "mod", "pmod", "i", "e"}
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")  # 2.5e-3
_MIXED = re.compile(r"(?<![\w.}^_{])(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}")  # 2\frac{1}{2}: two and a half
_PERCENT_WORDS = re.compile(r"\s*\b(?:percentage|percent|pct)\b\s*$", re.I)
_IN_SET = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*\\in(?![a-zA-Z])\s*")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_SPACE_THOUSANDS = re.compile(r"^-?\d{1,3}(?: \d{3})+(?:\.\d+)?$")


def normalize(s: str) -> str:
    """The canonical string form of an answer (also what `VerifyResult.normalized` reports)."""
    s = s.replace("\\\\(", "\\(").replace("\\\\)", "\\)").replace('\\"', "").replace('"', "")
    s = re.sub(r",\\!\s*", ",\\!", s)  # `11,\! 111` -> `11,\!111`
    for pattern, repl in _REPLACE:
        s = pattern.sub(repl, s)
    s = _SPACES.sub(" ", s)
    s = re.sub(r"\\q?quad(?=[a-zA-Z])", " ", s)  # `\quadx_{2}` (a lost space)
    s = _TEXT_CMD.sub(lambda m: " " + m.group(1).strip() + " ", s)
    s = _TEXT_CMD.sub(lambda m: " " + m.group(1).strip() + " ", s)  # nested once
    for pattern, repl in _FRAC_SHORT:
        s = pattern.sub(repl, s)
    s = _SCIENTIFIC.sub(r"\1*10^{\2}", s)
    s = _MIXED.sub(r"(\1+\\frac{\2}{\3})", s)
    s = _PERCENT_WORDS.sub("", s)
    s = _IN_SET.sub("", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = s.rstrip(" .;,").lstrip(" ;,")
    while len(s) > 1 and s[0] == "{" and s[-1] == "}" and _matching(s, 0) == len(s) - 1:
        s = s[1:-1].strip()
    if _SPACE_THOUSANDS.match(s):
        s = s.replace(" ", "")
    return s


def strip_units(item: str) -> str:
    """`125 miles` -> `125`, `15 cm^2` -> `15`, `1000.99m²` -> `1000.99`; only after a number (no variables), so
    formulas (`\\sum_{k=1}^{n} k^2`, `2 ab`) are left alone."""
    m = _UNIT_TAIL.match(item)
    if m and re.search(r"\d", m.group(1)) and not re.search(r"[A-Za-z]", re.sub(r"\\[a-zA-Z]+", "", m.group(1))) \
            and not (set(m.group(2).lower().split()) & _NOT_UNITS):
        return m.group(1).strip()
    return item


def strip_thousands(item: str) -> str:
    return item.replace(",", "") if _THOUSANDS.match(item) else item


def _matching(s: str, i: int) -> int:
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "\\":
            continue
        if s[j] == "{" and (j == 0 or s[j - 1] != "\\"):
            depth += 1
        elif s[j] == "}" and (j == 0 or s[j - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return j
    return -1


_COMMAND = re.compile(r"\\[a-zA-Z]+")
_LITERAL = re.compile(r"\d+(?:\.\d*)?|\.\d+")


def literals(s: str) -> tuple:
    """What an answer is written with, order aside: its numeric literals by value (`0.50` is `1/2`) and its
    variable letters (outside `\\commands`), as a sorted tuple. The math verifier's test for a copied not-answer."""
    s = _COMMAND.sub(" ", s)
    numbers = Counter(Fraction(m) for m in _LITERAL.findall(s))
    letters = Counter(re.findall(r"[a-zA-Z]", _LITERAL.sub(" ", s)))
    return tuple(sorted((str(k), n) for k, n in (numbers + letters).items()))
