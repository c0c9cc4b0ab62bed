"""The format warm-up cache: a cached result equals a fresh warm-up bit for bit, a hit starts no warm-up, and
every input the warm-up reads is in the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax_services.config import RunConfig, load_run_config
from relax_services.control import warmup_cache
from relax_services.control.warmup import format_warmup
from relax_services.control.warmup_cache import UNREAD_FIELDS, load_or_run, warmup_inputs, warmup_key
from relax_services.data.run_data import WarmupItem, prepare_data, warmup_items
from relax_services.models.checkpoint import resolve_source

SMALL = [
    "data.tasks=[image, text]",
    "data.train_per_task=6",
    "trainer.groups_per_step=2",
    "trainer.micro_batch_groups=2",
    "algorithm.group_size=2",
    "trainer.warmup_format_steps=3",
]


def _config(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_run_config(None, [*SMALL, f"run.output_dir={tmp_path}", *overrides])


def _items(cfg: RunConfig, run_dir: Path) -> tuple[list[WarmupItem], object]:
    # Each run folder gets its own copy of the synthetic files (other paths, the same bytes).
    data_dir = run_dir / "data_files"
    data_dir.mkdir(parents=True)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"data_dir": data_dir})})
    data = prepare_data(cfg, run_dir)
    return warmup_items(cfg), data.to_prompt


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:  # bitwise: equal values and dtypes, not "close"
        assert wa[name].dtype == wb[name].dtype and torch.equal(wa[name], wb[name]), name


def test_cached_warmup_equals_a_fresh_one_bitwise_and_a_hit_runs_nothing(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    cache = tmp_path / "cache"
    items, to_prompt = _items(cfg, tmp_path / "run1")
    calls: list[Path] = []

    def run(out: Path, items: list[WarmupItem], to_prompt: object) -> dict[str, object]:
        calls.append(out)
        return format_warmup(cfg, items, to_prompt, str(out), cfg.trainer.seed)

    first = tmp_path / "run1" / "warmup_model"
    info = load_or_run(cfg, items, first, lambda: run(first, items, to_prompt), cache=cache)
    assert info["cached"] is False and calls == [first]
    assert (cache / "warmup" / str(info["key"]) / "model.safetensors").is_file()

    # A second run folder writes its synthetic files anew (other paths, same bytes): a hit, no warm-up run. What
    # an interrupted warm-up left in its folder is replaced.
    items2, to_prompt2 = _items(cfg, tmp_path / "run2")
    second = tmp_path / "run2" / "warmup_model"
    second.mkdir()
    (second / "model.safetensors").write_bytes(b"torn")
    info2 = load_or_run(cfg, items2, second, lambda: run(second, items2, to_prompt2), cache=cache)
    assert info2["cached"] is True and calls == [first], "a cache hit must not run the warm-up"
    assert info2["key"] == info["key"] and info2["steps"] == info["steps"] == 3
    assert info2["path"] == str(second)
    assert sorted(p.name for p in second.iterdir()) == sorted(p.name for p in first.iterdir())

    fresh = tmp_path / "fresh"
    format_warmup(cfg, items2, to_prompt2, str(fresh), cfg.trainer.seed)
    _assert_bitwise_equal(second, fresh)
    start = load_file(str(resolve_source(cfg.model.source, cfg.model.seed) / "model.safetensors"))
    assert any(not torch.equal(start[k], v) for k, v in _weights(fresh).items()), "the warm-up did not train"

    # The fields left out of the key do not change the result: a warm-up with all of them changed is the same.
    unread = _config(
        tmp_path,
        "trainer.total_steps=7",
        "trainer.max_minutes=1",
        "trainer.minibatches=2",
        "trainer.ppo_epochs=3",
        "optimizer.lr=0.5",
        "optimizer.schedule=cosine",
        "optimizer.warmup_steps=2",
        "optimizer.min_lr_ratio=0.5",
        "rollout.top_p=0.5",
        "rollout.max_new_tokens=2",
    )
    assert warmup_key(warmup_inputs(unread, items2, resolve_source("tiny-omni"))) == info["key"]
    other = tmp_path / "unread"
    format_warmup(unread, items2, to_prompt2, str(other), unread.trainer.seed)
    _assert_bitwise_equal(other, fresh)


@pytest.fixture
def base(tmp_path: Path) -> tuple[RunConfig, list[WarmupItem], str]:
    cfg = _config(tmp_path)
    items, _ = _items(cfg, tmp_path / "run")
    return cfg, items, warmup_key(warmup_inputs(cfg, items, resolve_source(cfg.model.source, cfg.model.seed)))


def _key(cfg: RunConfig, items: list[WarmupItem]) -> str:
    return warmup_key(warmup_inputs(cfg, items, resolve_source(cfg.model.source, cfg.model.seed)))


@pytest.mark.parametrize(
    "override",
    [
        "trainer.warmup_format_steps=4",
        "trainer.warmup_lr=1e-3",
        "trainer.seed=1",
        "trainer.micro_batch_groups=1",
        "model.seed=1",
        "optimizer.betas=[0.8, 0.99]",
        "optimizer.eps=1e-6",
        "optimizer.weight_decay=0.05",
        "optimizer.grad_clip=0.5",
        "algorithm.group_size=4",
        "algorithm.loss_agg_mode=seq-mean-token-sum",
        "rollout.temperature=0.7",
    ],
)
def test_changing_a_config_input_changes_the_key(
    base: tuple[RunConfig, list[WarmupItem], str], tmp_path: Path, override: str
) -> None:
    _, items, key = base
    assert _key(_config(tmp_path, override), items) != key


@pytest.mark.parametrize("override", ["trainer.total_steps=7", "rollout.replicas=2", "staleness.tau=0"])
def test_fields_the_warmup_does_not_read_keep_the_key(
    base: tuple[RunConfig, list[WarmupItem], str], tmp_path: Path, override: str
) -> None:
    _, items, key = base
    assert _key(_config(tmp_path, override, "run.name=elsewhere"), items) == key


def test_every_field_of_the_read_sections_is_in_the_key_unless_listed_unread(
    base: tuple[RunConfig, list[WarmupItem], str],
) -> None:
    cfg, items, _ = base
    config = warmup_inputs(cfg, items, resolve_source("tiny-omni"))["config"]
    assert isinstance(config, dict)
    dumped = cfg.model_dump(mode="json")
    for section in warmup_cache.SECTIONS:
        unread = UNREAD_FIELDS.get(section, {})
        assert set(unread) <= set(dumped[section]), f"UNREAD_FIELDS[{section!r}] names a field that does not exist"
        assert config[section] == {k: v for k, v in dumped[section].items() if k not in unread}


def test_checkpoint_bytes_and_not_its_path_are_in_the_key(
    base: tuple[RunConfig, list[WarmupItem], str], tmp_path: Path
) -> None:
    _, items, key = base
    copy = tmp_path / "copy"
    shutil.copytree(resolve_source("tiny-omni"), copy)
    assert _key(_config(tmp_path, f"model.source={copy}"), items) == key  # same files elsewhere: same key
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.5}))
    assert _key(_config(tmp_path, f"model.source={copy}"), items) != key


def test_items_and_their_media_bytes_are_in_the_key(base: tuple[RunConfig, list[WarmupItem], str]) -> None:
    cfg, items, key = base
    assert _key(cfg, items[::-1]) != key  # the order the warm-up samples from
    changed = (items[0][0], items[0][1][:-1])
    assert _key(cfg, [changed, *items[1:]]) != key
    media = next(m for item, _ in items for m in item["item"].media)
    data = bytearray(Path(media.path).read_bytes())
    data[-1] ^= 1
    Path(media.path).write_bytes(bytes(data))
    assert _key(cfg, items) != key


def test_the_code_is_in_the_key(
    base: tuple[RunConfig, list[WarmupItem], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, items, key = base
    package = tmp_path / "src" / "warmup_code_probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(warmup_cache, "_CODE_PACKAGES", ("warmup_code_probe",))
    before = _key(cfg, items)
    (package / "__init__.py").write_text("X = 2\n")
    assert _key(cfg, items) != before
    monkeypatch.setattr(warmup_cache, "_LIBRARIES", ("torch", "pytest"))  # a library's version joins the key
    assert _key(cfg, items) not in (before, key)
