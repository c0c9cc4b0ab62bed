import relax_queue


def test_package_imports() -> None:
    assert relax_queue.__name__ == "relax_queue"
