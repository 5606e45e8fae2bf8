"""A class's `__init__` signature read from its source file, without importing it, where that is certain.

`unifit launch` checks the experiment's classes before any process starts. Importing them imports the user's
framework in the launching process, before a rank can start: TensorFlow ~5 s of CPU, Lightning ~6 s, on every
launch. Where a class defines its own `__init__` in plain Python, with hints of builtin types, the signature is read
from the file (ast) instead, once every package the file imports at its top is found installed. Anything else - an
`__init__` inherited or decorated, a decorated class or one with a metaclass keyword, a hint naming another type, a
file that does not parse, a package that is missing - gives None, and the caller imports the class as before.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

# what a hint may name to be evaluated here: builtin types and typing's spelling of them
_BUILTINS = {t.__name__: t for t in (int, float, str, bool, bytes, list, dict, tuple, set, frozenset, type(None))}
_TYPING = {n: getattr(typing, n) for n in ("Any", "Optional", "Union", "Literal", "List", "Dict", "Tuple", "Sequence")}
_NAMES: dict[str, Any] = {**_BUILTINS, "None": None, **_TYPING}


def signature_from_source(class_path: str) -> tuple[str, inspect.Signature] | None:
    """(the class's name, its __init__'s signature with evaluated hints, `self` left out), or None."""
    module_name, sep, name = class_path.partition(":")
    if not sep:
        module_name, _, name = class_path.rpartition(".")
    if not module_name or not name or module_name in sys.modules:  # imported already: the import costs nothing
        return None
    path = _source_file(module_name)
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    if not _imports_resolve(tree):
        return None  # the import fails: let it, before any process starts, in its words
    cls = _only_class(tree, name)
    init = _own_init(cls) if cls is not None else None
    if init is None:
        return None
    typing_names = _usable_names(tree)
    try:
        return name, _signature(init, typing_names)
    except _NotCertain:
        return None


class _NotCertain(Exception):
    pass


def _source_file(module_name: str) -> Path | None:
    """The module's .py file, found without running any package's __init__ (find_spec of a dotted name would)."""
    parts = module_name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if len(parts) == 1:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    locations = list(spec.submodule_search_locations or [])
    for i, part in enumerate(parts[1:], start=2):
        last = i == len(parts)
        found = None
        for location in locations:
            package, module = Path(location, part), Path(location, f"{part}.py")
            if last and module.is_file():
                return module
            if package.is_dir():
                found = package
                break
        if found is None:
            return None
        if last:
            init = found / "__init__.py"
            return init if init.is_file() else None
        locations = [str(found)]
    return None


def _imports_resolve(tree: ast.Module) -> bool:
    """Whether every package the module imports at its top is installed (found, not run)."""
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for top in {n.split(".")[0] for n in names}:
            try:
                if top not in sys.modules and importlib.util.find_spec(top) is None:
                    return False
            except (ImportError, ValueError):
                return False
    return True


def _only_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    """The module's class `name`, when it is the one thing that binds the name and nothing can change what it is."""
    binders = [node for node in tree.body if name in _bound_names(node)]
    if len(binders) != 1 or not isinstance(binders[0], ast.ClassDef):
        return None
    cls = binders[0]
    return None if cls.decorator_list or cls.keywords else cls


def _own_init(cls: ast.ClassDef) -> ast.FunctionDef | None:
    special = {"__init__", "__new__", "__signature__", "__call__"}
    defined = [node for node in cls.body if _bound_names(node) & special]
    if len(defined) != 1 or not isinstance(defined[0], ast.FunctionDef) or defined[0].name != "__init__":
        return None
    return None if defined[0].decorator_list else defined[0]


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    # anything else that may bind names at the top (if/try/with/for blocks): every name stored in it
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | {
        d.name for d in ast.walk(node) if isinstance(d, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _usable_names(tree: ast.Module) -> set[str]:
    """The names a hint may use: the builtin types the module does not rebind, and typing's forms it imports."""
    from_typing: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in ("typing", "typing_extensions"):
            from_typing |= {a.name for a in node.names if a.asname is None and a.name in _TYPING}
    bound = {n for node in tree.body for n in _bound_names(node)}
    return {n for n in (*_BUILTINS, "None") if n not in bound} | from_typing


def _signature(init: ast.FunctionDef, usable: set[str]) -> inspect.Signature:
    args = init.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = []
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        if i == 0:
            continue  # self
        kind = inspect.Parameter.POSITIONAL_ONLY if arg in args.posonlyargs else inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(_parameter(arg, kind, default, usable))
    if args.vararg is not None:
        params.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(_parameter(arg, inspect.Parameter.KEYWORD_ONLY, default, usable))
    if args.kwarg is not None:
        params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    if not positional:
        raise _NotCertain  # no self: not a plain method
    return inspect.Signature(params)


def _parameter(arg: ast.arg, kind: Any, default: ast.expr | None, usable: set[str]) -> inspect.Parameter:
    present = inspect.Parameter.empty if default is None else ...  # only whether there is one matters
    return inspect.Parameter(arg.arg, kind, default=present, annotation=_hint(arg.annotation, usable))


def _hint(node: ast.expr | None, usable: set[str]) -> Any:
    """The hint's value, when it names only builtin types and typing's forms; else _NotCertain."""
    if node is None:
        return inspect.Parameter.empty
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted hint
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            raise _NotCertain from None
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id not in usable:
            raise _NotCertain
        if not isinstance(sub, (ast.Name, ast.Load, ast.Subscript, ast.Tuple, ast.BinOp, ast.BitOr, ast.Constant)):
            raise _NotCertain  # attribute access, calls ...: not evaluated here
    try:
        return eval(compile(ast.Expression(node), "<hint>", "eval"), {"__builtins__": {}}, _NAMES)  # noqa: S307
    except Exception:
        raise _NotCertain from None
