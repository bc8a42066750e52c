"""Backend selection shared by the ops: one rule, so every op picks and fails the same way."""

from __future__ import annotations

import importlib

import torch
from torchtitan.tools.logging import logger

_IMPORTS: dict[str, bool] = {}


# A constant to torch.compile: dynamo cannot trace importlib, and installs do not change.
# The cache is a dict, not functools.cache: dynamo traces through a cache wrapper into the
# function it wraps, which would bypass this mark.
@torch.compiler.assume_constant_result
def module_available(name: str) -> bool:
    """Whether `name` imports. Being installed is not enough: a CUDA extension built for
    another torch or GPU fails only when imported, and auto selection must then skip it."""
    if name not in _IMPORTS:
        _IMPORTS[name] = _imports(name)
    return _IMPORTS[name]


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception as error:  # a broken build: ImportError, OSError from its library, ...
        if isinstance(error, ModuleNotFoundError) and error.name == name:
            return False  # not installed
        logger.warning(f"{name} is installed but does not import ({error}); not using it")
        return False
    return True


def resolve_backend(
    setting: str,
    requested: str | None,
    device: torch.device,
    cuda_preference: tuple[str, ...],
    cuda_only: dict[str, str | None],
    choices: tuple[str, ...],
) -> str:
    """The backend named by `requested`, or the first available one for `device`.

    `setting` names the config field in error messages; `cuda_only` maps a backend that needs
    CUDA to the extra package it imports (None: none); the others run on any device.
    """
    if requested in (None, "auto"):
        if device.type == "cuda":
            for name in cuda_preference:
                if _installed(cuda_only.get(name)):
                    return name
        return next(name for name in choices if name not in cuda_only)
    if requested not in choices:
        raise ValueError(f"model.{setting} = {requested!r} is unknown; choose one of {choices}")
    if requested in cuda_only:
        if device.type != "cuda":
            raise ValueError(
                f"model.{setting} = {requested!r} needs a CUDA device but this run is on "
                f"{device.type}; leave model.{setting} unset to pick a backend per device"
            )
        if not _installed(cuda_only[requested]):
            raise ValueError(
                f"model.{setting} = {requested!r} needs the `{cuda_only[requested]}` package, "
                "which is not installed"
            )
    return requested


def _installed(module: str | None) -> bool:
    return module is None or module_available(module)
