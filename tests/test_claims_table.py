"""Every field that crosses the wire has a row in docs/protocol.md's claims table.

The wire surfaces are read from the code, not from a list kept by hand: the signed bodies in
``protocols/messages.py`` (every pydantic model of the module), the signed group entry of
``swarm/averaging/groups.py``, and every message of the generated protobuf modules. A field counts as
named when a row of the table under ``## Claims`` names it as `` `Message.field` `` in its first cell,
so a new wire field without a row fails here, naming the field and its message.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor
from pydantic import BaseModel

from protocols import averaging_pb2, coordinator_pb2, messages, pipeline_pb2
from swarm.averaging.groups import GroupEntryBody

pytestmark = pytest.mark.timeout(30)

PROTOCOL_MD = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
SECTION = "## Claims"
COLUMNS = 6  # field, signed by, checked by, bound, the most a lie can do, test
NAMED = re.compile(r"`([A-Z][A-Za-z0-9]*)\.([a-z_][a-z0-9_]*)`")

Field = tuple[str, str]  # (message, field)


def section(markdown: str, title: str = SECTION) -> str:
    """The text of the ``## `` section titled ``title``, up to the next ``## `` heading."""
    lines = markdown.splitlines()
    try:
        start = lines.index(title)
    except ValueError:
        raise AssertionError(f"docs/protocol.md has no {title!r} section") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start + 1 : end])


def table_rows(text: str) -> Iterator[list[str]]:
    """The cells of every body row of every markdown table in ``text``: a table's first row is its
    header and its second the rule under it; the rows after them are its body."""
    position = 0  # of the current line within its table; 0 outside a table
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            position = 0
            continue
        position += 1
        if position > 2:
            yield [cell.strip() for cell in line.strip("|").split("|")]


def named_fields(rows: Iterable[list[str]]) -> set[Field]:
    """The `` `Message.field` `` names in the first cell of each row."""
    return {(m, f) for row in rows for m, f in NAMED.findall(row[0])}


def missing(fields: Iterable[Field], named: set[Field]) -> list[str]:
    return [f"{message}.{field}" for message, field in sorted(fields) if (message, field) not in named]


def model_fields(models: Iterable[type[BaseModel]]) -> set[Field]:
    return {(model.__name__, name) for model in models for name in model.model_fields}


def body_models() -> list[type[BaseModel]]:
    """Every pydantic model defined in protocols/messages.py that holds fields (the bodies)."""
    found = [
        obj
        for _, obj in inspect.getmembers(messages, inspect.isclass)
        if issubclass(obj, BaseModel) and obj.__module__ == messages.__name__ and obj.model_fields
    ]
    assert len(found) >= 10, f"found only {[m.__name__ for m in found]} in protocols/messages.py"
    return found


def proto_fields(module: object) -> set[Field]:
    """(message, field) of every message of a generated protobuf module, nested messages included but
    the entries protobuf generates for ``map<,>`` fields (they are named through the map field)."""

    def walk(descriptor: Descriptor) -> Iterator[Field]:
        if descriptor.GetOptions().map_entry:
            return
        for field in descriptor.fields:
            yield descriptor.name, field.name
        for nested in descriptor.nested_types:
            yield from walk(nested)

    file = module.DESCRIPTOR
    return {item for message in file.message_types_by_name.values() for item in walk(message)}


SURFACES = {
    "protocols/messages.py": lambda: model_fields(body_models()),
    "swarm/averaging/groups.py": lambda: model_fields([GroupEntryBody]),
    "protocols/averaging.proto": lambda: proto_fields(averaging_pb2),
    "protocols/pipeline.proto": lambda: proto_fields(pipeline_pb2),
    "protocols/coordinator.proto": lambda: proto_fields(coordinator_pb2),
}


