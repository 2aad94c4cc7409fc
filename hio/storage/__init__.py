"""Durable state on local disk: files replaced atomically and the fsync budget (``files``),
and the one segment log every role's log of records is built on (``segmentlog``)."""
