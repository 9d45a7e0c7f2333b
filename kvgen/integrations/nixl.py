"""kvgen.remote plans carried out by NIXL (`pip install --no-deps nixl-cu12`): register a
rank's cache, exchange descriptions, post the READs, wait, run the staging permutes.

    prefill = Worker("prefill-0", caches, remote.describe(caches, "NHD", tp_rank=0, tp_size=2))
    decode = Worker("decode-1", dst, remote.describe(dst, "HND", tp_rank=1, tp_size=4))
    decode.connect(prefill.handshake())        # bytes: send them any way (a socket, a pipe)
    decode.pull(src_slots, dst_slots)          # every READ posted, waited for, then the permutes

A worker holds one NIXL agent (UCX backend, DRAM). `pull` plans first: mismatched
descriptions, slots or strategies are refused before any READ is posted, and nothing is
written. The handshake is JSON: the agent's name, its NIXL metadata and the description.

`StateWorker` does the same for a hybrid model's per-request state tensors (by name, each
described by `remote.describe_state`): its `pull` moves each tensor's rows section by section
(`remote.plan_state`), every tensor planned before the first READ.
"""

from __future__ import annotations

import base64
import importlib
import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgen.errors import KVGenError
from kvgen.remote import CacheDescription, Costs, Plan, Read, StateDescription, check_pair, plan
from kvgen.remote.state import check_state_pair, plan_state
from kvgen.runtime.aliasing import extent
from kvgen.runtime.binding import leaves
from kvgen.runtime.errors import KVLayoutError

#: The module NIXL's CUDA 12 wheel installs (CPU DRAM transfers work without a GPU).
MODULE = "nixl_cu12._api"
#: Seconds a pull waits for its READs before giving up.
TIMEOUT = 120.0
#: UCX workers of an agent `new_agent` makes, and threads a Worker on it posts reads from: UCX
#: copies a READ between processes of one host (CMA) inside the posting call, so reads cut
#: into parts and posted side by side on several workers are what moves bytes in parallel.
STREAMS = 2
#: A read of fewer descriptors is posted whole (threads cost more than they overlap).
SPLIT_AT = 64


class TransportError(KVGenError, RuntimeError):
    """NIXL refused or failed a transfer (what it said is in the message)."""


def api() -> Any:
    """NIXL's Python API; KVGenError saying how to install it when it is absent."""
    try:
        return importlib.import_module(MODULE)
    except ImportError as why:
        raise KVGenError(f"NIXL is not installed ({why}); install it with "
                         "`pip install --no-deps nixl-cu12==1.5.1` (--no-deps: it would pull a CUDA torch)") from why


def unavailable() -> str | None:
    """Why NIXL cannot run here, or None."""
    try:
        api()
    except KVGenError as why:
        return str(why)
    return None


def new_agent(name: str, streams: int = STREAMS, *, serves: bool = True) -> Any:
    """A NIXL agent with a UCX backend of `streams` workers, safe to post from several threads
    (a Worker given it takes `streams=` as many).

    `serves`: peers read this agent's memory, so it runs NIXL's progress thread, which answers
    them while this process does something else. An agent that only reads (serves=False, a decode
    worker's) needs none: waiting for its reads progresses its UCX workers. NIXL's progress thread
    polls without a pause, a core for each agent even when idle, and takes the workers' lock the
    reads are posted and checked under."""
    nixl = api()
    conf = nixl.nixl_agent_config(enable_prog_thread=serves, backends=[],
                                  sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    agent = nixl.nixl_agent(name, conf)
    agent.create_backend("UCX", {"num_workers": str(streams)})
    return agent


def parts(src: np.ndarray, dst: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A read's descriptors cut into up to `n` parts of about equal bytes (rows stay paired)."""
    if n <= 1 or len(dst) < SPLIT_AT:
        return [(src, dst)]
    ends = np.cumsum(dst[:, 1])
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, n) / n, side="right")
    return [(a, b) for a, b in zip(np.split(src, cuts), np.split(dst, cuts), strict=True) if len(a)]


@dataclass(frozen=True)
class Peer:
    agent: str
    description: CacheDescription


