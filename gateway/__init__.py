"""The routing gateway: a drop-in OpenAI base URL in front of the replicas (HTTP app not built yet).

So far: ``block_index`` (block hash → bitmask of replicas, prefix lookups) and ``index_mirror``
(that index kept in sync with the replicas' Redis heartbeats, block sets and event streams).
It must never import torch, directly or through a package ``__init__``.
"""
