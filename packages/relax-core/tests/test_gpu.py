"""The math on CUDA tensors gives the CPU results (run with ``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

import relax_core as rc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("preset", rc.PRESET_NAMES)
def test_losses_and_advantages_match_cpu(preset: str) -> None:
    gen = torch.Generator().manual_seed(0)
    b, t = 8, 6
    old = -torch.rand(b, t, generator=gen)
    logp = old + 0.2 * torch.randn(b, t, generator=gen)
    prox = old + 0.1 * torch.randn(b, t, generator=gen)
    ref = old - 0.1
    values = torch.randn(b, t, generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.2).float()
    scores = torch.randint(0, 2, (b,), generator=gen).float()
    groups = [i // 4 for i in range(b)]
    cfg = rc.load_preset(preset, {"decoupled": True, "tis_cap": 2.0, "mis_level": "sequence", "entropy_coef": 0.01})
    entropy = torch.rand(b, t, generator=gen)

    def run(device: str) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        def d(x: torch.Tensor) -> torch.Tensor:
            return x.to(device)

        adv = rc.compute_advantages(
            cfg,
            d(scores),
            d(mask),
            group_ids=groups,
            values=d(values),
            old_logprobs=d(old),
            proximal_logprobs=d(prox),
            ref_logprobs=d(ref),
        ).advantages
        loss, diag = rc.compute_policy_loss(
            cfg, d(logp), d(old), adv, d(mask), proximal_logprobs=d(prox), ref_logprobs=d(ref), entropy=d(entropy)
        )
        return loss.cpu(), diag, adv.cpu()

    loss_cpu, diag_cpu, adv_cpu = run("cpu")
    loss_gpu, diag_gpu, adv_gpu = run("cuda")
    torch.testing.assert_close(adv_gpu, adv_cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss_gpu, loss_cpu, rtol=1e-4, atol=1e-5)
    assert diag_gpu.keys() == diag_cpu.keys()
    for key, value in diag_cpu.items():
        assert diag_gpu[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
