"""A normalised answer string -> a small typed tree; expressions inside it become sympy objects.

The expression parser is a hand-written recursive descent over LaTeX tokens (no `eval`, no `parse_expr`, so a
response cannot run code), and it refuses to build the objects that make sympy hang: integer powers with huge
exponents and factorials of huge numbers stay unevaluated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sympy

from megarl.verifiers.math.normalize import strip_thousands, strip_units


class AnswerSyntaxError(ValueError):
    pass


@dataclass(frozen=True)
class Text:
    text: str  # lower-case letters and digits only


@dataclass(frozen=True)
class Expr:
    value: object  # sympy expression (or Matrix)
    decimal: bool  # written with a decimal point: compare with a tolerance


@dataclass(frozen=True)
class Rel:
    ops: tuple  # chain a op b op c: ops[i] sits between parts[i] and parts[i + 1]
    parts: tuple


@dataclass(frozen=True)
class Assign:  # `x = 3`, `(p, q) = (3, 2)`, `|AB| = 1`: a named value
    label: str
    value: object


@dataclass(frozen=True)
class Seq:
    kind: str  # "list" (bare, order-free), "set" (\{...\}), "tuple" (bracketed: tuples, points, intervals)
    items: tuple
    open: str = ""
    close: str = ""


@dataclass(frozen=True)
class Union:
    parts: tuple


@dataclass(frozen=True)
class Matrix:
    value: object  # sympy Matrix


_RELOPS = ("≤", "≥", "≠", "<", ">", "=")
_MATRIX_ENV = re.compile(r"\\begin\{([pbvBV]?matrix|array)\}(?:\{[^{}]*\})?(.*?)\\+end\{\1\}", re.S)
_TEXTY = re.compile(r"^[A-Za-z][A-Za-z '\-]*$")
_CHOICE = re.compile(r"^\(?([A-Ea-e])\)?$")
_MAX_DEPTH = 100


def parse_answer(s: str, list_hint: bool = False) -> object:
    """Parse a normalised answer. `list_hint`: the other side is a list, so `1,234` means two items."""
    if _max_depth(s) > _MAX_DEPTH:  # refuse at once rather than recurse into the interpreter's limit
        raise AnswerSyntaxError(f"brackets nested more than {_MAX_DEPTH} deep")
    matrices: list = []
    s = _MATRIX_ENV.sub(lambda m: _stash_matrix(m.group(2), matrices), s)
    if not list_hint:
        s = strip_thousands(s)
    parts = _split_top(s, ";")
    if len(parts) > 1:
        return Seq("list", tuple(_solution(p, matrices) for p in parts))
    items = _split_list(s)
    if len(items) > 1:
        return Seq("list", tuple(_item(i, matrices) for i in items))
    return _item(s, matrices)


def _max_depth(s: str) -> int:
    depth = deepest = 0
    for c in s:
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth -= 1
    return deepest


def _solution(s: str, matrices) -> object:
    """One `;`-separated solution: `p=5,q=2` -> the tuple (5, 2)."""
    items = _split_list(s)
    nodes = tuple(_item(i, matrices) for i in items)
    if len(nodes) > 1 and all(isinstance(n, Assign) for n in nodes):
        return Seq("tuple", tuple(n.value for n in nodes), "(", ")")
    return nodes[0] if len(nodes) == 1 else Seq("list", nodes)


def _split_list(s: str) -> list[str]:
    s = re.sub(r"(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])", ",", s)
    s = re.sub(r"(?<=[\d)\]}])or(?=[A-Za-z(\\\d-])", ",", s)
    return [p for p in (x.strip() for x in _split_top(s, ",")) if p]


def _split_top(s: str, sep: str) -> list[str]:
    out, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            out.append(s[start:i])
            start = i + 1
        i += 1
    out.append(s[start:])
    return out


def _item(s: str, matrices, top: bool = True) -> object:
    """One answer item. `top`: it may be words or a choice letter (not inside a relation)."""
    s = strip_units(s.strip())
    if not s:
        raise AnswerSyntaxError("empty answer")
    if "\\pm" in s or "\\mp" in s:
        plus = s.replace("\\pm", "+").replace("\\mp", "-")
        minus = s.replace("\\pm", "-").replace("\\mp", "+")
        return Seq("list", (_item(plus, matrices), _item(minus, matrices)))
    choice = _CHOICE.match(s)
    if top and choice:
        return Text(choice.group(1).lower())
    if top and _TEXTY.match(s):  # words
        return Text(re.sub(r"[^a-z0-9]", "", s.lower()))
    chain = _split_relations(s)
    if len(chain) > 1:
        return _relation(chain, matrices)
    if _split_top_token(s, ":")[1:]:  # ratios and times (`7:32`, `12:00`) compare as written
        return Text(re.sub(r"[^a-z0-9:]", "", s.lower()))
    unions = _split_top_token(s, "\\cup")
    if len(unions) > 1:
        return Union(tuple(_item(u, matrices) for u in unions))
    bracketed = _bracketed(s, matrices)
    if bracketed is not None:
        return bracketed
    value = Parser(s, matrices).parse()
    if isinstance(value, sympy.MatrixBase):
        return Matrix(value)
    return Expr(value, decimal=bool(re.search(r"\d\.\d|(?<!\d)\.\d", s)))


def _relation(chain: list[str], matrices) -> object:
    parts, ops = chain[0::2], chain[1::2]
    if all(op == "=" for op in ops):
        label = parts[0].strip()
        if _is_label(label):
            return Assign(label, _item(parts[-1], matrices))
        if len(parts) > 2 or not any(re.search(r"[A-Za-z]", re.sub(r"\\[a-zA-Z]+", "", p)) for p in parts):
            return _item(parts[-1], matrices)  # a = b = c, or a computation `1/2 = 0.5`: the last value
    return Rel(tuple(ops), tuple(_item(p, matrices, top=False) for p in parts))


def _is_label(s: str) -> bool:
    """`x`, `f(x)`, `a_{37}`, `(p,q)`, `|AB|`, `V_1:V_2`, `\\frac{NO}{BO}`: names, not formulas."""
    if not re.search(r"[A-Za-z]", s) or _split_top_token(s, "+")[1:] or _split_top_token(s, "-")[1:]:
        return False
    bare = re.sub(r"_\{[^{}]*\}|_\w|\([^()]*\)|\\frac", "", s)
    return not re.search(r"\d", bare)


def _split_relations(s: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c in _RELOPS and depth == 0:
            out += [s[start:i], c]
            start = i + 1
    out.append(s[start:])
    return out if all(p.strip() for p in out[0::2]) else [s]


def _split_top_token(s: str, token: str) -> list[str]:
    out, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(token, i) and i > 0:
            out.append(s[start:i])
            start = i + len(token)
            i = start
            continue
        i += 1
    out.append(s[start:])
    return out


def _bracketed(s: str, matrices):
    """`(1, 2)`, `[0, 1)`, `\\{1, 2\\}` as a whole -> Seq; `(x)` -> x."""
    if s.startswith("\\{") and s.endswith("\\}"):
        inner, open_, close = s[2:-2], "{", "}"
    elif s[:1] in "([" and s[-1:] in ")]":
        inner, open_, close = s[1:-1], s[0], s[-1]
    else:
        return None
    if _closes_early(s):
        return None
    items = [p.strip() for p in _split_top(inner, ",")]
    if len(items) == 1:  # `(0;-2;6)`
        items = [p.strip() for p in _split_top(inner, ";")]
    if open_ == "{":
        return Seq("set", tuple(_item(i, matrices) for i in items if i))
    if len(items) == 1:
        return _item(items[0], matrices) if items[0] else None
    return Seq("tuple", tuple(_item(i, matrices) for i in items), open_, close)


def _closes_early(s: str) -> bool:
    depth, i = 0, 0
    while i < len(s):
        c = s[i]
        if c == "\\" and s[i + 1 : i + 2] in ("{", "}"):
            c = s[i + 1]
            i += 1
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and i < len(s) - 1:
                return True
        i += 1
    return False


def _stash_matrix(body: str, matrices: list) -> str:
    rows = [r for r in re.split(r"\\\\", body) if r.strip()]
    matrices.append([[Parser(cell.strip(), []).parse() for cell in row.split("&")] for row in rows])
    return f" \\MAT{{{len(matrices) - 1}}} "


# -- expressions ------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|(\\[a-zA-Z]+|\\[{}|])|([A-Za-z])|([-+*/^_()\[\]{}|!,'.:=]))")
_FUNCS = {"sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "sec": sympy.sec, "csc": sympy.csc,
          "cot": sympy.cot, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan, "sinh": sympy.sinh,
          "cosh": sympy.cosh, "tanh": sympy.tanh, "ln": sympy.log, "log": sympy.log, "exp": sympy.exp}
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
          "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta",
          "Theta", "Lambda", "Sigma", "Phi", "Psi", "Omega"}
_MAX_EXPONENT = 1000


class Parser:
    def __init__(self, s: str, matrices: list):
        self.tokens = self._tokenize(s)
        self.i = 0
        self.matrices = matrices  # the answer's matrices; `\MAT{i}` stands for the i-th
        self.abs_depth = 0

    @staticmethod
    def _tokenize(s: str) -> list[str]:
        out, i = [], 0
        while i < len(s):
            m = _TOKEN.match(s, i)
            if not m or m.end() == i:
                if s[i:].strip() == "":
                    break
                raise AnswerSyntaxError(f"unexpected {s[i:i + 10]!r}")
            out.append(next(g for g in m.groups() if g is not None))
            i = m.end()
        return out

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise AnswerSyntaxError(f"expected {expected or 'more'}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self):
        if not self.tokens:
            raise AnswerSyntaxError("empty expression")
        value = self.expr()
        if self.peek() is not None:
            raise AnswerSyntaxError(f"unexpected {self.peek()!r}")
        return value

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self):
        value = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", "/"):
                self.take()
                rhs = self.unary()
                value = value * rhs if tok == "*" else _div(value, rhs)
            elif self._starts_atom(tok):
                value = value * self.power()
            else:
                return value

    def unary(self):
        if self.peek() == "-":
            self.take()
            return -self.unary()
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.power()

    def power(self):
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            exponent = self.group() if self.peek() == "{" else self.unary_atom()
            return _pow(base, exponent)
        return base

    def unary_atom(self):
        if self.peek() == "-":
            self.take()
            return -self.postfix()
        return self.postfix()

    def postfix(self):
        value = self.atom()
        while self.peek() == "!":
            self.take()
            value = _factorial(value)
        return value

    def _starts_atom(self, tok) -> bool:
        if tok is None:
            return False
        if tok == "|":
            return self.abs_depth == 0
        if tok.startswith("\\"):
            return tok not in ("\\}", "\\rfloor", "\\rceil", "\\cup", "\\mod", "\\pmod")
        return tok[0].isalnum() or tok in ("(", "[", "{") or tok[0] == "."

    def group(self):
        """`{...}` or a single token (LaTeX argument)."""
        if self.peek() == "{":
            self.take()
            value = self.expr()
            self.take("}")
            return value
        return self.atom()

    def atom(self):
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return self._subscripted(sympy.Rational(tok) if "." in tok else sympy.Integer(tok), tok)
        if tok.isalpha() and len(tok) == 1:
            return self._subscripted({"e": sympy.E, "i": sympy.I}.get(tok, sympy.Symbol(tok)), tok)
        if tok in ("(", "[", "{"):
            value = self.expr()
            self.take({"(": ")", "[": "]", "{": "}"}[tok])
            return value
        if tok == "|":
            self.abs_depth += 1
            value = self.expr()
            self.take("|")
            self.abs_depth -= 1
            return sympy.Abs(value)
        if tok.startswith("\\"):
            return self.command(tok[1:])
        raise AnswerSyntaxError(f"unexpected {tok!r}")

    def _subscripted(self, value, tok):
        if self.peek() != "_":
            return value
        self.take()
        if self.peek() == "{":
            start = self.i
            self.take()
            depth = 1
            while depth:
                t = self.take()
                depth += (t == "{") - (t == "}")
            sub = "".join(self.tokens[start + 1 : self.i - 1])
        else:
            sub = self.take()
        if re.fullmatch(r"\w+", sub):
            return sympy.Symbol(f"{tok}_{sub}")
        return sympy.Function(f"{tok}_")(Parser(sub, []).parse())

    def command(self, name: str):
        if name == "frac":
            num = self.group()
            return _div(num, self.group())
        if name == "sqrt":
            if self.peek() == "[":
                self.take()
                n = self.expr()
                self.take("]")
                return sympy.root(self.group(), n)
            return sympy.sqrt(self.group())
        if name == "binom":
            n = self.group()
            return sympy.binomial(n, self.group())
        if name in _FUNCS:
            return self.function(name)
        if name == "pi":
            return sympy.pi
        if name == "infty":
            return sympy.oo
        if name in _GREEK:
            return sympy.Symbol(name)
        if name in ("lfloor", "lceil"):
            value = self.expr()
            self.take("\\r" + name[1:])
            return (sympy.floor if name == "lfloor" else sympy.ceiling)(value)
        if name in ("sum", "prod"):
            return self.big_operator(name)
        if name == "MAT":
            self.take("{")
            index = self.take()
            self.take("}")
            if not index.isdigit() or int(index) >= len(self.matrices):
                raise AnswerSyntaxError("\\MAT outside a matrix placeholder")
            return sympy.Matrix(self.matrices[int(index)])
        raise AnswerSyntaxError(f"unsupported command \\{name}")

    def function(self, name: str):
        base, power = None, None
        if name == "log" and self.peek() == "_":
            self.take()
            base = self.group()
        if self.peek() == "^":
            self.take()
            power = self.group() if self.peek() == "{" else self.unary_atom()
        if self.peek() == "(":
            arg = self.atom()
        else:  # `\sin 2x`: the argument is the product up to the next operator or function
            arg = self.power()
            while self._starts_atom(self.peek()) and not (self.peek().startswith("\\") and
                                                          self.peek()[1:] in _FUNCS):
                arg = arg * self.power()
        value = sympy.log(arg, base) if base is not None else _FUNCS[name](arg)
        return _pow(value, power) if power is not None else value

    def big_operator(self, name: str):
        self.take("_")
        self.take("{")
        var = sympy.Symbol(self.take())
        self.take("=")
        lo = self.expr()
        self.take("}")
        self.take("^")
        hi = self.group()
        body = self.power()
        while self._starts_atom(self.peek()):
            body = body * self.power()
        value = (sympy.Sum if name == "sum" else sympy.Product)(body, (var, lo, hi))
        # numeric bounds: evaluate (closed forms for polynomials; a huge range otherwise runs into the budget)
        return value.doit() if lo.is_number and hi.is_number else value


def _div(a, b):
    if getattr(b, "is_zero", False):
        raise AnswerSyntaxError("division by zero")
    return a / b


def _pow(base, exponent):
    big = (getattr(exponent, "is_Number", False) and abs(exponent) > _MAX_EXPONENT) or \
        getattr(exponent, "is_Pow", False) and not exponent.free_symbols
    if big and getattr(base, "is_Number", False) and abs(base) not in (0, 1):
        return sympy.Pow(base, exponent, evaluate=False)
    return base ** exponent


def _factorial(value):
    if getattr(value, "is_Number", False) and abs(value) > _MAX_EXPONENT:
        return sympy.factorial(value, evaluate=False)
    return sympy.factorial(value)
