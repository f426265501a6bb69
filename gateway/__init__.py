"""The routing gateway: a drop-in OpenAI base URL in front of the replicas (not built yet).

It must never import torch, directly or through a package ``__init__``.
"""
