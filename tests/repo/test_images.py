"""scripts/build_images.py: the CPU runtime and operator images built with buildah on an
mmdebstrap Debian base, then started the way the operator's pods run them.

The end-to-end test runs in the suite (CI included): the script's trimmed variant (``--ci``:
both Dockerfile targets built at once, no bytecode compiled, the Debian root filesystem reused
for a week; docs/images.md has the times). It skips, saying why, where it cannot run: not root,
no ``unshare``/``chroot``/``nsenter``, no buildah or mmdebstrap and no ``apt-get`` that installs
them, Debian's archive unreachable; ``KVFLEET_IMAGE_TEST=0`` skips it on purpose. In a
whole run it builds in the background from the end of collection on (tests/support/image_build.py),
beside the rest of the suite. The helpers it
rests on (the host's pip configuration carried into the build, the read-only sandbox) are checked
here on every run, and so is the CPU image's kernel prebuild: the entry point its build runs, then
``load()`` with no compiler and the prebuilt folder read-only.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import image_build

SCRIPT = image_build.SCRIPT


def _script():
    spec = importlib.util.spec_from_file_location("build_images", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PIP_CONFIG_LIST = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.find-links='/opt/old-wheels'
global.extra-index-url='file:///srv/pypi/simple https://pypi.example/simple'
install.constraint='/etc/xdg/pip/constraints.txt'
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
"""


def test_pip_config_list_is_merged_with_the_environment_winning():
    config = _script().parse_pip_config_list(PIP_CONFIG_LIST)
    assert config["global"] == {"cert": "/etc/ssl/certs/ca-certificates.crt", "find-links": "/opt/wheels",
                                "extra-index-url": "file:///srv/pypi/simple https://pypi.example/simple",
                                "default-timeout": "180"}
    assert config["install"] == {"constraint": "/etc/xdg/pip/constraints.txt"}


def test_merged_pip_conf_reads_back_as_pip_would():
    m = _script()
    config = m.parse_pip_config_list(PIP_CONFIG_LIST)
    parser = configparser.RawConfigParser()
    parser.read_string(m.pip_conf_text(config))
    assert {s: dict(parser[s]) for s in parser.sections()} == config


def test_local_paths_of_the_pip_config_are_mounted_read_only(tmp_path):
    m = _script()
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    cert = tmp_path / "ca.pem"
    cert.write_text("x")
    config = {"global": {
        "cert": str(cert), "find-links": f"{tmp_path / 'wheels'} {tmp_path / 'missing'}",
        "extra-index-url": f"file://{tmp_path / 'pypi' / 'simple'} https://pypi.example/simple"}}
    # A .../simple index links to files beside it: its parent is mounted.
    assert m.pip_local_paths(config) == [cert, tmp_path / "wheels", tmp_path / "pypi"]
    vols = m.build_volumes(config, tmp_path / "pip.conf")
    assert vols[0] == f"{tmp_path / 'pip.conf'}:/etc/pip.conf:ro"
    assert vols[1:] == [f"{p}:{p}:ro" for p in (cert, tmp_path / "wheels", tmp_path / "pypi")]


def test_the_start_up_checks_read_the_operator_as_it_is():
    """The script's preflight (run before it builds anything): what its runtime check takes from
    the operator -- the pod's env, writable mounts and cache mount -- resolves against today's
    operator. (It once crashed here, after the build, on a name that had moved: issue 42.)"""
    env, writable, cache_dir = _script().preflight()
    assert cache_dir == "/cache" and {"/cache", "/tmp"} <= set(writable)
    assert env["HOME"] == "/tmp" and env["HF_HUB_OFFLINE"] == "1"


def test_the_two_builds_run_at_once_each_timed_and_a_failure_shows_its_log(tmp_path, monkeypatch):
    """``--ci`` builds both images with two ``buildah bud`` at once (a stand-in buildah sleeps)."""
    m = _script()
    fake = tmp_path / "bin" / "buildah"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "building $4"\nsleep "$4"\n[ "$4" != 0.1 ]\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    buildah = m.Buildah(tmp_path / "build.log")
    slow, fast = buildah.bud_all([("1.5",), ("0.3",)])
    assert 0.3 <= fast < 1.2 <= 1.5 <= slow < 2.7  # at once: the pair takes about the longer one
    assert "building 0.3" in (tmp_path / "build.log.1").read_text()
    with pytest.raises(RuntimeError, match="building 0.1"):
        buildah.bud_all([("0.2",), ("0.1",)])


