"""kvgen.runtime: the small library that generated connectors import (with torch).

It holds what every connector shares: memory objects and format labels, reading a
cache's geometry, per-chunk slot work, device backends and the connector base classes.
"""

from kvgen.interface import ABI
from kvgen.runtime.cells import slot_cell_field
from kvgen.runtime.devices import Backend, available_devices, backend_for, register_backend
from kvgen.runtime.errors import KVLayoutError
from kvgen.runtime.layerwise import LayerwiseConnector
from kvgen.runtime.layout import CacheReader, Geometry, ObjectLayout, PagedLayout, PlaneGeometry
from kvgen.runtime.memory import UNDEFINED, Format, MemoryObj, Metadata, format_name
from kvgen.runtime.model.connector import ModelConnector
from kvgen.runtime.model.table import GroupTable, Section, StateTable
from kvgen.runtime.movers.program import CopyPath, CopyProgram, TransferPath, TransferProgram
from kvgen.runtime.ops import (
    bits,
    gather_slots,
    placed,
    put_index,
    put_rows,
    put_tokens,
    scatter_slots,
    take_index,
    take_rows,
    take_tokens,
)
from kvgen.runtime.planes import (
    as_words,
    block_field,
    bytes_of,
    cell_field,
    copy_into,
    kv_row_field,
    plane_words,
    region,
    region_bytes,
    region_starts,
    row_field,
    units,
)
from kvgen.runtime.registry import DEVICES, Registry, check_transition, convert
from kvgen.runtime.slots import Chunk, plan_chunk
from kvgen.runtime.transfer.connector import TransferBase, TransferCall
from kvgen.runtime.transfer.pairs import Pairs, carry, move_blocks, pick, pick_slots, put_slots
from kvgen.runtime.whole import ChunkConnector
from kvgen.runtime.words import Words


def require_abi(version: int, module: str) -> None:
    """Called by every generated module at import: refuse code generated for another runtime."""
    if version != ABI:
        raise ImportError(f"{module} was generated for kvgen runtime ABI {version}, but this kvgen "
                          f"runtime speaks ABI {ABI}: run `kvgen build` again")


__all__ = [
    "ABI", "UNDEFINED", "Backend", "Chunk", "ChunkConnector", "CopyPath", "CopyProgram", "Format", "Geometry",
    "KVLayoutError",
    "LayerwiseConnector", "MemoryObj", "Metadata", "ObjectLayout", "PagedLayout", "available_devices",
    "backend_for", "bits", "format_name", "plan_chunk", "put_tokens", "register_backend", "CacheReader",
    "DEVICES", "Registry", "check_transition", "convert",
    "require_abi", "take_tokens", "Words", "gather_slots", "scatter_slots", "take_rows", "put_rows",
    "take_index", "put_index", "placed",
    "PlaneGeometry", "block_field", "bytes_of", "cell_field", "kv_row_field", "copy_into", "region", "region_bytes",
    "region_starts", "row_field", "slot_cell_field",
    "units", "as_words", "plane_words",
    "ModelConnector", "GroupTable", "StateTable", "Section",
    "Pairs", "TransferBase", "TransferCall", "TransferPath", "TransferProgram", "carry", "move_blocks", "pick",
    "pick_slots", "put_slots",
]
