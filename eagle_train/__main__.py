"""python -m eagle_train [stage=capture|tokenmap|train|eval|pipeline|export|publish] [key=value ...]

Hydra composes conf/config.yaml with the overrides; `eagle_train.pipeline` runs the stage.
Relative paths resolve against the directory the command runs in; Hydra's own log and
config go to ${workdir}/hydra/<stage>-<timestamp>. Problems the user can fix (a bad
override, a missing file, a capture made for another model) print one `error: ...` line and
exit with status 2; set HYDRA_FULL_ERROR=1 for the full traceback instead.
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from eagle_infer.errors import UserError
from eagle_infer.shipped import shipped_dir

USER_ERRORS = (UserError, FileNotFoundError, HydraException, OmegaConfBaseException)
# conf/ as an absolute path (the checkout's, or the copy a wheel installs): Hydra would
# otherwise read a relative config_path as a Python package whenever main() is imported (a
# console script, tests) instead of run with `python -m`.
CONF_DIR = str(shipped_dir("conf"))


_USER_WANTS_TRACE = os.environ.get("HYDRA_FULL_ERROR") == "1"


def one_line(e: BaseException) -> str:
    msg = str(e).split("Config search path")[0]  # Hydra's search-path dump: noise to a user
    return " ".join(msg.split()) or type(e).__name__


def fail(e: BaseException) -> None:
    if _USER_WANTS_TRACE:
        raise e
    print(f"error: {one_line(e)}", file=sys.stderr)
    sys.exit(2)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    from eagle_train.pipeline import main_task

    # Handled here, not by Hydra (which would add an "Error executing job" line first).
    try:
        main_task(cfg)
    except USER_ERRORS as e:
        fail(e)


def main() -> None:
    # Let Hydra's own errors (bad overrides, unknown config groups) reach us instead of being
    # printed with a stack-trace hint, so every user error looks the same.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except USER_ERRORS as e:
        fail(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
