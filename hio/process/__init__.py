"""Process tools every role uses: child ``hio`` processes (``procs``), structured logging
(``log``) and memory tuning at start (``memory``)."""
