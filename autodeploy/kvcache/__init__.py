"""The KV-cache mechanism: page-pool layout, block allocation and per-step batch metadata."""

from .metadata import METADATA_INPUTS, BatchMetadata, SequenceChunk
from .pool import KVCacheSpec, KVPool

__all__ = ["METADATA_INPUTS", "BatchMetadata", "SequenceChunk", "KVCacheSpec", "KVPool"]
