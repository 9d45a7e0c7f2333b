"""What a generated package's `__init__` and `formats` modules share: looking connectors
up by name, refusing unsupported pairs and devices, label transitions and converters.

The generated modules hold only their tables; the behaviour lives here, where it is
linted and tested once.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from kvgen.errors import KVLayoutError
from kvgen.names import Named, resolve
from kvgen.runtime.layout import head_split
from kvgen.runtime.memory import format_name

#: Device types every generated connector runs on (through kvgen.runtime's backends).
DEVICES = ("cpu", "cuda", "xpu")


class Registry:
    """The connectors of one generated package, by (layout, object) name."""

    def __init__(self, package: str, layouts: Mapping[str, Mapping[str, Any]], aliases: Mapping[str, str],
                 modules: Mapping[tuple[str, str], tuple[str, str]],
                 transfers: Mapping[tuple[str, str], str] | None = None,
                 models: Mapping[tuple[str, str], str] | None = None):
        self.package = package
        self.layouts = layouts
        self.aliases = aliases
        self.modules = modules
        #: (source layout, destination layout) -> transfer module.
        self.transfers = transfers or {}
        #: (model, groups object) -> model connector module.
        self.models = models or {}
        self.named = [Named(name, tuple(facts["aliases"]),
                            tuple(f for f in (facts.get("format"), facts.get("lmcache")) if f))
                      for name, facts in layouts.items()]

    def capabilities(self) -> dict[tuple[str, str, str, str], bool]:
        """(layout, object format, mode, device) -> supported, for every generated pair."""
        return {(layout, self.layouts[obj]["format"], mode, device): True
                for (layout, obj), (_, mode) in self.modules.items() for device in DEVICES}

    def resolve(self, name: str) -> str:
        """The spec name for a name, alias or LMCache format name (see kvgen.names)."""
        return resolve(name, self.named)

    def get(self, layout: str, obj: str) -> type:
        """The connector class moving `layout` caches to and from `obj` memory objects; given a
        model's name instead of a layout, the model connector (get_model)."""
        if layout.lower() in {m.lower() for m, _ in self.models} and layout.lower() not in \
                {n.lower() for n in self.layouts}:
            return self.get_model(layout, obj)
        pair = (self.resolve(layout), self.resolve(obj))
        if pair not in self.modules:
            partners = sorted(o for p, o in self.modules if p == pair[0])
            raise KVLayoutError(f"no connector for {pair[0]} <-> {pair[1]}; {pair[0]} pairs with: "
                                f"{', '.join(partners) or 'nothing'}")
        module = importlib.import_module(f".{self.modules[pair][0]}", self.package)
        return module.Connector

    def get_model(self, model: str, obj: str) -> type:
        """The model connector class moving `model`'s whole cache (groups and state) to and from
        `obj` groups objects (kvgen.runtime.model.connector)."""
        models = {m.lower(): m for m, _ in self.models}
        if model.lower() not in models:
            raise KVLayoutError(f"no model connector for {model!r}; models: {', '.join(sorted(set(models.values())))}"
                                if models else f"no model connector for {model!r}: this build has no model specs")
        name, target = models[model.lower()], self.resolve(obj)
        if (name, target) not in self.models:
            partners = sorted(o for m, o in self.models if m == name)
            raise KVLayoutError(f"no model connector for {name} <-> {target}; {name} pairs with: "
                                f"{', '.join(partners) or 'nothing'} (`kvgen explain {name}` says why)")
        module = importlib.import_module(f".{self.models[(name, target)]}", self.package)
        return module.Connector

    def transfer(self, src: str, dst: str) -> type:
        """The transfer class copying KV from `src` caches into `dst` caches (kvgen.runtime.transfer.connector)."""
        pair = (self.resolve(src), self.resolve(dst))
        if pair not in self.transfers:
            partners = sorted(d for s, d in self.transfers if s == pair[0])
            why = self._transfer_blocker(*pair)
            advice = (f"no transfer can be declared: {why}" if why else f"Declare it with one line, "
                      f"'{pair[0]} -> {pair[1]}', in a transfers.yaml of a --specs folder and build")
            raise KVLayoutError(f"no transfer {pair[0]} -> {pair[1]} was generated; {pair[0]} transfers to: "
                                f"{', '.join(partners) or 'nothing'}. {advice}")
        module = importlib.import_module(f".{self.transfers[pair]}", self.package)
        return module.Transfer

    def _transfer_blocker(self, src: str, dst: str) -> str | None:
        """Why the build would refuse `src -> dst`, from the layouts' facts (None when it would
        take it). The build's rule is kvgen.spec.transfers.content_problem, which the runtime
        cannot import; tests/test_user_errors.py checks the two agree on every built-in pair."""
        why = next((w for name in (src, dst) if (w := _side_blocker(name, self.layouts[name])) is not None), None)
        if why is not None:
            return why
        content = {name: {_whole(a) for dim in (self.layouts[name]["lists"], *self.layouts[name]["dims"]) for a in dim}
                   - {"B", "N"} for name in (src, dst)}
        if content[src] != content[dst]:
            def words(axes: set[str]) -> str:
                return (f"{'K and V' if 'KV' in axes else 'one latent plane (no K/V)'} "
                        f"{'per head' if 'H' in axes else 'without heads'}")

            return f"{src} holds {words(content[src])} but {dst} holds {words(content[dst])}"
        groups = [head_split(self.layouts[name]["dims"]) for name in (src, dst)]
        if groups[0] and groups[1] and groups[0] != groups[1]:
            return (f"{src} splits H as {', '.join(groups[0])} and {dst} as {', '.join(groups[1])}: a transfer "
                    "between two caches of head groups needs the same split")
        return None

    def connector(self, layout: str, obj: str, device: str = "cpu", **kwargs: Any) -> Any:
        """A connector for `device`, refused now (not mid-transfer) when unsupported."""
        cls = self.get(layout, obj)
        kind = str(device).split(":")[0]
        if kind not in DEVICES:
            raise KVLayoutError(f"{cls.layout.name} <-> {cls.memory.format} is not generated for device "
                                f"{device!r}; supported device types: {', '.join(DEVICES)}")
        return cls(device=device, **kwargs)


