"""Is a parsed answer equivalent to the parsed gold? Structure first, then values.

- numbers: exact for integers and fractions; a side written with a decimal point is compared with a relative
  tolerance of 1e-9 (so `0.0833333333333333` is `1/12` but `3.14` is not `\\pi` and `0.33` is not `1/3`);
- expressions: structurally equal after sympy's own canonical form, else equal at four fixed random points
  (positive reals, to keep roots and logs real), else `simplify(a - b) == 0` (under the caller's time budget);
- relations: the same relation after moving everything to one side, up to a positive factor for inequalities
  (`-x > -1` is `x < 1`) and any non-zero factor for equations (`2x+4y-3=0` is `y=-x/2+3/4`);
- `x = 3` against `3`: the value counts, whatever the name (`f(x)=1`, `|AB|=1`, `(p,q)=(3,2)`);
- intervals and tuples: brackets must match (`(1,2)` is not `[1,2]`), items in order; an inequality in one
  variable against an interval compares the sets they describe;
- bare lists (`1, 2`), sets (`\\{1,2\\}`) and `\\pm` answers: order-free, each item matched both ways;
- matrices: shape and entries; text and choice letters: case-insensitive words.
"""

from __future__ import annotations

import sympy
from sympy.core.function import AppliedUndef

from megarl.verifiers.math.parse import Assign, Expr, Matrix, Parser, AnswerSyntaxError, Rel, Seq, Text, Union

_POINTS = [(0.5772156649, 1.3247179572, 2.2360679775, 0.8090169944),
           (1.6180339887, 0.6931471806, 1.4142135624, 2.7182818285),
           (2.5029078751, 0.9159655942, 1.2020569032, 0.3678794412),
           (0.7071067812, 1.7320508076, 0.4342944819, 1.9021130326)]
_FLIP = {"<": (">", True), "≤": ("≥", True), ">": (">", False), "≥": ("≥", False), "=": ("=", False),
         "≠": ("≠", False)}
_MAX_ITEMS = 64


def equivalent(gold, pred) -> bool:
    if isinstance(gold, Assign) and isinstance(pred, Assign):
        return equivalent(gold.value, pred.value)
    if isinstance(gold, Assign) or isinstance(pred, Assign):
        other = pred if isinstance(gold, Assign) else gold
        named = gold if isinstance(gold, Assign) else pred
        if isinstance(other, Rel):
            as_rel = _assign_as_rel(named)
            return as_rel is not None and (_rel_equal(as_rel, other))
        return equivalent(named.value, other) if isinstance(gold, Assign) else equivalent(gold, named.value)
    if isinstance(gold, Text) or isinstance(pred, Text):
        return isinstance(gold, Text) and isinstance(pred, Text) and gold.text == pred.text
    if _is_setlike(gold) or _is_setlike(pred):
        return _set_compare(gold, pred)
    if isinstance(gold, Rel) and isinstance(pred, Rel):
        return _rel_equal(gold, pred)
    if isinstance(gold, Seq) and isinstance(pred, Seq):  # two tuples / intervals
        return (gold.open, gold.close) == (pred.open, pred.close) and _ordered(gold.items, pred.items)
    if isinstance(gold, Matrix) and isinstance(pred, Matrix):
        return gold.value.shape == pred.value.shape and all(
            values_equal(a, b, False) for a, b in zip(gold.value, pred.value))
    if isinstance(gold, Expr) and isinstance(pred, Expr):
        return values_equal(gold.value, pred.value, gold.decimal or pred.decimal)
    if isinstance(gold, (Rel, Union, Seq)) or isinstance(pred, (Rel, Union, Seq)):
        return _same_set(gold, pred)
    return False


# -- collections --------------------------------------------------------------------------------------------------


def _is_setlike(node) -> bool:
    return isinstance(node, Seq) and node.kind in ("list", "set")


def _items(node) -> list:
    if _is_setlike(node):
        out = []
        for item in node.items:
            out.extend(_items(item))
        return out
    return [node.value if isinstance(node, Assign) else node]


