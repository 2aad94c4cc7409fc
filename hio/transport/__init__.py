"""How roles talk: gRPC servers and channels (``net``), the error table (``errors``), tuples
cut into frames and verified (``frames``), the payload lane and the one payload channel per
peer (``lane``, ``payload``), retries, route tickets and TLS certificates."""