@pytest.fixture(scope="module")
def claims() -> list[list[str]]:
    rows = list(table_rows(section(PROTOCOL_MD.read_text())))
    assert rows, "the Claims section of docs/protocol.md holds no table rows"
    return rows


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_every_wire_field_has_a_row_in_the_claims_table(surface: str, claims: list[list[str]]) -> None:
    fields = SURFACES[surface]()
    assert fields, f"no fields read from {surface}"
    absent = missing(fields, named_fields(claims))
    assert not absent, (
        f"docs/protocol.md's claims table has no row for these fields of {surface}: {', '.join(absent)}; "
        "add a row saying who signs each, who checks it and how, its bound, the most a lie can do and its test"
    )


def test_message_names_are_unambiguous_across_the_surfaces() -> None:
    """A row names `Message.field`, so no two surfaces may define a message of the same name."""
    owners: dict[str, set[str]] = {}
    for surface, read in SURFACES.items():
        for message, _ in read():
            owners.setdefault(message, set()).add(surface)
    shared = {m: sorted(s) for m, s in owners.items() if len(s) > 1}
    assert not shared, f"message names defined on more than one surface: {shared}"


def test_every_row_fills_every_column_and_names_only_real_fields(claims: list[list[str]]) -> None:
    """A row with an empty cell is no answer, and a row naming a field that no longer exists is stale."""
    real = set().union(*(read() for read in SURFACES.values()))
    for row in claims:
        assert len(row) == COLUMNS, f"row {row[0]!r} has {len(row)} cells, not {COLUMNS}"
        assert all(row), f"row {row[0]!r} leaves a cell empty (write 'none' where there is none)"
        named = named_fields([row])
        assert named, f"row {row[0]!r} names no `Message.field`"
        stale = missing(named, real)
        assert not stale, f"row {row[0]!r} names fields that no wire surface has: {', '.join(stale)}"


CITED_TEST = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
CITED_TEST_FILE = re.compile(r"`(tests/[\w/]+\.py)`")
CITED_CODE = re.compile(r"`((?:protocols|swarm|peer|coordinator|lab)/[\w/]+\.py):([A-Za-z_][\w.]*)`")


def test_every_cited_test_and_function_exists(claims: list[list[str]]) -> None:
    """A row's "test" and "checked by" cells point at code that is there, so a rename leaves no stale row."""
    root = PROTOCOL_MD.parents[1]
    for row in claims:
        text = " ".join(row)
        for path, name in CITED_TEST.findall(row[-1]):
            source = root / path
            assert source.is_file(), f"row {row[0]!r} cites {path}, which does not exist"
            assert re.search(rf"^def {name}\(", source.read_text(), re.M), (
                f"row {row[0]!r}: no test {path}::{name}"
            )
        for path in CITED_TEST_FILE.findall(row[-1]):
            assert (root / path).is_file(), f"row {row[0]!r} cites {path}, which does not exist"
        for path, dotted in CITED_CODE.findall(text):
            source = root / path
            assert source.is_file(), f"row {row[0]!r} cites {path}, which does not exist"
            for name in dotted.split("."):
                assert re.search(rf"^\s*(?:async def|def|class) {name}\b", source.read_text(), re.M), (
                    f"row {row[0]!r} cites {path}:{dotted}, which has no {name}"
                )


def test_a_field_without_a_row_is_named_with_its_message() -> None:
    """The check itself can fail: a synthetic body with a field the synthetic table leaves out."""

    class SyntheticBody(BaseModel):
        step: int
        throughput: float

    table = "\n".join(
        [
            "## Claims",
            "",
            "| field | signed by | checked by | bound | most a lie can do | test |",
            "| --- | --- | --- | --- | --- | --- |",
            "| `SyntheticBody.step` | the peer | nobody | < 2^63 | holds a round | none |",
            "",
            "## Errors",
            "",
            "| Error | gRPC status |",
            "| --- | --- |",
            "| `SyntheticBody.throughput` | named only outside the Claims section |",
        ]
    )
    rows = list(table_rows(section(table)))
    assert len(rows) == 1, "only the Claims section's body rows count"
    assert missing(model_fields([SyntheticBody]), named_fields(rows)) == ["SyntheticBody.throughput"]
    assert missing({("PartChunk", "weight")}, named_fields(rows)) == ["PartChunk.weight"]
