"""Folders the project ships beside its code: `conf/` (Hydra configs) and `heads/` (the
reference draft heads).

In a source checkout (and an editable install) they sit at the repository root. A wheel has
no repository root, so pyproject.toml maps them into the packages (`eagle_train/_conf`,
`eagle_infer/_heads`); this module finds whichever is there, checkout first.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# name at the repository root -> where a wheel installs it
_INSTALLED = {
    "conf": _PACKAGE_ROOT / "eagle_train" / "_conf",
    "heads": _PACKAGE_ROOT / "eagle_infer" / "_heads",
}


def shipped_dir(name: str) -> Path:
    """The shipped folder `name` ("conf" or "heads"): the checkout's, else the installed copy."""
    checkout = _PACKAGE_ROOT / name
    if checkout.is_dir():
        return checkout
    installed = _INSTALLED[name]
    if installed.is_dir():
        return installed
    raise FileNotFoundError(f"the project's {name}/ folder is missing: looked in {checkout} and {installed} "
                            "(reinstall eagle-spec)")
