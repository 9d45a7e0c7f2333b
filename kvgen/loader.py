"""Read one spec file: safe YAML with positions, then the JSON Schema.

Only plain YAML data is accepted: no anchors or aliases (they can multiply memory),
no tags that construct objects, one document, at most MAX_SPEC_BYTES.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kvgen.errors import Problem, SpecError, YamlPath, display_path

MAX_SPEC_BYTES = 64 * 1024


@dataclass
class Document:
    """A parsed spec file: its data and where each value stands in the text."""

    file: str
    data: Any
    text: bytes
    positions: dict[YamlPath, tuple[int, int]] = field(default_factory=dict)
    key_positions: dict[YamlPath, tuple[int, int]] = field(default_factory=dict)

    def where(self, path: YamlPath, *, key: bool = False) -> tuple[int, int]:
        """Line and column of the value (or its key) at `path`, else of its nearest parent."""
        for cut in range(len(path), -1, -1):
            table = self.key_positions if key and cut == len(path) else self.positions
            if path[:cut] in table:
                return table[path[:cut]]
        return (1, 1)

    def problem(self, path: YamlPath, message: str, *, key: bool = False) -> Problem:
        line, col = self.where(path, key=key)
        return Problem(self.file, line, col, path, message)


@cache
def schema() -> dict[str, Any]:
    """The published JSON Schema for spec files (kvgen/schema/spec.schema.json)."""
    text = resources.files("kvgen").joinpath("schema/spec.schema.json").read_text("utf-8")
    return json.loads(text)


def schema_path() -> Path:
    return Path(str(resources.files("kvgen").joinpath("schema/spec.schema.json")))


def _mark(mark: yaml.Mark | None) -> tuple[int, int]:
    return (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)


def _fail(file: str, where: tuple[int, int], message: str) -> SpecError:
    return SpecError([Problem(file, where[0], where[1], (), message)])


def parse_yaml(path: Path) -> Document:
    """Parse `path` into a Document; raise SpecError for anything that is not plain data."""
    file = display_path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _fail(file, (1, 1), f"cannot read the file: {exc.strerror or exc}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise _fail(file, (1, 1), f"file is {len(raw)} bytes; a spec may be at most {MAX_SPEC_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(file, (1, 1), f"file is not UTF-8 text (byte {exc.start})") from None

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise _fail(
                    file, _mark(event.start_mark),
                    "YAML anchors and aliases are not allowed in specs (write values out)",
                )
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = exc.problem or exc.context or "invalid YAML"
        raise _fail(file, _mark(mark), f"YAML syntax error: {reason}") from None
    except yaml.YAMLError as exc:
        raise _fail(file, (1, 1), f"YAML error: {exc}") from None

    nodes = [n for n in nodes if n is not None]
    if not nodes:
        raise _fail(file, (1, 1), "empty spec: expected a mapping with kvgen, name, kind, ...")
    if len(nodes) > 1:
        raise _fail(file, _mark(nodes[1].start_mark), "one spec per file: found a second YAML document")

    doc = Document(file=file, data=None, text=raw)
    doc.data = _build(doc, nodes[0], ())
    return doc


_SAFE_TAGS = {
    "tag:yaml.org,2002:str", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool", "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map",
}


def _build(doc: Document, node: yaml.Node, path: YamlPath) -> Any:
    doc.positions[path] = _mark(node.start_mark)
    if node.tag not in _SAFE_TAGS:
        raise SpecError([doc.problem(path, f"YAML tag {node.tag!r} is not allowed in specs (plain data only)")])
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                raise SpecError([Problem(doc.file, *_mark(key_node.start_mark), path,
                                         "mapping keys must be plain strings")])
            key = key_node.value
            if key in out:
                raise SpecError([Problem(doc.file, *_mark(key_node.start_mark), (*path, key),
                                         f"duplicate key {key!r}")])
            doc.key_positions[(*path, key)] = _mark(key_node.start_mark)
            out[key] = _build(doc, value_node, (*path, key))
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(doc, item, (*path, i)) for i, item in enumerate(node.value)]
    return yaml.SafeLoader("").construct_object(node)


_TYPE_WORDS = {"integer": "an integer", "string": "a string", "array": "a list", "object": "a mapping"}


def _typename(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping", type(None): "nothing (null)"}.get(type(value), type(value).__name__)


def _describe(error: jsonschema.ValidationError) -> str:
    """Turn a jsonschema error into one sentence: what is wrong and what is allowed."""
    v, value, arg = error.validator, error.instance, error.validator_value
    if v == "required":
        missing = [k for k in arg if isinstance(value, dict) and k not in value]
        return f"missing required field {missing[0]!r}" if missing else error.message
    if v == "type":
        return f"expected {_TYPE_WORDS.get(arg, arg)}, got {_typename(value)} {value!r}"
    if v == "enum":
        return f"{value!r} is not allowed; expected one of: {', '.join(map(str, arg))}"
    if v == "const":
        return f"{value!r} is not allowed; expected {arg!r}"
    if v == "pattern":
        return f"{value!r} does not match the allowed form {arg}"
    if v in ("maxLength", "minLength"):
        return f"length {len(value)} is out of range ({v} {arg})"
    if v in ("maxItems", "minItems"):
        return f"{len(value)} items is out of range ({v} {arg})"
    if v in ("minimum", "maximum"):
        return f"{value!r} is out of range ({v} {arg})"
    if v == "uniqueItems":
        return "items must be unique"
    if v == "anyOf" and len(error.absolute_path) == 2 and error.absolute_path[0] == "dims":
        return (f"{value!r} is not a dim: expected an axis letter (L KV B N H C T), "
                "1 for a singleton, or a list of 2-4 axis letters for a fused axis")
    return error.message


def _schema_problems(doc: Document) -> list[Problem]:
    validator = jsonschema.Draft202012Validator(schema())
    problems: list[Problem] = []
    for error in sorted(validator.iter_errors(doc.data), key=lambda e: list(map(str, e.absolute_path))):
        path: YamlPath = tuple(error.absolute_path)
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            allowed = sorted(error.schema.get("properties", {}))
            for key in error.instance:
                if key not in allowed:
                    problems.append(doc.problem(
                        (*path, key), f"unknown field {key!r}; allowed: {', '.join(allowed)}", key=True))
            continue
        if error.validator == "propertyNames":
            bad = error.instance if isinstance(error.instance, str) else None
            problems.append(doc.problem(path, f"unknown axis {bad!r} as a key; axes are L KV B N H C T"))
            continue
        if error.validator == "not":
            problems.extend(_misplaced_fields(doc))
            continue
        problems.append(doc.problem(path, _describe(error)))
    return problems


def _misplaced_fields(doc: Document) -> list[Problem]:
    """The fields that belong to the other kind, said plainly."""
    data, out = doc.data, []
    if data.get("kind") == "object":
        for key in ("lmcache", "engines"):
            if key in data:
                out.append(doc.problem((key,), f"field {key!r} is for kind: paged, not kind: object", key=True))
    else:
        for key in ("format", "code", "accepts"):
            if key in data:
                out.append(doc.problem((key,), f"field {key!r} is for kind: object, not kind: paged", key=True))
    return out


def load_document(path: Path) -> Document:
    """Parse and schema-check one spec file; raise SpecError listing every problem."""
    doc = parse_yaml(path)
    if not isinstance(doc.data, dict):
        raise SpecError([doc.problem((), f"a spec is a mapping of fields, got {_typename(doc.data)}")])
    problems = _schema_problems(doc)
    if problems:
        raise SpecError(dict.fromkeys(problems))
    return doc
