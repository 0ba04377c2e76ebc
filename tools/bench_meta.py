"""The benchmarks' name for shardlab_commands/provenance.py (what a figure was measured with), which moved into the
package because shardlab-evaluate --out records it too. This module is that one (``import bench_meta`` and ``from
tools import bench_meta`` alike), so a test's monkeypatch reaches the code that reads it."""

import sys

from shardlab_commands import provenance

sys.modules[__name__] = provenance
