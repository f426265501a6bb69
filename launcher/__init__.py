"""The ``kvroute`` command and ``kvroute up``: on top of the gateway and the replicas, it starts them."""
