"""Read one spec file: safe YAML with positions, then the JSON Schema.

Only plain YAML data is accepted: no anchors or aliases (they can multiply memory),
no tags that construct objects, one document, at most MAX_SPEC_BYTES and MAX_SPEC_DEPTH.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kvgen.errors import Problem, SpecError, YamlPath, display_path
from kvgen.spec.document import Document, key_problem, one_line, short
from kvgen.spec.schema_check import drop_unknown_fields, schema_problems, typename, version_problem

MAX_SPEC_BYTES = 64 * 1024
#: Deepest nesting of lists and mappings; a spec needs 3 (root, dims, a fused group).
#: Checked on the event stream, before PyYAML's recursive composer could overflow the stack.
MAX_SPEC_DEPTH = 16


def _mark(mark: yaml.Mark | None) -> tuple[int, int]:
    return (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)


def _fail(file: str, where: tuple[int, int], message: str) -> SpecError:
    return SpecError([Problem(file, where[0], where[1], (), message)])


def parse_yaml(path: Path) -> Document:
    """Parse `path` into a Document; raise SpecError for anything that is not plain data."""
    return parse_bytes(*read_spec(path))


def read_spec(path: Path) -> tuple[str, bytes]:
    """The file as its problems name it, and its bytes (at most MAX_SPEC_BYTES)."""
    file = display_path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _fail(file, (1, 1), f"cannot read the file: {exc.strerror or exc}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise _fail(file, (1, 1), f"file is {len(raw)} bytes; a spec may be at most {MAX_SPEC_BYTES}")
    return file, raw


def parse_bytes(file: str, raw: bytes) -> Document:
    """Parse one spec file's bytes (read_spec's) into a Document."""
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
        raise _fail(file, (1, 1), f"YAML error: {one_line(str(exc))}") from None

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


def _syntax_error(file: str, text: str, exc: yaml.MarkedYAMLError) -> SpecError:
    """The problem, located where a user can fix it.

    PyYAML notices an unclosed quote or bracket only at the end of the file; the line to fix
    is where that construct began, so point there instead.
    """
    problem = one_line(exc.problem or exc.context or "invalid YAML")
    context = one_line(exc.context or "")
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

def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML_TAG):] if tag.startswith(_YAML_TAG) else tag


def _explicit_tag(doc: Document, node: yaml.Node) -> bool:
    """Whether the tag is written in the text (`!!binary ...`), not resolved from a plain value."""
    return doc.text.decode("utf-8")[node.start_mark.index:].startswith("!")


def _tag_problem(doc: Document, node: yaml.Node, path: YamlPath) -> Problem:
    tag = _short_tag(node.tag)
    if _explicit_tag(doc, node):
        return doc.problem(path, f"YAML tag {tag} is not allowed on {_NODE_WORDS[type(node)]} in specs "
                                 "(plain strings, numbers, booleans, lists and mappings only)")
    # An untagged scalar that YAML resolves to something else, such as a date.
    return doc.problem(path, f"{short(node.value)} reads as YAML {tag}, which specs do not allow; "
                             "quote it to write a string")


def _bad_key(doc: Document, node: yaml.Node) -> str:
    if not isinstance(node, yaml.ScalarNode):
        return f"got {_NODE_WORDS[type(node)]}"
    if _explicit_tag(doc, node):
        return f"got a key tagged {_short_tag(node.tag)}"
    return f"{short(node.value)} reads as {_short_tag(node.tag)}; quote it"


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
                raise SpecError([key_problem(doc, path, key, f"duplicate key {short(key)} "
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
        raise SpecError([doc.problem(path, f"{short(node.value)} is not a valid "
                                           f"{_short_tag(node.tag)}")]) from exc


#: Documents that passed the schema check, by their bytes. One process loads the same specs
#: many times (a build after a validate, verify's workers, kvgen's tests), often from other
#: folders (a copy of the built-ins beside a user's spec), and parsing and the schema check are
#: most of a load. What they find is a function of the bytes alone; only the file a problem
#: names differs, and a clean document has none, so a hit is the same document under its file.
_CLEAN: dict[bytes, Document] = {}
_CLEAN_LIMIT = 1024


def load_document(path: Path) -> Document:
    """Parse and schema-check one spec file; raise SpecError listing every problem."""
    file, raw = read_spec(path)
    clean = _CLEAN.get(raw)
    if clean is None:
        clean = _checked(parse_bytes(file, raw))
        if len(_CLEAN) >= _CLEAN_LIMIT:
            _CLEAN.clear()
        _CLEAN[raw] = clean
    # A copy each time: callers may edit what they get (drop_unknown_fields, the tests' edits).
    return clean.copied(file)


def _checked(doc: Document) -> Document:
    """`doc`, if it is a mapping of a known version that the schema accepts; else SpecError."""
    if not isinstance(doc.data, dict):
        raise SpecError([doc.problem((), f"a spec is a mapping of fields (kvgen, name, kind, ...), "
                                         f"got {typename(doc.data)}")])
    future = version_problem(doc)
    if future is not None:
        raise SpecError([future])
    problems = schema_problems(doc, "model" if doc.data.get("kind") == "model" else "spec")
    if problems:
        raise SpecError(dict.fromkeys(problems))
    return doc


def load_document_past_unknown_fields(path: Path) -> tuple[Document | None, list[Problem]]:
    """load_document, except that a file whose only schema problems are unknown fields is
    returned too, with those fields dropped, so that its other (semantic) problems are found
    in the same pass: (document or None, the schema problems)."""
    try:
        return load_document(path), []
    except SpecError as exc:
        problems = list(exc.problems)
    if not all(p.message.startswith("unknown field ") for p in problems):
        return None, problems
    doc = parse_yaml(path)
    which = "model" if doc.data.get("kind") == "model" else "spec"
    drop_unknown_fields(doc, which)
    return (None if schema_problems(doc, which) else doc), problems

