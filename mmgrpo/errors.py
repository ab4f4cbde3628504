"""Errors that teach: every mmgrpo error says what went wrong, where (file, line, key) and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MmgrpoError(Exception):
    """Base class of every error mmgrpo raises on purpose."""


class ConfigError(MmgrpoError, ValueError):
    """A configuration file or override is invalid. Raised before any model is loaded."""


class RegistryError(MmgrpoError, KeyError):
    """An environment or verifier name is not registered, or a registration clashes."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0]) if self.args else ""


class EnvError(MmgrpoError):
    """An environment broke its protocol (bad observation, bad return shape)."""


class VerifierError(MmgrpoError):
    """A verifier broke its protocol (wrong return type or length)."""


class DataError(MmgrpoError, ValueError):
    """An episode or dataset cannot be used as given (e.g. a prompt longer than the context)."""


class FaultError(MmgrpoError):
    """Too large a share of a step's tasks or episodes failed in the environment (see mmgrpo.train.faults).

    Single failures are data (left out or ended early, and counted); past ``faults.max_failure_frac`` the
    run stops, since it would otherwise train on what is left of a broken environment.
    """


class EngineError(MmgrpoError, RuntimeError):
    """The generation engine (vLLM in its own process) failed or exited; the run's saved state is kept."""


class WarmStartError(MmgrpoError):
    """A warm start ended without the skill it was meant to teach (measured on held-out tasks), so GRPO
    from it could not succeed; the message names the skill, the measured rate and what to change."""


class NonFiniteError(MmgrpoError):
    """A reward, advantage or loss is NaN or infinite; an update with it would ruin the weights."""


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option closest to ``name`` (for 'did you mean ...?' hints), or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """A ' Did you mean 'x'?' suffix, or '' when nothing is close."""
    match = closest(name, options)
    return f" Did you mean '{match}'?" if match else ""
