"""A cache as one call sees it: a frozen copy of its container tree and the fingerprint of
every tensor in it, and the binding (geometry, word width, memory) worked out once per
distinct fingerprint.

A binding is immutable and holds no tensor, so threads share bindings freely and a cached
binding keeps no cache alive. The fingerprint covers what the checks depend on: each leaf's
address, shape, strides, dtype, device, storage size and negation bit, and the length of
every container. Replacing, appending, re-viewing or resizing any leaf changes it, so the
whole cache is checked again before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.runtime.aliasing import CacheMemory, check_cache_memory, check_storage, within_storage
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layout import Geometry
from kvgen.runtime.words import widest

#: The fingerprint: container lengths and per-leaf facts in tree order.
Key = tuple[Any, ...]


@dataclass(frozen=True)
class Binding:
    key: Key | None
    geometry: Geometry
    #: Bytes of the widest copy word every cache tensor allows.
    width: int
    memory: CacheMemory
    #: `kvcaches[2][0]` per leaf, for messages.
    names: tuple[str, ...]


class _NotACache(Exception):
    pass


def snapshot(kvcaches: Any) -> tuple[Any, Key | None]:
    """(tree, fingerprint): `kvcaches` with every list or tuple copied into a tuple of the
    same tensors, so the copies of one call go to the tensors checked at its start even if
    the caller's lists change meanwhile. The fingerprint is None when `kvcaches` is not a
    tree of tensors (the geometry check then says what is wrong)."""
    parts: list[Any] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            parts.append(_facts(node))
            return node
        if isinstance(node, (list, tuple)):
            items = tuple(node)
            parts.append(len(items))
            if all(isinstance(t, torch.Tensor) for t in items):  # the last list level, in one pass
                parts.extend([_facts(t) for t in items])
                return items
            return tuple([walk(item) for item in items])
        raise _NotACache

    try:
        tree = walk(kvcaches)
    except (_NotACache, RuntimeError, RecursionError):  # RuntimeError: tensors without storage or strides
        return kvcaches, None
    return tree, tuple(parts)


def _facts(t: torch.Tensor) -> tuple[Any, ...]:
    """What a leaf's checks depend on. The storage's size is among them (a storage shrunk
    after the cache was bound must be checked again, not trusted), and the negation bit (a
    negated view of a bound leaf has its address, shape and strides)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t.untyped_storage().nbytes(), t.is_neg()


def leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for sub in tree for t in leaves(sub)]


def layer_leaves(tree: Any, lists: tuple[str, ...], layers: int) -> list[list[int]]:
    """Per layer, the indices (in `leaves` order) of the cache tensors its copy touches: those
    under that layer's entry of the L list level, or every tensor where L is no list level."""
    out: list[list[int]] = [[] for _ in range(layers)]
    count = 0

    def walk(node: Any, depth: int, layer: int | None) -> None:
        nonlocal count
        if isinstance(node, torch.Tensor):
            for k in range(layers) if layer is None else (layer,):
                out[k].append(count)
            count += 1
            return
        at_l = depth < len(lists) and lists[depth] == "L"
        for i, sub in enumerate(node):
            walk(sub, depth + 1, i if at_l else layer)

    walk(tree, 0, None)
    return out


#: What a layerwise transfer refused between two steps has done.
LAYERS_MOVED = "the layers before this one were moved, nothing more is"


def check_layer_leaves(tensors: list[torch.Tensor], indices: list[int], binding: Binding,
                       what: str | Callable[[], str]) -> None:
    """Refuse to go on with a layer whose cache tensors changed memory since the transfer
    started (freed, resized or moved between two steps of a layerwise generator): a copy would
    reach bytes that are no longer theirs. A few attribute reads per tensor; `what` names the
    layer (a callable is called only for a refusal's message)."""
    extents = binding.memory.leaves
    for k in indices:
        t = tensors[k]
        if within_storage(t) and t.data_ptr() == extents[k].lo:
            continue
        name = f"{what() if callable(what) else what}: cache tensor {binding.names[k]}"
        check_storage(t, name, LAYERS_MOVED)
        raise KVLayoutError(f"{name}: moved in memory since the transfer started (its storage was freed, resized "
                            f"or replaced); {LAYERS_MOVED}")


def leaf_names(tree: Any, prefix: str = "kvcaches") -> list[str]:
    if isinstance(tree, torch.Tensor):
        return [prefix]
    return [name for i, sub in enumerate(tree) for name in leaf_names(sub, f"{prefix}[{i}]")]


@dataclass(frozen=True)
class Snapshot:
    """A cache as a call received it: the caller's object, its frozen tree and their fingerprint
    (`snapshot`), checked together before a binding is made."""

    kvcaches: Any
    tree: Any
    key: Key


def new_binding(snap: Snapshot, geometry: Geometry, names: tuple[str, ...], *, word_limit: int | None, owner: str,
                argument: str) -> Binding:
    """The checks a cache gets once its geometry is read, then its binding: its tensors'
    memory (nothing shared), the widest copy word they allow (`word_limit` bytes at most;
    None: the element size), and that the cache did not change while it was checked.
    `owner` prefixes a memory problem; `argument` names the cache when it changed."""
    kvcaches, tree, key = snap.kvcaches, snap.tree, snap.key
    tensors = leaves(tree)
    try:
        memory = check_cache_memory(tensors, names)
    except KVLayoutError as error:
        raise KVLayoutError(f"{owner}: {error}") from None
    width = tensors[0].element_size() if word_limit is None else widest(tensors, geometry.C, word_limit)
    if snapshot(kvcaches)[1] != key:
        raise KVLayoutError(f"{argument} changed while it was being checked (another thread is changing it); "
                            "nothing was moved")
    return Binding(key, geometry, width, memory, names)
