"""The replicas this gateway routes to: one record per replica (``replica``), and the fleet of them
(``fleet``) that says which are routable for a model."""