class _Reads:
    """Posting READs on `self.agent` from the peer of a source rank (`self.peers[rank].agent`)
    and waiting for them: what Worker and StateWorker share."""

    name: str
    agent: Any
    peers: dict[int, Any]

    def _post(self, rank: int, src_descs: Any, dst_descs: Any) -> Any:
        local = self.agent.get_xfer_descs(dst_descs, "DRAM")
        far = self.agent.get_xfer_descs(src_descs, "DRAM")
        handle = self.agent.initialize_xfer("READ", local, far, self.peers[rank].agent)
        if self.agent.transfer(handle) == "ERR":
            raise TransportError(f"{self.name}: NIXL refused the READ from {self.peers[rank].agent}")
        return handle

    def _wait(self, handles: list[Any]) -> None:
        deadline = time.monotonic() + TIMEOUT
        pending = list(handles)
        while pending:
            states = [self.agent.check_xfer_state(h) for h in pending]
            if "ERR" in states:
                raise TransportError(f"{self.name}: a NIXL READ failed")
            for h, state in zip(list(pending), states, strict=True):
                if state == "DONE":
                    self.agent.release_xfer_handle(h)
                    pending.remove(h)
            if pending and time.monotonic() > deadline:
                raise TransportError(f"{self.name}: {len(pending)} NIXL READs not done after {TIMEOUT:.0f} s")


