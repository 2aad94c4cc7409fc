"""HarmonicIO: stream large scientific tuples to processing engines, store
their features, and keep a live preview of what the data says.

Roles are subpackages: ``hio.gateway``, ``hio.master``, ``hio.worker``,
``hio.repository``, ``hio.kd``; the wire contract is ``hio.proto``. Code
shared by several roles is grouped by subject: ``hio.config`` and ``hio.settings``
(every role's configuration), ``hio.transport`` (how roles talk), ``hio.storage``
(durable state on disk) and ``hio.process`` (process tools). The command line is
``hio``.
"""

__version__ = "0.1.0"
