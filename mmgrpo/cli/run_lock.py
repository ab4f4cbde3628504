"""Moved to :mod:`mmgrpo.train.run_lock` (the recipe ``mmgrpo.run`` takes the lock too); kept importable here."""

from mmgrpo.train.run_lock import LOCK_NAME, RunLock, RunLockedError, is_launch_main_process

__all__ = ["LOCK_NAME", "RunLock", "RunLockedError", "is_launch_main_process"]
