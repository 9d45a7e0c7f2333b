"""The JSON Schema check of a parsed spec, with every message in words.

A schema error becomes one located problem that says what is wrong and what is allowed
(never a regex or a schema keyword), and a spec from a newer format version says only that.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

from kvgen import SPEC_FORMAT_VERSION
from kvgen.errors import Problem, YamlPath
from kvgen.spec.document import Document, key_problem, one_line, short
from kvgen.versions import RANGE

#: The published JSON Schemas, shipped inside the package: layouts and objects, and models.
SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
SCHEMA_PATH = SCHEMA_DIR / "spec.schema.json"


@cache
def schema(which: str = "spec") -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / f"{which}.schema.json").read_text("utf-8"))



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
    RANGE: "a range of releases, comma-separated comparisons (e.g. '>=0.33,<0.34')",
    "^[a-z][a-z0-9_]*$": "an engine family in lowercase (e.g. vllm, sglang)",
    "^(N|H|C)[/%]([1-9][0-9]{0,3}|[a-z][a-z0-9]{0,7})$": "an axis, or (format 3) N, H or C split as tile "
                                                        "and place, e.g. C/16 and C%16 (H/g with H%g: a factor "
                                                        "read from the tensor)",
}


def _is_integer(_checker: Any, value: Any) -> bool:
    # JSON Schema counts 1.0 as an integer; a spec must not (`kvgen: 1.0`, `code: 3.0`).
    return isinstance(value, int) and not isinstance(value, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


def typename(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping", type(None): "nothing (null)"}.get(type(value), type(value).__name__)


def _duplicates(value: Any, _arg: Any) -> str:
    dups = sorted({repr(x) for i, x in enumerate(value) if x in value[:i]})
    return f"items must be unique: {', '.join(dups)} given more than once"


#: Each validator's message from the value and the schema's bound: what is wrong, what is allowed.
_WORDS: dict[str, Callable[[Any, Any], str]] = {
    "type": lambda value, arg: (f"expected {_TYPE_WORDS.get(arg, arg)}, got {typename(value)}"
                                + ("" if value is None else f" {short(value)}")),
    "enum": lambda value, arg: f"{short(value)} is not allowed; expected one of: {', '.join(map(str, arg))}",
    "const": lambda value, arg: f"{short(value)} is not allowed; expected {arg!r}",
    "pattern": lambda value, arg: (f"{short(value)} is not allowed; expected "
                                   f"{_PATTERN_WORDS.get(arg, f'the form {arg}')}"),
    "maxLength": lambda value, arg: f"{short(value)} is {len(value)} characters long; at most {arg} allowed",
    "minLength": lambda value, arg: f"{short(value)} is {len(value)} characters long; at least {arg} needed",
    "maxItems": lambda value, arg: f"{len(value)} items; at most {arg} allowed",
    "minItems": lambda value, arg: f"{len(value)} items; at least {arg} allowed",
    "minimum": lambda value, arg: f"{value!r} is out of range (at least {arg})",
    "maximum": lambda value, arg: f"{value!r} is out of range (at most {arg})",
    "uniqueItems": _duplicates,
}


def _describe(error: jsonschema.ValidationError) -> str:
    """Turn a jsonschema error into one sentence: what is wrong and what is allowed."""
    placed = _describe_at(error)
    if placed is not None:
        return placed
    words = _WORDS.get(str(error.validator))
    return words(error.instance, error.validator_value) if words else one_line(error.message)


def _describe_at(error: jsonschema.ValidationError) -> str | None:
    """The messages that depend on where the error is: the format version, parts, fields, a dim."""
    v, value, path = error.validator, error.instance, tuple(error.absolute_path)
    if v == "minimum" and path == ("kvgen",):
        return (f"spec format version {value} does not exist; versions start at 1 "
                f"(this kvgen reads up to {SPEC_FORMAT_VERSION})")
    if v in ("minProperties", "maxProperties") and path[:1] == ("parts",):
        return (f"{len(value)} part{'s' if len(value) != 1 else ''}; a cache of parts has 2 to 8 "
                "(write a single tensor tree with dims instead)")
    if v in ("minProperties", "maxProperties") and path[-1:] == ("fields",):
        return "fields holds one list: row (fields of each row) or block (fields of each block)"
    if v == "anyOf" and _is_dim(error):
        return (f"{short(value)} is not a dim: expected an axis letter ({_AXES_WORDS}), "
                "1 for a singleton, a list of 2-4 axis letters for a fused axis, or (format 3) N, H or C "
                "split as tile and place (C/16 with C%16)")
    return None


def drop_unknown_fields(doc: Document, which: str = "spec") -> None:
    """Remove from `doc.data` every field the schema does not know (what schema_problems
    reports as "unknown field"), so the rest of the file can still be checked."""
    validator = _Validator(schema(which))
    found = [(error.instance, sorted(error.schema.get("properties", {})))
             for error in validator.iter_errors(doc.data)
             if error.validator == "additionalProperties" and isinstance(error.instance, dict)]
    for mapping, allowed in found:
        for key in [k for k in mapping if k not in allowed]:
            del mapping[key]


def _fitting_branch(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError] | None:
    """The errors of the one anyOf branch whose kind of value (list, mapping, ...) the value
    has, so `{every: 0}` is told what is wrong inside it rather than "not valid under any of
    the given schemas"; None when no branch, or several, take that kind."""
    branches: dict[Any, list[jsonschema.ValidationError]] = {}
    for sub in error.context or ():
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    here = list(error.absolute_path)
    fitting = [errors for errors in branches.values()
               if not any(list(e.absolute_path) == here and e.validator in ("type", "const", "enum") for e in errors)]
    return fitting[0] if len(fitting) == 1 else None


