"""``hub.push``: the final model folder, with its model card, uploaded to the Hugging Face hub.

Access is checked before training (:func:`check_hub_access`: huggingface_hub installed, a token found), so
that a run does not train for hours and then fail to push; the upload itself (:func:`push_to_hub`) runs
after the final model is saved, and a failure there says that the model is safe on disk.
"""

from __future__ import annotations

from pathlib import Path

from mmgrpo.config.core import Config
from mmgrpo.errors import ConfigError, MmgrpoError


def repo_id(cfg: Config) -> str:
    """hub.repo_id, or output_dir's folder name (the hub puts it under the token's account)."""
    return cfg.hub.repo_id or Path(cfg.output_dir).resolve().name


def check_hub_access(cfg: Config) -> None:
    """With hub.push: a ConfigError now, before any training, when the push could not happen."""
    if not cfg.hub.push:
        return
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(
            "hub.push: true needs the huggingface_hub package (pip install huggingface_hub); or set hub.push: "
            "false (the final model is saved in output_dir/final either way)"
        ) from None
    if not huggingface_hub.get_token():
        raise ConfigError(
            f"hub.push: true, but no Hugging Face token was found to push '{repo_id(cfg)}': log in with "
            "`hf auth login` (or set HF_TOKEN), or set hub.push: false (the final model is saved in "
            "output_dir/final either way). Nothing was trained."
        )


def push_to_hub(cfg: Config, folder: Path) -> str:
    """Upload ``folder`` (the final model) to hub.repo_id, creating the repository; returns its URL."""
    from huggingface_hub import HfApi

    api, name = HfApi(), repo_id(cfg)
    try:
        repo = api.create_repo(name, private=cfg.hub.private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo.repo_id, commit_message="mmgrpo: final model")
    except Exception as exc:  # network, permissions: the model is on disk, say so
        raise MmgrpoError(
            f"hub.push: uploading {folder} to '{name}' failed ({type(exc).__name__}: {exc}); the model is saved "
            f"in {folder}: push it later with `hf upload {name} {folder}`"
        ) from None
    return str(repo.url)
