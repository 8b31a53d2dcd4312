"""``kvfleet operator``: run the kopf operator that reconciles InferenceServices.

Options::

    kvfleet operator [--namespace NS]... | [--all-namespaces]
                     [--kubeconfig FILE] [--health-port PORT]
                     [--peering NAME | --standalone] [--priority N] [--verbose]

Imports :mod:`kvfleet.operator.handlers` (which registers every kopf handler) and runs kopf
with a peering identity (:func:`peering_identity`, also put in ``memo.peering_identity`` for
the autoscaler loop) and a random priority unless ``--priority`` is given. What each option
does, and how peering works: docs/operator.md.
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import logging
import os
import random
import secrets
import socket
import sys

DEFAULT_PEERING = "kvfleet-operator"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfleet operator", description="Run the kvfleet Kubernetes operator (kopf).")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    p.add_argument("--health-port", type=int, default=None, help="liveness endpoint port (/healthz)")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", default=None, metavar="NAME", help="peering object name (mandatory peering)")
    peer.add_argument("--standalone", action="store_true", help="no peering: act alone")
    p.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return p.parse_args(argv)


def peering_identity() -> str:
    """This process's kopf peering identity: ``$POD_ID`` (the chart sets the pod name), else
    ``user@host/UTC-time/random`` (the format kopf's own ``detect_own_id`` uses)."""
    pod = os.environ.get("POD_ID")
    if pod:
        return pod
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (arbitrary container UIDs)
        user = str(os.getuid())
    now = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
    return f"{user}@{socket.gethostname()}/{now}/{secrets.token_hex(2)}"


def cluster_problem(timeout: float = 5.0) -> str | None:
    """Why there is no cluster to talk to (one line), or None: no in-cluster service account
    and no usable kubeconfig, or an API server that does not answer ``GET /version``."""
    import kubernetes
    import urllib3

    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                               client_configuration=config)
        except (kubernetes.config.ConfigException, OSError, TypeError, ValueError) as e:
            return ("no Kubernetes cluster: not in a pod, and no usable kubeconfig "
                    f"(--kubeconfig FILE, $KUBECONFIG or ~/.kube/config): {str(e).splitlines()[0][:200]}")
    config.retries = 0
    try:
        with kubernetes.client.ApiClient(config) as api:
            kubernetes.client.VersionApi(api).get_code(_request_timeout=timeout)
    except kubernetes.client.exceptions.ApiException:
        return None  # it answered (401, 403, 404 on /version ...): the cluster is there
    except (urllib3.exceptions.HTTPError, OSError) as e:
        return f"cannot reach the Kubernetes API at {config.host}: {type(e).__name__}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvfleet operator``; returns when the operator stops (0), at once with
    2 for a ``--kubeconfig`` that does not exist or no cluster configuration, or 1 for an API
    server that does not answer (one line on stderr)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.kubeconfig:
        if not os.path.isfile(args.kubeconfig):
            # kopf would log the failed login and retry forever; a wrong path is a usage error.
            print(f"kvfleet operator: --kubeconfig {args.kubeconfig!r}: no such file", file=sys.stderr)
            return 2
        os.environ["KUBECONFIG"] = os.path.abspath(args.kubeconfig)
    problem = cluster_problem()
    if problem is not None:  # kopf would log the failed login and retry forever
        print(f"kvfleet operator: {problem}", file=sys.stderr)
        return 2 if problem.startswith("no Kubernetes cluster") else 1
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import kopf

    from kvfleet.operator import handlers  # noqa: F401  (registers the handlers)

    identity = peering_identity()
    priority = args.priority if args.priority is not None else random.SystemRandom().randint(1, 2**31 - 1)
    kwargs: dict = {
        "clusterwide": not args.namespace,
        "namespaces": args.namespace,
        "standalone": bool(args.standalone),
        "priority": priority,
        # kopf keeps its paused state to itself; the autoscaler loop judges the peering
        # object by the same rule and needs to know which entry there is its own.
        "identity": identity,
        "memo": kopf.Memo(peering_identity=identity),
    }
    if args.peering:
        kwargs["peering_name"] = args.peering
    if args.health_port:
        kwargs["liveness_endpoint"] = f"http://0.0.0.0:{args.health_port}/healthz"

    kopf.run(**kwargs)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
