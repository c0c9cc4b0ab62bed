"""relax_queue: see the package README for what it provides."""

__all__: list[str] = []
