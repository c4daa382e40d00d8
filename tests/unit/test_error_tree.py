"""Every exception kernelmode raises descends from KernelmodeError, lives in ``errors.py``, has
its own stable code and HTTP status, is named in the code table ``errors.ERRORS`` and drawn in
the tree of ``errors.py``'s docstring; a process that imports only the client knows them all."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kernelmode
from kernelmode import errors
from kernelmode.errors import ERRORS, KernelmodeError, from_wire

# Raised inside kernels by the preamble, which may import nothing of kernelmode (stdlib only).
KERNEL_SIDE = "kernelmode.kernel."


def exception_classes() -> list[type[BaseException]]:
    """Every exception class of the package, found by importing every module."""
    found = []
    for info in pkgutil.walk_packages(kernelmode.__path__, "kernelmode."):
        module = importlib.import_module(info.name)
        found += [c for c in vars(module).values() if inspect.isclass(c)
                  and issubclass(c, BaseException) and c.__module__ == info.name]
    return found


def kernelmode_errors() -> list[type[KernelmodeError]]:
    """Every KernelmodeError class, from the module walk and from the subclass tree (which also
    finds a class made inside a function), once every module is imported."""
    found = {c for c in exception_classes() if issubclass(c, KernelmodeError)}
    todo: list[type[KernelmodeError]] = [KernelmodeError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.code)


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


def test_every_error_lives_in_errors_py_and_is_in_the_code_table() -> None:
    classes = kernelmode_errors()
    assert len(classes) > 40
    for cls in classes:
        assert cls.__module__ == "kernelmode.errors", f"{cls.__module__}.{cls.__name__}: define it in errors.py"
        assert ERRORS.get(cls.code) is cls, f"{cls.__name__} ({cls.code}) is missing from errors.ERRORS"
    assert set(ERRORS.values()) == set(classes)


def test_codes_are_unique() -> None:
    codes = [c.code for c in kernelmode_errors()]
    assert len(codes) == len(set(codes)), sorted(codes)


def test_old_aliases_are_gone() -> None:
    assert not hasattr(errors, "ValidationError")  # InvalidRequest's name in the never-released 0.1.0


_CHILD = """
import json, sys
import httpx
from kernelmode.client import error_from_response
answers = {}
for code, status in json.load(sys.stdin):
    e = error_from_response(httpx.Response(status, json={"error": {"code": code, "message": "m"}}))
    answers[code] = [type(e).__module__ + "." + type(e).__qualname__, e.code, e.http_status]
print(json.dumps({"answers": answers, "loaded": sorted(m for m in sys.modules if m.startswith("kernelmode"))}))
"""


def test_a_process_that_imports_only_the_client_knows_every_code() -> None:
    """In a fresh interpreter (no module of the server imported first), every code the server
    can send comes back as its own class, with the server's code and status."""
    expected = {c.code: c for c in kernelmode_errors()}
    root = Path(kernelmode.__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps([[c, e.http_status] for c, e in expected.items()]),
                         capture_output=True, text=True, check=True, cwd=root, env={"PYTHONPATH": str(root)})
    seen = json.loads(out.stdout)
    assert "kernelmode.artifacts.workspace" not in seen["loaded"]  # the case that hid the gap
    for code, cls in expected.items():
        assert seen["answers"][code] == [f"{cls.__module__}.{cls.__qualname__}", code, cls.http_status], code


@pytest.mark.parametrize(("status", "cls"), [
    (400, errors.InvalidRequest), (401, errors.Unauthorized), (403, errors.Forbidden), (404, errors.NotFound),
    (405, errors.MethodNotAllowed), (409, errors.Conflict), (413, errors.PayloadTooLarge),
    (422, errors.InvalidRequest), (429, errors.TooManyRequests), (502, KernelmodeError), (503, KernelmodeError),
])
def test_a_code_this_side_does_not_know_gets_the_class_of_its_status(status: int, cls: type) -> None:
    e = from_wire("from a newer server", code="brand_new_code", status=status, details={"x": 1})
    assert type(e) is cls and (e.code, e.http_status, e.details) == ("brand_new_code", status, {"x": 1})


def test_an_answer_without_a_code_keeps_the_status_class_and_its_code() -> None:
    assert from_wire("Not Found", status=404).to_dict() == {"code": "not_found", "message": "Not Found"}
    bare = from_wire("Bad Gateway", status=502)
    assert type(bare) is KernelmodeError and (bare.code, bare.http_status) == ("http_error", 502)
    known = from_wire("gone", code="file_not_found")  # a run's failure: no status of its own
    assert type(known) is errors.FileNotFound and known.http_status == 404
