"""Find the final answer in a model response (pure string work, linear in the response length).

Strategies:
- `strict`: the last `\\boxed{...}` / `\\fbox{...}` only (R1-style training, where the format is part of the task);
- `lenient`: the last boxed answer (with boxed answers right before it, joined: `\\boxed{1}` and `\\boxed{2}`);
  else the sentence after the last "answer is" / "Answer:" marker; else the last `$...$` / `\\(...\\)` /
  `\\[...\\]` span or the last number, whichever comes later; else a short response that is a formula as a whole.

Text after a chat template's stop token (`<|im_start|>`, ...) is ignored, and so is a `<think>` block when
something follows it.
"""

from __future__ import annotations

import re
from collections import deque

_STOP = re.compile(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>|</s>")
_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_MARKER = re.compile(r"(?<![A-Za-z])(?:final\s+answer|answer)\b\s*(?:\*\*)?\s*(?:is\b|:|=)?\s*(?:\*\*)?\s*:?", re.I)
# $$..$$ | $..$ (not \$) | \[..\] | \(..\)
_MATH = re.compile(r"\$\$(.+?)\$\$|(?<!\\)\$((?:[^$\\]|\\.)+?)(?<!\\)\$|\\\[(.+?)\\\]|\\\((.+?)\\\)", re.S)
# a number standing on its own (not inside a word such as `AZYUK2A`): 1,000.5  .4  2/3  100%
_NUMBER = re.compile(r"(?<![\w.,\\])-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
                     r"(?:\s*/\s*\d+)?(?:\s*%)?(?!\d)")
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}(?![A-Za-z(])")
_SEPARATOR_WORDS = {"and", "or", "pct", "percent", "percentage"}
_BOX_GAP = re.compile(r"^(?:\s|\$|\\[()\[\]]|\\q?quad|\\text\{[^{}]{0,30}\}|\*\*[^*]{0,20}\*\*|[,;.]|and|or"
                      r"|[A-Za-z](?:_\{?\w+\}?)?\s*=)*$")
# Phrases that say there is no answer: a response (or a marker's sentence) that is only one of these is no answer,
# not a wrong one, and counts in `reward_no_answer_rate`.
_NON_ANSWER = re.compile(r"(?:no\s+idea|i\s+(?:do\s+not|don'?t)\s+know|idk|dunno|not\s+sure|unsure|no\s+clue|unknown"
                         r"|cannot\s+(?:be\s+)?(?:determined|solve[d]?)|n/?a|\?+|\.{2,}|…)", re.I)
MAX_CHARS = 20_000
_SPAN_WINDOW = 2_000  # only the tail is searched: answers live at the end, and this bounds the work


def final_answer(response: str, strategy: str = "lenient") -> str | None:
    found = _find(response, strategy)
    if found is not None and _NON_ANSWER.fullmatch(found.strip().rstrip(".!").strip()):
        return None  # "No idea.", "The answer is unknown."
    return found


def _find(response: str, strategy: str) -> str | None:
    text = _final_text(response)
    boxed = _boxed(text)
    if strategy == "strict":
        return boxed[-1][2].strip() if boxed else None
    m = _last(_MARKER.finditer(text))
    if m is not None and (not boxed or m.start() > boxed[-1][1]):
        found = _after_marker(text[m.end():])
        if found:
            return found
    if boxed:
        return _join_adjacent_boxes(text, boxed)
    plain = text.strip()
    short = len(plain.split()) <= 2 or re.search(r"[\d\\=^]", plain)
    if plain and len(plain) < 200 and short and not _is_prose(plain):
        return plain  # the whole response is the answer: a formula or a word or two, not "I give up"
    return _last_math_or_number(text)


def _final_text(response: str) -> str:
    text = response[-MAX_CHARS:]
    stop = _STOP.search(text)
    if stop:
        text = text[: stop.start()]
    if "</think>" in text:
        after = text.rsplit("</think>", 1)[1]
        if after.strip():
            text = after
    # doubly escaped LaTeX (`\\boxed{\\frac{1}{2}}`, seen in JSON-mangled outputs); a `\\` before a letter
    # pair is otherwise a matrix row break followed by a multi-letter word, which answers do not contain
    return re.sub(r"\\\\(?=(?:boxed|fbox|frac|dfrac|tfrac|left|right|sqrt|pi|text|cdot|times|infty|circ)\b)",
                  r"\\", text)


def _boxed(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of every `\\boxed{...}` (balanced braces) and `\\boxed 5`."""
    out = []
    for m in _BOX.finditer(text):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "\\":
                    j += 2
                    continue
                depth += (c == "{") - (c == "}")
                if depth == 0:
                    break
                j += 1
            out.append((m.start(), j + 1, text[i + 1 : j]))
        elif i > m.end():
            token = re.match(r"[^\s$]+", text[i:])
            if token:
                out.append((m.start(), i + token.end(), token.group()))
    return out


def _join_adjacent_boxes(text: str, boxed) -> str:
    """The last boxed answer, with the boxed answers just before it when only connectives separate them
    (`\\boxed{-2} \\quad\\text{and}\\quad \\boxed{1}` -> `-2, 1`)."""
    parts = [boxed[-1]]
    for prev in reversed(boxed[:-1]):
        gap = text[prev[1] : parts[0][0]]
        if len(gap) > 60 or "\n\n" in gap.strip() or not _BOX_GAP.match(gap):
            break
        parts.insert(0, prev)
    contents = [p[2].strip() for p in parts]
    if len(set(contents)) == 1:
        return contents[0]
    return ", ".join(contents)


def _after_marker(tail: str) -> str | None:
    tail = tail.lstrip(" *:\"'")
    m = _MATH.match(tail)
    if m:
        return next(g for g in m.groups() if g is not None).strip()
    sentence = re.split(r"\.(?=\s|$)|\n", tail, maxsplit=1)[0].strip().rstrip(".")
    if not sentence:
        return None
    if _is_prose(sentence):
        for word in (" is ", " are ", " = ", " was "):
            if word in sentence:
                rest = sentence.rsplit(word, 1)[1].strip()
                if rest and not _is_prose(rest):
                    return _strip_math(rest)
        return _last_math_or_number(sentence)
    return _strip_math(sentence)


def _last_math_or_number(text: str) -> str | None:
    text = text[-_SPAN_WINDOW:]  # an unclosed `\[` makes the span search quadratic: keep it short
    span = _last(_MATH.finditer(text))
    tail_start = span.end() if span else 0
    number = _last(_NUMBER.finditer(text, tail_start))
    if number is not None:
        return number.group().strip()
    if span is not None:
        return next(g for g in span.groups() if g is not None).strip()
    return None


def _last(matches):
    """The last of `matches` (an iterator, read through one at a time), or None when there is none."""
    last = deque(matches, maxlen=1)
    return last[0] if last else None


def _strip_math(s: str) -> str:
    return re.sub(r"(?<!\\)\$|\\[()\[\]]", " ", s).strip()


def _is_prose(s: str) -> bool:
    """More than one ordinary word outside LaTeX commands and `\\text{}`: a sentence rather than a formula."""
    s = re.sub(r"\\(?:text|mbox|textbf|textnormal|mathrm)\{[^{}]*\}", " ", s)
    words = [w for w in _PROSE_WORD.findall(s) if w.lower() not in _SEPARATOR_WORDS]
    return len(words) >= 2
