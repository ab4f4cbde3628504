"""Built-in environments, installed as the package ``mmgrpo.envs`` (one environment per module).

Each is registered by name through the ``mmgrpo.envs`` entry-point group in pyproject.toml
(e.g. ``counting = "mmgrpo.envs.counting:CountingEnv"``) and built with ``mmgrpo.registry.make_env``.
Modules are imported on demand, so importing this package is cheap.
"""
