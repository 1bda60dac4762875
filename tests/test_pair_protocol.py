"""PairSession and RemotePair are both the engine's `Pair` (engine/pair.py): every member the
protocol names exists on each, methods with the protocol's parameters (names, kinds,
defaults), properties as properties or attributes set in __init__. Checked on the classes,
so no model is loaded and no worker started."""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Protocol

import pytest

from tandem.engine.pair import Pair, PairSession
from tandem.engine.remote.worker import RemotePair


def _members(protocol: type) -> set[str]:
    names = set(protocol.__dict__.get("__annotations__", {}))
    for name, value in protocol.__dict__.items():
        if name in ("__enter__", "__exit__") or not name.startswith("_"):
            if callable(value) or isinstance(value, property):
                names.add(name)
    return names


def _set_in_init(cls: type) -> set[str]:
    """The attributes cls.__init__ assigns to self (plain or tuple targets)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self":
                    names.add(t.attr)
    return names


def _params(func) -> list[tuple]:
    sig = inspect.signature(func)
    return [(p.name, p.kind, p.default) for p in list(sig.parameters.values())[1:]]


def _problems(protocol: type, cls: type) -> list[str]:
    problems = []
    assigned = _set_in_init(cls)
    for name in sorted(_members(protocol)):
        wanted = protocol.__dict__.get(name)
        have = inspect.getattr_static(cls, name, None)
        if have is None and name not in assigned:
            problems.append(f"{cls.__name__} lacks {name}")
        elif callable(wanted) and not isinstance(wanted, property):
            if not callable(have):
                problems.append(f"{cls.__name__}.{name} is not a method")
            elif _params(have) != _params(wanted):
                problems.append(f"{cls.__name__}.{name}{inspect.signature(have)} differs from "
                                f"the protocol's {inspect.signature(wanted)}")
        elif isinstance(wanted, property) and have is not None and \
                not isinstance(have, property) and callable(have):
            problems.append(f"{cls.__name__}.{name} is a method, the protocol's a property")
    return problems


@pytest.mark.parametrize("cls", [PairSession, RemotePair])
def test_both_pairs_are_the_protocol(cls):
    assert _problems(Pair, cls) == []


def test_the_protocol_names_what_callers_use():
    assert {"options", "target_path", "draft_path", "n_ctx", "cached_tokens", "context_files",
            "tokenizes_aside", "tokenize", "prompt_tokens", "add_context_file",
            "check_drafter", "generate", "stream", "close", "__enter__",
            "__exit__", "fim_tokens", "pieces", "props", "template_text",
            "infill_tokens"} == _members(Pair)


def test_the_check_sees_a_missing_member_and_a_changed_signature():
    class Small(Protocol):
        n_ctx: int

        def generate(self, prompt, record: bool = True): ...

        @property
        def cached_tokens(self): ...

    class Wrong:
        def __init__(self):
            self.other = 1

        def generate(self, prompt, record: bool = False): ...

        def cached_tokens(self): ...

    assert _problems(Small, Wrong) == [
        "Wrong.cached_tokens is a method, the protocol's a property",
        "Wrong.generate(self, prompt, record: 'bool' = False) differs from the protocol's "
        "(self, prompt, record: 'bool' = True)",
        "Wrong lacks n_ctx"]
