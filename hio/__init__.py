"""HarmonicIO: stream large scientific tuples to processing engines, store
their features, and keep a live preview of what the data says.

Roles are subpackages: ``hio.gateway``, ``hio.master``, ``hio.worker``,
``hio.repository``, ``hio.kd``; the wire contract is ``hio.proto``; code
shared by several roles is ``hio.common``. The command line is ``hio``.
"""

__version__ = "0.1.0"
