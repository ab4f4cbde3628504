"""Faults of a training run, counted: a bad task, episode or verifier is data, not a crash.

A run meets three kinds of faults, and none of them should stop it on its own:

- an env raises in ``reset()``: that task is left out of the step (``env_reset_failures``);
- an env raises in ``step()``: that episode ends there and is kept, with the reward its verifiers give
  (``env_step_failures``);
- a verifier raises or returns a bad value: it scores 0.0 for that episode (``verifier_failures``, fed
  from :class:`mmgrpo.verifier.RewardBreakdown`).

:class:`FaultTracker` counts them for the whole run (``faults/...`` in the metrics log), writes one line per
env fault to the run's ``warnings.log``, shows the first few on stderr, and shows each kind of verifier
failure once. It stops the run with :class:`~mmgrpo.errors.FaultError` only when more than
``max_failure_frac`` of one step's tasks or episodes failed: past that share the env is broken, and training
on what is left of it would only hide that. Its :meth:`~FaultTracker.state_dict` goes into checkpoints, so a
resumed run neither resets the counts nor shows the same warnings again.

:func:`check_finite` is the guard before an update: it names the verifier, the advantages or the loss that
turned NaN or infinite (the caller skips the batch, see :meth:`FaultTracker.skipped_batch`, or raises
:class:`~mmgrpo.errors.NonFiniteError`).

This module knows nothing about models or environments; torch is imported only by :func:`check_finite`.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmgrpo.errors import ConfigError, FaultError

if TYPE_CHECKING:
    import torch

__all__ = ["FaultTracker", "check_finite", "verifier_fault_kind"]

PREFIX = "mmgrpo: warning: "
"""How every line this module writes begins (the trainer's other warnings begin the same way)."""

KIND_CHARS = 60
"""How much of a failure message names its kind when no exception type can be found in it."""

_NAME_AT_START = re.compile(r"(?i)^verifier '([^']*)'")
_EPISODE_PREFIX = re.compile(r"^ failed on (?:all \d+ episodes|episode \d+): ")
_NON_FINITE = re.compile(r"^ returned (-?inf|nan) for episode \d+")
_BAD_TYPE = re.compile(r"^ returned (\w+) \(.*\) for episode \d+", re.DOTALL)
_TYPE_NAME = re.compile(r"^([A-Za-z_][\w.]*):(?:\s|$)")  # "ValueError: bad", "KeyError: 'answer'"


def verifier_fault_kind(message: str, names: list[str] | None = None) -> tuple[str, str]:
    """(verifier name, kind label) of a failure message from :meth:`mmgrpo.verifier.Rewards.score`.

    The messages have these forms (see ``_score_forgiving`` and ``_as_float`` in mmgrpo/verifier.py)::

        verifier 'x' failed on all 8 episodes: ValueError: bad          -> ('x', 'ValueError')
        verifier 'x' failed on episode 3: KeyError: 'answer'            -> ('x', 'KeyError')
        verifier 'x' failed on all 8 episodes: Batched verifier 'x' returned 3 values for 8 episodes; ...
                                                                         -> ('x', "Batched verifier 'x' ...")
        Verifier 'x' returned nan for episode 3; rewards must be finite. -> ('x', 'returned nan')
        Verifier 'x' returned str ('7') for episode 3; a verifier ...    -> ('x', 'returned str')

    Without an exception type, the kind is the first :data:`KIND_CHARS` characters of the description with
    every number written ``#``, so that episode indices and counts do not make a new kind each step. The
    name is the known name (``names``, longest first) the message starts with, else the first quoted word,
    else ``"?"``.
    """
    name, rest = _split_name(message, names or [])
    if match := _NON_FINITE.match(rest):
        return name, f"returned {match.group(1)}"
    if match := _BAD_TYPE.match(rest):
        return name, f"returned {match.group(1)}"
    description = _EPISODE_PREFIX.sub("", rest, count=1)
    if match := _TYPE_NAME.match(description):
        return name, match.group(1)
    return name, re.sub(r"\d+", "#", description[:KIND_CHARS]).strip()


def _split_name(message: str, names: list[str]) -> tuple[str, str]:
    """(name, what follows "verifier 'name'") -- or (a best guess, the whole message) for other forms."""
    lowered = message.lower()
    for name in sorted(names, key=len, reverse=True):  # longest first: "a' b" before "a"
        head = f"verifier '{name}'"
        if lowered.startswith(head.lower()):
            return name, message[len(head) :]
    if match := _NAME_AT_START.match(message):
        return match.group(1), message[match.end() :]
    quoted = re.search(r"'([^']+)'", message)
    return (quoted.group(1) if quoted else "?"), message


class FaultTracker:
    """Counts the faults of one training run; one instance per run (and per process).

    ``env_name`` labels the lines. ``log_path`` is the run's ``warnings.log``: every line is appended to it
    (None: nothing is written). ``max_failure_frac``: the share of one step's tasks (or episodes) whose env
    may fail before the run stops with :class:`FaultError`; exactly that share is still allowed, and 1.0
    never stops. ``echo_limit``: how many env-fault and skipped-batch lines go to stderr in the whole run
    (the rest go only to the log file). ``echo=False`` prints nothing (the non-main processes of a
    distributed run).
    """

    def __init__(
        self,
        env_name: str,
        log_path: Path | None,
        *,
        max_failure_frac: float = 0.5,
        echo_limit: int = 5,
        echo: bool = True,
    ) -> None:
        if (
            isinstance(max_failure_frac, bool)
            or not isinstance(max_failure_frac, (int, float))
            or not 0.0 <= max_failure_frac <= 1.0
        ):
            raise ConfigError(
                f"faults.max_failure_frac must be a number from 0 to 1 (the share of a step's tasks or "
                f"episodes whose env may fail; 1.0 never stops the run), got {max_failure_frac!r}."
            )
        if isinstance(echo_limit, bool) or not isinstance(echo_limit, int) or echo_limit < 0:
            raise ConfigError(f"FaultTracker: echo_limit must be an int >= 0, got {echo_limit!r}.")
        self.env_name = env_name
        self.log_path = Path(log_path) if log_path is not None else None
        self.max_failure_frac = float(max_failure_frac)
        self.echo_limit = echo_limit
        self.echo = echo
        self.env_reset = 0
        self.env_step = 0
        self.skipped_batches = 0
        self.verifier: dict[str, int] = {}
        self.shown_kinds: set[tuple[str, str]] = set()
        self.all_failed_shown: set[str] = set()
        self.echoed = 0
        self.echo_notice_shown = False

    # ------------------------------------------------------------------------------------------ env
    def env_reset_failures(self, step: int, failed: list[tuple[int, str]], total_tasks: int) -> None:
        """Tasks whose env raised in ``reset()`` (``(seed, message)`` each) were left out of ``step``.

        Counts and logs each; raises :class:`FaultError` when more than ``max_failure_frac`` of the step's
        ``total_tasks`` failed.
        """
        _check_total(failed, total_tasks, "total_tasks")
        for seed, message in failed:
            self._echo_limited(
                f"{PREFIX}step {step}: env '{self.env_name}' failed to reset task seed {seed}: {message}; "
                f"the task was left out"
            )
        self.env_reset += len(failed)
        self._check_share(step, failed, total_tasks, "failed to reset", "tasks", "reset")

    def env_step_failures(self, step: int, failed: list[tuple[int, str]], total_episodes: int) -> None:
        """Episodes whose env raised in ``step()`` (``(seed, message)`` each) ended there.

        They are kept as data, with the reward their verifiers give. Counts and logs each; raises
        :class:`FaultError` when more than ``max_failure_frac`` of the step's ``total_episodes`` failed.
        """
        _check_total(failed, total_episodes, "total_episodes")
        for seed, message in failed:
            self._echo_limited(
                f"{PREFIX}step {step}: env '{self.env_name}' raised in step() on task seed {seed}: {message}; "
                f"the episode ended there"
            )
        self.env_step += len(failed)
        self._check_share(step, failed, total_episodes, "raised in step() on", "episodes", "step")

    def _check_share(
        self, step: int, failed: list[tuple[int, str]], total: int, verb: str, unit: str, method: str
    ) -> None:
        if not failed:
            return
        share = len(failed) / total
        if share <= self.max_failure_frac:
            return
        seed, message = failed[0]
        error = (
            f"step {step}: env '{self.env_name}' {verb} {len(failed)} of {total} {unit} ({share:.0%}), more "
            f"than faults.max_failure_frac = {self.max_failure_frac:g}; first: seed {seed}: {message}. Fix the "
            f"env ({method}() on seed {seed} reproduces it), or raise faults.max_failure_frac (1.0 never stops "
            f"the run)."
        )
        self._write(f"mmgrpo: error: {error}")
        raise FaultError(error)

    # ------------------------------------------------------------------------------------ verifiers
    def verifier_failures(self, step: int, failures: dict[str, int], errors: list[str], n: int) -> None:
        """Count one step's verifier failures (``RewardBreakdown.failures`` and ``.errors``, ``n`` episodes).

        The first message of each kind (verifier name and exception type, see :func:`verifier_fault_kind`)
        is shown once per run. A verifier that failed on all ``n`` episodes is reported once per run as
        well: it scores 0 everywhere, which trains on nothing while looking like a hard task.
        """
        names = list(failures)
        for name, count in failures.items():
            self.verifier[name] = self.verifier.get(name, 0) + int(count)
        for message in errors:
            kind = verifier_fault_kind(message, names)
            if kind in self.shown_kinds:
                continue
            self.shown_kinds.add(kind)
            name, label = kind
            self._show(
                f"{PREFIX}step {step}: {message} (first '{label}' failure of verifier '{name}': it scores 0.0 "
                f"there; more of this kind are only counted, in faults/verifier/{name})"
            )
        for name, count in failures.items():
            if n > 0 and count >= n and name not in self.all_failed_shown:
                self.all_failed_shown.add(name)
                first = next((e for e in errors if verifier_fault_kind(e, names)[0] == name), "not kept")
                self._show(
                    f"{PREFIX}step {step}: verifier '{name}' failed on all {n} episodes, so it scores 0 for "
                    f"every one: that trains on nothing while looking like a hard task. First error: {first}. "
                    f"Fix the verifier (mmgrpo.verifier.check_verifier runs it strictly and raises)"
                )

    # -------------------------------------------------------------------------------------- batches
    def skipped_batch(self, step: int, reason: str) -> None:
        """The update of ``step`` was skipped (``reason``: why, e.g. from :func:`check_finite`)."""
        self.skipped_batches += 1
        self._echo_limited(f"{PREFIX}step {step}: the batch was skipped, no update: {reason}")

    # -------------------------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        """The run's cumulative counts, for the metrics log (every verifier seen so far is listed)."""
        out = {
            "faults/env_reset": float(self.env_reset),
            "faults/env_step": float(self.env_step),
            "faults/skipped_batches": float(self.skipped_batches),
        }
        out.update({f"faults/verifier/{name}": float(count) for name, count in self.verifier.items()})
        return out

    # ------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Counts and what was already shown, as plain python types (a checkpoint can json-dump it)."""
        return {
            "env_reset": self.env_reset,
            "env_step": self.env_step,
            "skipped_batches": self.skipped_batches,
            "verifier": dict(self.verifier),
            "shown_kinds": [[name, label] for name, label in sorted(self.shown_kinds)],
            "all_failed_shown": sorted(self.all_failed_shown),
            "echoed": self.echoed,
            "echo_notice_shown": self.echo_notice_shown,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: counts go on from there, shown warnings are not shown again."""
        try:
            self.env_reset = int(state["env_reset"])
            self.env_step = int(state["env_step"])
            self.skipped_batches = int(state["skipped_batches"])
            self.verifier = {str(k): int(v) for k, v in state["verifier"].items()}
            self.shown_kinds = {(str(name), str(label)) for name, label in state["shown_kinds"]}
            self.all_failed_shown = {str(name) for name in state["all_failed_shown"]}
            self.echoed = int(state["echoed"])
            self.echo_notice_shown = bool(state["echo_notice_shown"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"FaultTracker.load_state_dict: not a FaultTracker state ({type(exc).__name__}: {exc}); pass "
                f"what FaultTracker.state_dict() returned, or start the tracker fresh."
            ) from exc

    # ---------------------------------------------------------------------------------------- output
    def _echo_limited(self, line: str) -> None:
        """Write ``line`` to the log file; print it too while the run's echo budget lasts."""
        self._write(line)
        if not self.echo:
            return
        if self.echoed < self.echo_limit:
            self.echoed += 1
            _print(line)
        elif not self.echo_notice_shown:
            self.echo_notice_shown = True
            where = (
                f"written only to {self.log_path}"
                if self.log_path is not None
                else "not shown (no log file); see the faults/ counts in the metrics log"
            )
            _print(
                f"{PREFIX}more than {self.echo_limit} env faults or skipped batches; further ones are {where}"
            )

    def _show(self, line: str) -> None:
        """Write ``line`` to the log file and print it (a once-per-run line)."""
        self._write(line)
        if self.echo:
            _print(line)

    def _write(self, line: str) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_total(failed: list[tuple[int, str]], total: int, what: str) -> None:
    if total < len(failed):
        raise ValueError(
            f"FaultTracker: {what}={total} is less than the {len(failed)} failures reported; pass the number "
            f"of tasks (or episodes) the step attempted, failed ones included."
        )


# ------------------------------------------------------------------------------------------- finite
def check_finite(
    step: int,
    per_verifier: dict[str, torch.Tensor],
    advantages: torch.Tensor | None = None,
    loss: float | None = None,
) -> str | None:
    """None when everything given is finite, else one line naming ``step`` and the culprit.

    The first stage holding NaN or inf is named, since the later ones inherit it: the verifier(s) whose
    rewards hold NaN/inf (with how many rows), else the advantages, else the loss.
    """
    import torch

    bad: list[str] = []
    for name, values in per_verifier.items():
        values = torch.as_tensor(values)
        counts = _non_finite(values)
        if counts:
            bad.append(f"verifier '{name}' returned {counts} of {values.numel()} episodes")
    if bad:
        return (
            f"step {step}: {'; '.join(bad)}; a reward must be a finite number: fix the verifier "
            f"(mmgrpo.verifier.check_verifier runs it strictly and raises on nan/inf)"
        )
    if advantages is not None:
        counts = _non_finite(advantages)
        if counts:
            unit = "episodes" if advantages.dim() == 1 else "entries"
            return (
                f"step {step}: the advantages hold {counts} of {advantages.numel()} {unit} although every "
                f"verifier's rewards are finite; likely a reward of huge magnitude (the group's std "
                f"overflows): keep rewards within a few units, or lower the verifier weights"
            )
    if loss is not None:
        loss = float(loss)
        if not math.isfinite(loss):
            return (
                f"step {step}: the loss is {loss} although the rewards and advantages are finite; likely "
                f"causes: a learning rate too high (lower grpo.lr), a reward of huge magnitude, or half "
                f"precision overflowing (model.dtype=bfloat16 rather than float16)"
            )
    return None


def _non_finite(values: torch.Tensor) -> str:
    """'nan for 2', 'inf for 1', 'nan for 2 and inf for 1', or '' when every value is finite."""
    import torch

    if not values.is_floating_point():
        return ""
    nan = int(torch.isnan(values).sum())
    inf = int(torch.isinf(values).sum())
    parts = ([f"nan for {nan}"] if nan else []) + ([f"inf for {inf}"] if inf else [])
    return " and ".join(parts)
