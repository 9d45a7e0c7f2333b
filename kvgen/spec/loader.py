"""Read one spec file: safe YAML with positions, then the JSON Schema.

Only plain YAML data is accepted: no anchors or aliases (they can multiply memory),
no tags that construct objects, one document, at most MAX_SPEC_BYTES and MAX_SPEC_DEPTH.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kvgen import SPEC_FORMAT_VERSION
from kvgen.errors import Problem, SpecError, YamlPath, display_path

MAX_SPEC_BYTES = 64 * 1024
#: Deepest nesting of lists and mappings; a spec needs 3 (root, dims, a fused group).
#: Checked on the event stream, before PyYAML's recursive composer could overflow the stack.
MAX_SPEC_DEPTH = 16


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
        shown, odd = _shown_path(path)
        if odd is not None:
            message = f"under key {_short(odd)}: {message}"
        return Problem(self.file, line, col, shown, message)


#: The published JSON Schema for spec files, shipped inside the package.
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "spec.schema.json"


@cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text("utf-8"))



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
        raise _fail(file, _byte_position(raw, exc.start),
                    f"file is not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x}); "
                    "save it as UTF-8") from None

    try:
        nodes = _compose(file, text)
    except yaml.MarkedYAMLError as exc:
        raise _syntax_error(file, text, exc) from None
    except yaml.reader.ReaderError as exc:
        # Its str() spans two lines and gives only a character offset; say where, on one line.
        code = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "?")
        raise _fail(file, _char_position(text, exc.position),
                    f"character {chr(code)!r} (U+{code:04X}) cannot appear in YAML text; "
                    "remove it (control characters are not allowed)") from None
    except yaml.YAMLError as exc:
        raise _fail(file, (1, 1), f"YAML error: {_one_line(str(exc))}") from None

    # A document with no content (`---` alone) composes to an empty null scalar: no spec either.
    nodes = [n for n in nodes if n is not None and not _is_blank(n)]
    if not nodes:
        raise _fail(file, (1, 1), "empty spec: expected a mapping with kvgen, name, kind, ...")
    if len(nodes) > 1:
        raise _fail(file, _mark(nodes[1].start_mark), "one spec per file: found a second YAML document "
                                                      "(remove the '---' and what follows)")

    doc = Document(file=file, data=None, text=raw)
    doc.data = _build(doc, nodes[0], ())
    return doc


#: libyaml's parser where PyYAML was built with it (the usual wheels are): the same events
#: and nodes, several times faster. Anything it refuses is parsed again by PyYAML's own
#: parser, whose messages say more, and so is text PyYAML's reader would refuse.
_FAST_LOADER = getattr(yaml, "CSafeLoader", None)


def _compose(file: str, text: str) -> list[yaml.Node]:
    if _FAST_LOADER is not None and not yaml.reader.Reader.NON_PRINTABLE.search(text):
        try:
            _scan_events(file, text, _FAST_LOADER)
            return list(yaml.compose_all(text, Loader=_FAST_LOADER))
        except yaml.YAMLError:
            pass
    _scan_events(file, text, yaml.SafeLoader)
    return list(yaml.compose_all(text, Loader=yaml.SafeLoader))


def _scan_events(file: str, text: str, loader: Any) -> None:
    """Reject anchors, aliases and deep nesting on the event stream, before anything is composed.

    Aliases can multiply memory once constructed (a billion-laughs file), and PyYAML's
    composer recurses once per nesting level, so both are refused on the flat event stream.
    """
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise _fail(file, _mark(event.start_mark),
                        "YAML anchors and aliases are not allowed in specs (write values out)")
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                raise _fail(file, _mark(event.start_mark),
                            f"nesting is deeper than {MAX_SPEC_DEPTH} levels; a spec nests at most 3")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def _is_blank(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _YAML_TAG + "null" and node.value == ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _syntax_error(file: str, text: str, exc: yaml.MarkedYAMLError) -> SpecError:
    """The problem, located where a user can fix it.

    PyYAML notices an unclosed quote or bracket only at the end of the file; the line to fix
    is where that construct began, so point there instead.
    """
    problem = _one_line(exc.problem or exc.context or "invalid YAML")
    context = _one_line(exc.context or "")
    at_end = exc.problem_mark is not None and exc.problem_mark.index >= len(text.rstrip())
    if at_end and context and exc.context_mark is not None:
        what = re.sub(r"^while (parsing|scanning) (an? )?", "", context)
        return _fail(file, _mark(exc.context_mark),
                     f"YAML syntax error: this {what} is not closed before the end of the file ({problem})")
    message = f"YAML syntax error: {problem}"
    if context and exc.context_mark is not None and exc.problem:
        line, col = _mark(exc.context_mark)
        message += f" ({context} started at line {line}, column {col})"
    return _fail(file, _mark(exc.problem_mark or exc.context_mark), message)


def _char_position(text: str, index: int) -> tuple[int, int]:
    return (text.count("\n", 0, index) + 1, index - text.rfind("\n", 0, index))


def _byte_position(raw: bytes, index: int) -> tuple[int, int]:
    return (raw.count(b"\n", 0, index) + 1, index - raw.rfind(b"\n", 0, index))


_YAML_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_YAML_TAG + t for t in ("str", "int", "float", "bool", "null")}
#: The tags each kind of node may carry; anything else would construct something other than plain data.
_NODE_TAGS: dict[type[yaml.Node], set[str]] = {
    yaml.ScalarNode: _SCALAR_TAGS,
    yaml.SequenceNode: {_YAML_TAG + "seq"},
    yaml.MappingNode: {_YAML_TAG + "map"},
}
_NODE_WORDS = {yaml.ScalarNode: "a scalar", yaml.SequenceNode: "a list", yaml.MappingNode: "a mapping"}
#: Keys shown in a YAML path as they are; others (spaces, dots, control characters) are named
#: in the message instead, so a problem stays one `FILE:LINE:COL: PATH: message` line.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML_TAG):] if tag.startswith(_YAML_TAG) else tag


def _short(value: Any, limit: int = 60) -> str:
    """repr() of a value, cut to `limit` characters so a message stays readable."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shown_path(path: YamlPath) -> tuple[YamlPath, str | None]:
    """`path` cut before its first key that is not plain, and that key (None when all are)."""
    for i, part in enumerate(path):
        if isinstance(part, str) and not _PLAIN_KEY.fullmatch(part):
            return path[:i], part
    return path, None


