"""Diagnoses of a GRPO run from its metrics: the practitioners' troubleshooting table, as checks.

:class:`Diagnostics` is fed the metrics record of each step (the dict the trainer appends to
``metrics.jsonl``) and keeps a bounded window of them. After ``warmup`` records it runs every check in
:data:`CHECKS` on that window; a check that sees its symptom returns a :class:`Finding` -- what is wrong,
the numbers that show it, and what to try -- written as one line to ``diagnostics.log`` (and to stderr)::

    mmgrpo: diagnosis: step 40: zero-variance groups: 81% of groups had all-equal rewards ...; try: raise ...

Each symptom is reported at most once per ``cooldown`` steps. The checks, their thresholds and the notions
they share (flat, solved, low) are in :mod:`mmgrpo.train.health_checks`; in short:

====================== ============================================ =========================================
symptom                likely cause                                 what to try
====================== ============================================ =========================================
zero-variance groups   no learning signal                           group_size / temperature, partial credit,
                                                                    warm start, dynamic sampling
KL too low             the policy does not move                     raise lr, lower beta
KL too high            steps too large (or growing several-fold)    lower lr, raise beta, fewer iterations
completion length      length hacking, rambling                     overlong penalty, max_new_tokens,
growing                                                             token-level aggregation
repetition rising      degenerate loops                             entropy bonus, lower lr, penalize
                                                                    repetition in the reward
entropy collapse       premature convergence                        entropy bonus, temperature, clip-higher
answer collapse        some right answers are never sampled         the eval's answer table;
                       (counts: only 1, 3 and 5 given)              grpo.freeze_embeddings; a KL anchor
reward oscillation     lr too high                                  lower lr, more tasks per step
====================== ============================================ =========================================

:func:`repetition` is the ``repetition`` metric of a step's completions; :func:`verdict` is the summary
line of ``mmgrpo probe`` (can GRPO learn from what the model samples now?).

This module imports nothing heavy (no torch): it works on plain numbers and strings.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# CHECKS, Finding and History moved to health_checks; re-exported here (see __all__) for their importers
from mmgrpo.train.health_checks import CHECKS, ENTROPY_EARLY, Finding, History, finite, mean_of, sig3

__all__ = ["CHECKS", "Diagnostics", "Finding", "History", "repetition", "verdict"]

HISTORY = 100
"""How many records :class:`Diagnostics` keeps (the longest window a check reads is 40)."""

DEFAULT_WARMUP = 10
DEFAULT_COOLDOWN = 50

CHARS_PER_WORD = 4
""":func:`repetition` on texts of few words uses character n-grams of ``CHARS_PER_WORD * n`` characters."""

# --------------------------------------------------------------------------------------- probe verdict
VERDICT_MIN_SIGNAL_FRAC = 0.2
VERDICT_EDGE_FRAC = 0.02
VERDICT_FORMAT_OK = 0.5

_TRACKED = (
    "reward",
    "reward_std_within_group",
    "frac_zero_std_groups",
    "adv_abs_mean",
    "kl",
    "completion_len",
    "truncated_frac",
    "entropy",
    "repetition",
    "num_episodes",
    "answer_coverage",
)
"""The keys a record keeps in the history (besides ``step`` and every ``reward/<verifier>``)."""


# ------------------------------------------------------------------------------------------ diagnostics
class Diagnostics:
    """Watches a run's metrics, one record per step, and reports the symptoms of :data:`CHECKS`.

    ``log_path``: the run's ``diagnostics.log`` (every finding is appended; None: no file). ``echo``: also
    print each finding to stderr (False on the non-main processes of a distributed run). ``warmup``: no
    finding before this many records were observed. ``cooldown``: a symptom is reported at most once per
    this many steps. ``reward_max``: the highest total reward (the sum of the verifier weights when each
    verifier scores 0..1); it tells a solved task from a stuck one (without it, every ``reward/<verifier>``
    near 1 means solved). ``history``: how many records are kept. Records with a ``stage`` key (the warm
    start's) are ignored.
    """

    def __init__(
        self,
        log_path: Path | None = None,
        echo: bool = True,
        *,
        warmup: int = DEFAULT_WARMUP,
        cooldown: int = DEFAULT_COOLDOWN,
        reward_max: float | None = None,
        history: int = HISTORY,
        checks: Iterable[Callable[[History], Finding | None]] = CHECKS,
    ) -> None:
        for name, value, low in (("warmup", warmup, 0), ("cooldown", cooldown, 1), ("history", history, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Diagnostics: {name} must be an int >= {low}, got {value!r}.")
        if reward_max is not None and finite(reward_max) is None:
            raise ValueError(f"Diagnostics: reward_max must be a finite number or None, got {reward_max!r}.")
        self.log_path = Path(log_path) if log_path is not None else None
        self.echo = echo
        self.warmup = warmup
        self.cooldown = cooldown
        self.reward_max = float(reward_max) if reward_max is not None else None
        self.checks = tuple(checks)
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self.seen = 0
        self.last_fired: dict[str, int] = {}
        self.entropy_first: list[float] = []

    # ------------------------------------------------------------------------------------------ observe
    def observe(self, record: dict[str, Any]) -> list[Finding]:
        """Add one step's metrics record; returns the findings reported for it (already written)."""
        if "stage" in record:
            return []
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            step = (int(self.history[-1]["step"]) + 1) if self.history else self.seen + 1
        if self.history and step <= int(self.history[-1]["step"]):  # a rewound run: forget the future
            kept = [r for r in self.history if int(r["step"]) < step]
            self.history.clear()
            self.history.extend(kept)
            self.last_fired = {k: s for k, s in self.last_fired.items() if s < step}
        self.history.append(_trim(record, step))
        self.seen += 1
        entropy = finite(record.get("entropy"))
        if entropy is not None and len(self.entropy_first) < ENTROPY_EARLY:
            self.entropy_first.append(entropy)
        if self.seen < self.warmup:
            return []
        view = History(self.history, self.reward_max, self.entropy_early)
        found: list[Finding] = []
        for check in self.checks:
            finding = check(view)
            if finding is None:
                continue
            last = self.last_fired.get(finding.symptom)
            if last is not None and step - last < self.cooldown:
                continue
            self.last_fired[finding.symptom] = step
            found.append(finding)
            self._report(finding.line())
        return found

    @property
    def entropy_early(self) -> float | None:
        """The mean of the run's first :data:`ENTROPY_EARLY` entropies, once there were that many."""
        return mean_of(self.entropy_first) if len(self.entropy_first) >= ENTROPY_EARLY else None

    # --------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """History and rate-limit state as plain python types (JSON-safe: NaN and inf are written None)."""
        return {
            "history": [{k: _plain(v) for k, v in r.items()} for r in self.history],
            "seen": self.seen,
            "last_fired": dict(self.last_fired),
            "entropy_first": list(self.entropy_first),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the same window, and reported symptoms stay in cooldown."""
        try:
            history = [dict(r) for r in state["history"]]
            for r in history:
                r["step"] = int(r["step"])
            seen = int(state["seen"])
            last_fired = {str(k): int(v) for k, v in state["last_fired"].items()}
            entropy_first = [float(v) for v in state["entropy_first"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"Diagnostics.load_state_dict: not a Diagnostics state ({type(exc).__name__}: {exc}); pass "
                f"what Diagnostics.state_dict() returned, or start fresh."
            ) from exc
        self.history.clear()
        self.history.extend(history)
        self.seen = seen
        self.last_fired = last_fired
        self.entropy_first = entropy_first

    # ------------------------------------------------------------------------------------------- output
    def _report(self, line: str) -> None:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                f.write(line + "\n")
        if self.echo:
            print(line, file=sys.stderr, flush=True)


def _trim(record: dict[str, Any], step: int) -> dict[str, Any]:
    """The part of ``record`` the checks read: ``step``, the tracked keys, every ``reward/<verifier>``."""
    out: dict[str, Any] = {"step": step}
    for key, value in record.items():
        if key in _TRACKED or key.startswith("reward/"):
            out[key] = float(value) if finite(value) is not None else None
    return out


def _plain(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


# ------------------------------------------------------------------------------------------- repetition
def repetition(texts: Sequence[str], n: int = 3) -> float:
    """The mean over ``texts`` of the share of repeated n-grams (0: none, towards 1: one loop).

    For one text: the n-grams are taken over its words (split on whitespace, case kept) when it has at least
    ``n + 1`` words; otherwise over its characters, ``CHARS_PER_WORD * n`` at a time (a short answer such as
    ``<answer>3</answer>`` then repeats nothing, while ``33333333333333`` does). The share is
    ``(occurrences - distinct) / occurrences``: every occurrence of an n-gram after its first counts as
    repeated. A text too short for one n-gram scores 0. An empty list gives 0.0.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"repetition: n must be an int >= 1, got {n!r}.")
    if not texts:
        return 0.0
    return sum(_repeated_share(text, n) for text in texts) / len(texts)


def _repeated_share(text: str, n: int) -> float:
    words = text.split()
    if len(words) >= n + 1:
        grams: list[Any] = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    else:
        k = CHARS_PER_WORD * n
        grams = [text[i : i + k] for i in range(len(text) - k + 1)]
    if not grams:
        return 0.0
    return (len(grams) - len(Counter(grams))) / len(grams)


# ---------------------------------------------------------------------------------------------- verdict
def verdict(
    rewards_by_group: Sequence[Sequence[float]],
    format_rate: float | None = None,
    *,
    reward_max: float | None = None,
) -> tuple[bool, str]:
    """Can GRPO learn from these sampled rewards? ``(can_learn, one line)`` for ``mmgrpo probe``.

    ``rewards_by_group``: the total rewards of each group (one task's G samples). ``format_rate``: the
    share of well-formatted answers, when known (it tells "wrong format" from "wrong answer"). ``reward_max``:
    the highest total reward, when known (else the highest one sampled stands for it).

    It can learn when at least :data:`VERDICT_MIN_SIGNAL_FRAC` of the groups have reward variance (max >
    min) and the mean reward is neither within :data:`VERDICT_EDGE_FRAC` of the range of its lowest value
    (0, or the lowest sampled when below 0) nor of its highest. Otherwise the line says why and what to try:
    all rewards 0 -> the model never earns a reward (warm start / SFT cold start); all at the maximum ->
    solved, nothing to learn; too few groups with variance -> group size, temperature, a finer reward.
    Non-finite rewards are left out.
    """
    groups = [[float(r) for r in group if finite(r) is not None] for group in rewards_by_group]
    groups = [g for g in groups if g]
    flat = [r for g in groups for r in g]
    if not flat:
        return False, "cannot learn yet: no finite rewards were sampled; try: check the env and the verifiers"
    if all(len(g) < 2 for g in groups):
        return False, (
            "cannot learn yet: every group holds one sample, so every advantage is 0; try: grpo.group_size >= 2"
        )
    n = len(groups)
    varied = sum(max(g) - min(g) >= 1e-8 for g in groups)
    share = varied / n
    mean = mean_of(flat)
    lo = min(0.0, min(flat))
    hi = float(reward_max) if reward_max is not None else max(flat)
    edge = VERDICT_EDGE_FRAC * (hi - lo) if hi > lo else 0.0
    fmt = f", format rate {format_rate:.2f}" if format_rate is not None else ""
    summary = f"{share:.0%} of groups ({varied}/{n}) have reward variance, mean reward {sig3(mean)}{fmt}"
    bad_format = format_rate is not None and format_rate < VERDICT_FORMAT_OK
    if format_rate is None:
        never = "the model never produces a correct (or well-formatted) answer"
    elif bad_format:
        never = "the model rarely produces a well-formatted answer"
    else:
        never = "the model never produces a correct answer (the format is fine: the task is too hard for it)"
    start = (
        "a format warm start (warm_start.steps) or an SFT cold start (mmgrpo sft), then probe again"
        if bad_format or format_rate is None
        else "an SFT cold start (mmgrpo sft) on solved examples, an easier task, or partial credit in the reward"
    )
    if max(flat) == min(flat):
        value = flat[0]
        if value == 0.0:
            return False, f"cannot learn yet: every reward is 0{fmt}: {never}; try: {start}"
        if reward_max is not None and value >= hi - edge:
            return (
                False,
                f"cannot learn yet: every reward is at the maximum {sig3(value)}: the task is solved, "
                + ("nothing to learn; try: a harder task"),
            )
        return False, (
            f"cannot learn yet: every reward is {sig3(value)}{fmt}: the reward cannot tell the samples apart "
            f"(if that is its maximum, the task is solved); try: a finer (partial-credit) reward, or a harder "
            f"task"
        )
    if mean <= lo + edge:
        return False, f"cannot learn yet: {summary}; nearly every reward is {sig3(lo)}: {never}; try: {start}"
    if mean >= hi - edge:
        return False, (
            f"cannot learn yet: {summary}; nearly every reward is at the maximum {sig3(hi)}: the task is "
            f"nearly solved; try: a harder task"
        )
    if share < VERDICT_MIN_SIGNAL_FRAC:
        return False, (
            f"cannot learn yet: {summary}; under {VERDICT_MIN_SIGNAL_FRAC:.0%} of groups give a learning "
            f"signal; try: raise grpo.group_size or grpo.temperature, give partial credit (a finer reward), "
            f"or sample until groups differ (grpo.dynamic_sampling)"
        )
    return True, f"can learn: {summary}"
