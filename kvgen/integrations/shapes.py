"""Caches as detection reads them: list lengths, the leaf's shape, strides and dtype,
from live tensors or from text (the CLI), the stride order of a leaf's dims, and the check
that a leaf handed over in a spec's declared order (`given`) follows its memory order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgen.errors import KVLayoutError


class Mismatch(Exception):
    """One fact a spec disagrees with (internal to detection)."""


@dataclass(frozen=True)
class CacheShape:
    """A cache described without tensors: list lengths outermost first, the leaf shape and,
    optionally, the leaf's strides (in elements) and dtype name."""

    lists: tuple[int, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    dtype: str | None = None

    def describe(self) -> str:
        text = "".join(f"{n} x " for n in self.lists) + f"[{', '.join(map(str, self.shape))}]"
        if self.dtype:
            text += f" {self.dtype}"
        if self.stride is not None:
            text += f" strides ({', '.join(map(str, self.stride))})"
        return text


def map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(t, fn) for t in tree)
    return fn(tree)


def read_structure(kvcaches: Any) -> tuple[CacheShape, list[Any]]:
    """A live cache's CacheShape and its tensors; KVLayoutError when the lists are uneven
    or the tensors differ in shape, strides, dtype or device."""
    # torch on first use: detection's tables and shape parsing stay torch-free
    import torch

    lengths: list[int] = []
    level = [kvcaches]
    while all(isinstance(n, (list, tuple)) for n in level):
        sizes = {len(n) for n in level}
        if len(sizes) != 1 or 0 in sizes:
            raise KVLayoutError(f"kvcaches: list level {len(lengths)} must be non-empty and equally long "
                                f"everywhere, got lengths {sorted(sizes)}")
        lengths.append(sizes.pop())
        level = [x for n in level for x in n]
    if not all(isinstance(n, torch.Tensor) for n in level):
        kinds = sorted({type(n).__name__ for n in level})
        raise KVLayoutError(f"kvcaches: expected nested lists or tuples of tensors, found {', '.join(kinds)} "
                            f"at list level {len(lengths)}")
    first = level[0]
    for t in level[1:]:
        if (t.shape, t.stride(), t.dtype, t.device) != (first.shape, first.stride(), first.dtype, first.device):
            raise KVLayoutError(f"kvcaches: every tensor must have one shape, stride, dtype and device; found "
                                f"{list(first.shape)} {first.stride()} {first.dtype} on {first.device} and "
                                f"{list(t.shape)} {t.stride()} {t.dtype} on {t.device}")
    shape = CacheShape(tuple(lengths), tuple(first.shape), tuple(first.stride()),
                       str(first.dtype).removeprefix("torch."))
    return shape, level


def memory_order(shape: Sequence[int], stride: Sequence[int] | None) -> tuple[int, ...]:
    """The permutation that sorts a tensor's dims by stride, outermost first. Size-1 dims
    keep their place (their stride says nothing); equal strides keep their order."""
    ident = tuple(range(len(shape)))
    if stride is None:
        return ident
    big = [i for i in ident if shape[i] != 1]
    order = sorted(big, key=lambda i: -stride[i])
    perm = list(ident)
    for slot, src in zip(big, order, strict=True):
        perm[slot] = src
    return tuple(perm)


def _integers(text: str, sep: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(sep) if n)


def parse_cache_shape(text: str, stride: str | None = None, dtype: str | None = None) -> CacheShape:
    """`32x[2,1000,16,8,128]` (list lengths outermost first, then the leaf shape; `[...]`
    alone for one tensor) and optional comma-separated strides, as the CLI takes them."""
    head, sep, leaf = text.replace(" ", "").rpartition("[")
    if not leaf.endswith("]") or (head and not head.endswith("x")) or (not sep):
        raise KVLayoutError(f"cache shape {text!r}: write list lengths then the tensor shape, e.g. "
                            "32x[2,1000,16,8,128] or 2x32x[4096,8,128] or [1000,32,2,8,16,128]")
    try:
        lists, shape = _integers(head, "x"), _integers(leaf[:-1], ",")
        strides = _integers(stride.replace(" ", ""), ",") if stride else None
    except ValueError:
        raise KVLayoutError(f"cache shape {text!r} / strides {stride!r}: every extent must be an integer") from None
    if not shape or (strides is not None and len(strides) != len(shape)):
        raise KVLayoutError(f"cache shape {text!r}: need a tensor shape, and one stride per dim when strides "
                            "are given")
    return CacheShape(lists, shape, strides, dtype)


def check_given(given: Sequence[tuple[str, ...]], dims: Sequence[tuple[str, ...]], cache: CacheShape,
                perm: tuple[int, ...]) -> None:
    """A leaf handed over in the spec's `given` order has strides that follow its `dims`."""
    if len(cache.shape) != len(given):
        raise Mismatch(f"rank: the engine hands over {len(given)}-dim tensors, the cache's have {len(cache.shape)}")
    if cache.stride is None:
        return  # a shape alone: the given order is the engine's statement, nothing to check it with
    big = [(cache.stride[i], i) for i in perm if cache.shape[i] != 1]
    if all(a[0] > b[0] for a, b in zip(big, big[1:], strict=False)):
        return
    names = [_dim_name(d) for d in given]
    found = [names[i] for _, i in sorted(big, key=lambda si: -si[0])]
    raise Mismatch(f"handed over as [{', '.join(names)}] with strides ({', '.join(map(str, cache.stride))}), "
                    f"the memory order is [{', '.join(found)}], not the spec's "
                    f"[{', '.join(_dim_name(d) for d in dims)}]")


def _dim_name(dim: tuple[str, ...]) -> str:
    return "1" if not dim else dim[0] if len(dim) == 1 else f"({' '.join(dim)})"
