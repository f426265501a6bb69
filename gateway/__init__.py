"""The routing gateway: a drop-in OpenAI base URL in front of the replicas.

The modules in the order a request meets them:

- ``auth``: who may call it (Bearer keys, checked before any handler);
- ``app``: the HTTP face: routes, lifespan, and the wiring of the parts below;
- ``pipeline``: a generation request's path: parse, tokenize, plan, dispatch, relay;
- ``tokenizer_registry``: the ids the replicas will see (their own tokenizer, cached across a
  chat's turns);
- ``fleet``: every replica, one record each (``fleet.replica``): where it came from, ejected or
  drained, in flight, stats; and which are routable for a model (``fleet.fleet``);
- ``index``: the replicas' cache contents in memory (``index.block_index``), mirrored from Redis
  (``index.mirror``), with the shared drain set and the pruning of crashed replicas apart;
- ``routing``: from prompt and roster to a plan (load, index lookup), over ``policies``;
- ``proxy``: forwarding to the chosen replica (``proxy.relay``) over the HTTP client
  (``proxy.upstream``, ``proxy.connection``).

Beside the request path: ``health`` (probing ejected replicas back, discovering static ones),
``admin`` (``/admin``), ``metrics`` (Prometheus), ``settings`` and ``cli`` (what a gateway can be
told). It must never import torch, directly or through a package ``__init__``.
"""
