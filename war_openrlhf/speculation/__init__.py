"""Model-free speculative decoding from a global suffix index (SuffixDecoding, shared).

- :mod:`records`: validated completed-turn records.
- :mod:`log`: the sequence-numbered log replicas apply.
- :mod:`index`: :class:`GlobalSuffixIndex`, one replica per engine, on arctic-inference's C++ tree;
  its parts: :mod:`index_config` (knobs), :mod:`replica` (replicated state, applied in slices),
  :mod:`rebuild` (trees rebuilt from surviving records), :mod:`request_trees` (per-request
  trees), :mod:`index_file` (save/load).
- :mod:`proposers`: the drafters compared in benchmarks (none, vLLM ngram, vLLM per-engine suffix, WAR global).
"""

from .index import Draft, GlobalSuffixIndex, IndexFileError, SuffixIndexConfig
from .log import CompletedSequenceLog, LogEntry, LogTruncatedError
from .records import CompletedSequence, InflightChunk, as_token_array

__all__ = [
    "CompletedSequence",
    "CompletedSequenceLog",
    "InflightChunk",
    "Draft",
    "GlobalSuffixIndex",
    "IndexFileError",
    "LogEntry",
    "LogTruncatedError",
    "SuffixIndexConfig",
    "as_token_array",
]
