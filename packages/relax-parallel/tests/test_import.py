import relax_parallel


def test_package_imports() -> None:
    assert relax_parallel.__name__ == "relax_parallel"
