"""Diagnoses of a GRPO run from its metrics: the practitioners' troubleshooting table, as checks.

:class:`Diagnostics` is fed the metrics record of each step (the dict the trainer appends to
``metrics.jsonl``) and keeps a bounded window of them. After ``warmup`` records it runs every check in
:data:`CHECKS` on that window; a check that sees its symptom returns a :class:`Finding` -- what is wrong,
the numbers that show it, and what to try -- written as one line to ``diagnostics.log`` (and to stderr)::

    mmgrpo: diagnosis: step 40: zero-variance groups: 81% of groups had all-equal rewards ...; try: raise ...

Each symptom is reported at most once per ``cooldown`` steps. The checks (thresholds are the module
constants named in each docstring):

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
reward oscillation     lr too high                                  lower lr, more tasks per step
====================== ============================================ =========================================

Many checks hold back while the reward is still improving (learning is happening, whatever the other
numbers do) or is *solved*: near ``reward_max`` when the trainer gives it (the sum of the verifier weights),
else every ``reward/<verifier>`` near 1 (verifiers that score 0..1); groups whose samples all earned the
maximum do not count as zero-variance groups. Records may lack keys (``entropy`` and
``repetition`` are newer than some runs) or hold NaN: a check without enough finite values says nothing.

:func:`repetition` is the ``repetition`` metric of a step's completions; :func:`verdict` is the summary
line of ``mmgrpo probe`` (can GRPO learn from what the model samples now?).

This module imports nothing heavy (no torch): it works on plain numbers and strings.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHECKS", "Diagnostics", "Finding", "History", "repetition", "verdict"]

PREFIX = "mmgrpo: diagnosis: "
"""How every line of a finding begins."""

HISTORY = 100
"""How many records :class:`Diagnostics` keeps (the longest window a check reads is 40)."""

DEFAULT_WARMUP = 10
DEFAULT_COOLDOWN = 50

# ---------------------------------------------------------------------------------------- shared notions
FLAT_DELTA = 0.05
"""The reward is *flat* over a window of w steps when the mean of its last w steps is less than
``FLAT_DELTA * scale`` above the mean of the w steps before (scale: ``reward_max``, else 1.0). A falling
reward is flat too."""

SOLVED_FRAC = 0.9
"""The reward is *solved* when the mean of the window is at least ``SOLVED_FRAC * reward_max`` (or, without
``reward_max``, when every ``reward/<verifier>`` mean is at least ``SOLVED_FRAC``)."""

REWARD_LOW_FRAC = 0.2
"""The reward is *low* (entropy check only, and only with ``reward_max``) below ``REWARD_LOW_FRAC *
reward_max``."""

MIN_FINITE_FRAC = 0.5
"""A window counts only when at least this share of its records hold a finite value of the key."""

# ------------------------------------------------------------------------------------------- thresholds
# Each check's docstring says how these are used. The real counting demo (tests/fixtures/
# healthy_counting_metrics.jsonl, 400 steps, accuracy 0.21 -> 1.0) peaks at: stuck zero-variance share 0.09,
# kl median 1.8, kl rise 2.3x, completion_len growth 1.03x, reward swing 0.13 per step; lowest kl mean 0.02.
ZERO_STD_WINDOW = 10
ZERO_STD_FRAC = 0.5  # as `mmgrpo probe`: most groups teach nothing

KL_LOW_WINDOW = 20
KL_LOW = 1e-3  # per-token k3 KL; a moving policy is at 1e-2 or more within a few steps
ADV_SIGNAL_MIN = 0.1

KL_HIGH_WINDOW = 10
KL_HIGH = 5.0  # per token: the policy's tokens had ~e^-6 of the reference's probability
KL_RISE_RECENT = 3
KL_RISE_BASE = 10
KL_RISE_FACTOR = 4.0
KL_RISE_MIN = 0.1

LENGTH_WINDOW = 20
LENGTH_GROWTH = 1.25
LENGTH_MIN_TOKENS = 2.0

REPETITION_WINDOW = 10
REPETITION_RISE = 0.1
REPETITION_HIGH = 0.2

ENTROPY_EARLY = 10
ENTROPY_WINDOW = 10
ENTROPY_COLLAPSE_FRAC = 0.1

OSC_WINDOW = 12
OSC_SIGN_CHANGES = 6  # iid noise alone gives about 2/3 of the 10 possible: the amplitude decides
OSC_AMPLITUDE = 0.25  # of the reward's scale; 16 tasks of 0/1 reward swing about 0.14 by sampling alone
OSC_NOISE_FACTOR = 3.0

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
)
"""The keys a record keeps in the history (besides ``step`` and every ``reward/<verifier>``)."""


# ---------------------------------------------------------------------------------------------- finding
@dataclass(frozen=True)
class Finding:
    """One diagnosis: ``symptom`` (short name), ``evidence`` (the numbers), ``remedy`` (what to try), at
    ``step``."""

    symptom: str
    evidence: str
    remedy: str
    step: int

    def line(self) -> str:
        """``mmgrpo: diagnosis: step N: <symptom>: <evidence>; try: <remedy>`` (one line)."""
        return f"{PREFIX}step {self.step}: {self.symptom}: {self.evidence}; try: {self.remedy}"


def _finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (bools are not numbers here), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------- history
class History:
    """The window of records the checks read, and the notions they share (flat, solved, low).

    ``records`` are trimmed records (``step``, the keys of ``_TRACKED``, ``reward/<verifier>``), oldest
    first. ``entropy_early``: the mean entropy of the run's first :data:`ENTROPY_EARLY` records that had one
    (None until there were that many).
    """

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        reward_max: float | None = None,
        entropy_early: float | None = None,
    ) -> None:
        self.records = list(records)
        self.reward_max = reward_max
        self.entropy_early = entropy_early

    @property
    def step(self) -> int:
        return int(self.records[-1]["step"]) if self.records else 0

    @property
    def scale(self) -> float:
        """The size of a reward: ``reward_max`` when known (and positive), else 1.0."""
        return self.reward_max if self.reward_max is not None and self.reward_max > 0 else 1.0

    def rows(self, w: int, offset: int = 0) -> list[dict[str, Any]] | None:
        """The ``w`` records that end ``offset`` records before the newest, or None when there are fewer."""
        if w <= 0 or len(self.records) < w + offset:
            return None
        end = len(self.records) - offset
        return self.records[end - w : end]

    def values(self, key: str, w: int, offset: int = 0) -> list[float] | None:
        """The finite values of ``key`` in :meth:`rows`, or None when fewer than :data:`MIN_FINITE_FRAC` of
        them (and at least one) are finite."""
        rows = self.rows(w, offset)
        if rows is None:
            return None
        values = [v for v in (_finite(r.get(key)) for r in rows) if v is not None]
        if not values or len(values) < MIN_FINITE_FRAC * w:
            return None
        return values

    def mean(self, key: str, w: int, offset: int = 0) -> float | None:
        values = self.values(key, w, offset)
        return None if values is None else _mean(values)

    def span(self, w: int, offset: int = 0) -> str:
        """``"a-b"``: the steps of :meth:`rows` (for the evidence)."""
        rows = self.rows(w, offset) or self.records
        return f"{rows[0]['step']}-{rows[-1]['step']}" if rows else "-"

    def trend(self, key: str, w: int) -> tuple[float, float] | None:
        """(mean of the ``w`` records before the last ``w``, mean of the last ``w``), or None."""
        before, recent = self.mean(key, w, offset=w), self.mean(key, w)
        if before is None or recent is None:
            return None
        return before, recent

    def flat(self, w: int) -> tuple[float, float] | None:
        """The reward's :meth:`trend` over ``w`` when it is flat (see :data:`FLAT_DELTA`), else None."""
        trend = self.trend("reward", w)
        if trend is None or trend[1] - trend[0] >= FLAT_DELTA * self.scale:
            return None
        return trend

    def solved(self, w: int) -> bool:
        """Whether the reward of the last ``w`` records is near its maximum (see :data:`SOLVED_FRAC`)."""
        if self.reward_max is not None:
            recent = self.mean("reward", w)
            return recent is not None and recent >= SOLVED_FRAC * self.reward_max
        names = {k for r in (self.rows(w) or []) for k in r if k.startswith("reward/")}
        means = [self.mean(name, w) for name in sorted(names)]
        return bool(means) and all(m is not None and m >= SOLVED_FRAC for m in means)

    def max_share(self, w: int) -> float:
        """An upper bound on the share of groups whose samples all earned the maximum reward, over the last
        ``w`` records: mean reward / ``reward_max`` when known, else the lowest ``reward/<verifier>`` mean
        (verifiers that score 0..1), else 0. Clipped to [0, 1]."""
        if self.reward_max is not None and self.reward_max > 0:
            recent = self.mean("reward", w)
            share = recent / self.reward_max if recent is not None else 0.0
        else:
            names = {k for r in (self.rows(w) or []) for k in r if k.startswith("reward/")}
            means = [m for m in (self.mean(name, w) for name in sorted(names)) if m is not None]
            share = min(means) if means else 0.0
        return min(1.0, max(0.0, share))

    def low(self, w: int) -> float | None:
        """The mean reward of the last ``w`` records when it is low (see :data:`REWARD_LOW_FRAC`), else None."""
        recent = self.mean("reward", w)
        if self.reward_max is None or recent is None or recent >= REWARD_LOW_FRAC * self.reward_max:
            return None
        return recent


