"""Callable modules: only `hybridpar.runtime.parallelize` still uses this.

It is both a module and a function: once a submodule is imported, Python binds its name on the parent
package to the module, shadowing a function of the same name; making the module itself callable keeps
`hybridpar.runtime.parallelize(...)` working either way. The runtime's rewrite renames that module and
deletes this file.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable


def make_module_callable(module_name: str, fn: Callable) -> None:
    module = sys.modules[module_name]
    cls = type(f"_Callable_{module_name.replace('.', '_')}", (types.ModuleType,),
               {"__call__": staticmethod(lambda *a, **k: fn(*a, **k)), "__doc__": fn.__doc__})
    module.__class__ = cls
