"""The module paths of hf-memfit 0.1's flat layout, kept working for one release.

`import hf_memfit.trainer` (or `from hf_memfit.planner import ...` of a name the
new package no longer re-exports) still works: the old name is an alias of the
module's new home, so both names are the same module object, and a
`DeprecationWarning` names the new path. Remove after the next release.
(`hf_memfit.calibrated` is gone, not moved: the parametric fit, `estimator/parametric.py`, replaced it.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module -> where it lives now
MOVED = {
    "hf_memfit.generic": "hf_memfit.models.generic",
    "hf_memfit.spec": "hf_memfit.models.spec",
    "hf_memfit.breakdown": "hf_memfit.estimator.breakdown",
    "hf_memfit.formulas": "hf_memfit.estimator.fast",
    "hf_memfit.trace": "hf_memfit.estimator.trace",
    "hf_memfit.step": "hf_memfit.estimator.step",
    "hf_memfit.sharding": "hf_memfit.estimator.sharding",
    "hf_memfit.cuda_overhead": "hf_memfit.estimator.cuda_overhead",
    "hf_memfit.timeline": "hf_memfit.estimator.timeline",
    "hf_memfit.measure": "hf_memfit.estimator.measure",
    "hf_memfit.deepspeed": "hf_memfit.planner.deepspeed",
    "hf_memfit.fsdp": "hf_memfit.planner.accelerate",
    "hf_memfit.plot": "hf_memfit.report.plot",
    "hf_memfit.args": "hf_memfit.integrations.args",
    "hf_memfit.trainer": "hf_memfit.integrations.trainer",
    "hf_memfit.mixin": "hf_memfit.integrations.mixin",
    "hf_memfit.trl": "hf_memfit.integrations.trl",
    "hf_memfit.introspect": "hf_memfit.integrations.introspect",
    "hf_memfit.recipe": "hf_memfit.integrations.recipe",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)  # the new module itself: one object under both names

    def exec_module(self, module):
        pass  # already executed under its new name


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"`{fullname}` moved to `{new}`; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
