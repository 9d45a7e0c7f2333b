"""Memory-format converters between object specs holding the same KV content.

An object's dims are *atoms* (an axis or a fused group such as (H C)); two objects
convert when they share their atoms apart from L, which one holds as a dim and the
other as a per-layer list. A converter selects or stacks layers and permutes atoms;
it returns views where the target is a plain slice of the source, copies otherwise.
No torch here: this plans the generated code.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from kvgen.spec.library import Library
from kvgen.spec.model import Spec, Vocabulary

Atom = tuple[str, ...]


class Conversion(Vocabulary):
    """What a converter's result is: views of the source's memory, or copies."""

    VIEW = "view"
    COPY = "copy"


class Direction(Vocabulary):
    """Whole-chunk to per-layer (split), per-layer to whole (stack), or per layer on both sides."""

    SPLIT = "split"
    STACK = "stack"
    PER_LAYER = "per_layer"


def atoms(spec: Spec) -> tuple[Atom, ...]:
    return tuple(d.axes for d in spec.dims if not d.is_singleton)


def _content(spec: Spec) -> frozenset[Atom]:
    return frozenset(a for a in atoms(spec) if a != ("L",))


@dataclass(frozen=True)
class Converter:
    src: Spec
    dst: Spec
    #: VIEW when every result is a slice of the source's memory, else COPY.
    kind: Conversion
    #: Source dims in the order of the target's (per-layer) dims, with L dropped.
    order: tuple[int, ...]

    @property
    def function(self) -> str:
        # Names never hold "__", so this is unique per pair (like connector modules).
        return f"{self.src.name}__{self.dst.name}"

    @property
    def direction(self) -> Direction:
        if not self.src.lists and self.dst.lists:
            return Direction.SPLIT
        return Direction.STACK if self.src.lists and not self.dst.lists else Direction.PER_LAYER

    @property
    def signature(self) -> str:
        """`def name(param: type) -> type:` of the generated function."""
        arg = "tensor: torch.Tensor" if self.direction is Direction.SPLIT else "tensors: Sequence[torch.Tensor]"
        result = "torch.Tensor" if self.direction is Direction.STACK else "list[torch.Tensor]"
        return f"def {self.function}({arg}) -> {result}:"

    @property
    def doc(self) -> str:
        return (f"{self.src.format} {self.src.arrow()} -> {self.dst.format} {self.dst.arrow()} "
                f"({self.kind.value}).")

    @property
    def body(self) -> tuple[str, ...]:
        """The generated function's statements."""
        turn = permute(self.order)
        copy = ".contiguous()" if self.kind is Conversion.COPY else ""
        if self.direction is Direction.PER_LAYER:
            return (f"return [t{turn}.contiguous() for t in tensors]",)
        dim = layer_dim(self)
        if self.direction is Direction.SPLIT:
            strip = strip_singletons(self)
            src = "src" if strip else "tensor"
            head = [f"src = tensor{strip}"] if strip else []
            return (*head, f"return [{src}.select({dim}, layer){turn}{copy} for layer in range({src}.shape[{dim}])]")
        items = f"[t{turn} for t in tensors]" if turn else "list(tensors)"
        return (f"return torch.stack({items}, dim={dim}){add_singletons(self)}",)


def _convertible(src: Spec, dst: Spec) -> bool:
    """Whether a converter between the two objects exists: the same content, at most a layer
    list on either side (not on neither), and the same packing (a regions object, [L, R] or [R]
    per layer, only splits and stacks its layers)."""
    if src is dst or _content(src) != _content(dst) or not {src.lists, dst.lists} <= {(), ("L",)}:
        return False
    if src.pack != dst.pack:
        return False  # format-2 objects convert only to their own kind of packing
    if src.pack == "regions" and atoms(src)[1 if not src.lists else 0:] != atoms(dst)[1 if not dst.lists else 0:]:
        return False
    return bool(src.lists or dst.lists)  # whole <-> whole of one content would be the same format


def _kind(src: Spec, dst: Spec, order: tuple[int, ...]) -> Conversion:
    """VIEW where a layer of the whole source is contiguous (only singletons stand before L, no permutation)."""
    if not src.lists and dst.lists and order == tuple(sorted(order)):
        lead = next(i for i, d in enumerate(src.dims) if d.axes == ("L",))
        if all(d.is_singleton for d in src.dims[:lead]):
            return Conversion.VIEW
    return Conversion.COPY


def _plan(src: Spec, dst: Spec) -> Converter | None:
    if not _convertible(src, dst):
        return None
    src_dims = [d for d in src.dims if not d.is_singleton and d.axes != ("L",)]
    dst_dims = [d for d in dst.dims if not d.is_singleton and d.axes != ("L",)]
    order = tuple(src_dims.index(d) for d in dst_dims)
    return Converter(src, dst, _kind(src, dst, order), order)


def plan_converters(library: Library) -> list[Converter]:
    out = [c for a, b in permutations(library.objects, 2) if (c := _plan(a, b)) is not None]
    return sorted(out, key=lambda c: c.function)


def _whole(c: Converter) -> Spec:
    return c.dst if c.src.lists else c.src


def strip_singletons(c: Converter) -> str:
    """`.select(0, 0)` for each singleton dim of the whole-chunk side, last first."""
    dims = _whole(c).dims
    return "".join(f".select({i}, 0)" for i in range(len(dims) - 1, -1, -1) if dims[i].is_singleton)


def add_singletons(c: Converter) -> str:
    dims = _whole(c).dims
    return "".join(f".unsqueeze({i})" for i, d in enumerate(dims) if d.is_singleton)


def layer_dim(c: Converter) -> int:
    """Position of L among the whole-chunk side's non-singleton dims."""
    return [d.axes for d in _whole(c).dims if not d.is_singleton].index(("L",))


def permute(order: tuple[int, ...]) -> str:
    return "" if order == tuple(sorted(order)) else f".permute({', '.join(map(str, order))})"
