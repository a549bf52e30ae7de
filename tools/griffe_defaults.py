"""A griffe extension for the API page: a default named by a constant shows its value.

``distributed(on_stall=DEFAULT_ON_STALL)`` tells a reader nothing; the signature shows
``on_stall='report'`` instead. Only names of module constants whose value is a plain
``str``, ``int``, ``float``, ``bool`` or ``None`` are replaced (read from the imported
module, so the page cannot drift from the code); anything else is left as written.
mkdocs.yml loads it (``extensions: [tools/griffe_defaults.py]``).
"""

from __future__ import annotations

import importlib
from typing import Any

import griffe


class LiteralDefaults(griffe.Extension):
    """Replace a parameter default that names a constant with the constant's literal."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        """Rewrite ``func``'s defaults that are bare names of simple module constants."""
        for param in func.parameters:
            if not isinstance(param.default, griffe.ExprName):
                continue
            try:
                module = importlib.import_module(func.module.path)
                value = getattr(module, str(param.default))
            except (ImportError, AttributeError):
                continue
            for kind in (bool, int, float, str):
                if isinstance(value, kind):
                    param.default = repr(kind(value))
                    break
            else:
                if value is None:
                    param.default = "None"
