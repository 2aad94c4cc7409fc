"""Durable state on local disk: files replaced atomically and the final-on-failure rule of
fsyncs (``files``), and the one segment log every role's log of records is built on
(``segmentlog``)."""