def _set_compare(gold, pred) -> bool:
    # a bare list against a tuple: `1, 3` is the pair (1, 3), in that order
    for a, b in ((gold, pred), (pred, gold)):
        if isinstance(a, Seq) and a.kind == "tuple" and isinstance(b, Seq) and b.kind == "list":
            return _ordered(a.items, b.items)
    g, p = _items(gold), _items(pred)
    if len(g) > _MAX_ITEMS or len(p) > _MAX_ITEMS:
        return False
    return all(any(equivalent(x, y) for y in p) for x in g) and all(any(equivalent(x, y) for x in g) for y in p)


def _ordered(a, b) -> bool:
    return len(a) == len(b) and all(equivalent(x, y) for x, y in zip(a, b))


# -- values -------------------------------------------------------------------------------------------------------


def values_equal(a, b, decimal: bool) -> bool:
    if isinstance(a, sympy.MatrixBase) or isinstance(b, sympy.MatrixBase):
        return isinstance(a, sympy.MatrixBase) and isinstance(b, sympy.MatrixBase) and a.shape == b.shape and all(
            values_equal(x, y, decimal) for x, y in zip(a, b))
    try:
        if a == b:
            return True
        if a.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
            return False
        if a.has(sympy.Sum, sympy.Product, AppliedUndef) or b.has(sympy.Sum, sympy.Product, AppliedUndef):
            return False  # nothing to evaluate (symbolic bounds, unknown functions): sympy's canonical form decided
        free = a.free_symbols | b.free_symbols
        if not free:
            if a.is_Rational and b.is_Rational and not decimal:
                return False
            return _close(a, b, decimal)
        verdict = _agree_at_points(a, b, sorted(free, key=str))
        if verdict is not None:
            return verdict
        return sympy.simplify(a - b) == 0
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError, RecursionError):
        return False


def _close(a, b, decimal: bool) -> bool:
    """Constants: a decimal side within a relative 1e-9; exact sides must differ by (almost) nothing, measured on
    the symbolic difference (sympy cancels equal terms and evalf raises its precision against cancellation), so
    `2^{3^{4^{5}}}+1` is not `2^{3^{4^{5}}}` however close their ratio."""
    diff = (a - b).evalf(30)
    va, vb = a.evalf(30), b.evalf(30)
    if not all(v.is_number for v in (diff, va, vb)) or any(v.has(sympy.nan, sympy.zoo) for v in (diff, va, vb)):
        return False
    scale = sympy.Max(abs(va), abs(vb)).evalf(30)
    if decimal:
        return bool(abs(diff) <= 1e-9 * scale) or bool(abs(diff) < 1e-30)
    return bool(abs(diff) <= 1e-12 * sympy.Min(1, scale)) or bool(diff == 0)


