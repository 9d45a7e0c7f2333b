"""kvgen.remote plans carried out by NIXL (`pip install --no-deps nixl-cu12`): register a
rank's cache, exchange descriptions, post the READs, wait, run the staging permutes.

    prefill = Worker("prefill-0", caches, remote.describe(caches, "NHD", tp_rank=0, tp_size=2))
    decode = Worker("decode-1", dst, remote.describe(dst, "HND", tp_rank=1, tp_size=4))
    decode.connect(prefill.handshake())        # bytes: send them any way (a socket, a pipe)
    decode.pull(src_slots, dst_slots)          # every READ posted, waited for, then the permutes

A worker holds one NIXL agent (UCX backend, DRAM). `pull` plans first: mismatched
descriptions, slots or strategies are refused before any READ is posted, and nothing is
written. The handshake is JSON: the agent's name, its NIXL metadata and the description.
"""

from __future__ import annotations

import base64
import importlib
import json
import time
from dataclasses import dataclass
from typing import Any

from kvgen.errors import KVGenError
from kvgen.remote import CacheDescription, Costs, Plan, check_pair, plan
from kvgen.runtime.binding import leaves
from kvgen.runtime.errors import KVLayoutError

#: The module NIXL's CUDA 12 wheel installs (CPU DRAM transfers work without a GPU).
MODULE = "nixl_cu12._api"
#: Seconds a pull waits for its READs before giving up.
TIMEOUT = 120.0


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


@dataclass(frozen=True)
class Peer:
    agent: str
    description: CacheDescription


class Worker:
    """One rank's cache registered with a NIXL agent: its own (named `name`), or `agent`, one
    the caller made and keeps (several caches may share one: an agent costs ~0.5 s to start)."""

    def __init__(self, name: str, caches: Any, description: CacheDescription, agent: Any = None):
        found = tuple(t.data_ptr() for t in leaves(caches))
        if found != description.leaves:
            raise KVLayoutError(f"{name}: the description is not of these caches ({description})")
        nixl = api()
        self.name, self.caches, self.description = name, caches, description
        self._own = agent is None
        self.agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"])) if agent is None else agent
        self.name = self.agent.name
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
        stays registered until forget(plan) or close())."""
        if p.dst != self.description:
            raise KVLayoutError(f"{self.name}: the plan is for another cache ({p.dst})")
        if p.staging and id(p) not in self._staging:
            self._staging[id(p)] = (p, [self.agent.register_memory(leaves(st.caches)) for st in p.staging])
        handles = [self._post(r.src_rank, r.src_descs, r.dst_descs) for r in p.reads if len(r.dst_descs)]
        self._wait(handles)
        p.finish(self.caches)

    def forget(self, p: Plan) -> None:
        """Release a plan's staging registration."""
        _, regs = self._staging.pop(id(p), (None, []))
        for reg in regs:
            self.agent.deregister_memory(reg)

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

    def close(self) -> None:
        for p, _ in list(self._staging.values()):
            self.forget(p)
        if self._own:  # a shared agent may still read from these peers for another cache
            for peer in self.peers.values():
                self.agent.remove_remote_agent(peer.agent)
        self.peers.clear()
        self.agent.deregister_memory(self._registered)


__all__ = ["MODULE", "Peer", "TransportError", "Worker", "api", "unavailable"]
