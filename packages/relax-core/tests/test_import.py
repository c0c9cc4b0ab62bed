import relax_core


def test_package_imports() -> None:
    assert relax_core.__name__ == "relax_core"
