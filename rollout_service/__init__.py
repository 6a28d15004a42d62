"""rollout_service: reward groups for RL post-training, generated on vLLM against step-driven environments."""

from importlib import metadata


def installed_version() -> str:
    """The version of the installed package (pyproject.toml is its one source)."""
    try:
        return metadata.version("rollout-service")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


__version__ = installed_version()