def _side_blocker(name: str, facts: dict[str, Any]) -> str | None:
    """Why one layout cannot be a side of any transfer (the build's kvgen.spec.transfers.single_part)."""
    if facts["kind"] != "paged":
        return f"{name} is a memory object; transfers copy between paged layouts"
    if facts.get("slots_per_token", 1) > 1:
        return (f"{name} stores each token as {facts['slots_per_token']} slots; transfers move layouts "
                "of one slot a token")
    if "parts" in facts and not _head_groups_only(facts):
        return (f"{name} is a spec format 2 or 3 layout with parts, fields or split axes; transfers move "
                "single-part (format 1) layouts only, and one tree whose only split axes split H by a "
                "factor read from the tensor (H/g, H%g)")
    return None


def _head_groups_only(facts: dict[str, Any]) -> bool:
    """A one-tree layout whose split axes all split H by a factor read from the tensor (`H/g`,
    `H%g`; a tree with split axes has no fields), which transfers move."""
    split = {a for dim in facts["dims"] for a in dim if _whole(a) != a}
    return facts["parts"] == ("",) and bool(split) and split == set(head_split(facts["dims"]) or ())


def _whole(axis: str) -> str:
    """The axis a split axis splits (`H/g`, `H%g`: H); any other axis itself."""
    return axis.split("/")[0].split("%")[0]


def check_transition(transitions: frozenset[tuple[str, str]], formats: Any, current: Any, target: Any) -> None:
    """Raise KVLayoutError unless an object labelled `current` may be stored as `target`.

    Labels are None (a fresh object) or any enum member with the right `.name`, so
    LMCache's own MemoryFormat works too."""
    try:
        pair = (format_name(current), format_name(target))
    except TypeError as exc:
        raise KVLayoutError(str(exc)) from None
    if pair[1] not in formats.__members__:
        raise KVLayoutError(f"unknown memory format {pair[1]}; known: {', '.join(formats.__members__)}")
    if pair not in transitions:
        allowed = sorted(a for a, b in transitions if b == pair[1])
        raise KVLayoutError(f"cannot re-label a {pair[0]} object as {pair[1]}; "
                            f"{pair[1]} may be stored over: {', '.join(allowed)}")


def convert(conversions: Mapping[tuple[str, str], tuple[str, str]], namespace: Mapping[str, Any], data: Any,
            source: str, target: str) -> Any:
    """Run the generated converter (a function named in `namespace`) from object layout
    `source` to `target`."""
    try:
        function, _ = conversions[(source, target)]
    except KeyError:
        known = ", ".join(f"{a}->{b}" for a, b in conversions)
        raise KVLayoutError(f"no converter from {source} to {target}; known: {known}") from None
    return namespace[function](data)
