import relax_services


def test_package_imports() -> None:
    assert relax_services.__name__ == "relax_services"
