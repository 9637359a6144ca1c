"""Real components the launcher tests start, installed from Debian's packages when missing.

``.ci/run`` installs them before the suite; a developer's machine gets them the first time
a test needs them, where apt and root are at hand (``apt-get install``, by package name from
the configured registries). Elsewhere ``ensure`` says why they are missing and the tests skip
with that reason.
"""

import os
import shutil
import subprocess
from pathlib import Path

INSTALL_S = 600
"""apt-get update + install, at most (slurm-wlm and its dependencies: about a minute)."""


def _present(binary: str) -> bool:
    return shutil.which(binary) is not None or any(
        Path(d, binary).exists() for d in ("/usr/sbin", "/sbin")
    )


def ensure(packages: tuple[str, ...], binaries: tuple[str, ...]) -> str | None:
    """Install ``packages`` if any of ``binaries`` is missing; None when all are there, else
    why not (no apt, not root, the install failed)."""
    missing = [b for b in binaries if not _present(b)]
    if not missing:
        return None
    how = f"apt-get install {' '.join(packages)}"
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return f"{', '.join(missing)} missing and not installable here (needs root and apt: {how})"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock = ("-o", "DPkg::Lock::Timeout=300")  # another test worker may be installing
    try:
        subprocess.run(["apt-get", *lock, "update", "-qq"], env=env, capture_output=True,
                       timeout=INSTALL_S, check=True)  # fmt: skip
        subprocess.run(["apt-get", *lock, "install", "-y", "-qq", *packages], env=env,
                       capture_output=True, timeout=INSTALL_S, check=True)  # fmt: skip
    except (subprocess.SubprocessError, OSError) as err:
        return f"{how} failed: {err}"
    missing = [b for b in binaries if not _present(b)]
    return f"{how} did not provide {', '.join(missing)}" if missing else None
