"""The weight publish benchmark's per-version table: each store's ratios to the plain copy beside it."""

from __future__ import annotations

from relax_services.bench.weight_publish import VersionSeries, format_versions


def test_the_table_prints_each_version_against_its_own_copy() -> None:
    fresh = VersionSeries(
        "fresh", [0.5, 0.3, 0.3, 0.25], [0.05, 0.06, 0.05, 0.05], [0.4, 0.3, 0.3, 0.2], [0.05] * 4, 2e9
    )
    reused = VersionSeries("reused", [0.5, 0.05, 0.06], [0.1, 0.05, 0.04], [0.5, 0.05, 0.05], [0.1, 0.05, 0.05], 3e9)
    lines = format_versions([fresh, reused]).splitlines()
    assert lines[1] == "1 | 0.500 / 0.050 (10.0x), 8.0x | 0.500 / 0.100 (5.0x), 5.0x"
    assert lines[3] == "3 | 0.300 / 0.050 (6.0x), 6.0x | 0.060 / 0.040 (1.5x), 1.0x"
    assert lines[4] == "4 | 0.250 / 0.050 (5.0x), 4.0x | "  # the shorter series leaves its cell empty
    # versions 1-3 medians: fresh wall (10, 5, 6) -> 6.0, later (5.0); reused has no later versions: all three.
    assert lines[5].startswith("fresh: wall versions 1-3 median 6.0x, later median 5.0x (max 5.0x); CPU")
    assert lines[6].startswith("reused: wall versions 1-3 median 1.5x, later median 1.5x (max 5.0x)")
    assert lines[6].endswith("resident after the last 3000 MB")
