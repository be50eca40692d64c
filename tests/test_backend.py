"""Both engines give the runner the interface :class:`vlens.backend.EngineAPI`
declares, read from the classes (no engine starts, no server runs)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from vlens.backend import EngineAPI
from vlens.engine import Engine
from vlens.remote.client import RemoteEngine

ENGINES = [Engine, RemoteEngine]


def _annotations(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}


def _members() -> tuple[set[str], dict[str, object]]:
    """The Protocol's data members and its methods/properties, by name."""
    data = set(vars(EngineAPI).get("__annotations__", {}))
    calls = {name: value for name, value in vars(EngineAPI).items()
             if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return data, calls


def _params(fn: object) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_declares_what_the_runner_needs():
    data, calls = _members()
    assert {"info", "tokenizer", "lock", "model", "remote", "in_process"} <= data
    assert {"closed", "close", "hold_vectors", "hold_saes", "release_saes", "generate",
            "stream", "rpc"} <= set(calls)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_each_engine_declares_every_member_with_its_signature(cls):
    data, calls = _members()
    missing = [name for name in data
               if name not in _annotations(cls) and not hasattr(cls, name)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name, proto in calls.items():
        mine = inspect.getattr_static(cls, name, None)
        assert mine is not None, f"{cls.__name__} lacks {name}"
        if isinstance(proto, property):
            assert isinstance(mine, property), f"{cls.__name__}.{name} is no property"
            continue
        assert callable(mine), f"{cls.__name__}.{name} is not a method"
        assert _params(getattr(cls, name)) == _params(proto), (
            f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} differs from "
            f"EngineAPI.{name}{inspect.signature(proto)}")


def test_the_runner_uses_nothing_of_its_engine_but_the_protocol():
    data, calls = _members()
    runner = Path(__file__).resolve().parent.parent / "vlens" / "_runner.py"
    used = set()
    for node in ast.walk(ast.parse(runner.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "engine"):
                used.add(node.attr)
    assert used, "the runner's engine calls were not found"
    assert used <= data | set(calls), sorted(used - data - set(calls))
