"""Safe evaluation of arithmetic expressions: the calculator tool (the built-in `calculator`
environment, rltool.env.builtins, and the `--generate-fn rltool.rollout.calculator:generate`
loop). Numbers, + - * / // % **, parentheses; no names, calls or attributes."""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_EXPR_CHARS = 200
MAX_OPERATIONS = 64
MAX_INT_BITS = 1024  # ~308 decimal digits


def evaluate(expr: str) -> str:
    """Evaluate an arithmetic expression safely (no names, calls or attributes); 'error' if not.

    Bounded by construction: at most MAX_EXPR_CHARS characters and MAX_OPERATIONS operators,
    exponents of at most MAX_EXPONENT, and no integer (operand or result) beyond MAX_INT_BITS bits,
    checked before a power is computed; so every answer costs microseconds and prints (Python
    refuses str() of integers beyond ~4300 digits). Complex, infinite and NaN results are errors.
    """
    if len(expr) > MAX_EXPR_CHARS:
        return "error"
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
        if sum(isinstance(n, (ast.BinOp, ast.UnaryOp)) for n in ast.walk(tree)) > MAX_OPERATIONS:
            return "error"
        value = _eval(tree)
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError):
        return "error"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose exponent or integer result would exceed the caps, before computing it."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError("exponent too large")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        # With b = bit_length(base), base**exponent has more than (b - 1) * exponent bits and at
        # most b * exponent: refuse what is surely over the cap, and what passes has fewer than
        # MAX_INT_BITS + MAX_EXPONENT bits, cheap to compute before _checked applies the exact cap.
        if (abs(base).bit_length() - 1) * exponent >= MAX_INT_BITS:
            raise ValueError("result too large")


def _checked(value: object) -> int | float:
    """The value if it is a finite real within the integer cap; ValueError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise ValueError("integer too large")
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"not a finite real number: {type(value).__name__}")
