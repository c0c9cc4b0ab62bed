"""relax_core: see the package README for what it provides."""

__all__: list[str] = []
