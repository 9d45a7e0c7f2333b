"""Disaggregated prefill/decode transfers: describe a worker's cache, plan the wire transfer.

    from kvgen import remote
    mine = remote.describe(caches, "vllm_flash_attn_nhd", tp_rank=1, tp_size=4)
    wire = mine.to_bytes()                       # a few hundred bytes for the handshake
    theirs = remote.CacheDescription.from_bytes(data)
    p = remote.plan([theirs, ...], mine, src_slots, dst_slots)   # reads + local permutes
    ...  # post p.reads (src_descs -> dst_descs) on a transport, wait, then p.finish(caches)

kvgen.integrations.nixl runs a plan over NIXL. docs/remote.md describes the handshake, the
plan and the strategies.
"""

from kvgen.remote.cost import Costs, costs
from kvgen.remote.describe import CacheDescription, check_pair, describe, digest, empty, layout_of
from kvgen.remote.plan import STRATEGIES, Plan, Read, Staging, group_cut, plan
from kvgen.remote.stamps import check_loads, check_stamp, stamp
from kvgen.remote.state import StateDescription, check_state_pair, describe_state, plan_state

__all__ = ["STRATEGIES", "Costs", "CacheDescription", "Plan", "Read", "Staging", "StateDescription", "check_loads",
           "check_pair", "check_stamp", "check_state_pair", "costs", "describe", "describe_state", "digest", "empty",
           "group_cut", "layout_of", "plan", "plan_state", "stamp"]
