"""Episodes from a policy and environments: ``episodes`` (B tasks x G episodes, multi-turn, token in / token
out, env and tool tokens masked), ``sampling`` (row selection and the length penalties of dynamic sampling),
``evaluation`` (held-out accuracy, transcripts).
"""

from mmgrpo.rollout.episodes import RolloutBatch, Trajectory, episode_metrics, reset_group, rollout

__all__ = ["RolloutBatch", "Trajectory", "episode_metrics", "reset_group", "rollout"]
