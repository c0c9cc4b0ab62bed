"""Devices in the run config: ``run.device`` resolution, GPU counts per role, dtypes, and the errors before start."""

from __future__ import annotations

import pytest

from relax_core import ConfigError
from relax_services.config import load_run_config
from relax_services.config.devices import (
    DeviceError,
    device_of,
    dtype_of,
    resolve_device,
    role_gpus,
    trainer_autocast,
    with_device,
)
from relax_services.engines.registry import RolloutEngineOptions
from relax_services.engines.torch import train_config
from relax_services.engines.trainer_plan import trainer_plan_text
from relax_services.engines.vllm import vllm_config
from relax_services.hosting.placement import check_cluster, run_processes

GPU = ["run.device=cuda"]


def test_auto_resolves_by_what_the_cluster_reports() -> None:
    assert resolve_device("auto", 0.0, source="Ray") == "cpu"
    assert resolve_device("auto", 2.0, source="Ray") == "cuda"
    assert resolve_device("cpu", 8.0, source="Ray") == "cpu"  # asked for the CPU: GPUs present change nothing
    assert resolve_device("cuda", 1.0, source="Ray") == "cuda"


def test_cuda_without_a_gpu_is_an_error_naming_the_field_and_the_reporter() -> None:
    with pytest.raises(DeviceError, match=r"run\.device='cuda', but Ray reports no GPU"):
        resolve_device("cuda", 0.0, source="Ray")


def test_a_cpu_run_reserves_nothing_and_computes_in_float32() -> None:
    cfg = load_run_config(None, ["run.device=cpu"])
    for role in ("trainer", "rollout", "reference", "critic", "eval", "reward"):
        assert role_gpus(cfg, role) == 0.0
        assert device_of(cfg, role) == "cpu"
        assert dtype_of(cfg, role) == "float32"
    assert all(slot.gpus == 0 and slot.group is None for slot in run_processes(cfg))
    train = train_config(cfg)
    assert (train.device, train.param_dtype) == ("cpu", "float32")
    assert "over gloo" in trainer_plan_text(load_run_config(None, ["run.device=cpu", "trainer.world_size=2"]))


def test_gpu_roles_read_bf16_and_the_trainer_keeps_fp32_master_weights() -> None:
    cfg = load_run_config(None, [*GPU, "eval.gpus=0", "critic.gpus=0.5"])
    assert {r: dtype_of(cfg, r) for r in ("trainer", "critic", "rollout", "reference", "eval")} == {
        "trainer": "float32",
        "critic": "float32",
        "rollout": "bfloat16",
        "reference": "bfloat16",
        "eval": "float32",  # eval.gpus=0: it decodes on the CPU
    }
    assert device_of(cfg, "eval") == "cpu" and device_of(cfg, "rollout") == "cuda"
    assert role_gpus(cfg, "critic") == 0.5 and role_gpus(cfg, "reward") == 0.0
    assert trainer_autocast(cfg) == "auto"  # bf16 autocast where the device supports it
    assert trainer_autocast(load_run_config(None, [*GPU, "trainer.dtype=float32"])) == "off"
    reference = train_config(cfg, "reference")
    assert (reference.device, reference.param_dtype) == ("cuda", "bfloat16")
    assert (train_config(cfg).device, train_config(cfg).param_dtype) == ("cuda", "float32")
    assert "over nccl" in trainer_plan_text(load_run_config(None, [*GPU, "trainer.world_size=2"]))


def test_an_explicit_dtype_wins_over_auto() -> None:
    cfg = load_run_config(None, [*GPU, "rollout.dtype=float32", "reference.dtype=float16"])
    assert dtype_of(cfg, "rollout") == "float32" and dtype_of(cfg, "reference") == "float16"


@pytest.mark.parametrize("value", ["-1", "1.5", "2.25"])
def test_gpu_counts_are_fractions_up_to_one_or_whole(value: str) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.gpus: a GPU count is a fraction up to 1"):
        load_run_config(None, [f"rollout.gpus={value}"])
    assert load_run_config(None, ["rollout.gpus=2"]).rollout.gpus == 2


