"""Benchmarks and the soak test. They run from a source checkout (``make bench``,
``hio bench``, ``hio bench-core``, ...) and are not part of the installed package."""
