"""A calculator tool: the model may call it before answering; the episode ends at the answer.

    <calc>347*8</calc>          the model's call (a whole turn)
    <result>2776</result>       the environment's answer (an observation)
    2776                        the model's answer: reward 1 when it equals the row's label, else 0

Rows: `prompt` (the question) and `label` (the answer, compared as stripped text). Expressions may use
integers, + - * / and parentheses; anything else gets `<result>error</result>` and counts as a tool error.
"""

from __future__ import annotations

import ast
import operator
import re

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_DIGITS = 30  # refuse results past this: 9**9**9 must not take the worker down


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text (integers stay integers); ValueError if it is not one."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            result = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(result) >= 10**MAX_DIGITS:
                raise ValueError("too large")
            return result
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError, RecursionError) as e:
        raise ValueError(str(e)) from None
    if isinstance(result, float):
        return str(int(result)) if result.is_integer() else f"{result:.6g}"
    return str(result)


class Environment:
    def reset(self, row: dict):
        self.label = str(row.get("label", "")).strip()
        return None  # the row's prompt is the first observation

    def step(self, action: str):
        call = CALL.search(action)
        if call:
            try:
                return f"<result>{evaluate(call.group(1))}</result>", 0.0, False, {"tool_call": True}
            except ValueError:
                return "<result>error</result>", 0.0, False, {"tool_call": True, "tool_error": True}
        correct = action.strip() == self.label
        return None, float(correct), True, {"success": correct}
