"""The benchmarks' own unit tests (pytest collects bench/selftest next to tests/): the scripts in
bench/ import each other as scripts do (`import harness`), so bench/ goes on sys.path first."""

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1])
if BENCH not in sys.path:
    sys.path.append(BENCH)
