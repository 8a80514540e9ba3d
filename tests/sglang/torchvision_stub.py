"""A stand-in for ``torchvision``, installed into ``sys.modules`` before SGLang is imported.

SGLang 0.5.23 imports ``torchvision.transforms`` at module level in its multimodal config and
processor modules (``sglang.srt.configs`` imports them all), which the speculative-decoding
modules these tests exercise pull in. PyPI's torchvision wheel is a CUDA build whose C
operators do not register beside CPU torch (``operator torchvision::nms does not exist``), and
no image is ever processed here: so these tests import a stand-in whose attributes are inert
placeholders (transformers, seeing a torchvision module, imports names from it too)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

_SUBMODULES = ("transforms", "transforms.functional", "transforms.v2",
               "transforms.v2.functional", "io", "ops", "models")


class _Placeholder:
    """Any name a module asks of torchvision: callable, indexable, never used here."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: the torchvision stand-in of tests/sglang has no"
                           " image operations")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # (a module subclassing a torchvision class)


class _Module(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        self.__path__: list[str] = []

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


def install() -> None:
    """Put the stand-in in ``sys.modules`` unless a torchvision is imported already."""
    if "torchvision" in sys.modules:
        return
    root = _Module("torchvision")
    root.__version__ = "0.0.0+dspark-test-stub"
    sys.modules["torchvision"] = root
    for sub in _SUBMODULES:
        module = _Module(f"torchvision.{sub}")
        sys.modules[module.__name__] = module
        parent, _, leaf = module.__name__.rpartition(".")
        setattr(sys.modules[parent], leaf, module)