def _agree_at_points(a, b, symbols) -> bool | None:
    """True/False when at least two points could be evaluated, None when the values are not numeric."""
    good = 0
    for point in _POINTS:
        subs = {s: point[i % len(point)] + 0.1 * (i // len(point)) for i, s in enumerate(symbols)}
        va, vb = _complex(a, subs), _complex(b, subs)
        if va is None or vb is None:
            continue
        if abs(va - vb) > 1e-8 * max(abs(va), abs(vb), 1e-6):
            return False
        good += 1
    return True if good >= 2 else None


def _complex(expr, subs) -> complex | None:
    try:  # substituting Floats evaluates as it goes: several times faster than evalf(subs=...)
        v = complex(expr.xreplace({k: sympy.Float(x, 20) for k, x in subs.items()}))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError):
        return None
    if v != v or abs(v) == float("inf"):
        return None
    return v


# -- relations ----------------------------------------------------------------------------------------------------


def _canonical(rel: Rel) -> list[tuple[str, object]] | None:
    out = []
    for i, op in enumerate(rel.ops):
        lhs, rhs = rel.parts[i], rel.parts[i + 1]
        if not (isinstance(lhs, Expr) and isinstance(rhs, Expr)):
            return None
        canon, flip = _FLIP[op]
        out.append((canon, (rhs.value - lhs.value) if flip else (lhs.value - rhs.value)))
    return out


def _rel_equal(a: Rel, b: Rel) -> bool:
    ca, cb = _canonical(a), _canonical(b)
    if ca is None or cb is None or len(ca) != len(cb):
        return False
    return all(any(op1 == op2 and _proportional(d1, d2, positive=op1 in (">", "≥")) for op2, d2 in cb)
               for op1, d1 in ca) and all(any(op1 == op2 and _proportional(d1, d2, positive=op1 in (">", "≥"))
                                              for op1, d1 in ca) for op2, d2 in cb)


def _proportional(d1, d2, positive: bool) -> bool:
    """d1 = c * d2 for a constant c (c > 0 when `positive`)."""
    try:
        if sympy.simplify(d1 - d2) == 0 if not (d1.free_symbols or d2.free_symbols) else d1 == d2:
            return True
        symbols = sorted(d1.free_symbols | d2.free_symbols, key=str)
        ratios = []
        for point in _POINTS:
            subs = {s: point[i % len(point)] for i, s in enumerate(symbols)}
            v1, v2 = _complex(d1, subs), _complex(d2, subs)
            if v1 is None or v2 is None or abs(v2) < 1e-12:
                continue
            ratios.append(v1 / v2)
        if len(ratios) < 2 or abs(ratios[0]) < 1e-12:
            return False
        if any(abs(r - ratios[0]) > 1e-8 * abs(ratios[0]) for r in ratios):
            return False
        return ratios[0].real > 0 if positive else True
    except (TypeError, ValueError, AttributeError):
        return False


def _assign_as_rel(node: Assign) -> Rel | None:
    if not isinstance(node.value, Expr):
        return None
    try:
        label = Parser(node.label, []).parse()
    except (AnswerSyntaxError, TypeError, ValueError, ZeroDivisionError):
        return None
    return Rel(("=",), (Expr(label, False), node.value))


# -- intervals and the sets that inequalities describe -----------------------------------------------------------


def _same_set(a, b) -> bool:
    sa, sb = _as_set(a), _as_set(b)
    if sa is None or sb is None:
        return False
    try:
        return bool(sa == sb) or sa.symmetric_difference(sb) == sympy.S.EmptySet
    except (TypeError, ValueError, AttributeError):
        return False


def _as_set(node):
    try:
        if isinstance(node, Union):
            parts = [_as_set(p) for p in node.parts]
            return None if any(p is None for p in parts) else sympy.Union(*parts)
        if isinstance(node, Seq) and node.kind == "tuple" and len(node.items) == 2 and all(
                isinstance(i, Expr) for i in node.items) and node.open in "([" and node.close in ")]":
            lo, hi = node.items[0].value, node.items[1].value
            return sympy.Interval(lo, hi, left_open=node.open == "(", right_open=node.close == ")")
        if isinstance(node, Seq) and node.kind == "set" and all(isinstance(i, Expr) for i in node.items):
            return sympy.FiniteSet(*[i.value for i in node.items])
        if isinstance(node, Rel) and "=" not in node.ops and "≠" not in node.ops:
            return _solve_chain(node)
    except (TypeError, ValueError, AttributeError):
        return None
    return None


def _solve_chain(rel: Rel):
    canon = _canonical(rel)
    if canon is None:
        return None
    symbols = set().union(*(d.free_symbols for _, d in canon))
    if len(symbols) != 1:
        return None
    (x,) = symbols
    x_real = sympy.Symbol(x.name, real=True)
    result = sympy.S.Reals
    for op, d in canon:
        d = d.subs(x, x_real)
        a, b = d.diff(x_real), None
        if a.is_number and a != 0:  # linear: a half-line, no solver needed
            b = -(d - a * x_real).expand() / a
            half = sympy.Interval(b, sympy.oo, left_open=op == ">") if a > 0 else \
                sympy.Interval(-sympy.oo, b, right_open=op == ">")
        else:
            half = sympy.solveset(d > 0 if op == ">" else d >= 0, x_real, sympy.S.Reals)
        result = result.intersect(half)
    return result
