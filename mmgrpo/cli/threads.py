"""Moved to :mod:`mmgrpo.train.threads` (the recipe ``mmgrpo.run`` sets the threads too); kept importable here."""

from mmgrpo.train.threads import cpu_cores, default_cpu_threads, set_cpu_threads

__all__ = ["cpu_cores", "default_cpu_threads", "set_cpu_threads"]
