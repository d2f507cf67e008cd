"""No function in ``fedrod_ray/`` over 60 lines or 8 arguments without a reason written beside it: a comment
``# size: <why>`` on the line above its ``def`` (or above its decorators). A method that overrides a hook whose
definition in a base class carries the reason (``Personalization.train``) shares it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fedrod_ray"
MAX_LINES, MAX_ARGS = 60, 8


def _arguments(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    return len(names) - (1 if names and names[0].arg in ("self", "cls") else 0)


def _reason(lines: list[str], fn: ast.FunctionDef) -> str | None:
    """The ``# size:`` comment (its lines joined) that ends right above ``fn``'s def or decorators."""
    row = min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) - 2
    block = []
    while row >= 0 and lines[row].strip().startswith("#"):
        block.insert(0, lines[row].strip().lstrip("#").strip())
        if lines[row].strip().startswith("# size:"):
            return " ".join(block).removeprefix("size:").strip() or None
        row -= 1
    return None


def oversized(sources: dict[str, str]) -> list[str]:
    """``path:line name (lines, arguments)`` of every function over the limits without a reason of its own or
    of the hook it overrides."""
    found, reasoned, bases = [], set(), {}
    for path, text in sources.items():
        lines, tree = text.splitlines(), ast.parse(text)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases[cls.name] = {b.id for b in cls.bases if isinstance(b, ast.Name)}
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and _reason(lines, fn):
                    reasoned.add((cls.name, fn.name))

    def inherited(cls: str, name: str, seen: frozenset = frozenset()) -> bool:
        return any((b, name) in reasoned or (b not in seen and inherited(b, name, seen | {cls}))
                   for b in bases.get(cls, ()))

    for path, text in sources.items():
        lines, tree = text.splitlines(), ast.parse(text)
        owner = {fn: cls.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for fn in cls.body}
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            size, args = fn.end_lineno - fn.lineno + 1, _arguments(fn)
            if (size > MAX_LINES or args > MAX_ARGS) and not _reason(lines, fn) and not (
                    fn in owner and inherited(owner[fn], fn.name)):
                found.append(f"{path}:{fn.lineno} {fn.name} ({size} lines, {args} arguments)")
    return found


def test_every_long_or_wide_function_says_why():
    sources = {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert oversized(sources) == []


def test_the_check_finds_a_wide_function_and_takes_a_reason_or_a_hook_s():
    wide = ", ".join(f"a{i}" for i in range(9))
    source = (f"def f({wide}):\n    pass\n\n# size: a reason\n# on two lines\ndef g({wide}):\n    pass\n\n"
              f"class Base:\n    # size: the hook's\n    def hook(self, {wide}):\n        pass\n\n"
              f"class Mid(Base):\n    pass\n\nclass Sub(Mid):\n    def hook(self, {wide}):\n        pass\n\n"
              f"    def other(self, {wide}):\n        pass\n")
    assert [line.split(" ")[1] for line in oversized({"m.py": source})] == ["f", "other"]