def _is_dim(error: jsonschema.ValidationError) -> bool:
    """A dim of the top-level dims, or of a part's (`parts.k.dims[2]`)."""
    path = list(error.absolute_path)
    return (len(path) == 2 and path[0] == "dims") or (len(path) == 4 and path[0] == "parts" and path[2] == "dims")


def _fused_problems(doc: Document, error: jsonschema.ValidationError) -> list[Problem]:
    """A bad fused group: say what is wrong inside it, not only that it is not a dim."""
    path: YamlPath = tuple(error.absolute_path)
    out = []
    for sub in error.context or ():
        if sub.relative_schema_path[0] != 2:  # the list branch of the dim's anyOf
            continue
        if sub.validator == "enum":
            out.append(doc.problem(tuple(sub.absolute_path),
                                   f"unknown axis {short(sub.instance)}; axes are {_AXES_WORDS}"))
        elif sub.validator in ("minItems", "maxItems"):
            out.append(doc.problem(path, f"a fused axis groups 2-4 axes, got {len(error.instance)}"
                                         + (" (write a single axis as a plain letter)"
                                            if len(error.instance) == 1 else "")))
        else:
            out.append(doc.problem(tuple(sub.absolute_path), _describe(sub)))
    return out or [doc.problem(path, _describe(error))]


def schema_problems(doc: Document, which: str = "spec") -> list[Problem]:
    validator = _Validator(schema(which))
    errors = sorted(validator.iter_errors(doc.data), key=lambda e: list(map(str, e.absolute_path)))
    return [p for error in errors for p in _error_problems(doc, error, which)]


def _error_problems(doc: Document, error: jsonschema.ValidationError, which: str) -> list[Problem]:
    """One schema error as problems: the first rule of _RULES that knows it, else its description."""
    for rule in _RULES:
        found = rule(doc, error, which)
        if found is not None:
            return found
    return [doc.problem(tuple(error.absolute_path), _describe(error))]


def _unknown_fields(doc: Document, error: jsonschema.ValidationError, _which: str) -> list[Problem] | None:
    if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
        return None
    allowed = sorted(error.schema.get("properties", {}))
    return [key_problem(doc, tuple(error.absolute_path), key, f"unknown field {short(key)}; allowed: "
                                                              f"{', '.join(allowed)}")
            for key in error.instance if key not in allowed]


def _bad_name_key(doc: Document, error: jsonschema.ValidationError, _which: str) -> list[Problem] | None:
    """A part, group or state group named against the name rule."""
    path: YamlPath = tuple(error.absolute_path)
    if ("propertyNames" not in error.relative_schema_path or not isinstance(error.instance, str)
            or path[-1:] not in (("parts",), ("groups",), ("state",))):
        return None
    what = {"parts": "part", "groups": "group", "state": "state group"}[str(path[-1])]
    return [key_problem(doc, path, error.instance, f"{what} name {short(error.instance)} is not allowed; expected "
                                                   f"{_PATTERN_WORDS['^[a-z][a-z0-9]*(_[a-z0-9]+)*$']}")]


