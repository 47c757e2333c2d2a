"""docs/protocol.md documents every message, every field and every subject family."""

from __future__ import annotations

import inspect
from pathlib import Path

import msgspec
import pytest

from metalguard.proto import base, events, iommu, jobs, nodes, provision, qos, telemetry
from metalguard.proto.messages import MESSAGE_TYPES

DOC = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()


def _structs() -> list[type[msgspec.Struct]]:
    found: list[type[msgspec.Struct]] = []
    for module in (base, telemetry, events, qos, jobs, nodes, provision, iommu):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if not issubclass(obj, msgspec.Struct) or obj.__module__ != module.__name__:
                continue
            if msgspec.structs.fields(obj):
                found.append(obj)
    return found


@pytest.mark.parametrize("struct", _structs(), ids=lambda s: s.__name__)
def test_every_field_is_documented(struct: type[msgspec.Struct]) -> None:
    missing = [
        f.encode_name for f in msgspec.structs.fields(struct) if f"`{f.encode_name}`" not in DOC
    ]
    assert not missing, f"{struct.__name__}: fields missing from docs/protocol.md: {missing}"


@pytest.mark.parametrize("message", MESSAGE_TYPES, ids=lambda m: m.__name__)
def test_every_message_tag_is_documented(message: type[msgspec.Struct]) -> None:
    assert f'`type = "{message.__struct_config__.tag}"`' in DOC


@pytest.mark.parametrize("family", ["tel", "evt", "ctl", "cmd", "dlq", "fed"])
def test_every_subject_family_is_documented(family: str) -> None:
    assert f"`<p>.{family}." in DOC
