"""KV memory: the request table, slot allocators, the K/V pools and the hybrid (full + SWA) layer."""

from swaserve.memory.allocator import TokenToKVPoolAllocator
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.planner import MemoryPlan, plan_memory
from swaserve.memory.req_to_token import ReqToTokenPool
from swaserve.memory.swa import SWAKVPool, SWATokenToKVPoolAllocator
from swaserve.memory.window import SWAEvictor

__all__ = [
    "KVPool",
    "MemoryPlan",
    "ReqToTokenPool",
    "SWAEvictor",
    "SWAKVPool",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "plan_memory",
]