def _bad_size_key(doc: Document, error: jsonschema.ValidationError, which: str) -> list[Problem] | None:
    """A model group's sizes key that is no size it may fix."""
    path: YamlPath = tuple(error.absolute_path)
    if "propertyNames" not in error.relative_schema_path or path[-1:] != ("sizes",) or which != "model":
        return None
    return [key_problem(doc, path, error.instance, f"unknown size {short(error.instance)}; a group fixes H, C, N, "
                                                   "or C.PART for one part of its layout")]


def _bad_axis_key(doc: Document, error: jsonschema.ValidationError, _which: str) -> list[Problem] | None:
    if "propertyNames" not in error.relative_schema_path or not isinstance(error.instance, str):
        return None
    # jsonschema reports a bad key at its mapping, as the key's own (enum) error.
    return [key_problem(doc, tuple(error.absolute_path), error.instance,
                        f"unknown axis {short(error.instance)} as a key; axes are {_AXES_WORDS}")]


def _missing_fields(doc: Document, error: jsonschema.ValidationError, _which: str) -> list[Problem] | None:
    if error.validator != "required" or not isinstance(error.instance, dict):
        return None
    # One error per missing field, but jsonschema gives no field name apart from its text.
    why = {"format": " (kind: object needs it)", "code": " (kind: object needs it)",
           "dims": " (or parts, in kvgen: 2)"} if "then" in error.relative_schema_path else {}
    return [doc.problem(tuple(error.absolute_path), f"missing required field {k!r}{why.get(k, '')}")
            for k in error.validator_value if k not in error.instance]


def _misplaced(doc: Document, error: jsonschema.ValidationError, _which: str) -> list[Problem] | None:
    return _misplaced_fields(doc, error) if error.validator == "not" else None


def _model_version(doc: Document, error: jsonschema.ValidationError, which: str) -> list[Problem] | None:
    if which != "model" or tuple(error.absolute_path) != ("kvgen",) or error.validator != "minimum":
        return None
    return [doc.problem(("kvgen",), f"a model spec needs kvgen: 2 (this one says kvgen: {error.instance})")]


def _bad_fused_dim(doc: Document, error: jsonschema.ValidationError, _which: str) -> list[Problem] | None:
    if error.validator != "anyOf" or not _is_dim(error) or not isinstance(error.instance, list):
        return None
    return _fused_problems(doc, error)


def _one_branch(doc: Document, error: jsonschema.ValidationError, _which: str) -> list[Problem] | None:
    branch = _fitting_branch(error) if error.validator == "anyOf" else None
    return [doc.problem(tuple(sub.absolute_path), _describe(sub)) for sub in branch] if branch else None


#: How schema errors become problems, the first rule that returns problems wins (None: not its error).
_RULES: tuple[Callable[[Document, jsonschema.ValidationError, str], list[Problem] | None], ...] = (
    _unknown_fields, _bad_name_key, _bad_size_key, _bad_axis_key, _missing_fields, _misplaced, _model_version,
    _bad_fused_dim, _one_branch,
)


def _misplaced_fields(doc: Document, error: jsonschema.ValidationError) -> list[Problem]:
    """The fields that belong to the other kind (or pack), said plainly."""
    data, out = doc.data, []
    if any(r == {"required": ["members"]} for r in error.validator_value.get("anyOf", ())):
        return [doc.problem((key,), f"field {key!r} is for objects of pack: groups", key=True)
                for key in ("members", "carries") if key in data]
    if data.get("kind") == "object":
        for key in ("lmcache", "engines", "versions", "given", "placement"):
            if key in data:
                out.append(doc.problem((key,), f"field {key!r} is for kind: paged, not kind: object", key=True))
    else:
        # kind is paged, or missing/invalid (reported on its own): these fields need kind: object.
        now = ", not kind: paged" if data.get("kind") == "paged" else " only"
        for key in ("format", "code", "accepts"):
            if key in data:
                out.append(doc.problem((key,), f"field {key!r} is for kind: object{now}", key=True))
    return out


def version_problem(doc: Document) -> Problem | None:
    """A spec from a newer format: say so alone, not as a list of fields this kvgen does not know."""
    version = doc.data.get("kvgen")
    if isinstance(version, int) and not isinstance(version, bool) and version > SPEC_FORMAT_VERSION:
        return doc.problem(("kvgen",), f"spec format version {version} is newer than this kvgen "
                                       f"reads (up to {SPEC_FORMAT_VERSION}); upgrade kvgen")
    return None