def _key_problem(doc: Document, path: YamlPath, key: str, message: str,
                 where: tuple[int, int] | None = None) -> Problem:
    """A problem at mapping key `key` under `path`, located at the key itself (or `where`).

    `message` names the key, so an odd key is left out of the path rather than repeated.
    """
    line, col = where or doc.where((*path, key), key=True)
    shown = _shown_path((*path, key))[0]
    return Problem(doc.file, line, col, shown, message)


def _explicit_tag(doc: Document, node: yaml.Node) -> bool:
    """Whether the tag is written in the text (`!!binary ...`), not resolved from a plain value."""
    return doc.text.decode("utf-8")[node.start_mark.index:].startswith("!")


def _tag_problem(doc: Document, node: yaml.Node, path: YamlPath) -> Problem:
    tag = _short_tag(node.tag)
    if _explicit_tag(doc, node):
        return doc.problem(path, f"YAML tag {tag} is not allowed on {_NODE_WORDS[type(node)]} in specs "
                                 "(plain strings, numbers, booleans, lists and mappings only)")
    # An untagged scalar that YAML resolves to something else, such as a date.
    return doc.problem(path, f"{_short(node.value)} reads as YAML {tag}, which specs do not allow; "
                             "quote it to write a string")


def _bad_key(doc: Document, node: yaml.Node) -> str:
    if not isinstance(node, yaml.ScalarNode):
        return f"got {_NODE_WORDS[type(node)]}"
    if _explicit_tag(doc, node):
        return f"got a key tagged {_short_tag(node.tag)}"
    return f"{_short(node.value)} reads as {_short_tag(node.tag)}; quote it"


