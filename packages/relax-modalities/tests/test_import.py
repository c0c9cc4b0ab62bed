import relax_modalities


def test_package_imports() -> None:
    assert relax_modalities.__name__ == "relax_modalities"
