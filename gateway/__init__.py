"""The routing gateway: a drop-in OpenAI base URL in front of the replicas.

``app`` is the HTTP face; ``tokenizers`` produces the ids the replicas will see (cached across a
chat's turns); ``block_index`` and ``index_mirror`` keep the replicas' cache contents in memory from
Redis; ``routing`` and ``policies`` choose a replica; ``proxy`` and ``upstream`` forward to it;
``health``, ``auth``, ``admin`` and ``metrics`` do what they say. It must never import torch,
directly or through a package ``__init__``.
"""