def _g(x: float) -> str:
    """A number for the evidence: 3 significant digits."""
    return f"{x:.3g}"


# ------------------------------------------------------------------------------------------------ checks
def check_zero_variance(h: History) -> Finding | None:
    """A high share of zero-variance groups (all G rewards of a task equal): no learning signal.

    Groups whose samples all earn the maximum are success, not a missing signal, so only the groups that
    must be stuck below it count: ``frac_zero_std_groups`` minus the largest share of all-max groups the
    reward allows (see :meth:`History.max_share`). Fires when that averages at least :data:`ZERO_STD_FRAC`
    over the last :data:`ZERO_STD_WINDOW` steps while the reward is flat over that window (compared with the
    one before).
    """
    w = ZERO_STD_WINDOW
    frac = h.mean("frac_zero_std_groups", w)
    if frac is None:
        return None
    at_max = h.max_share(w)
    stuck = frac - at_max
    if stuck < ZERO_STD_FRAC:
        return None
    flat = h.flat(w)
    if flat is None:
        return None
    bound = f", and at most {at_max:.0%} can be all at the maximum reward" if at_max > 0 else ""
    return Finding(
        "zero-variance groups",
        f"{frac:.0%} of groups had all-equal rewards (frac_zero_std_groups, mean of steps {h.span(w)}; "
        f"threshold {ZERO_STD_FRAC:.0%}{bound}) while the reward stayed flat ({_g(flat[0])} -> "
        f"{_g(flat[1])}), so those groups give zero advantages",
        "raise grpo.group_size or grpo.temperature, give partial credit (a finer reward), add a format warm "
        "start (warm_start.steps), or sample until groups differ (grpo.dynamic_sampling)",
        h.step,
    )


