"""Arguments shared by the preference-training tests (one process against the ring, step for step), and the
error model that says how far a logged metric of a correct ring run may be from the one-process run's.

The error model
---------------
Both runs compute the same float32 numbers in different orders: attention in blocks merged by their
log-sum-exp (the ring) or whole (SDPA), the LM head over this rank's tokens or all of them, sums over tokens
split across ranks or not. What a DPO or GRPO metric sums is per-token log-probabilities (and entropies),
so the error of a metric is bounded by the magnitudes it sums, not by its value::

    |ring - one process| <= ROUNDINGS * eps * scale(metric)

``eps`` is the unit of the runs' dtype (float32: 2**-23 = 1.19e-7) and ``scale`` is the sum of the magnitudes
that went into the metric (its "condition"), written out per metric in ``metric_tolerance``. For a sum of
same-sign terms (a sequence's log-probability ``S = sum_t logp_t <= 0``, a mean entropy) the scale is the
value itself; for a difference of such sums it is the sum of the magnitudes, however small the difference: a
DPO reward ``beta * (S - S_ref)`` of 2.4e-4 made of two sums of about -45 carries the rounding of -45, not of
2.4e-4 (that was the flaw of a tolerance relative to the reward, which failed on an AMD host by 1.1e-6).

``ROUNDINGS``: measured over every DPO and GRPO equality case of the suite (36 tests, 2 steps, every rank;
2026-12-07, AMD EPYC with AVX-512, and again with ATen, MKL and oneDNN held to AVX2 and to no vector
instructions, the kernels other x86 CPUs pick), the largest error was ``MEASURED`` roundings of the scale;
``ROUNDINGS = 16`` leaves a factor of about 15 for other CPUs. A mean entropy is the exception: each
token's is itself a sum of ``vocab`` terms ``-p log p`` that the runs may add in other orders (Higham's bound
for such a sum: ``vocab`` roundings), measured at 21 roundings with vocab = 64 (DP 2 x CP 2 against TRL on 2
processes): ``ROUNDINGS + vocab``. The tolerance the reward test had before, ``1e-6 + 1e-5 |reward|``, failed
under both the AVX-512 kernels (by 1.1e-6) and the scalar ones (by 1.5e-6); these pass everywhere.

Values the models do not log are bounded from what the tests build: the tiny random models' logits stay
within +-1 (logged mean logits are about 5e-3), so a token's log-probability is at most
``log(vocab) + 2 / temperature`` in magnitude (``L``), and a GRPO advantage, rewards standardised within a
group of ``G``, at most ``sqrt(G)``. Counts (tokens, lengths, accuracies, clip ratios, rewards of the same
completions) are compared exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

EPS32 = 2.0**-23  # float32's machine epsilon
ROUNDINGS = 16
MEASURED = 1.1  # the largest error / (eps * scale) seen, see the module docstring
GRAD_RTOL = 2e-5  # every gradient within this of its parameter's largest (the runs' gradient check)

# compared exactly: counts (tokens, lengths; accuracies, which would need a tie within rounding to flip; clip
# ratios, of a policy ratio that is exactly 1), rewards, functions of the same completions' text, and the
# learning rate
EXACT = {"num_tokens", "frac_reward_zero_std", "reward", "rewards/accuracies", "mean_token_accuracy", "learning_rate"}
EXACT_PREFIXES = ("completions/", "clip_ratio/")


@dataclass(frozen=True)
class Run:
    """What the error model needs to know of a DPO or GRPO run besides its logs."""

    trainer: str  # "dpo" or "grpo"
    vocab: int
    beta: float = 0.0  # DPO's beta; GRPO's KL coefficient
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    temperature: float = 1.0
    num_generations: int = 4
    eps: float = EPS32  # float32's also for float64 models: TRL's metrics pass through float32 steps

    @classmethod
    def of(cls, trainer: str, vocab: int, spec: dict[str, Any]) -> Run:
        """From a test's case (its ``loss_type``, ``loss_weights``, ``beta``, ``temperature``)."""
        types = spec.get("loss_type", "sigmoid")
        types = (types,) if isinstance(types, str) else tuple(types)
        weights = spec.get("loss_weights")
        return cls(trainer, vocab, float(spec.get("beta", 0.2 if trainer == "dpo" else 0.0)), types,
                   tuple(weights) if weights is not None else None, float(spec.get("temperature", 1.0)),
                   int(spec.get("num_generations", 4)))  # fmt: skip

    @property
    def token_logp(self) -> float:
        """``L``: the largest |log-probability| of a token (logits within +-1, see the module docstring)."""
        return math.log(self.vocab) + 2.0 / self.temperature


def _sums(logged: dict[str, float], prefix: str, beta: float) -> float:
    """``|S| + |S_ref|`` of the chosen and of the rejected completions (means over the pairs): each ``S`` is a
    sum of log-probabilities <= 0, ``S_ref = S - reward / beta``."""
    total = 0.0
    for side in ("chosen", "rejected"):
        s, r = logged[f"{prefix}logps/{side}"], logged[f"{prefix}rewards/{side}"]
        total += abs(s) + abs(s - r / beta)
    return total


