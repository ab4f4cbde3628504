"""The checks behind :class:`mmgrpo.train.diagnostics.Diagnostics` (its docstring has the table of them).

A check reads a :class:`History` (the window of a run's metrics records and the notions the checks share)
and, when it sees its symptom, returns a :class:`Finding` -- what is wrong, the numbers that show it, and
what to try. :data:`CHECKS` lists them; the thresholds are the module constants named in each docstring.

Many checks hold back while the reward is still improving (learning is happening, whatever the other
numbers do) or is *solved*: near ``reward_max`` when the trainer gives it (the sum of the verifier weights),
else every ``reward/<verifier>`` near 1 (verifiers that score 0..1); groups whose samples all earned the
maximum do not count as zero-variance groups. Records may lack keys (``entropy`` and
``repetition`` are newer than some runs) or hold NaN: a check without enough finite values says nothing.

This module imports nothing heavy (no torch): it works on plain numbers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "mmgrpo: diagnosis: "
"""How every line of a finding begins."""

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

ANSWER_WINDOW = 20
ANSWER_COVERAGE_LOW = 0.8  # a policy answering only 1, 3 and 5 to counts of 1 to 5 covers 0.6

OSC_WINDOW = 12
OSC_SIGN_CHANGES = 6  # iid noise alone gives about 2/3 of the 10 possible: the amplitude decides
OSC_AMPLITUDE = 0.25  # of the reward's scale; 16 tasks of 0/1 reward swing about 0.14 by sampling alone
OSC_NOISE_FACTOR = 3.0


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


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (bools are not numbers here), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def mean_of(values: Sequence[float]) -> float:
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------- history
class History:
    """The window of records the checks read, and the notions they share (flat, solved, low).

    ``records`` are trimmed records (``step``, the keys of ``mmgrpo.train.diagnostics._TRACKED``,
    ``reward/<verifier>``), oldest first. ``entropy_early``: the mean entropy of the run's first
    :data:`ENTROPY_EARLY` records that had one (None until there were that many).
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
        values = [v for v in (finite(r.get(key)) for r in rows) if v is not None]
        if not values or len(values) < MIN_FINITE_FRAC * w:
            return None
        return values

    def mean(self, key: str, w: int, offset: int = 0) -> float | None:
        values = self.values(key, w, offset)
        return None if values is None else mean_of(values)

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


def sig3(x: float) -> str:
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
        f"threshold {ZERO_STD_FRAC:.0%}{bound}) while the reward stayed flat ({sig3(flat[0])} -> "
        f"{sig3(flat[1])}), so those groups give zero advantages",
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
    kl = mean_of(kls)
    if kl >= KL_LOW or h.solved(w // 2):
        return None
    flat = h.flat(w // 2)
    if flat is None:
        return None
    return Finding(
        "KL too low",
        f"kl {kl:.2g} (mean of steps {h.span(w)}; threshold {KL_LOW:g}) although the advantages are not "
        f"zero (adv_abs_mean {adv:.2f}) and the reward stayed flat ({sig3(flat[0])} -> {sig3(flat[1])}): the "
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
            shown = ", ".join(sig3(k) for k in recent)
            return Finding(
                "KL too high",
                f"kl grew {low / base:.1f}x or more in {n} steps: {sig3(base)} (mean of steps "
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
        f"kl {sig3(median)} (median of steps {h.span(w)}; threshold {KL_HIGH:g}): the policy is far from the "
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
        f"({sig3(flat[0])} -> {sig3(flat[1])})",
        "penalize overlong completions in the reward, lower grpo.max_new_tokens, or aggregate the loss per "
        "token (grpo.aggregation=token)",
        h.step,
    )


def check_repetition(h: History) -> Finding | None:
    """Rising repetition in the completions: degenerate loops.

    Fires when the mean ``repetition`` (see :func:`mmgrpo.train.diagnostics.repetition`) of the last
    :data:`REPETITION_WINDOW` steps is at least :data:`REPETITION_HIGH` and at least :data:`REPETITION_RISE`
    above the mean of the window before. The reward does not matter: a loop that still scores is a loop.
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
        why = f"while the reward stayed flat ({sig3(flat[0])} -> {sig3(flat[1])})"
    elif low is not None:
        why = f"while the reward is low ({sig3(low)} of at most {sig3(h.scale)})"
    else:
        return None
    return Finding(
        "entropy collapse",
        f"entropy {sig3(recent)} (mean of steps {h.span(w)}) is {recent / early:.0%} of its early value "
        f"{sig3(early)} (threshold {ENTROPY_COLLAPSE_FRAC:.0%}) {why}",
        "add an entropy bonus, raise grpo.temperature, or clip higher (grpo.clip_eps_high=0.28)",
        h.step,
    )


def check_answer_collapse(h: History) -> Finding | None:
    """Answer collapse: the policy no longer samples some of the right answers at all.

    Fires when the mean ``answer_coverage`` (the share of a step's true answers that some episode gave,
    logged for tasks with a few short answers) of the last :data:`ANSWER_WINDOW` steps is below
    :data:`ANSWER_COVERAGE_LOW` while the reward is not solved. Its groups then agree on the wrong answers
    for those tasks and nothing rewards the missing ones back: a count that answers only 1, 3 and 5 stays
    there (mmgrpo's counting_hard runs that did so ended near 0.5).
    """
    w = ANSWER_WINDOW
    coverage = h.mean("answer_coverage", w)
    if coverage is None or coverage >= ANSWER_COVERAGE_LOW or h.solved(w):
        return None
    return Finding(
        "answer collapse",
        f"the episodes gave {coverage:.0%} of their tasks' true answers (mean of steps {h.span(w)}; threshold "
        f"{ANSWER_COVERAGE_LOW:.0%}): the other answers are never sampled, so no group can reward them",
        "look at which answers it gives (`mmgrpo eval` prints them per true answer); keep GRPO off the "
        "answers' output rows (grpo.freeze_embeddings: true; counting_hard's fix); a KL anchor (grpo.beta 0.02) "
        "keeps every answer sampled but slows the climb",
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
    maybe = [finite(r.get("reward")) for r in rows]
    rewards = [r for r in maybe if r is not None]
    if len(rewards) < len(maybe):  # a gap would fake a swing
        return None
    diffs = [rewards[i + 1] - rewards[i] for i in range(len(rewards) - 1)]
    signs = [d for d in diffs if d != 0.0]
    changes = sum((signs[i] > 0) != (signs[i + 1] > 0) for i in range(len(signs) - 1))
    amplitude = mean_of([abs(d) for d in diffs])
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
        f"the reward moved {sig3(amplitude)} per step on average and changed direction {changes} times in "
        f"steps {h.span(w)} (range {sig3(min(rewards))}..{sig3(max(rewards))}; thresholds {OSC_SIGN_CHANGES} "
        f"changes and {sig3(OSC_AMPLITUDE * h.scale)} per step{noise})",
        "lower grpo.lr, or raise grpo.tasks_per_step (more tasks per step average the update)",
        h.step,
    )


CHECKS: tuple[Callable[[History], Finding | None], ...] = (
    check_zero_variance,
    check_kl_low,
    check_kl_high,
    check_length_growth,
    check_repetition,
    check_answer_collapse,
    check_entropy_collapse,
    check_reward_oscillation,
)
"""Every check :class:`~mmgrpo.train.diagnostics.Diagnostics` runs, in this order (the order of the
findings of one step)."""