def check_kl_low(h: History) -> Finding | None:
    """KL too low for many steps while the reward is flat: the policy does not move.

    Fires when ``kl`` averages below :data:`KL_LOW` over the last :data:`KL_LOW_WINDOW` steps, the
    advantages are not zero (``adv_abs_mean`` mean at least :data:`ADV_SIGNAL_MIN`; zero advantages are the
    zero-variance symptom) and the reward is flat (last half of the window against the first half). A KL
    that is exactly 0 at every step is not measured (no reference model, ``grpo.beta`` = 0): no finding.
    """
    w = KL_LOW_WINDOW
    kls = h.values("kl", w)
    adv = h.mean("adv_abs_mean", w)
    if kls is None or adv is None or adv < ADV_SIGNAL_MIN or all(k == 0.0 for k in kls):
        return None
    kl = _mean(kls)
    if kl >= KL_LOW or h.solved(w // 2):
        return None
    flat = h.flat(w // 2)
    if flat is None:
        return None
    return Finding(
        "KL too low",
        f"kl {kl:.2g} (mean of steps {h.span(w)}; threshold {KL_LOW:g}) although the advantages are not "
        f"zero (adv_abs_mean {adv:.2f}) and the reward stayed flat ({_g(flat[0])} -> {_g(flat[1])}): the "
        f"policy does not move",
        "raise grpo.lr, or lower grpo.beta",
        h.step,
    )


def check_kl_high(h: History) -> Finding | None:
    """KL too high, or exploding: the updates are too large.

    Fires when the median ``kl`` of the last :data:`KL_HIGH_WINDOW` steps is at least :data:`KL_HIGH`, or
    when each of the last :data:`KL_RISE_RECENT` steps' ``kl`` is at least :data:`KL_RISE_MIN` and
    :data:`KL_RISE_FACTOR` times the mean of the :data:`KL_RISE_BASE` steps before them (one spike is not
    enough: KL measured on a batch is noisy).
    """
    remedy = (
        "lower grpo.lr, raise grpo.beta, or take smaller steps per batch (lower grpo.num_iterations, "
        "grpo.clip_eps_low/clip_eps_high)"
    )
    n, b = KL_RISE_RECENT, KL_RISE_BASE
    recent = h.values("kl", n)
    base = h.mean("kl", b, offset=n)
    if recent is not None and base is not None and len(recent) == n:
        low = min(recent)
        if low >= KL_RISE_MIN and low >= KL_RISE_FACTOR * base:
            shown = ", ".join(_g(k) for k in recent)
            return Finding(
                "KL too high",
                f"kl grew {low / base:.1f}x or more in {n} steps: {_g(base)} (mean of steps "
                f"{h.span(b, n)}) -> {shown} (steps {h.span(n)}; threshold {KL_RISE_FACTOR:g}x and "
                f"{KL_RISE_MIN:g})",
                remedy,
                h.step,
            )
    w = KL_HIGH_WINDOW
    kls = h.values("kl", w)
    if kls is None:
        return None
    median = statistics.median(kls)
    if median < KL_HIGH:
        return None
    return Finding(
        "KL too high",
        f"kl {_g(median)} (median of steps {h.span(w)}; threshold {KL_HIGH:g}): the policy is far from the "
        f"reference",
        remedy,
        h.step,
    )


def check_length_growth(h: History) -> Finding | None:
    """Completion length growing while the reward is flat: length hacking or rambling.

    Fires when the mean ``completion_len`` of the last :data:`LENGTH_WINDOW` steps is at least
    :data:`LENGTH_GROWTH` times, and :data:`LENGTH_MIN_TOKENS` tokens more than, the mean of the window
    before, while the reward is flat over the same windows.
    """
    w = LENGTH_WINDOW
    trend = h.trend("completion_len", w)
    if trend is None:
        return None
    before, recent = trend
    if recent < LENGTH_GROWTH * before or recent - before < LENGTH_MIN_TOKENS:
        return None
    flat = h.flat(w)
    if flat is None:
        return None
    truncated = h.trend("truncated_frac", w)
    cut = f", truncated_frac {truncated[0]:.2f} -> {truncated[1]:.2f}" if truncated is not None else ""
    growth = recent / before - 1 if before > 0 else math.inf
    return Finding(
        "completion length growing",
        f"completion_len {before:.1f} -> {recent:.1f} tokens (+{growth:.0%}, steps {h.span(w, w)} vs "
        f"{h.span(w)}; threshold +{LENGTH_GROWTH - 1:.0%}){cut} while the reward stayed flat "
        f"({_g(flat[0])} -> {_g(flat[1])})",
        "penalize overlong completions in the reward, lower grpo.max_new_tokens, or aggregate the loss per "
        "token (grpo.aggregation=token)",
        h.step,
    )


def check_repetition(h: History) -> Finding | None:
    """Rising repetition in the completions: degenerate loops.

    Fires when the mean ``repetition`` (see :func:`repetition`) of the last :data:`REPETITION_WINDOW` steps
    is at least :data:`REPETITION_HIGH` and at least :data:`REPETITION_RISE` above the mean of the window
    before. The reward does not matter: a loop that still scores is a loop.
    """
    w = REPETITION_WINDOW
    trend = h.trend("repetition", w)
    if trend is None:
        return None
    before, recent = trend
    if recent < REPETITION_HIGH or recent - before < REPETITION_RISE:
        return None
    return Finding(
        "repetition rising",
        f"repetition {before:.2f} -> {recent:.2f} (share of repeated n-grams in the completions, steps "
        f"{h.span(w, w)} vs {h.span(w)}; threshold +{REPETITION_RISE:g} and {REPETITION_HIGH:g})",
        "add an entropy bonus or lower grpo.lr, and penalize repetition in the reward (rather than lowering "
        "the temperature)",
        h.step,
    )


def check_entropy_collapse(h: History) -> Finding | None:
    """Entropy collapse: premature convergence.

    Fires when the mean ``entropy`` of the last :data:`ENTROPY_WINDOW` steps is at most
    :data:`ENTROPY_COLLAPSE_FRAC` of its early value (the mean of the run's first :data:`ENTROPY_EARLY`
    values) while the reward is not solved and is flat or low (see :data:`REWARD_LOW_FRAC`).
    """
    w = ENTROPY_WINDOW
    early, recent = h.entropy_early, h.mean("entropy", w)
    if early is None or early <= 0 or recent is None or recent > ENTROPY_COLLAPSE_FRAC * early:
        return None
    if h.solved(w):
        return None
    flat, low = h.flat(w), h.low(w)
    if flat is not None:
        why = f"while the reward stayed flat ({_g(flat[0])} -> {_g(flat[1])})"
    elif low is not None:
        why = f"while the reward is low ({_g(low)} of at most {_g(h.scale)})"
    else:
        return None
    return Finding(
        "entropy collapse",
        f"entropy {_g(recent)} (mean of steps {h.span(w)}) is {recent / early:.0%} of its early value "
        f"{_g(early)} (threshold {ENTROPY_COLLAPSE_FRAC:.0%}) {why}",
        "add an entropy bonus, raise grpo.temperature, or clip higher (grpo.clip_eps_high=0.28)",
        h.step,
    )


def check_reward_oscillation(h: History) -> Finding | None:
    """Reward oscillation: the reward swings up and down by large steps, a sign of a learning rate too high.

    Over the last :data:`OSC_WINDOW` steps, fires when the step-to-step difference of ``reward`` changes
    sign at least :data:`OSC_SIGN_CHANGES` times and its mean size is at least :data:`OSC_AMPLITUDE` times
    the reward's scale (``reward_max``, else 1.0) and at least :data:`OSC_NOISE_FACTOR` times what sampling
    alone gives (about ``1.13 * reward_std_within_group / sqrt(num_episodes)``, when both are logged).
    """
    w = OSC_WINDOW
    rows = h.rows(w)
    if rows is None:
        return None
    maybe = [_finite(r.get("reward")) for r in rows]
    rewards = [r for r in maybe if r is not None]
    if len(rewards) < len(maybe):  # a gap would fake a swing
        return None
    diffs = [rewards[i + 1] - rewards[i] for i in range(len(rewards) - 1)]
    signs = [d for d in diffs if d != 0.0]
    changes = sum((signs[i] > 0) != (signs[i + 1] > 0) for i in range(len(signs) - 1))
    amplitude = _mean([abs(d) for d in diffs])
    if changes < OSC_SIGN_CHANGES or amplitude < OSC_AMPLITUDE * h.scale:
        return None
    std, n = h.mean("reward_std_within_group", w), h.mean("num_episodes", w)
    noise = ""
    if std is not None and n is not None and n > 0:
        expected = 1.13 * std / math.sqrt(n)
        if amplitude < OSC_NOISE_FACTOR * expected:
            return None
        noise = f", {amplitude / expected:.0f}x what sampling alone gives" if expected > 0 else ""
    return Finding(
        "reward oscillation",
        f"the reward moved {_g(amplitude)} per step on average and changed direction {changes} times in "
        f"steps {h.span(w)} (range {_g(min(rewards))}..{_g(max(rewards))}; thresholds {OSC_SIGN_CHANGES} "
        f"changes and {_g(OSC_AMPLITUDE * h.scale)} per step{noise})",
        "lower grpo.lr, or raise grpo.tasks_per_step (more tasks per step average the update)",
        h.step,
    )


CHECKS: tuple[Callable[[History], Finding | None], ...] = (
    check_zero_variance,
    check_kl_low,
    check_kl_high,
    check_length_growth,
    check_repetition,
    check_entropy_collapse,
    check_reward_oscillation,
)
"""Every check :class:`Diagnostics` runs, in this order (the order of the findings of one step)."""


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
        if reward_max is not None and _finite(reward_max) is None:
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
        entropy = _finite(record.get("entropy"))
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
        return _mean(self.entropy_first) if len(self.entropy_first) >= ENTROPY_EARLY else None

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
            out[key] = float(value) if _finite(value) is not None else None
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
    groups = [[float(r) for r in group if _finite(r) is not None] for group in rewards_by_group]
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
    mean = _mean(flat)
    lo = min(0.0, min(flat))
    hi = float(reward_max) if reward_max is not None else max(flat)
    edge = VERDICT_EDGE_FRAC * (hi - lo) if hi > lo else 0.0
    fmt = f", format rate {format_rate:.2f}" if format_rate is not None else ""
    summary = f"{share:.0%} of groups ({varied}/{n}) have reward variance, mean reward {_g(mean)}{fmt}"
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
                f"cannot learn yet: every reward is at the maximum {_g(value)}: the task is solved, "
                + ("nothing to learn; try: a harder task"),
            )
        return False, (
            f"cannot learn yet: every reward is {_g(value)}{fmt}: the reward cannot tell the samples apart "
            f"(if that is its maximum, the task is solved); try: a finer (partial-credit) reward, or a harder "
            f"task"
        )
    if mean <= lo + edge:
        return False, f"cannot learn yet: {summary}; nearly every reward is {_g(lo)}: {never}; try: {start}"
    if mean >= hi - edge:
        return False, (
            f"cannot learn yet: {summary}; nearly every reward is at the maximum {_g(hi)}: the task is "
            f"nearly solved; try: a harder task"
        )
    if share < VERDICT_MIN_SIGNAL_FRAC:
        return False, (
            f"cannot learn yet: {summary}; under {VERDICT_MIN_SIGNAL_FRAC:.0%} of groups give a learning "
            f"signal; try: raise grpo.group_size or grpo.temperature, give partial credit (a finer reward), "
            f"or sample until groups differ (grpo.dynamic_sampling)"
        )
    return True, f"can learn: {summary}"
