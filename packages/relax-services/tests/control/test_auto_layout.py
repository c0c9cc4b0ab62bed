"""``trainer.layout=auto``: the planner's layout (among those the FSDP group executes) becomes the run config's
degrees, from the model's config, the first training rows and the devices; an explicit degree wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_modalities import ChatMessage, ContentPart, DataRecord
from relax_parallel import ClusterSpec, InfeasiblePlanError, enumerate_configs, load_model_spec, training_memory
from relax_services.config import RunConfig, load_run_config
from relax_services.control.auto_layout import data_workload, first_records, layout_text, plan_layout, realisable
from relax_services.engines.trainer_plan import trainer_layout
from relax_services.models.tiny_omni import tiny_omni_checkpoint

LONG = 3000  # prompt characters: one token each under the tiny tokenizer
AUTO = [
    "trainer.world_size=2",
    "trainer.layout=auto",
    "rollout.max_new_tokens=4096",
    "trainer.groups_per_step=2",
    "algorithm.group_size=2",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return tiny_omni_checkpoint(0)


def _text_rows(n: int = 4) -> list[DataRecord]:
    message = ChatMessage("user", (ContentPart("text", text="1" * LONG),))
    return [DataRecord(source="long.jsonl", row=i, messages=(message,)) for i in range(n)]


def _need(cfg: RunConfig, folder: Path, cp: int) -> float:
    """The least memory per rank of the executable 2-rank layouts with this sp degree, by the cost model."""
    model = load_model_spec(folder / "config.json")
    workload = data_workload(cfg, _text_rows(), folder)
    ok = realisable(model, {})
    cluster = ClusterSpec(num_gpus=2, gpus_per_node=2)
    return min(
        training_memory(model, workload, c, "text").total
        for c in enumerate_configs(model, workload, cluster, 2)
        if ok(c) and c.cp == cp
    )


def _cluster_between(cfg: RunConfig, folder: Path) -> ClusterSpec:
    """Devices with room for sp = 2 (half of each sequence per rank) but not for sp = 1."""
    one, two = _need(cfg, folder, 1), _need(cfg, folder, 2)
    assert two < one  # halving the sequence halves the activations
    usable = (one + two) / 2
    return ClusterSpec(num_gpus=2, gpus_per_node=2, gpu_memory_gib=usable / 0.9 / 2**30)


def test_the_workload_is_read_from_the_first_rows(folder: Path) -> None:
    cfg = load_run_config(None, AUTO)
    workload = data_workload(cfg, _text_rows(), folder)
    assert workload.modality_mix == {"text": 1.0}
    assert workload.prompt_tokens == LONG
    assert workload.max_response_tokens == 4096 and workload.samples_per_step == 4
    # The default data: the synthetic tasks' files, interleaved, every modality present.
    mix = data_workload(cfg, first_records(cfg), folder).modality_mix
    assert set(mix) == {"text", "image", "audio", "video"} and sum(mix.values()) == pytest.approx(1.0)


def test_small_devices_get_sequence_parallelism_and_the_config_carries_it(folder: Path) -> None:
    cfg = load_run_config(None, AUTO)
    resolved, plan = plan_layout(cfg, folder, _text_rows(), _cluster_between(cfg, folder))
    assert plan is not None and (plan.dp, plan.cp, plan.tp) == (1, 2, 1)
    assert (resolved.trainer.sequence_parallel, resolved.trainer.tensor_parallel) == (2, 1)
    layout = trainer_layout(resolved)  # what the Trainer group builds its mesh from
    assert (layout.dp, layout.cp, layout.tp) == (1, 2, 1)
    text = layout_text(resolved, plan)
    assert "mesh       (pp, dp, cp, tp) = (1, 1, 2, 1)" in text
    assert "layout chosen by relax-parallel (trainer.layout=auto): tp=1 sp(cp)=2 dp=1" in text
    assert "binding: memory" in text


def test_roomy_devices_keep_data_parallelism(folder: Path) -> None:
    cfg = load_run_config(None, AUTO)
    roomy = ClusterSpec(num_gpus=2, gpus_per_node=2, gpu_memory_gib=80)
    resolved, plan = plan_layout(cfg, folder, _text_rows(), roomy)
    assert plan is not None and (plan.dp, plan.cp, plan.tp) == (2, 1, 1)
    assert resolved.trainer.sequence_parallel == 1


def test_an_explicit_degree_wins_over_the_planner(folder: Path) -> None:
    cfg = load_run_config(None, AUTO)
    tight = _cluster_between(cfg, folder)
    given = load_run_config(None, [*AUTO, "trainer.sequence_parallel=1"])
    with pytest.raises(InfeasiblePlanError, match="does not fit"):  # sp = 1 is kept, and it does not fit
        plan_layout(given, folder, _text_rows(), tight)
    both = load_run_config(None, [*AUTO, "trainer.sequence_parallel=1", "trainer.tensor_parallel=1"])
    assert plan_layout(both, folder, _text_rows(), tight) == (both, None)
    fixed = load_run_config(None, ["trainer.world_size=2", "trainer.layout=given"])
    assert plan_layout(fixed, folder, _text_rows(), tight) == (fixed, None)
