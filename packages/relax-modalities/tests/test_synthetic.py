"""Synthetic tasks: real files whose content determines the answer, determinism, rewards, speed."""

import hashlib
import time
from collections import Counter
from pathlib import Path

import decord
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from relax_modalities import load_audio
from relax_modalities.synthetic import (
    TASKS,
    TaskItem,
    chance_level,
    exact_match_reward,
    read_manifest,
    reward,
    write_synthetic_tasks,
)
from relax_modalities.text import TinyTokenizer

PALETTE = {"r": (220, 30, 30), "g": (30, 200, 40), "b": (30, 60, 230), "y": (230, 220, 30)}


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.*"))}


def test_generation_is_seeded_and_deterministic(tmp_path: Path) -> None:
    a = write_synthetic_tasks(tmp_path / "a", n_per_task=3, seed=5)
    b = write_synthetic_tasks(tmp_path / "b", n_per_task=3, seed=5)
    c = write_synthetic_tasks(tmp_path / "c", n_per_task=3, seed=6)
    assert _digest(a.parent) == _digest(b.parent)
    assert [i.answer for i in read_manifest(a)] != [i.answer for i in read_manifest(c)]
    # An item does not depend on which other tasks are generated with it.
    only_text = write_synthetic_tasks(tmp_path / "t", tasks=("text",), n_per_task=3, seed=5)
    assert [i.prompt for i in read_manifest(only_text)] == [i.prompt for i in read_manifest(a) if i.task == "text"]


def test_items_are_well_formed(synthetic_items: list[TaskItem]) -> None:
    tok = TinyTokenizer()
    assert {i.task for i in synthetic_items} == set(TASKS)
    for it in synthetic_items:
        tok.encode(it.prompt)  # raises on characters outside the tiny vocabulary
        tok.encode(it.answer)
        assert 1 <= len(it.answer) <= 3 and it.answer in it.options
        assert chance_level(it) == pytest.approx(it.chance) == pytest.approx(1 / len(it.options))
        assert all(Path(m.path).is_file() for m in it.media)


def test_rewards_are_exact_match_on_stripped_response(synthetic_items: list[TaskItem]) -> None:
    it = synthetic_items[0]
    wrong = next(o for o in it.options if o != it.answer)
    assert reward(f" {it.answer}\n", it) == 1.0 == exact_match_reward(it.answer, it) == exact_match_reward("7 ", "7")
    assert reward(wrong, it) == 0.0 and reward(it.answer + it.answer, it) == 0.0
    with pytest.raises(KeyError, match="no reward function"):
        reward("x", TaskItem(id="z", task="nope", prompt="?"))


def _direction(path: str) -> str:
    frames = decord.VideoReader(path, num_threads=1).get_batch([0, 3]).asnumpy().astype(float).sum(-1)
    cy, cx = [], []
    for f in frames:
        ys, xs = np.nonzero(f > f.mean())  # the bright square
        cy.append(ys.mean())
        cx.append(xs.mean())
    dy, dx = cy[1] - cy[0], cx[1] - cx[0]
    return ("d" if dy > 0 else "u") if abs(dy) > abs(dx) else ("r" if dx > 0 else "l")


def _pitch(x: np.ndarray, names: tuple[str, ...], freqs: tuple[float, ...]) -> str:
    peak = np.argmax(np.abs(np.fft.rfft(x[:16000]))) * 16000 / 16000
    return names[int(np.argmin([abs(np.log(peak / f)) for f in freqs]))]


@pytest.mark.parametrize("difficulty", [0, 2])
def test_answers_are_recoverable_from_the_files(tmp_path: Path, difficulty: int) -> None:
    from relax_modalities import extract_audio_track

    items = read_manifest(write_synthetic_tasks(tmp_path, n_per_task=6, seed=11, difficulty=difficulty))
    pitches = (("l", "h"), (250.0, 2000.0)) if difficulty == 0 else (("1", "2", "3", "4"), (250.0, 500.0, 1e3, 2e3))
    for it in items:
        if it.task == "image":
            px = np.asarray(Image.open(it.media[0].path).convert("RGB")).reshape(-1, 3).astype(float)
            sat = px.max(1) - px.min(1)
            colour = px[sat > 100].mean(0)  # the saturated pixels are the coloured block
            got = min(it.options, key=lambda k: float(np.abs(colour - PALETTE[k]).sum()))
        elif it.task == "audio":
            got = _pitch(load_audio(it.media[0].path), *pitches)
        elif it.task == "video":
            got = _direction(it.media[0].path)
        elif it.task == "text":
            a, b = it.prompt.rstrip("=").split("+")
            got = str(int(a) + int(b))
        else:
            track = extract_audio_track(it.media[0].path)
            assert track is not None
            got = _direction(it.media[0].path) + _pitch(track, ("l", "h"), (250.0, 2000.0))
        assert got == it.answer, it


@pytest.mark.parametrize("difficulty", [0, 1])
def test_text_answers_are_balanced_so_the_majority_answer_scores_chance(tmp_path: Path, difficulty: int) -> None:
    items = read_manifest(write_synthetic_tasks(tmp_path, ("text",), n_per_task=1900, seed=3, difficulty=difficulty))
    counts = Counter(it.answer for it in items)
    assert set(counts) == set(items[0].options)  # every sum occurs
    # Uniform over the options: each count is within 5 binomial standard deviations of n × chance.
    n, p = len(items), items[0].chance
    assert max(abs(c - n * p) for c in counts.values()) < 5 * (n * p * (1 - p)) ** 0.5


def test_generation_is_fast(tmp_path: Path) -> None:
    start = time.perf_counter()
    write_synthetic_tasks(tmp_path, n_per_task=20, seed=1)
    per_minute = 100 / (time.perf_counter() - start) * 60
    assert per_minute > 1000, per_minute  # measured ≈ 5,500/min on one busy core


def test_unknown_task_and_audio_formats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown synthetic task"):
        write_synthetic_tasks(tmp_path, tasks=("smell",))
    items = read_manifest(write_synthetic_tasks(tmp_path, tasks=("audio",), n_per_task=2))
    rates = [sf.info(it.media[0].path).samplerate for it in items]
    assert rates == [16000, 24000]  # WAV at 16 kHz, FLAC at 24 kHz (exercises resampling)
