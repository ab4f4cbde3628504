"""The sections of what a run does beside training: ``logging`` (trackers, saved samples), ``faults`` (what a
failing env or verifier, or a non-finite number, does to the run) and ``hub`` (pushing the final model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mmgrpo.config.types import Section


@dataclass(frozen=True)
class LoggingConfig(Section):
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers, through accelerate's log_with: tensorboard, wandb, mlflow, comet_ml, aim,
    clearml, dvclive (each needs its package). metrics.jsonl in output_dir is always written."""
    project: str = "mmgrpo"
    """Project / experiment name given to the trackers."""
    samples_every: int = 0
    """Every N steps, write some of the step's episodes (prompt, completion, rewards) to
    output_dir/samples/step-N.jsonl; 0 = never."""
    samples_per_step: int = 8
    """How many episodes a samples file holds."""

    def _validate(self) -> None:
        known = (
            "tensorboard",
            "wandb",
            "mlflow",
            "comet_ml",
            "aim",
            "clearml",
            "dvclive",
            "swanlab",
            "trackio",
        )
        for t in self.report_to:
            self._require(t in known, "report_to", f"must list trackers among {', '.join(known)}")
        self._require(self.samples_every >= 0, "samples_every", "must be >= 0")
        self._require(self.samples_per_step >= 1, "samples_per_step", "must be >= 1")


@dataclass(frozen=True)
class FaultsConfig(Section):
    max_failure_frac: float = 0.5
    """An env that raises in reset() or step() fails that task or episode only (counted, logged with its
    seed); when more than this share of a step's tasks or episodes fail, the run stops. 1 = never stop."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN or infinite reward, advantage or loss: stop the run naming the step and the verifier, or skip
    the batch (no update) and count it in faults/skipped_batches."""

    def _validate(self) -> None:
        self._require(0 <= self.max_failure_frac <= 1, "max_failure_frac", "must be in [0, 1]")


@dataclass(frozen=True)
class HubConfig(Section):
    push: bool = False
    """After training, upload the final model folder (weights, processor, model card README.md, config) to
    the Hugging Face hub (TRL's push_to_hub). Needs a token (`hf auth login` or HF_TOKEN), checked before
    training starts."""
    repo_id: str = ""
    """The hub repository, "user/name" (TRL's hub_model_id); empty = output_dir's folder name under your
    account."""
    private: bool = True
    """Create the repository as private when it does not exist yet."""