def _build(doc: Document, node: yaml.Node, path: YamlPath) -> Any:
    doc.positions[path] = _mark(node.start_mark)
    if node.tag not in _NODE_TAGS[type(node)]:
        raise SpecError([_tag_problem(doc, node, path)])
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == _YAML_TAG + "str"):
                raise SpecError([Problem(doc.file, *_mark(key_node.start_mark), path,
                                         f"mapping keys must be plain strings: {_bad_key(doc, key_node)}")])
            key = key_node.value
            if key in out:
                first = doc.key_positions[(*path, key)][0]
                raise SpecError([_key_problem(doc, path, key, f"duplicate key {_short(key)} "
                                              f"(first on line {first})", _mark(key_node.start_mark))])
            doc.key_positions[(*path, key)] = _mark(key_node.start_mark)
            out[key] = _build(doc, value_node, (*path, key))
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(doc, item, (*path, i)) for i, item in enumerate(node.value)]
    try:
        return yaml.SafeLoader("").construct_object(node)
    except (yaml.YAMLError, ValueError, KeyError, IndexError) as exc:
        # An explicit tag on text that is not of that type, e.g. `!!int abc`.
        raise SpecError([doc.problem(path, f"{_short(node.value)} is not a valid "
                                           f"{_short_tag(node.tag)}")]) from exc


_TYPE_WORDS = {"integer": "an integer", "string": "a string", "array": "a list", "object": "a mapping"}
_AXES_WORDS = "L KV B N H C T"

#: Schema patterns in words, so a message says what is allowed rather than quoting a regex.
_PATTERN_WORDS = {
    "^[a-z][a-z0-9]*(_[a-z0-9]+)*$": "lowercase letters, digits and single underscores, starting "
                                     "with a letter and not ending with '_' (e.g. vllm_flash_attn)",
    "^[ -~]*$": "one line of printable ASCII (no newlines, tabs or control characters)",
    "^[A-Za-z][A-Za-z0-9_]*$": "letters, digits and underscores, starting with a letter",
    "^[A-Z][A-Z0-9_]*$": "uppercase letters, digits and underscores, starting with a letter "
                         "(e.g. KV_2LTD)",
    "^[a-z][a-z0-9_.-]*/[A-Za-z0-9_.-]+$": "engine/BACKEND (e.g. vllm/FLASH_ATTN)",
    "^[^\\n]*(?!\\n)$": "a single line (no line break, not even a trailing one)",
}