def test_vllm_follows_the_rollout_gpus_and_dtype() -> None:
    gpu = vllm_config(load_run_config(None, [*GPU, "rollout.gpus=2"]), RolloutEngineOptions(), exported=False)
    assert (gpu.tensor_parallel_size, gpu.dtype, gpu.kv_cache_bytes, gpu.enforce_eager) == (2, "bfloat16", None, False)
    assert gpu.memory_fraction == 0.85 and not gpu.in_process  # two ranks: vLLM's workers are processes
    cpu = vllm_config(load_run_config(None, ["run.device=cpu"]), RolloutEngineOptions(), exported=False)
    assert (cpu.tensor_parallel_size, cpu.dtype, cpu.kv_cache_bytes, cpu.enforce_eager) == (
        1,
        "float32",
        256 * 2**20,
        True,
    )
    set_tp = load_run_config(None, [*GPU, "rollout.gpus=4", "rollout.vllm.tensor_parallel_size=2"])
    assert vllm_config(set_tp, RolloutEngineOptions(), exported=False).tensor_parallel_size == 2
    evaluator = vllm_config(
        load_run_config(None, [*GPU, "eval.gpus=0"]), RolloutEngineOptions(role="eval"), exported=False
    )
    assert evaluator.dtype == "float32" and evaluator.kv_cache_bytes is not None  # the Evaluator on the CPU


def test_processes_bundles_and_the_largest_count_of_a_host() -> None:
    cfg = load_run_config(None, [*GPU, "trainer.world_size=2", "rollout.gpus=0.5", "reference.gpus=0.25"])
    slots = {slot.process: slot for slot in run_processes(cfg)}
    assert list(slots) == ["trainer", "host-rollout-0-reward-reference-eval", "trainer-rank-0", "trainer-rank-1"]
    assert slots["trainer"].gpus == 0  # a group's driver: the ranks compute
    host = slots["host-rollout-0-reward-reference-eval"]
    assert (host.gpus, host.group, host.bundle, host.dtype) == (1.0, "roles", 0, "bfloat16")  # eval.gpus=1 is largest
    assert [(slots[f"trainer-rank-{r}"].group, slots[f"trainer-rank-{r}"].bundle) for r in (0, 1)] == [
        ("trainer", 0),
        ("trainer", 1),
    ]
    one = {s.process: s for s in run_processes(load_run_config(None, [*GPU, "run.hosts=[]", "rollout.replicas=2"]))}
    assert (one["trainer"].gpus, one["trainer"].group) == (1.0, "trainer")  # the torch engine computes in the service
    assert [one[f"rollout-{i}"].bundle for i in (0, 1)] == [0, 1] and one["reward"].gpus == 0


def test_the_cluster_check_names_fields_counts_and_what_ray_reports() -> None:
    cfg = load_run_config(
        None,
        [*GPU, "trainer.world_size=2", "rollout.replicas=3", "run.hosts=[]", "eval.gpus=0", "algorithm.kl_coef=0"],
    )
    with pytest.raises(DeviceError) as err:
        check_cluster(cfg, run_processes(cfg), 4.0)
    assert str(err.value).startswith(
        "the run asks for 5 GPUs (trainer.world_size=2 × trainer.gpus_per_rank=1 + rollout.replicas=3 × "
        "rollout.gpus=1), but Ray reports 4"
    )
    fits = load_run_config(
        None,
        [*GPU, "trainer.world_size=2", "rollout.replicas=2", "run.hosts=[]", "eval.gpus=0", "algorithm.kl_coef=0"],
    )
    check_cluster(fits, run_processes(fits), 4.0)
    shared = load_run_config(None, [*GPU, "trainer.world_size=2", "trainer.gpus_per_rank=0.5"])
    with pytest.raises(DeviceError, match=r"trainer\.gpus_per_rank=0\.5 with trainer\.world_size=2: .* NCCL"):
        check_cluster(shared, run_processes(shared), 8.0)
    one = [*GPU, "trainer.engine=fsdp", "trainer.world_size=1", "trainer.gpus_per_rank=0.5", "rollout.gpus=0.5"]
    alone = load_run_config(None, [*one, "reference.gpus=0.5", "eval.gpus=0.5"])  # one rank beside the rollout host
    check_cluster(alone, run_processes(alone), 1.0)
    host = load_run_config(None, [*GPU, "reference.gpus=2"])
    with pytest.raises(
        DeviceError,
        match=r"host-rollout-0-reward-reference-eval \(the largest of rollout\.gpus, "
        r"reference\.gpus, eval\.gpus\) 2",
    ):
        check_cluster(host, run_processes(host), 2.0)


def test_with_device_sets_only_the_device() -> None:
    cfg = load_run_config(None, [])
    assert cfg.run.device == "auto"
    resolved = with_device(cfg, "cuda")
    assert resolved.run.device == "cuda" and resolved.model_copy(update={"run": cfg.run}) == cfg
