"""What the tests and the benchmarks in bench/ share: starting `kernelmode serve` (``server``),
reading /proc (``procfs``), a local package index, an external Kernel Gateway, a Jupyter
Server on a gateway, the Enterprise Gateway rig (``cluster``).

The one place both sides meet: bench/ imports ``tests.support`` and nothing else of tests/,
tests/ import nothing of bench/ (tests/unit/test_import_graph.py checks both). Modules here
hold no tests and no fixtures; they import nothing of tests/ outside this package."""
