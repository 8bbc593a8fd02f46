"""A mypy plugin (`make lint`): a ``.get("key")`` on a TypedDict must name one of its keys.

mypy checks ``status["key"]`` against a TypedDict, but types ``status.get("typo")`` as ``object`` without a
word, and the status readers (node/ops/metrics.py, node/ops/doctor_status.py, node/ops/status_view.py, ...) use ``.get``
because an older daemon may lack a key: a misspelt key would silently read nothing. With this plugin such
a read is an error (``typeddict-item``); mypy's own inference of the value's type still applies.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.errorcodes import TYPEDDICT_ITEM
from mypy.plugin import MethodContext, Plugin
from mypy.plugins.default import typed_dict_get_callback
from mypy.typeops import try_getting_str_literals
from mypy.types import Type, TypedDictType


def _checked_get(ctx: MethodContext) -> Type:
    if isinstance(ctx.type, TypedDictType) and ctx.args and len(ctx.args[0]) == 1:
        keys = try_getting_str_literals(ctx.args[0][0], ctx.arg_types[0][0]) or []
        for key in keys:
            if key not in ctx.type.items:
                name = ctx.type.fallback.type.name
                ctx.api.fail(f'TypedDict "{name}" has no key "{key}"', ctx.context, code=TYPEDDICT_ITEM)
    return typed_dict_get_callback(ctx)


class TypedDictKeys(Plugin):
    # Plugins named in the config come before mypy's default one, whose hook for this method is the one
    # called above: this hook replaces it and keeps its inference.
    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        return _checked_get if fullname == "typing.Mapping.get" else None


def plugin(version: str) -> type[Plugin]:
    return TypedDictKeys