def test_sandbox_mounts_the_root_read_only_before_dropping_to_the_user():
    m = _script()
    script = m.sandbox_script(Path("/var/lib/x/merged"), "1000:1000", {"HOME": "/tmp", "A": "b c"},
                              ["kvfleet", "serve", "--port", "8001"], {"/cache": Path("/var/tmp/w/cache")})
    lines = script.splitlines()
    ro = lines.index('mount -o remount,bind,ro "$R"')
    assert lines[ro - 1] == 'mount --bind "$R" "$R"'
    assert lines.index("mount --bind /var/tmp/w/cache \"$R\"/cache") > ro
    assert lines[-1].startswith('exec chroot --userspec=1000:1000 "$R" /usr/bin/env -i HOME=/tmp \'A=b c\' kvfleet serve')


PREBUILT_CHECK = textwrap.dedent("""
    import os, stat, sys
    from pathlib import Path
    from kvfleet.kernels import cpu_lib, cpu_woq
    prebuilt, cache, empty = map(Path, sys.argv[1:])
    assert cpu_lib.main(["--prebuild", str(prebuilt)]) == 0
    names = sorted(p.name for p in prebuilt.glob("*.so"))
    assert names == sorted(cpu_lib.library_name(v) for v in cpu_lib.VARIANT_FLAGS), names
    so = prebuilt / cpu_lib.library_name(cpu_lib.variant_for(cpu_lib.cpu_features.detect()))
    # The image at run time: no compiler on PATH, the prebuilt folder read-only.
    os.environ["PATH"] = "/nonexistent"
    os.environ.pop("CC", None)
    os.chmod(prebuilt, stat.S_IRUSR | stat.S_IXUSR)
    os.environ[cpu_lib.CACHE_DIR_ENV] = str(cache)
    os.environ[cpu_lib.PREBUILT_DIR_ENV] = str(empty)
    assert cpu_lib.load() is None and str(empty) in cpu_lib.unavailable_reason()
    cpu_lib._lib = cpu_lib._error = None
    os.environ[cpu_lib.PREBUILT_DIR_ENV] = str(prebuilt)
    lib = cpu_lib.load()
    assert lib is not None and lib._name == str(so), cpu_lib.unavailable_reason()
    assert not cache.exists(), "compiled into the cache"
    import torch
    x, q, s = torch.randn(3, 64), torch.randint(-127, 128, (32, 64), dtype=torch.int8), torch.rand(32)
    torch.testing.assert_close(cpu_woq.int8_linear(x, q, s, None), x @ (q.float() * s[:, None]).T,
                               rtol=1e-4, atol=1e-4)
    print("ok", so.name)
""")


def test_prebuilt_kernels_load_without_a_compiler_from_a_read_only_folder(tmp_path, kernels_build_root):
    """The image's prebuild entry point, then :func:`load` as the pod runs it: no compiler,
    the prebuilt folder read-only, nothing written to the cache. The prebuild folder is the
    session's kernels build folder (tests/conftest.py): a variant tests/unit/kernels/test_cpu_lib.py
    compiled already is not compiled again (that test checks each variant compiles)."""
    from kvfleet.kernels import cpu_lib, cpu_woq

    if not cpu_woq.cpu_supported() or cpu_lib.compiler() is None:
        pytest.skip("needs an AVX2 x86-64 Linux machine with a C compiler")
    (tmp_path / "empty").mkdir()
    prebuilt = kernels_build_root / "kernels"
    try:
        proc = subprocess.run([sys.executable, "-c", PREBUILT_CHECK, str(prebuilt), str(tmp_path / "cache"),
                               str(tmp_path / "empty")], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    finally:
        prebuilt.chmod(0o755)
    assert proc.returncode == 0 and "ok kvfleet_cpu-" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_images_build_and_start():
    reason = image_build.why_not()
    if reason:
        pytest.skip(reason)
    # started in the background when the suite's collection finished (tests/conftest.py)
    rc, output, report_file = image_build.result(timeout=3600)
    assert rc == 0, output
    report = json.loads(report_file.read_text())
    rt, op = report["runtime"], report["operator"]
    assert set(report["times_s"]) == {"mmdebstrap", "base_image", "context", "runtime_cpu_image", "operator_image"}
    assert rt["chat"].strip() and rt["model"]
    # Non-root: the image's USER, and the uid the server process has.
    assert rt["user"] == "1000:1000" and set(rt["process_uid"]) == {"1000"}
    # Read-only root: the server's own root mount, and a write as root in its namespace.
    assert "ro" in rt["root_mount_options"].split(",")
    assert "Read-only file system" in rt["root_write_as_root"] and rt["root_write_as_root"].endswith("rc=1")
    # No compile at start: the library mapped is the image's, nothing was built in the cache,
    # and the image has no compiler.
    assert rt["prebuilt_kernels"] and rt["kernels_mapped"]
    assert all("/opt/kvfleet/kernels/kvfleet_cpu-" in p for p in rt["kernels_mapped"]), rt["kernels_mapped"]
    assert rt["kernels_built_in_cache"] == [] and rt["compilers_in_image"] == []
    assert op["user"] == "65532:65532" and op["exit_code"] != 0 and "no Kubernetes cluster" in op["output"]
