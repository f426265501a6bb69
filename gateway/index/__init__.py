"""The replicas' cache contents in memory, mirrored from Redis.

``block_index`` is the pure data structure (block hash → replicas holding it, and the gateway's
own predictions); ``mirror`` keeps it exact: it subscribes to the replicas' event streams,
bootstraps from their blocks sets (``snapshots``) and detects gaps in a stream (``streams``).
Apart from that: ``drains`` (the drain set every gateway shares), ``pruning`` (what crashed
replicas left in Redis) and ``metrics`` (``kvroute_index_*``).
"""
