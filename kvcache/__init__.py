"""kvcache: paged KV block accounting (pure Python) and, in separate modules, MLX storage.

Importing this package loads only the pure-Python accounting (blocks, hashing, manager): it never
imports mlx. The MLX halves, `kvcache.storage`, `kvcache.attention` and `kvcache.quantized` (the int8
row format), are imported explicitly by the runner.
"""

from kvcache.blocks import BlockPool, FreeBlockQueue, KVCacheBlock
from kvcache.hashing import BlockHash, extend_block_hashes, hash_block_tokens
from kvcache.manager import KVCacheManager, KVSequence

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVSequence",
    "extend_block_hashes",
    "hash_block_tokens",
]