def _is_integer(_checker: Any, value: Any) -> bool:
    # JSON Schema counts 1.0 as an integer; a spec must not (`kvgen: 1.0`, `code: 3.0`).
    return isinstance(value, int) and not isinstance(value, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


def _typename(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping", type(None): "nothing (null)"}.get(type(value), type(value).__name__)


def _describe(error: jsonschema.ValidationError) -> str:
    """Turn a jsonschema error into one sentence: what is wrong and what is allowed."""
    v, value, arg = error.validator, error.instance, error.validator_value
    if v == "type":
        shown = "" if value is None else f" {_short(value)}"
        return f"expected {_TYPE_WORDS.get(arg, arg)}, got {_typename(value)}{shown}"
    if v == "enum":
        return f"{_short(value)} is not allowed; expected one of: {', '.join(map(str, arg))}"
    if v == "const":
        return f"{_short(value)} is not allowed; expected {arg!r}"
    if v == "pattern":
        return f"{_short(value)} is not allowed; expected {_PATTERN_WORDS.get(arg, f'the form {arg}')}"
    if v == "maxLength":
        return f"{_short(value)} is {len(value)} characters long; at most {arg} allowed"
    if v == "minLength":
        return f"{_short(value)} is {len(value)} characters long; at least {arg} needed"
    if v in ("maxItems", "minItems"):
        bound = "at most" if v == "maxItems" else "at least"
        return f"{len(value)} items; {bound} {arg} allowed"
    if v == "minimum" and tuple(error.absolute_path) == ("kvgen",):
        return (f"spec format version {value} does not exist; versions start at 1 "
                f"(this kvgen reads up to {SPEC_FORMAT_VERSION})")
    if v in ("minimum", "maximum"):
        return f"{value!r} is out of range ({'at least' if v == 'minimum' else 'at most'} {arg})"
    if v == "uniqueItems":
        dups = sorted({repr(x) for i, x in enumerate(value) if x in value[:i]})
        return f"items must be unique: {', '.join(dups)} given more than once"
    if v == "anyOf" and _is_dim(error):
        return (f"{_short(value)} is not a dim: expected an axis letter ({_AXES_WORDS}), "
                "1 for a singleton, or a list of 2-4 axis letters for a fused axis")
    return _one_line(error.message)


def _is_dim(error: jsonschema.ValidationError) -> bool:
    return len(error.absolute_path) == 2 and error.absolute_path[0] == "dims"


def _fused_problems(doc: Document, error: jsonschema.ValidationError) -> list[Problem]:
    """A bad fused group: say what is wrong inside it, not only that it is not a dim."""
    path: YamlPath = tuple(error.absolute_path)
    out = []
    for sub in error.context or ():
        if sub.relative_schema_path[0] != 2:  # the list branch of the dim's anyOf
            continue
        if sub.validator == "enum":
            out.append(doc.problem(tuple(sub.absolute_path),
                                   f"unknown axis {_short(sub.instance)}; axes are {_AXES_WORDS}"))
        elif sub.validator in ("minItems", "maxItems"):
            out.append(doc.problem(path, f"a fused axis groups 2-4 axes, got {len(error.instance)}"
                                         + (" (write a single axis as a plain letter)"
                                            if len(error.instance) == 1 else "")))
        else:
            out.append(doc.problem(tuple(sub.absolute_path), _describe(sub)))
    return out or [doc.problem(path, _describe(error))]


def _schema_problems(doc: Document) -> list[Problem]:
    validator = _Validator(schema())
    problems: list[Problem] = []
    for error in sorted(validator.iter_errors(doc.data), key=lambda e: list(map(str, e.absolute_path))):
        path: YamlPath = tuple(error.absolute_path)
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            allowed = sorted(error.schema.get("properties", {}))
            for key in error.instance:
                if key not in allowed:
                    problems.append(_key_problem(
                        doc, path, key, f"unknown field {_short(key)}; allowed: {', '.join(allowed)}"))
            continue
        if "propertyNames" in error.relative_schema_path and isinstance(error.instance, str):
            # jsonschema reports a bad key at its mapping, as the key's own (enum) error.
            problems.append(_key_problem(doc, path, error.instance,
                                         f"unknown axis {_short(error.instance)} as a key; "
                                         f"axes are {_AXES_WORDS}"))
            continue
        if error.validator == "required" and isinstance(error.instance, dict):
            # One error per missing field, but jsonschema gives no field name apart from its text.
            why = " (kind: object needs it)" if "then" in error.relative_schema_path else ""
            problems.extend(doc.problem(path, f"missing required field {k!r}{why}")
                            for k in error.validator_value if k not in error.instance)
            continue
        if error.validator == "not":
            problems.extend(_misplaced_fields(doc))
            continue
        if error.validator == "anyOf" and _is_dim(error) and isinstance(error.instance, list):
            problems.extend(_fused_problems(doc, error))
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
        # kind is paged, or missing/invalid (reported on its own): these fields need kind: object.
        now = ", not kind: paged" if data.get("kind") == "paged" else " only"
        for key in ("format", "code", "accepts"):
            if key in data:
                out.append(doc.problem((key,), f"field {key!r} is for kind: object{now}", key=True))
    return out


def _version_problem(doc: Document) -> Problem | None:
    """A spec from a newer format: say so alone, not as a list of fields this kvgen does not know."""
    version = doc.data.get("kvgen")
    if isinstance(version, int) and not isinstance(version, bool) and version > SPEC_FORMAT_VERSION:
        return doc.problem(("kvgen",), f"spec format version {version} is newer than this kvgen "
                                       f"reads (up to {SPEC_FORMAT_VERSION}); upgrade kvgen")
    return None


def load_document(path: Path) -> Document:
    """Parse and schema-check one spec file; raise SpecError listing every problem."""
    doc = parse_yaml(path)
    if not isinstance(doc.data, dict):
        raise SpecError([doc.problem((), f"a spec is a mapping of fields (kvgen, name, kind, ...), "
                                         f"got {_typename(doc.data)}")])
    future = _version_problem(doc)
    if future is not None:
        raise SpecError([future])
    problems = _schema_problems(doc)
    if problems:
        raise SpecError(dict.fromkeys(problems))
    return doc
