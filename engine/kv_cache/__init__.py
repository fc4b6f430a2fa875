"""Paged KV cache: sink + sliding-window block tables over one preallocated pool."""

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_table import BranchBlockTable
from engine.kv_cache.cross_cache import CrossAttentionCache
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import KVSpec
from engine.kv_cache.state import SessionKVState

__all__ = ["BlockPool", "BranchBlockTable", "CrossAttentionCache", "KVCacheManager", "KVSpec", "SessionKVState"]
