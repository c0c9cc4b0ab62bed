"""``relax bench pipeline|train|trl`` and ``relax chaos``: measured side-by-side comparisons, imported only by the
CLI."""