def metric_tolerance(key: str, logged: dict[str, float], run: Run) -> tuple[float, str]:
    """``(tolerance, error model)`` of one logged metric, from the one-process run's logged values of the same
    step (``logged``): how far the ring's value may be from it."""
    prefix = "eval_" if key.startswith("eval_") else ""
    name = key[len(prefix) :]
    k = ROUNDINGS * run.eps
    L = run.token_logp  # noqa: N806
    value = abs(logged[key])
    if name in EXACT or name.startswith(EXACT_PREFIXES) or (name.startswith("rewards/") and name.endswith("/mean")):
        return 0.0, "exact: a count, or a function of the same completions' text"
    if name in ("logps/chosen", "logps/rejected"):
        return k * value, "sum of log-probabilities <= 0: K eps |S|"
    if name in ("rewards/chosen", "rewards/rejected"):
        side = name.split("/")[1]
        s = logged[f"{prefix}logps/{side}"]
        return k * run.beta * (abs(s) + abs(s - logged[key] / run.beta)), "beta (S - S_ref): K eps beta (|S| + |S_ref|)"
    if name == "rewards/margins":
        return k * run.beta * _sums(logged, prefix, run.beta), "beta (dS_chosen - dS_rejected): K eps beta sum |S|"
    if name == "entropy":  # each token's a sum over the vocabulary, which the runs may take in other orders
        return (ROUNDINGS + run.vocab) * run.eps * value, "mean of -sum_v p log p: (K + vocab) eps |value|"
    if name == "grad_norm":
        return GRAD_RTOL * value, "norm of the gradients, each as accurate as the gradient check's GRAD_RTOL"
    if name == "logits_count":
        return 0.0, "exact: the evaluation's logits counted"
    if name in ("logits_mean", "logits_abs_mean", "logits_max"):  # tests/test_dpo.py's compute_metrics
        return k * (value + 1.0), "mean or max of the same forward's logits: K eps (|value| + max |logit| = 1)"
    if name in ("logits/chosen", "logits/rejected"):
        return k * (value + 1.0), "mean logit over the vocabulary: K eps (|value| + max |logit| = 1)"
    if name == "kl":
        # per token exp(d) - d - 1 with d = logp_ref - logp ~ 0: rounded against 1 (2 eps), and moved by the
        # error of d (at most 2 K eps L) times |exp(d) - 1| ~ |d| <= sqrt(2 kl) on average
        return k * (2.0 + math.sqrt(2.0 * value) * 2.0 * L), "mean of exp(d) - d - 1: K eps (2 + sqrt(2 kl) 2L)"
    if name.startswith("sampling/sampling_logp_difference/"):
        return k * 2.0 * L, "|logp - logp_vllm| per token: K eps 2L"
    if name.startswith("sampling/importance_sampling_ratio/"):
        return k * value * (1.0 + 2.0 * L), "exp(logp - logp_vllm): K eps ratio (1 + 2L)"
    if name == "loss" and run.trainer == "dpo":
        return _dpo_loss(logged, prefix, run, value)
    if name == "loss":
        return _grpo_loss(logged, run, value)
    raise AssertionError(f"{key}: no error model for this metric; add one to testkit.post.metric_tolerance")


def _dpo_loss(logged: dict[str, float], prefix: str, run: Run, value: float) -> tuple[float, str]:
    """The DPO loss, a weighted sum of per-pair losses of the scores ``delta = (S - S_ref)_chosen - (...)_rejected``:
    sigmoid and hinge move by at most ``beta`` per unit of ``delta`` (error: the margins'); IPO's
    ``(x - 1 / (2 beta))^2``, ``x`` the scores per token, moves by ``2 sqrt(loss_ipo)`` per unit of ``x``, whose
    error is at most ``K eps 4L`` (four per-token means of log-probabilities); plus the loss's own rounding."""
    k = ROUNDINGS * run.eps
    weights = run.loss_weights or (1.0,) * len(run.loss_type)
    total = k * value
    for kind, w in zip(run.loss_type, weights, strict=True):
        if kind in ("sigmoid", "hinge"):
            total += w * k * run.beta * _sums(logged, prefix, run.beta)
        elif kind == "ipo":  # mean over pairs of sqrt(loss_i) <= sqrt(mean loss_i) <= sqrt(loss / w)
            total += w * 2.0 * math.sqrt(value / w) * k * 4.0 * run.token_logp
        else:
            raise AssertionError(f"loss_type {kind!r}: no error model; add one to testkit.post._dpo_loss")
    return total, "DPO loss: slope x score error (sigmoid/hinge: the margins'; IPO: 2 sqrt(loss) K eps 4L)"


def _grpo_loss(logged: dict[str, float], run: Run, value: float) -> tuple[float, str]:
    """The GRPO loss, a token-weighted mean of ``-A * w * ratio + beta * kl`` near 0 (advantages sum to 0 in a
    group): ``ratio = exp(logp - logp.detach()) = 1`` exactly in both runs, so without vLLM's importance weights
    ``w`` only the mean's rounding of ``|A| <= sqrt(G)`` remains; with them, ``w`` carries the error of
    ``logp - logp_vllm`` (``w (1 + 2L)``); plus ``beta`` times the KL term's."""
    k = ROUNDINGS * run.eps
    advantage = math.sqrt(run.num_generations)
    weight = logged.get("sampling/importance_sampling_ratio/max")
    policy = advantage if weight is None else advantage * weight * (1.0 + 2.0 * run.token_logp)
    kl = 0.0
    if run.beta:
        kl = run.beta * (2.0 + math.sqrt(2.0 * abs(logged.get("kl", 0.0))) * 2.0 * run.token_logp)
    return k * (value + policy + kl), "GRPO loss: K eps (|loss| + sqrt(G) [w (1 + 2L)] + beta kl scale)"


def dpo_arguments(out: str, **overrides: Any) -> dict[str, Any]:
    """``DPOConfig`` keyword arguments of the DPO equality tests: 2 steps of 2 micro-batches of 2 pairs,
    plain SGD at a large rate (so a wrong gradient shows in the next step), float32, no saving."""
    return dict(output_dir=out, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=0.05, optim="sgd", logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
                bf16=False, save_strategy="no", seed=0, beta=0.2) | overrides  # fmt: skip
