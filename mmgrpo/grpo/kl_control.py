"""KL to the reference outside the loss: as a penalty in the reward, and with an adaptive coefficient.

Two ways to keep the policy near the reference model, besides ``beta * kl`` in the loss
(:func:`mmgrpo.grpo.losses.grpo_loss`):

- In the reward (PPO-RLHF style, Ziegler et al. 2019; verl's ``use_kl_in_reward``): each episode's reward
  becomes ``r_i - beta * sum_t kl_t`` over its policy tokens, computed once, without gradient, from the
  rollout policy's log-probs, BEFORE the group normalisation; the loss then runs with ``beta=0``. Inside a
  group this favours the samples that stayed closer to the reference. :func:`kl_penalized_rewards`.
- With a coefficient that follows a target (Ziegler et al. 2019, arXiv 1909.08593, section 2.2):
  :class:`AdaptiveKLController` raises beta when the measured KL is above ``target_kl`` and lowers it when
  below; :class:`FixedKLController` keeps it constant behind the same interface. Both hold one float of
  state (``state_dict``), to be saved with the checkpoint so that a resumed run continues with the same beta.

Example::

    ctl = AdaptiveKLController(init_beta=0.05, target_kl=0.02, horizon=1000)
    rewards = kl_penalized_rewards(rewards, logp_old, ref_logp, mask, ctl.beta, "k1")   # (N,)
    adv = group_advantages(rewards, group_size)                                          # (N,)
    ...                                                                                  # loss with beta=0
    ctl.update(float(sequence_kl(logp_old, ref_logp, mask, "k1").mean()))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor

from mmgrpo.grpo.losses import KLEstimator, kl_estimate


def sequence_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: KLEstimator = "k1") -> Tensor:
    """KL estimate (N,) of each sequence: the per-token estimate summed over its policy tokens, no grad.

    logp, ref_logp, mask (N, T); positions outside the mask (prompt, padding, tool output) may hold any
    garbage (inf, NaN): they are replaced by zeros before any arithmetic and contribute nothing.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be (N, T), got shape {tuple(logp.shape)}.")
    for name, t in (("ref_logp", ref_logp), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(logp.shape)}, got {tuple(t.shape)}.")
    with torch.no_grad():
        m = mask.to(logp.device).bool()  # (N, T)
        dtype = torch.promote_types(logp.dtype, torch.float32)
        zero = torch.zeros((), dtype=dtype, device=logp.device)  # ()
        lp = torch.where(m, logp.detach().to(dtype), zero)  # (N, T)
        ref = torch.where(m, ref_logp.detach().to(device=logp.device, dtype=dtype), zero)  # (N, T)
        kl = kl_estimate(lp, ref, estimator)  # (N, T) 0 outside the mask (logp == ref there)
        return torch.where(m, kl, zero).sum(dim=1)  # (N,)


def kl_penalized_rewards(
    rewards: Tensor,
    logp_old: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    beta: float,
    estimator: KLEstimator = "k1",
) -> Tensor:
    """Rewards (N,) minus beta times each sequence's KL to the reference, for use BEFORE group normalisation.

    rewards (N,); logp_old (N, T) the log-probs under the policy that sampled the episodes (the rollout
    policy); ref_logp (N, T) the reference model's; mask (N, T), 1 for the tokens the policy generated.
    Returns ``rewards - beta * sum_t kl_t`` (N,) on the rewards' device, in the rewards' floating dtype,
    without gradient. The default estimator is k1, the classic in-reward penalty (an unbiased estimate of
    the sequence KL, log pi(o) / pi_ref(o)); see :func:`mmgrpo.grpo.losses.kl_estimate` for the others.
    Pass ``beta=0`` to the loss when the KL is in the reward, or the policy is penalised twice.
    """
    if not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta must be a finite number >= 0, got {beta}.")
    if rewards.dim() != 1 or rewards.shape[0] != logp_old.shape[0]:
        raise ValueError(
            f"rewards must be (N,) with N = logp_old.shape[0] = {logp_old.shape[0]}, got {tuple(rewards.shape)}."
        )
    seq_kl = sequence_kl(logp_old, ref_logp, mask, estimator)  # (N,)
    with torch.no_grad():
        r = rewards.detach()  # (N,)
        if not r.is_floating_point():
            r = r.float()  # (N,)
        return r - beta * seq_kl.to(device=r.device, dtype=r.dtype)  # (N,)


