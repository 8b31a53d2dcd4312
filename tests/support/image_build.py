"""The image build-and-start check of tests/repo/test_images.py, started in the background.

Building both images takes minutes of mostly waiting on the disk and the package indexes, while
the rest of the suite keeps the CPUs busy: tests/conftest.py starts :func:`start` as soon as the
suite's collection holds the image test (and it can run here: :func:`why_not`), the test waits on
:func:`result`, and the session's end stops a build still running (SIGINT: the script's own
clean-up of images, containers and work folder runs). Run alone, the test starts it itself.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from support.paths import ROOT

SCRIPT = ROOT / "scripts" / "build_images.py"
OPT_OUT_ENV = "KVFLEET_IMAGE_TEST"
TEST_ID = "tests/repo/test_images.py::test_images_build_and_start"


@functools.cache
def why_not() -> str | None:
    """Why the images cannot be built and started here (None: they can)."""
    if os.environ.get(OPT_OUT_ENV) == "0":
        return f"{OPT_OUT_ENV}=0"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (mmdebstrap, buildah's storage, mount namespaces)"
    missing = [t for t in ("unshare", "chroot", "nsenter") if shutil.which(t) is None]
    if missing:
        return f"no {', '.join(missing)} (util-linux, coreutils)"
    if shutil.which("apt-get") is None:
        return "no apt-get: the base is made from Debian's archive (mmdebstrap), buildah installed with apt-get"
    # The archive mmdebstrap and the Dockerfile's apt-get read (the host's apt sources).
    update = subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True, timeout=300)
    if update.returncode != 0 or "Err:" in update.stdout + update.stderr:
        return "Debian's archive is unreachable: " + (update.stderr or update.stdout).strip()[-300:]
    return None


@dataclass
class Build:
    folder: Path
    proc: subprocess.Popen

    @property
    def report(self) -> Path:
        return self.folder / "report.json"

    @property
    def log(self) -> Path:
        return self.folder / "build.log"


_build: Build | None = None


def start() -> Build:
    """Start ``build_images.py --ci`` once (later calls return the same build)."""
    global _build
    if _build is None:
        folder = Path(tempfile.mkdtemp(prefix="kvfleet-image-build-"))
        env = dict(os.environ)
        if "kvfleet-test-config-" in env.get("XDG_CONFIG_HOME", ""):
            # tests/conftest.py's folder for the suite's fleet secret: the build must see the user's
            # own configuration (pip's user config file names the package indexes it reads)
            del env["XDG_CONFIG_HOME"]
        with open(folder / "build.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, str(SCRIPT), "--ci", "--work", str(folder / "work"), "--report",
                                     str(folder / "report.json")], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        _build = Build(folder, proc)
    return _build


def result(timeout: float) -> tuple[int, str, Path]:
    """Wait for the build: its exit status, its output's tail and its report file."""
    build = start()
    rc = build.proc.wait(timeout=timeout)
    return rc, build.log.read_text(errors="replace")[-8000:], build.report


def stop() -> None:
    """End a build still running (SIGINT, so the script removes what it made), then its folder."""
    global _build
    if _build is None:
        return
    if _build.proc.poll() is None:
        os.killpg(_build.proc.pid, signal.SIGINT)
        try:
            _build.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(_build.proc.pid, signal.SIGKILL)
            _build.proc.wait()
    shutil.rmtree(_build.folder, ignore_errors=True)
    _build = None
