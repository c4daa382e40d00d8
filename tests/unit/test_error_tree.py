"""Every exception kernelmode raises descends from KernelmodeError, has its own stable code and
HTTP status, and is drawn in the tree of ``errors.py``'s docstring."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import kernelmode
from kernelmode import errors
from kernelmode.errors import InvalidRequest, KernelmodeError

# Raised inside kernels by the preamble, which may import nothing of kernelmode (stdlib only).
KERNEL_SIDE = "kernelmode.kernel."


def exception_classes() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(kernelmode.__path__, "kernelmode."):
        module = importlib.import_module(info.name)
        found += [c for c in vars(module).values() if inspect.isclass(c)
                  and issubclass(c, BaseException) and c.__module__ == info.name]
    return found


def test_every_exception_is_a_kernelmode_error_in_the_tree() -> None:
    classes = exception_classes()
    assert len(classes) > 25  # the walk found the package's modules
    tree = errors.__doc__ or ""
    for cls in classes:
        if cls.__module__.startswith(KERNEL_SIDE):
            continue
        assert issubclass(cls, KernelmodeError), f"{cls.__module__}.{cls.__name__} is outside the tree"
        assert f" {cls.__name__} " in tree, f"{cls.__name__} is not drawn in errors.py's docstring"
        assert f"({cls.http_status} {cls.code})" in tree, f"{cls.__name__}: code or status differ from the tree"


def test_codes_are_unique() -> None:
    kernelmode_errors = [c for c in exception_classes() if issubclass(c, KernelmodeError)]
    codes = [c.code for c in kernelmode_errors]
    assert len(codes) == len(set(codes)), sorted(codes)


def test_invalid_request_keeps_its_code_and_the_old_name_warns() -> None:
    assert (InvalidRequest.code, InvalidRequest.http_status) == ("invalid_request", 422)
    with pytest.warns(DeprecationWarning):
        assert errors.ValidationError is InvalidRequest  # type: ignore[attr-defined]