class KLController(Protocol):
    """What the trainer needs from a KL coefficient: its value, an update per step, and checkpointing."""

    @property
    def beta(self) -> float: ...

    def update(self, current_kl: float, n_steps: int = 1) -> float: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: Mapping[str, float]) -> None: ...


def _beta_from_state(state: Mapping[str, float], positive: bool) -> float:
    """The beta of a ``state_dict``, checked: a finite float, >= 0 (> 0 when ``positive``)."""
    if "beta" not in state:
        raise ValueError(f"a KL controller state needs the key 'beta', got keys {sorted(state)}.")
    beta = float(state["beta"])
    if not math.isfinite(beta) or beta < 0 or (positive and beta == 0):
        raise ValueError(f"the saved beta must be a finite number {'>' if positive else '>='} 0, got {beta}.")
    return beta


class FixedKLController:
    """A constant KL coefficient behind the controller interface: ``update`` returns it unchanged."""

    def __init__(self, beta: float) -> None:
        if not math.isfinite(beta) or beta < 0:
            raise ValueError(f"beta must be a finite number >= 0, got {beta}.")
        self._beta = float(beta)

    @property
    def beta(self) -> float:
        """The coefficient (the same at every step)."""
        return self._beta

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Ignore the measured KL and return beta."""
        return self._beta

    def state_dict(self) -> dict[str, float]:
        """``{"beta": float}``, plain floats (JSON- and ``torch.load(weights_only=True)``-safe)."""
        return {"beta": self._beta}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore beta from :meth:`state_dict`."""
        self._beta = _beta_from_state(state, positive=False)


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller of the KL coefficient (as in verl and TRL's PPO).

    After each step, with the measured KL ``current_kl``::

        error = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta  = beta * (1 + error * n_steps / horizon)

    so beta moves by at most 0.2 * n_steps / horizon (relative) per update, and about ``horizon`` steps
    (in the units of ``n_steps``: optimiser steps by default, samples in the paper) of a KL 20% off target
    change beta by a factor of about e^0.2. ``current_kl`` must be in the units of ``target_kl``: a token
    mean (``LossOutput.kl``) with a per-token target, or a sequence sum (:func:`sequence_kl`) with a
    per-sequence target.
    """

    def __init__(self, init_beta: float, target_kl: float, horizon: float) -> None:
        if not math.isfinite(init_beta) or init_beta <= 0:
            raise ValueError(
                f"init_beta must be a finite number > 0 (a multiplicative update never leaves 0), got {init_beta}."
            )
        if not math.isfinite(target_kl) or target_kl <= 0:
            raise ValueError(f"target_kl must be a finite number > 0, got {target_kl}.")
        if not math.isfinite(horizon) or horizon <= 0:
            raise ValueError(f"horizon must be a finite number > 0, got {horizon}.")
        self._beta = float(init_beta)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    @property
    def beta(self) -> float:
        """The current coefficient."""
        return self._beta

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Move beta towards keeping ``current_kl`` at ``target_kl``; return the new beta."""
        kl = float(current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"current_kl must be finite, got {kl}; beta would become {kl} too.")
        if n_steps < 0 or n_steps >= 5 * self.horizon:
            raise ValueError(
                f"n_steps must be >= 0 and < 5 * horizon = {5 * self.horizon} (else beta can turn <= 0), "
                f"got {n_steps}."
            )
        error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
        self._beta *= 1.0 + error * n_steps / self.horizon
        return self._beta

    def state_dict(self) -> dict[str, float]:
        """``{"beta": float}``, plain floats (JSON- and ``torch.load(weights_only=True)``-safe).

        target_kl and horizon are configuration, not state: they come from the constructor on resume.
        """
        return {"beta": self._beta}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore beta from :meth:`state_dict`, so a resumed run continues with the adapted value."""
        self._beta = _beta_from_state(state, positive=True)
