"""The transfers file: which layout-to-layout transfers a build generates.

A spec folder may hold a `transfers.yaml` (built-ins: specs/transfers.yaml) listing pairs of
paged layouts, one line each:

    kvgen: 1
    transfers:
      - vllm_flash_attn_hnd -> vllm_flash_attn_nhd     # one direction
      - NHD <-> hicache_page_first                 # both directions

Names resolve like everywhere else (spec name, alias, LMCache format name, any case). The
file is read with the spec loader's safe YAML, checked against its own JSON Schema
(kvgen/spec/schema/transfers.schema.json), then line by line against the library; every
problem of every transfers file is reported at once, located FILE:LINE:COL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

from kvgen.errors import KVGenError, Problem, SpecError
from kvgen.spec.document import Document, key_problem, short
from kvgen.spec.elements import split_of
from kvgen.spec.library import BUILTIN_SPECS, TRANSFER_FILES, Library
from kvgen.spec.loader import parse_yaml
from kvgen.spec.model import Spec

SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "transfers.schema.json"
#: Highest format version of a transfers file this kvgen reads.
TRANSFERS_FORMAT_VERSION = 1

_LINE = re.compile(r"^\s*(?P<src>\S+)\s*(?P<arrow><->|->)\s*(?P<dst>\S+)\s*$")
#: Axes that address slots; the rest is the content a transfer moves.
_SLOT_AXES = {"B", "N"}


@dataclass(frozen=True)
class TransferPair:
    """One generated transfer: copy KV from `src` caches into `dst` caches."""

    src: Spec
    dst: Spec
    #: Where it was declared, `specs/transfers.yaml:7`.
    declared: str

    @property
    def module(self) -> str:
        return f"xfer__{self.src.name}__{self.dst.name}"


@cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text("utf-8"))


def transfer_files(extra_dirs: Sequence[Path] = (), *, builtin: bool = True) -> list[Path]:
    """The transfers files of a build: the built-in one, then those in (or named by) `extra_dirs`."""
    found = [BUILTIN_SPECS / name for name in TRANSFER_FILES if (BUILTIN_SPECS / name).is_file()] if builtin else []
    for d in extra_dirs:
        if d.is_file() and d.name in TRANSFER_FILES:
            found.append(d)
        elif d.is_dir():
            found.extend(sorted(p for p in d.rglob("*") if p.name in TRANSFER_FILES and p.is_file()))
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def single_part(spec: Spec) -> str | None:
    """Why a transfer cannot move `spec` (None when it can): transfers move format-1 layouts,
    whose every element is one (layer, kv, slot, head, c) of one tensor kind, and one tree
    whose only split axes split H (heads in groups)."""
    tokens, slots = getattr(spec, "token_ratio", (1, 1))
    if (tokens, slots) != (1, 1):
        return (f"{spec.name} stores {f'each token as {slots} slots' if slots > 1 else f'{tokens} tokens a slot'}; "
                "transfers move layouts of one slot a token")
    if spec.version != 1 and not heads_split_only(spec):
        return (f"{spec.name} is a spec format {spec.version} layout with parts, fields or split axes; transfers "
                "move single-part (format 1) layouts only, and one tree whose only split axes split H by a factor "
                "read from the tensor (H/g, H%g)")
    return None


def heads_split_only(spec: Spec) -> bool:
    """A one-tree cache without fields or pack whose split axes (format 3) all split H by a
    factor read from the tensor (`H/g`, `H%g`): a transfer views the other side's H as the same
    groups (SGLang's page_unified head groups). A literal factor is a tiling a transfer does not plan."""
    parts = getattr(spec, "parts", ())
    if len(parts) != 1 or parts[0].fields or getattr(spec, "pack", None) is not None:
        return False
    split = {a for a in parts[0].tensor_axes if split_of(a) is not None}
    return bool(split) and split == set(spec.head_groups)


def content_problem(src: Spec, dst: Spec) -> str | None:
    """Why `src` and `dst` cannot exchange KV (None when they can)."""
    for spec in (src, dst):
        if not spec.is_paged:
            return f"{spec.name} is a memory object; transfers copy between paged layouts (connectors move objects)"
        why = single_part(spec)
        if why:
            return why
    a, b = _whole_axes(src) - _SLOT_AXES, _whole_axes(dst) - _SLOT_AXES
    if a != b:
        return (f"{src.name} holds {_content(src)} but {dst.name} holds {_content(dst)}: "
                "a transfer needs the same content on both sides")
    a, b = src.head_groups, dst.head_groups
    if a and b and a != b:
        return (f"{src.name} splits H as {', '.join(a)} and {dst.name} as {', '.join(b)}: a transfer between two "
                "caches of head groups needs the same split")
    if not set(src.dtypes) & set(dst.dtypes):
        return f"{src.name} and {dst.name} share no dtype ({', '.join(src.dtypes)} vs {', '.join(dst.dtypes)})"
    return None


def _whole_axes(spec: Spec) -> set[str]:
    """The spec's axes, a split one as the axis it splits (`H/g` and `H%g` are H)."""
    return {(split_of(a) or (a,))[0] for a in spec.axes}


def _content(spec: Spec) -> str:
    kv = "K and V" if spec.has("KV") else "one latent plane (no K/V)"
    heads = "per head" if spec.has("H") else "without heads"
    return f"{kv} {heads}"


def _schema_problems(doc: Document) -> list[Problem]:
    data = doc.data
    if not isinstance(data, dict):
        return [doc.problem((), "a transfers file is a mapping with `kvgen: 1` and `transfers:` (a list of "
                                "'SOURCE -> DESTINATION' lines)")]
    version = data.get("kvgen")
    if isinstance(version, int) and not isinstance(version, bool) and version > TRANSFERS_FORMAT_VERSION:
        return [doc.problem(("kvgen",), f"transfers format version {version} is newer than this kvgen reads "
                                        f"(up to {TRANSFERS_FORMAT_VERSION}); upgrade kvgen")]
    out = []
    if "kvgen" in data and (isinstance(version, bool) or not isinstance(version, int)):
        # JSON Schema counts 1.0 (and YAML's booleans) as integers; a version is a plain int.
        out.append(doc.problem(("kvgen",), f"expected an integer format version, got {short(version)}"))
    errors = sorted(jsonschema.Draft202012Validator(schema()).iter_errors(data), key=lambda e: list(e.path))
    # A version of the wrong type is said once, above, not again as the schema's error.
    return out + [p for error in errors if not (out and tuple(error.absolute_path) == ("kvgen",))
                  for p in _error_problems(doc, error)]


_TYPE_WORDS = {"integer": "an integer", "array": "a list", "string": "a string"}


def _error_problems(doc: Document, error: jsonschema.ValidationError) -> list[Problem]:
    """One schema error of a transfers file in words."""
    data, path = doc.data, tuple(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = ", ".join(sorted(schema()["properties"]))
        return [key_problem(doc, (), key, f"unknown field {short(key)}; allowed: {allowed}")
                for key in data if key not in schema()["properties"]]
    if error.validator == "required":
        return [doc.problem((), f"missing required field {k!r}") for k in error.validator_value if k not in data]
    if error.validator == "type":
        want = _TYPE_WORDS.get(str(error.validator_value), str(error.validator_value))
        return [doc.problem(path, f"expected {want}, got {short(error.instance)}")]
    return [doc.problem(path, f"{short(error.instance)}: {error.message}")]


def _resolve(library: Library, name: str) -> Spec | str:
    try:
        return library[name]
    except KVGenError as exc:
        return str(exc)


def _pairs(doc: Document, library: Library) -> tuple[list[tuple[Spec, Spec, tuple[str, int]]], list[Problem]]:
    """The ordered pairs a checked document declares, each with its YAML path."""
    pairs, problems = [], []
    for i, line in enumerate(doc.data["transfers"]):
        path = ("transfers", i)
        if not isinstance(line, str):
            continue  # the schema's problem
        match = _LINE.match(line)
        if match is None:
            problems.append(doc.problem(path, f"{short(line)} is not a transfer: write 'SOURCE -> DESTINATION', or "
                                              "'A <-> B' for both directions (layout names or aliases)"))
            continue
        ends = [_resolve(library, match[side]) for side in ("src", "dst")]
        bad = [e for e in ends if isinstance(e, str)]
        if bad:
            problems.extend(doc.problem(path, why) for why in bad)
            continue
        src, dst = ends
        assert isinstance(src, Spec) and isinstance(dst, Spec)
        why = content_problem(src, dst)
        if why:
            problems.append(doc.problem(path, f"cannot transfer {src.name} -> {dst.name}: {why}"))
            continue
        pairs.append((src, dst, path))
        if match["arrow"] == "<->" and src is not dst:
            pairs.append((dst, src, path))
    return pairs, problems


def load_transfers(library: Library, extra_dirs: Sequence[Path] = (), *,
                   builtin: bool = True) -> tuple[TransferPair, ...]:
    """Every transfer the build's transfers files declare, checked against `library`, in a
    stable order; one SpecError with every problem otherwise."""
    return check_transfers(library, transfer_files(extra_dirs, builtin=builtin))


def check_transfers(library: Library, files: Iterable[Path]) -> tuple[TransferPair, ...]:
    problems: list[Problem] = []
    declared: dict[tuple[str, str], tuple[TransferPair, str]] = {}
    for path in files:
        try:
            doc = parse_yaml(path)
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        found = _schema_problems(doc)
        problems.extend(found)
        if any(len(p.path) != 2 or p.path[0] != "transfers" for p in found):
            continue  # the file's shape is wrong; a wrong item still lets the others be checked
        pairs, found = _pairs(doc, library)
        problems.extend(found)
        for src, dst, where in pairs:
            line = doc.where(where)[0]
            pair = TransferPair(src, dst, f"{doc.file}:{line}")
            first = declared.get((src.name, dst.name))
            if first is not None:
                problems.append(doc.problem(where, f"transfer {src.name} -> {dst.name} is already declared at "
                                                   f"{first[0].declared}; declare each pair once"))
                continue
            declared[(src.name, dst.name)] = (pair, doc.file)
    if problems:
        raise SpecError(dict.fromkeys(problems))
    return tuple(pair for _, (pair, _) in sorted(declared.items()))


__all__ = ["TRANSFER_FILES", "TransferPair", "check_transfers", "content_problem", "load_transfers",
           "single_part", "transfer_files"]
