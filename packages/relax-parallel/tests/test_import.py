import relax_parallel


def test_public_api_is_exported() -> None:
    missing = [name for name in relax_parallel.__all__ if not hasattr(relax_parallel, name)]
    assert missing == []
    assert "ParallelPlan" in relax_parallel.__all__
