"""Training side of the EAGLE toolkit: conversation data, FR-Spec token maps, draft heads."""

from pathlib import Path

from omegaconf import OmegaConf


def target_name(path: str) -> str:
    """model.name's default (`${target_name:${model.path}}`, conf/model/): the embedded default's
    name for it, else the target folder's name, so that a run on another target does not file its
    work, token maps and published card under the default's name."""
    from eagle_infer.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME

    if str(path) in (DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME
    return Path(str(path)).expanduser().absolute().name or str(path)


# registered on import, before Hydra composes a config (python -m eagle_train, tests' compose)
OmegaConf.register_new_resolver("target_name", target_name, replace=True)
