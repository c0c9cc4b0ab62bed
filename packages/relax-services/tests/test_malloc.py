"""The C heap helpers: callable everywhere, effective on glibc."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from relax_services._malloc import limit_arenas, release_free_memory

GLIBC = platform.libc_ver()[0] == "glibc" and ctypes.util.find_library("c") is not None


def test_release_answers_a_bool_and_never_raises() -> None:
    assert isinstance(release_free_memory(), bool)


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_the_arena_cap_is_accepted_by_glibc() -> None:
    assert limit_arenas(8) is True  # a cap of 8 heaps for this test process: only bounds its later threads