class Worker(_Reads):
    """One rank's cache registered with a NIXL agent: its own (named `name`, STREAMS workers),
    or `agent`, one the caller made and keeps (several caches may share one: an agent costs
    ~0.5 s to start). `streams`: threads reads are posted from (default: STREAMS on its own
    agent, 1 on a given one; more than 1 needs an agent safe across threads, as new_agent's).
    `serves`: whether peers read this cache (new_agent's `serves`, for an agent of its own; a
    decode worker that only pulls passes False)."""

    def __init__(self, name: str, caches: Any, description: CacheDescription, agent: Any = None,
                 streams: int | None = None, *, serves: bool = True):
        found = tuple(t.data_ptr() for t in leaves(caches))
        if found != description.leaves:
            raise KVLayoutError(f"{name}: the description is not of these caches ({description})")
        _check_regions(name, leaves(caches), description.regions())
        self.name, self.caches, self.description = name, caches, description
        self._own = agent is None
        self.streams = streams or (STREAMS if agent is None else 1)
        self.agent = new_agent(name, self.streams, serves=serves) if agent is None else agent
        self.name = self.agent.name
        self._pool = ThreadPoolExecutor(self.streams, thread_name_prefix=f"kvgen-nixl-{self.name}") \
            if self.streams > 1 else None
        self._registered = self.agent.register_memory(
            [(a, n, d, "") for a, n, d in description.regions()], "DRAM")
        self.peers: dict[int, Peer] = {}
        #: Staging caches registered once per plan (registration pins pages: too dear per read).
        self._staging: dict[int, tuple[Plan, list[Any]]] = {}

    def handshake(self) -> bytes:
        """What the other side needs to read from this cache (or to be read into)."""
        return json.dumps({"agent": self.name, "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                           "description": self.description.to_bytes().decode()}).encode()

    def connect(self, handshake: bytes) -> CacheDescription:
        """Accept a source rank's handshake (refused, naming both caches, when its cache cannot
        move into this one); returns its description."""
        try:
            raw = json.loads(handshake)
            agent, metadata = raw["agent"], base64.b64decode(raw["metadata"])
            description = CacheDescription.from_bytes(raw["description"].encode())
        except (ValueError, KeyError, TypeError) as why:
            raise KVLayoutError(f"not a kvgen NIXL handshake: {why}") from why
        check_pair(description, self.description)
        # Replace what this agent knew of the peer whole: registrations the peer made or dropped
        # since an earlier handshake (another cache on a shared agent) must not linger.
        self.agent.remove_remote_agent(agent)
        self.agent.add_remote_agent(metadata)
        self.peers[description.tp_rank] = Peer(agent, description)
        return description

    def plan(self, src_slots: Any, dst_slots: Any, *, strategy: str | None = None, cost: Costs | None = None) -> Plan:
        """The plan `pull` runs, from the connected source ranks into this cache."""
        if not self.peers:
            raise KVLayoutError(f"{self.name}: connect() to the source ranks before planning a read")
        return plan([p.description for p in self.peers.values()], self.description, src_slots, dst_slots,
                    strategy=strategy, cost=cost)

    def pull(self, src_slots: Any, dst_slots: Any, *, strategy: str | None = None, cost: Costs | None = None) -> Plan:
        """Read token i's KV from source slot src_slots[i] into destination slot dst_slots[i]:
        plan (every refusal here, before a READ), post a READ per source rank, wait, permute."""
        p = self.plan(src_slots, dst_slots, strategy=strategy, cost=cost)
        self.run(p)
        return p

    def run(self, p: Plan) -> None:
        """Carry out a plan made for this worker's cache (again, if need be: a plan's staging
        stays registered until forget(plan) or close()). Every read is posted at once (cut into
        parts over the worker's streams); chunk c's permutes run as soon as its reads are done,
        while later chunks are still read."""
        if p.dst != self.description:
            raise KVLayoutError(f"{self.name}: the plan is for another cache ({p.dst})")
        if p.staging and id(p) not in self._staging:
            distinct = {id(st.caches): st.caches for st in p.staging}  # a route's chunks share one staging
            self._staging[id(p)] = (p, [self.agent.register_memory(leaves(c)) for c in distinct.values()])
        if self._pool is None:
            self._run_here(p)
        else:
            self._run_streams(p, self._pool)

    def _jobs(self, p: Plan, chunk: int, n: int) -> list[tuple[int, Any, Any]]:
        """(source rank, src_descs, dst_descs) of chunk `chunk`'s reads, each cut into up to n parts."""
        return [(r.src_rank, *x) for r in p.reads if r.chunk == chunk and len(r.dst_descs)
                for x in parts(r.src_descs, r.dst_descs, n)]

    def _run_here(self, p: Plan) -> None:
        """One stream: post and wait in this thread, chunk by chunk, each chunk's permutes after it."""
        for chunk in p.chunks:
            self._wait([self._post(*job) for job in self._jobs(p, chunk, 1)])
            p.finish(self.caches, chunk)

    def _run_streams(self, p: Plan, pool: ThreadPoolExecutor) -> None:
        """Every chunk's reads queued at once on the streams' threads (in chunk order); chunk c's
        permutes run here as soon as its reads are done."""
        posted = {c: [pool.submit(self._read, *job) for job in self._jobs(p, c, self.streams)] for c in p.chunks}
        try:
            for chunk in p.chunks:
                for f in posted[chunk]:
                    f.result()
                p.finish(self.caches, chunk)
        finally:  # a failure: let the other reads end before the caller sees it
            wait([f for fs in posted.values() for f in fs])

    def _read(self, rank: int, src_descs: Any, dst_descs: Any) -> None:
        """One READ, posted and waited for (on a stream's thread)."""
        self._wait([self._post(rank, src_descs, dst_descs)])

    def forget(self, p: Plan) -> None:
        """Release a plan's staging registration."""
        _, regs = self._staging.pop(id(p), (None, []))
        for reg in regs:
            self.agent.deregister_memory(reg)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for p, _ in list(self._staging.values()):
            self.forget(p)
        if self._own:  # a shared agent may still read from these peers for another cache
            for peer in self.peers.values():
                self.agent.remove_remote_agent(peer.agent)
        self.peers.clear()
        self.agent.deregister_memory(self._registered)


@dataclass(frozen=True)
class StatePeer:
    agent: str
    #: The source rank's state tensors by name.
    descriptions: dict[str, StateDescription]


class StateWorker(_Reads):
    """One rank's per-request state tensors (a hybrid model's conv and recurrent states, by
    name) registered with a NIXL agent, its own or `agent`, as Worker's caches are:

        prefill = StateWorker("prefill-0", {"conv": conv}, {"conv": remote.describe_state(conv, ...)})
        decode = StateWorker("decode-1", {"conv": mine}, {"conv": remote.describe_state(mine, ...)})
        decode.connect(prefill.handshake())     # one per source rank
        decode.pull(src_slots, dst_slots)       # each tensor's section shares, from the ranks holding them

    Every tensor moves by plan_state: a request's row, section by section. `pull` plans every
    tensor first: mismatched descriptions or slots are refused before any READ is posted."""

    def __init__(self, name: str, tensors: Mapping[str, Any], descriptions: Mapping[str, StateDescription],
                 agent: Any = None):
        self.tensors, self.descriptions = dict(tensors), dict(descriptions)
        _check_states(name, self.tensors, self.descriptions)
        self._own = agent is None
        self.agent = new_agent(name, 1) if agent is None else agent
        self.name = self.agent.name
        self.tp_rank, self.tp_size = _ranks(name, self.descriptions)
        self._registered = self.agent.register_memory(
            [(d.address, d.span, d.device_id, "") for d in self.descriptions.values()], "DRAM")
        self.peers: dict[int, StatePeer] = {}

    def handshake(self) -> bytes:
        """What the other side needs to read these state tensors (or to be read into them)."""
        return json.dumps({"agent": self.name, "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                           "states": {k: d.to_bytes().decode() for k, d in self.descriptions.items()}}).encode()

    def connect(self, handshake: bytes) -> dict[str, StateDescription]:
        """Accept a source rank's handshake: refused, naming both tensors, unless it holds the
        same named tensors, each able to move into this one's; returns its descriptions."""
        try:
            raw = json.loads(handshake)
            agent, metadata = raw["agent"], base64.b64decode(raw["metadata"])
            theirs = {k: StateDescription.from_bytes(v) for k, v in raw["states"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as why:
            raise KVLayoutError(f"not a kvgen NIXL state handshake: {why}") from why
        if set(theirs) != set(self.descriptions):
            raise KVLayoutError(f"{self.name}: {agent} holds the state tensors {sorted(theirs)}, this rank "
                                f"{sorted(self.descriptions)}")
        for k, d in theirs.items():
            check_state_pair(d, self.descriptions[k])
        rank, _ = _ranks(agent, theirs)
        self.agent.remove_remote_agent(agent)
        self.agent.add_remote_agent(metadata)
        self.peers[rank] = StatePeer(agent, theirs)
        return theirs

    def plan(self, src_slots: Any, dst_slots: Any) -> dict[str, tuple[Read, ...]]:
        """Each tensor's reads, from the connected source ranks into this rank's tensors."""
        if not self.peers:
            raise KVLayoutError(f"{self.name}: connect() to the source ranks before planning a read")
        return {k: plan_state([p.descriptions[k] for p in self.peers.values()], d, src_slots, dst_slots)
                for k, d in self.descriptions.items()}

    def pull(self, src_slots: Any, dst_slots: Any) -> dict[str, tuple[Read, ...]]:
        """Move request i's state from source slot src_slots[i] into destination slot
        dst_slots[i] (< 0 skips it) of every tensor: plan all (every refusal here, before a
        READ), post every read, wait."""
        reads = self.plan(src_slots, dst_slots)
        self.run(reads)
        return reads

    def run(self, reads: Mapping[str, Sequence[Read]]) -> None:
        """Post every read (one per tensor and source rank) at once and wait for them all."""
        if set(reads) != set(self.descriptions):
            raise KVLayoutError(f"{self.name}: reads for the tensors {sorted(reads)}, this rank holds "
                                f"{sorted(self.descriptions)}")
        self._wait([self._post(r.src_rank, r.src_descs, r.dst_descs) for rs in reads.values() for r in rs
                    if len(r.dst_descs)])

    def close(self) -> None:
        if self._own:
            for peer in self.peers.values():
                self.agent.remove_remote_agent(peer.agent)
        self.peers.clear()
        self.agent.deregister_memory(self._registered)


def _check_states(name: str, tensors: dict[str, Any], descriptions: dict[str, StateDescription]) -> None:
    if not descriptions or set(tensors) != set(descriptions):
        raise KVLayoutError(f"{name}: give one description per state tensor, by name (tensors {sorted(tensors)}, "
                            f"descriptions {sorted(descriptions)})")
    for k, t in tensors.items():
        if t.data_ptr() != descriptions[k].address:
            raise KVLayoutError(f"{name}: the description of {k!r} is not of this tensor ({descriptions[k]})")
    _check_regions(name, list(tensors.values()), [(d.address, d.span, d.device_id) for d in descriptions.values()])


def _check_regions(name: str, tensors: Sequence[Any], regions: Sequence[tuple[int, int, int]]) -> None:
    """Every region a worker registers lies in the tensor that starts there: a remote READ writes a
    registered region's bytes, so a description claiming more bytes than its tensor's view reaches is
    refused before anything is registered (a storage freed or shrunk since moves the tensor's address,
    which the callers' address check refuses)."""
    by_address = {t.data_ptr(): t for t in tensors}
    for address, nbytes, _ in regions:
        t = by_address[address]  # the callers matched every address to a tensor
        held = extent(t).hi - address
        if nbytes > held:
            raise KVLayoutError(f"{name}: the description registers {nbytes} bytes at {address:#x}, where the "
                                f"tensor's view holds {held} (shape {list(t.shape)}, strides {list(t.stride())}): "
                                "nothing was registered")


def _ranks(name: str, descriptions: dict[str, StateDescription]) -> tuple[int, int]:
    """The one TP rank and size every tensor of a worker is of."""
    found = {(d.tp_rank, d.tp_size) for d in descriptions.values()}
    if len(found) != 1:
        raise KVLayoutError(f"{name}: every state tensor of one worker must be of one TP rank, got {sorted(found)}")
    return found.pop()



__all__ = ["MODULE", "STREAMS", "Peer", "StatePeer", "StateWorker", "TransportError", "Worker", "api", "new_agent",
           "parts", "unavailable"]
