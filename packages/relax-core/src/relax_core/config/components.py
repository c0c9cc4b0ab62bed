"""Component configs owned by relax-core: algorithm, optimizer, staleness (the reward runner's config is in
``rewards/runner.py``).

Each is a small :class:`~relax_core.ConfigModel`; every field carries its default and a docstring.
relax-services composes its run config from these plus its own service configs.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import pydantic
from pydantic_core import PydanticCustomError

from relax_core._names import KLEstimator, LossAggMode
from relax_core.algorithms.table import ALGORITHMS, algorithm_spec, preset_names
from relax_core.config.base import ConfigModel, load_config
from relax_core.config.presets import PresetName, preset_data

__all__ = [
    "AdvantageEstimator",
    "AlgorithmConfig",
    "KLControlConfig",
    "KLEstimator",
    "LossAggMode",
    "OptimizerConfig",
    "PolicyLossName",
    "StalenessConfig",
    "load_preset",
    "lr_multiplier",
]

AdvantageEstimator = str
"""An advantage estimator id: a key of :data:`~relax_core.ALGORITHMS` (checked when a config is loaded)."""
PolicyLossName = Literal[
    "ppo", "gspo", "cispo", "sapo", "gpg", "reinforce", "dro", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl"
]


class KLControlConfig(ConfigModel):
    """How the KL coefficient moves during a run (verl's ``algorithm.kl_ctrl``)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: β stays ``kl_coef``; ``adaptive``: β starts at ``kl_coef`` and after each update is multiplied by
    1 + clip(KL / target_kl − 1, ±0.2) · samples / horizon (Ziegler et al. 2019), logged as ``kl_coef`` and kept in
    checkpoints."""

    target_kl: float = pydantic.Field(default=0.1, gt=0.0)
    """The KL (as the loss measures it, metric ``kl``) the adaptive controller steers toward."""

    horizon: int = pydantic.Field(default=10000, gt=0)
    """Samples over which the adaptive controller corrects a KL error (larger: slower)."""


class AlgorithmConfig(ConfigModel):
    """The RL algorithm: advantage estimator, policy loss, KL/entropy terms, off-policy corrections."""

    preset: PresetName | None = None
    """Preset the values start from (grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, ppo: the presets of the
    algorithm table :data:`~relax_core.ALGORITHMS`); keys given
    next to it override the preset's. Applied when the config is loaded, not on later assignment.
    None: start from the defaults below."""

    advantage_estimator: AdvantageEstimator = "grpo"
    """How advantages are computed: a key of the algorithm table :data:`~relax_core.ALGORITHMS`: gae / vtrace
    (need a critic), grpo, rloo, reinforce_pp, reinforce_pp_baseline."""

    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std. False gives Dr.GRPO."""

    whiten_advantages: bool = False
    """Whiten advantages over all valid tokens of the batch (masked mean 0, std 1) after estimation."""

    gamma: float = pydantic.Field(default=1.0, ge=0.0, le=1.0)
    """Discount factor γ for GAE, V-trace and REINFORCE++ returns."""

    lam: float = pydantic.Field(default=1.0, ge=0.0, le=1.0)
    """GAE λ (and the V-trace λ that scales the trace coefficients c)."""

    group_size: int = pydantic.Field(default=8, ge=1)
    """Samples generated per prompt (n). Group estimators (``needs_groups`` in the algorithm table: grpo, rloo,
    reinforce_pp_baseline) need >= 2."""

    policy_loss: PolicyLossName = "ppo"
    """Surrogate (verl's names; relax's ``ppo`` is verl's ``vanilla``): ppo (clip; Schulman et al. 2017), gspo
    (sequence ratios; Zheng et al. 2025), cispo (clipped IS weight; MiniMax-M1), sapo (soft gate; Gao et al. 2025),
    gpg and reinforce (−A·log π; Chu et al. 2025, Williams 1992), dro (−A·log π + β/2·(log r)²; Richemond et al.
    2024), geo_mean (GMPO: geometric-mean sequence ratio clipped in log space; Zhao et al. 2025), clip_cov and
    kl_cov (covariance-selected tokens cut or KL-penalised; Cui et al. 2025), dppo_tv and dppo_kl (binary TV / KL
    trust-region masks; Qi et al. 2026). Each function's docstring in ``relax_core/algorithms/policy_losses.py``
    gives its formula."""

    clip_eps_low: float = pydantic.Field(default=0.2, gt=0.0, le=1.0)
    """Lower clip range ε_low: ratios below 1 − ε_low are clipped (CISPO: the lower IS-weight clip; 1.0
    disables it)."""

    clip_eps_high: float = pydantic.Field(default=0.2, gt=0.0)
    """Upper clip range ε_high: ratios above 1 + ε_high are clipped (DAPO clip-higher uses 0.28). geo_mean reads
    ε_low / ε_high as bounds on the log-ratio, dppo_tv / dppo_kl as the trust region's δ_low / δ_high."""

    dual_clip_c: float | None = pydantic.Field(default=None, gt=1.0)
    """Dual-clip bound c > 1 for negative advantages (Ye et al. 2020); None disables it."""

    sapo_tau_pos: float = pydantic.Field(default=1.0, gt=0.0)
    """SAPO gate temperature for positive advantages."""

    sapo_tau_neg: float = pydantic.Field(default=1.05, gt=0.0)
    """SAPO gate temperature for negative advantages."""

    dro_beta: float = pydantic.Field(default=0.1, gt=0.0)
    """DRO (``policy_loss='dro'``): weight β of the squared log-ratio ½β·(log π_θ − log π_old)²."""

    clip_cov_ratio: float = pydantic.Field(default=0.0002, gt=0.0, le=1.0)
    """Clip-Cov: share of the valid tokens whose gradient is cut (at least one)."""

    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance window the cut tokens are drawn from."""

    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of that window."""

    kl_cov_ratio: float = pydantic.Field(default=0.0002, gt=0.0, le=1.0)
    """KL-Cov: share of the valid tokens (the highest covariance, at least one) that get the |log r| penalty."""

    ppo_kl_coef: float = pydantic.Field(default=1.0, ge=0.0)
    """KL-Cov: weight of the |log r| penalty on the selected tokens."""

    dppo_ratio_cap: float = pydantic.Field(default=20.0, gt=0.0)
    """DPPO (dppo_tv, dppo_kl): cap c of the detached ratio that weighs each token's −A·log π (verl's
    ``clip_ratio_c``); the trust region's bounds are ``clip_eps_low`` / ``clip_eps_high``."""

    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses become a scalar: token-mean, token-sum (no normaliser; a step split into micro-batches
    averages their sums), seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (sum over tokens divided
    by B · loss_norm_constant; Dr.GRPO)."""

    loss_norm_constant: int | None = pydantic.Field(default=None, gt=0)
    """Constant normaliser C for seq-mean-token-sum-norm. A run config (``relax train``) fills it with its
    generation budget ``rollout.max_new_tokens`` when unset; an AlgorithmConfig used alone falls back to the padded
    response width T of each batch (which moves with the batch's longest answer)."""

    kl_coef: float = pydantic.Field(default=0.0, ge=0.0)
    """Weight β of the KL(π_θ ‖ π_ref) term; 0 disables the reference model."""

    kl_estimator: KLEstimator = "k3"
    """KL estimator (Schulman 2020), with r = π_θ/π_ref: k1 = log r, k2 = ½ (log r)², k3 = r⁻¹ − 1 + log r (low
    variance), abs = |log r|, all from the sampled tokens; ``k1+`` / ``k3+``: the value of k1 / k3 with the
    gradient of k2 (straight-through, verl's ``+`` forms); ``kl``, ``mse``, ``low_var_kl``: verl's names of k1, k2,
    k3. ``full`` = the exact KL(π_ref ‖ π_θ) over the vocabulary: the reference then ships its whole next-token
    distribution, V floats per response token (``[B, T, V]`` float32 through the queue unless the trainer holds
    the reference itself), and the term keeps options alive that the policy stopped sampling. ``full`` needs
    ``kl_placement='loss'``."""

    kl_ctrl: KLControlConfig = pydantic.Field(default_factory=KLControlConfig)
    """Fixed or adaptive KL coefficient (``type``, ``target_kl``, ``horizon``); adaptive needs kl_coef > 0."""

    kl_placement: Literal["loss", "reward"] = "loss"
    """Where β·KL goes: added to the loss, or subtracted from the token rewards before advantages."""

    kl_clamp: float = pydantic.Field(default=10.0, gt=0.0)
    """The KL estimate per token is clamped to [−kl_clamp, kl_clamp] (k3 low-variance clamp)."""

    entropy_coef: float = pydantic.Field(default=0.0, ge=0.0)
    """Entropy bonus weight: loss −= entropy_coef · aggregated entropy."""

    value_loss_coef: float = pydantic.Field(default=0.5, ge=0.0)
    """Weight of the critic's value loss (PPO with a critic)."""

    value_clip_eps: float | None = pydantic.Field(default=0.2, gt=0.0)
    """Value-function clip range around the old values; None disables value clipping."""

    decoupled: bool = False
    """Decoupled PPO (Hilton et al. 2022): the trainer recomputes proximal log-probs before each update;
    the clip is taken around them and π_prox/π_behaviour becomes an importance weight. Needed for
    τ > 0 and for rollout/trainer mismatch corrections."""

    tis_cap: float | None = pydantic.Field(default=None, gt=0.0)
    """Token-level truncated IS: the π_prox/π_behaviour weight is capped at this value. Needs decoupled."""

    tis_level: Literal["token", "sequence"] = "token"
    """Level of the truncated IS weight: ``token`` caps each π_prox/π_behaviour; ``sequence`` gives every token of a
    sequence the product exp(Σ_t log w_t), capped (verl's ``rollout_is: sequence``)."""

    tis_cap_low: float | None = pydantic.Field(default=None, gt=0.0)
    """Lower truncation of the IS weight (at the level ``tis_level``); None: no lower cap. Needs decoupled."""

    tis_batch_normalize: bool = False
    """Divide the truncated IS weights by their mean over the batch's valid tokens (token level) or sequences
    (sequence level), so they average 1 (verl's ``rollout_is_batch_normalize``). In the trainer the batch is one
    micro-batch. Needs decoupled."""

    rollout_rs: str | None = None
    """Rejection by rollout/trainer divergence (verl's ``rollout_rs``): comma-separated options, every one must pass.
    With log w = log π_prox − log π_behaviour per token and k1 = −log w, k2 = ½(log w)², k3 = e^{log w} − 1 − log w:
    ``token_k1``/``token_k2``/``token_k3`` reject tokens; ``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k2``,
    ``seq_max_k3`` reject whole sequences by the sum, mean or max of the tokens' divergence. Rejected tokens leave
    the loss; their share is the metric ``rs_masked_frac`` (``rs_seq_masked_frac`` for sequences). Needs decoupled."""

    rollout_rs_threshold: str | float | None = None
    """Thresholds for ``rollout_rs``: one shared by every option or one per option, comma-separated. A k1 option
    takes ``lower_upper`` ratio bounds (keep log lower ≤ k1 ≤ log upper; a single value u means 1/u_u); the others
    one upper bound on the divergence."""

    mis_level: Literal["none", "token", "sequence"] = "none"
    """Masked IS (MIS / IcePop): zero the loss of tokens (or whole sequences, by geometric-mean ratio)
    whose π_prox/π_behaviour ratio falls outside [mis_low, mis_high]. Needs decoupled."""

    mis_low: float = pydantic.Field(default=0.5, gt=0.0, lt=1.0)
    """Lower ratio threshold for masked IS; must be < 1."""

    mis_high: float = pydantic.Field(default=2.0, gt=1.0)
    """Upper ratio threshold for masked IS; must be > 1."""

    vtrace_rho_bar: float = pydantic.Field(default=1.0, gt=0.0)
    """V-trace ρ̄: truncation of the importance weight in the TD term."""

    vtrace_c_bar: float = pydantic.Field(default=1.0, gt=0.0)
    """V-trace c̄: truncation of the trace coefficients (c̄ <= ρ̄ in the paper)."""

    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, no signal)."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in preset_names():
            return {**preset_data(data["preset"]), **data}
        return data

    @pydantic.field_validator("preset")
    @classmethod
    def _check_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in preset_names():
            raise _not_one_of(preset_names())
        return value

    @pydantic.field_validator("advantage_estimator")
    @classmethod
    def _check_estimator(cls, value: str) -> str:
        if value not in ALGORITHMS:
            raise _not_one_of(tuple(ALGORITHMS))
        return value

    @pydantic.field_validator("group_size")
    @classmethod
    def _check_group_size(cls, value: int, info: pydantic.ValidationInfo) -> int:
        estimator = info.data.get("advantage_estimator")
        if estimator in ALGORITHMS and ALGORITHMS[estimator].needs_groups and value < 2:
            raise _inconsistent(f">= 2 for advantage_estimator={estimator}")
        return value

    @pydantic.field_validator("kl_ctrl")
    @classmethod
    def _check_kl_ctrl(cls, value: KLControlConfig, info: pydantic.ValidationInfo) -> KLControlConfig:
        if value.type == "adaptive" and not info.data.get("kl_coef", 0.0) > 0.0:
            raise _inconsistent("type 'fixed' unless kl_coef > 0 (the adaptive controller starts from kl_coef)")
        return value

    @pydantic.field_validator("kl_placement")
    @classmethod
    def _check_full_kl_in_loss(cls, value: str, info: pydantic.ValidationInfo) -> str:
        if value != "loss" and info.data.get("kl_estimator") == "full":
            raise ValueError(
                f"kl_estimator='full' is a loss term over the policy's distribution; kl_placement={value!r} "
                "must be 'loss' (or use k1/k2/k3 in the reward)"
            )
        return value

    @pydantic.field_validator("rollout_rs_threshold")
    @classmethod
    def _check_rollout_rs(cls, value: str | float | None, info: pydantic.ValidationInfo) -> str | float | None:
        options = info.data.get("rollout_rs")
        if options is not None:
            parse_rollout_rs(options, value)  # raises ValueError naming what is wrong
        return value

    @pydantic.field_validator("tis_cap", "mis_level", "tis_cap_low", "tis_batch_normalize", "rollout_rs")
    @classmethod
    def _check_needs_decoupled(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        if value not in (None, "none", False) and not info.data.get("decoupled", False):
            raise _inconsistent("null/'none'/false unless decoupled=true")
        return value

    @property
    def rollout_rs_rules(self) -> tuple[RejectionRule, ...]:
        """``rollout_rs`` and its thresholds parsed: one ``(option, lower, upper)`` per option (empty when unset)."""
        return parse_rollout_rs(self.rollout_rs, self.rollout_rs_threshold) if self.rollout_rs else ()

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a value model (``needs_critic`` in the algorithm table: gae, vtrace)."""
        return algorithm_spec(self.advantage_estimator).needs_critic

    @property
    def uses_reference(self) -> bool:
        """Whether a frozen reference model is needed (kl_coef > 0, or an estimator that ``needs_reference``)."""
        return self.kl_coef > 0.0 or algorithm_spec(self.advantage_estimator).needs_reference

    @property
    def uses_full_kl(self) -> bool:
        """Whether the loss holds the exact KL over the vocabulary (kl_coef > 0 with ``kl_estimator='full'``): the
        only term that reads the policy's whole next-token distribution rather than its sampled tokens'."""
        return self.kl_coef > 0.0 and self.kl_estimator == "full"


ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""The rejection options ``algorithm.rollout_rs`` accepts (verl's names)."""

RejectionRule = tuple[str, float | None, float]
"""``(option, lower, upper)``: k1 options bound the log-ratio k1 in [log lower, log upper]; the others bound the
divergence by ``upper`` (``lower`` None)."""


def parse_rollout_rs(options: str, thresholds: str | float | None) -> tuple[RejectionRule, ...]:
    """Parse ``rollout_rs`` and ``rollout_rs_threshold`` as verl does (one threshold shared, or one per option).

    Raises:
        ValueError: On an unknown option, a missing or malformed threshold, or a count that matches neither.
    """
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    unknown = [n for n in names if n not in ROLLOUT_RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs options {unknown or options!r} are not among {', '.join(ROLLOUT_RS_OPTIONS)}")
    if thresholds is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = [p.strip() for p in str(thresholds).split(",") if p.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} values; give 1 or {len(names)} (one per option)")
    specs = specs * len(names) if len(specs) == 1 else specs
    rules: list[RejectionRule] = []
    for name, spec in zip(names, specs, strict=True):
        try:
            if name.endswith("k1"):
                low_text, _, high_text = spec.partition("_") if "_" in spec else (str(1.0 / float(spec)), "", spec)
                low, high = float(low_text), float(high_text)
                if low <= 0 or high <= 0:
                    raise ValueError
                rules.append((name, low, high))
            else:
                rules.append((name, None, float(spec)))
                if rules[-1][2] <= 0:
                    raise ValueError
        except ValueError:
            raise ValueError(
                f"rollout_rs_threshold {spec!r} for {name} must be positive ('lower_upper' for k1)"
            ) from None
    return tuple(rules)


def _inconsistent(allowed: str) -> PydanticCustomError:
    """An error for a value inconsistent with an earlier field; ConfigError reports ``allowed``."""
    return PydanticCustomError("inconsistent_value", "value inconsistent with other fields", {"expected": allowed})


def _not_one_of(names: tuple[str, ...]) -> PydanticCustomError:
    """An error for a value outside ``names``, worded like pydantic's Literal errors."""
    quoted = [repr(n) for n in names]
    allowed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return PydanticCustomError("literal_error", "not one of the allowed values", {"expected": allowed})


def load_preset(name: str, overrides: dict[str, Any] | None = None) -> AlgorithmConfig:
    """Load an algorithm preset (the ``presets`` of an entry in :data:`~relax_core.ALGORITHMS`).

    Args:
        name: A preset of the algorithm table: ``grpo``, ``dr_grpo``, ``dapo``, ``gspo``, ``rloo``,
            ``reinforce_pp``, ``ppo`` (and any preset of an entry added to the table).
        overrides: Field values replacing the preset's.

    Raises:
        ConfigError: If the name is unknown (the message lists the presets) or an override is invalid.
    """
    return load_config(AlgorithmConfig, {"preset": name, **(overrides or {})})


class OptimizerConfig(ConfigModel):
    """AdamW optimizer and learning-rate schedule of a trained model (policy or critic)."""

    lr: float = pydantic.Field(default=1e-6, gt=0.0)
    """Peak learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (β1, β2) moment decay rates, each in [0, 1)."""

    eps: float = pydantic.Field(default=1e-8, gt=0.0)
    """AdamW ε added to the denominator for numerical stability."""

    weight_decay: float = pydantic.Field(default=0.01, ge=0.0)
    """Decoupled weight decay."""

    grad_clip: float | None = pydantic.Field(default=1.0, gt=0.0)
    """Clip the global gradient norm to this value; None disables clipping."""

    warmup_steps: int = pydantic.Field(default=0, ge=0)
    """Linear warm-up from 0 to lr over this many optimizer steps."""

    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up: constant, linear or cosine down to min_lr_ratio · lr at total_steps."""

    min_lr_ratio: float = pydantic.Field(default=0.0, ge=0.0, le=1.0)
    """Final lr as a fraction of the peak for the linear and cosine schedules."""

    total_steps: int | None = pydantic.Field(default=None, gt=0)
    """Total optimizer steps; required by the linear and cosine schedules."""

    @pydantic.field_validator("betas")
    @classmethod
    def _check_betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError("each beta must be in [0, 1)")
        return value

    @pydantic.field_validator("total_steps")
    @classmethod
    def _check_total_steps(cls, value: int | None, info: pydantic.ValidationInfo) -> int | None:
        schedule = info.data.get("schedule", "constant")
        if value is None and schedule != "constant":
            raise _inconsistent(f"an int > 0 for schedule={schedule}")
        return value


def lr_multiplier(cfg: OptimizerConfig, step: int) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (use with ``torch.optim.lr_scheduler.LambdaLR``).

    Linear warm-up over ``warmup_steps``; then constant, or linear/cosine decay to ``min_lr_ratio``
    at ``total_steps``.
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.total_steps is None:
        return 1.0
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    decay = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


class StalenessConfig(ConfigModel):
    """The staleness bound τ and what happens to a sample that exceeds it at consumption time."""

    tau: int | None = pydantic.Field(default=0, ge=0)
    """Maximum staleness V − v_min of a consumed sample; 0 is strictly on-policy, null is unbounded (∞)."""

    on_stale: Literal["drop", "requeue", "flag"] = "drop"
    """Safety net for samples found stale when consumed: drop, requeue for regeneration, or flag
    (keep, with off-policy correction). Always counted."""

    def is_stale(self, current_version: int, sample_min_version: int) -> bool:
        """Whether a sample whose oldest token has ``sample_min_version`` exceeds τ at ``current_version``."""
        return self.tau is not None and current_version - sample_min_version > self.tau
