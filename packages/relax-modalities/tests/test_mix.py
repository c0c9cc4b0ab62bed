"""Task-weighted mixing: proportions follow the weights, weights can change, resume is exact."""

from collections import Counter
from pathlib import Path

import pytest

from relax_modalities import build_task_mix_loader
from relax_modalities.synthetic import TaskItem
from relax_modalities.text import TinyTokenizer


def _text_items() -> list[TaskItem]:
    # Text-only items keep these tests fast; tasks are just labels for the mixer.
    items = []
    for task in ("a", "b", "c"):
        for i in range(5):
            items.append(TaskItem(id=f"{task}-{i}", task=task, prompt=f"{i}+1=", answer=str(i + 1), options=("1",)))
    return items


def _take(loader, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    it = iter(loader)
    return [next(it).item.id for _ in range(n)]


def test_draws_follow_the_weights_and_cycle_each_task() -> None:
    loader = build_task_mix_loader(_text_items(), TinyTokenizer(), {"a": 0.8, "b": 0.2}, seed=1)
    ids = _take(loader, 400)
    counts = Counter(i.split("-")[0] for i in ids)
    assert "c" not in counts  # weight 0 is never drawn
    assert 0.72 < counts["a"] / 400 < 0.88  # 0.8 ± 4 standard deviations (0.02)
    a_ids = [i for i in ids if i.startswith("a")]
    assert sorted(a_ids[:5]) == [f"a-{k}" for k in range(5)]  # each task walks through all its items per pass
    assert loader.task_weights == pytest.approx({"a": 0.8, "b": 0.2, "c": 0.0})


def test_changing_weights_reaches_the_consumer() -> None:
    loader = build_task_mix_loader(_text_items(), TinyTokenizer(), {"a": 1.0}, prefetch=2, seed=2)
    it = iter(loader)
    first = [next(it).item.task for _ in range(20)]
    loader.set_task_weights({"c": 1.0})
    later = [next(it).item.task for _ in range(60)]
    assert set(first) == {"a"}
    assert later[-30:] == ["c"] * 30  # after the prefetched samples drain, only c
    with pytest.raises(ValueError, match="unknown tasks"):
        loader.set_task_weights({"z": 1.0})
    with pytest.raises(ValueError, match="not all 0"):
        loader.set_task_weights({"a": 0.0})


def test_resume_is_exact(tmp_path: Path) -> None:
    tok = TinyTokenizer()
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    reference = _take(build_task_mix_loader(_text_items(), tok, weights, seed=3), 60)
    first = build_task_mix_loader(_text_items(), tok, weights, seed=3)
    head = _take(first, 23)
    state = first.state_dict()
    resumed = build_task_mix_loader(_text_items(), tok, weights, seed=3, num_workers=1)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 37) == reference
