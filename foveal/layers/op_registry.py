"""Modules by key, for the opaque ops a compiled forward calls (`foveal::attention`,
`foveal::linear`; foveal/worker/compiled_decode.py): an op takes plain tensors and
ints, so it names its module by an int key assigned before tracing."""
from __future__ import annotations

import itertools
import weakref

from torch import nn

_MODULES: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_module(module: nn.Module) -> int:
    """A new key for `module` (held weakly: a freed engine's modules drop out)."""
    key = next(_KEYS)
    _MODULES[key] = module
    return key


def module_by_key(key: int) -> nn.Module:
    return _MODULES[key]
