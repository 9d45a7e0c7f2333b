"""Triton's interpreter as `kvgen verify --backend triton --device cpu` and the tests run it.

The interpreter runs every program instance of a launch in Python, one numpy call per Triton
operation. Three of its habits cost more than the kernels' own work there, and `quicken` turns
them off for the process:

* It checks every 32-bit integer add, subtract and multiply for overflow (about 40% of its time
  on kvgen's kernels). Those checks cannot fire here: every address kvgen's kernels compute is
  64-bit (block ids, slots and token positions are widened before they meet a stride), and the
  32-bit values left (program ids, a tile's lanes, a row's word offsets: a head or channel index
  times its stride inside one token's row) stay far below 2**31 in the caches the scenarios
  build, a few kilobytes each.
* Each call of a jitted helper (kvgen.runtime.tiles: move_chunk and the two it calls, three per
  program instance) patches triton.language again, walking its modules' members (about a
  quarter of the rest), though the launch around it has patched them already and restores
  them once it ends. Inside a launch those repeats are skipped (the launch's own patch is
  kept); a helper that sees a module the launch did not patch is still patched.
* It builds its table of numpy dtypes afresh (19 of them) to look up one, once per operation it
  runs. Each answer is kept instead (a launch-heavy check: 0.78-1.22 s of CPU before, 0.61-0.73 s
  after).

What keeps a launch inside its tensors is the connector's check of every cache and object
against its storage (kvgen.runtime.aliasing) before any mover runs; it runs as before.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any


def quicken() -> bool:
    """Switch both habits off for this process (idempotent); False where this Triton does not
    have the interpreter parts it changes (the interpreter then runs as it is)."""
    if importlib.util.find_spec("triton") is None:
        return False
    # triton: optional, and only where a kernel runs in its interpreter
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    patch = getattr(interpreter, "_patch_lang", None)
    if not (dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow") and callable(patch)):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    if not isinstance(patch, _PatchOnce):
        interpreter._patch_lang = _PatchOnce(patch, (tl, tl.core))
    lookup = getattr(interpreter, "_get_np_dtype", None)
    if callable(lookup) and not isinstance(lookup, _NumpyDtypes):
        interpreter._get_np_dtype = _NumpyDtypes(lookup)
    return True


class _NumpyDtypes:
    """triton's `_get_np_dtype` (the numpy dtype that holds a Triton dtype's values), each answer
    kept: it is a function of the dtype, which triton's dtypes hash and compare by. A dtype that
    cannot be hashed (a pointer type) is asked of triton's function every time."""

    def __init__(self, lookup: Any):
        self.lookup = lookup
        self.known: dict[Any, Any] = {}

    def __call__(self, tt_dtype: Any) -> Any:
        try:
            return self.known[tt_dtype]
        except KeyError:
            found = self.known[tt_dtype] = self.lookup(tt_dtype)
            return found
        except TypeError:  # unhashable
            return self.lookup(tt_dtype)


class _PatchOnce:
    """triton's `_patch_lang` that patches once per launch: while a launch's patch is in force
    (between its patch and its restore), a helper whose triton.language modules the launch
    has patched already changes nothing and restores nothing; a helper that sees another of
    them (a kernel library's own import of triton.language.core, say) is patched as triton
    patches it."""

    def __init__(self, patch: Any, modules: tuple[Any, ...]):
        #: triton's own patch, and the modules it changes (triton.language and its core).
        self.patch, self.modules = patch, modules
        self.active: frozenset[int] | None = None  # the modules the running launch has patched
        self._langs: dict[Any, frozenset[int]] = {}

    def langs(self, fn: Any) -> frozenset[int]:
        """Which of `modules` `fn` sees, by id."""
        found = self._langs.get(fn)
        if found is None:
            found = self._langs[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if any(v is m for m in self.modules))
        return found

    def __call__(self, fn: Any) -> Any:
        langs = self.langs(fn)
        if self.active is not None and langs <= self.active:
            return _Kept()
        scope = self.patch(fn)
        if self.active is not None:  # a helper's own modules: patched, as triton leaves them
            self.active |= langs
            return scope
        self.active = langs
        return _Restoring(scope, self)


class _Kept:
    """The scope of a repeated patch: nothing to restore."""

    def restore(self) -> None:
        pass


class _Restoring:
    """A launch's scope: restoring it ends the launch's patch."""

    def __init__(self, scope: Any, owner: _PatchOnce):
        self.scope, self.owner = scope, owner

    def restore(self) -> None:
        try:
            self.scope.restore()
        finally:
            self.owner.active = None
