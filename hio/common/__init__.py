"""Code shared by several roles: configuration, gRPC servers and channels,
the error table, tuple framing and checksums, logging. Nothing role-specific."""
