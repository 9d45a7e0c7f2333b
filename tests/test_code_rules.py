"""What tests/code_rules.py measures, on small sources whose counts are known (radon 6 gives
the same complexities for every function below), so a miscount fails here rather than
letting an offender through tests/test_architecture.py."""

from __future__ import annotations

import ast

import pytest
from code_rules import PACKAGE, Function, ImportSite, complexity, cycles, parameters

SOURCE = '''
def plain():
    return 1

def branches(a):
    if a == 1:
        return 1
    elif a == 2:
        return 2
    else:
        return 3

def loops(xs):
    for x in xs:
        pass
    else:
        pass
    while xs:
        xs = xs[1:]

def handlers():
    try:
        pass
    except ValueError:
        pass
    except KeyError:
        pass
    else:
        pass
    finally:
        pass

def operands(a, b, c):
    return a and b or c

def comprehension(xs, z):
    return [x for x in xs if x if z]

def asserted(a, b):
    assert a and b

def outer(a):
    def inner():
        if a:
            pass
    return inner

def with_lambda(b):
    return lambda: 1 if b else 2

def matched(v):
    match v:
        case 1:
            return 1
        case 2:
            return 2
        case _:
            return 0
'''

#: radon 6's complexity of each function of SOURCE (`radon cc -s`, closures shown).
RADON = {"plain": 1, "branches": 3, "loops": 4, "handlers": 4, "operands": 3, "comprehension": 4, "asserted": 2,
         "outer": 1, "inner": 2, "with_lambda": 2, "matched": 3}


@pytest.mark.parametrize("name", RADON)
def test_complexity_is_counted_as_radon_counts_it(name: str) -> None:
    node = next(n for n in ast.walk(ast.parse(SOURCE)) if isinstance(n, ast.FunctionDef) and n.name == name)
    assert complexity(node) == RADON[name]


def _function(source: str, in_class: bool) -> Function:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    return Function(PACKAGE / "x.py", node.name, node, in_class)


@pytest.mark.parametrize(("source", "in_class", "count"), [
    ("def m(self, a, *args, b, **kw): pass", True, 4),  # self not counted; *args and **kw one each
    ("def m(cls, a, b): pass", True, 2),
    ("def f(self, a): pass", False, 2),  # a plain function's first parameter counts, whatever its name
    ("def f(a, /, b, *, c=1): pass", False, 3),
])
def test_parameters_are_counted_without_self_and_cls(source: str, in_class: bool, count: int) -> None:
    assert parameters(_function(source, in_class)) == count


def _site(module: str, target: str) -> ImportSite:
    return ImportSite(PACKAGE / f"{module}.py", 1, target, None, False)


def test_cycles_are_the_modules_that_reach_each_other() -> None:
    graph = {"a": [_site("a", "b")], "b": [_site("b", "c")], "c": [_site("c", "a"), _site("c", "d")],
             "d": [], "e": [_site("e", "e")], "f": [_site("f", "d")]}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e"]]
