"""The structural OpenAPI v3 schema of the ``InferenceService`` CRD: types, defaults, enums,
ranges and the CEL rules (``x-kubernetes-validations``), one block per part of the spec
(:data:`MODEL`, :data:`RUNTIME`, :data:`ENGINE`, :data:`PARALLELISM`, :data:`AUTOSCALING`, :data:`TUNING`,
:data:`ROLLOUT`, :data:`DISRUPTION`, :data:`ROUTER`) and the status, all in
:data:`OPENAPI_SCHEMA`.

Plain dicts, so that the generated YAML is readable and its diffs obvious; the builders default
a block with :func:`kvfleet.operator.crd.apply_defaults` and one of these. The CRD object and
its generated files are :mod:`kvfleet.operator.crd`.
"""

from __future__ import annotations

from typing import Any

from kvfleet.operator.parallelism_schema import PARALLELISM
from kvfleet.operator.pool_schema import POOLS_STATUS, PREFILL_AUTOSCALING
from kvfleet.operator.spec_enums import (
    AutoscalingMode,
    ConditionStatus,
    Dtype,
    FailureMode,
    ImagePullPolicy,
    KVCacheDtype,
    KVTierType,
    MetricsSource,
    Quantization,
    RolloutStrategy,
    RouterAlgorithm,
    SchedulingPolicy,
    SpeculativeMethod,
    values,
)
from kvfleet.runtime.router import routing

BLOCK_SIZES = [8, 16, 32, 64, 128]
MODEL_URI_SCHEMES = ["hf://", "pvc://", "file:///"]


DEFAULT_IMAGE = "ghcr.io/kvfleet/kvfleet-runtime:0.1.0"
DEFAULT_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")
"""Files of an hf:// repository the init container fetches by default (not .bin/.pth/.onnx copies)."""


# ---------------------------------------------------------------------------------
# schema helpers (plain dicts, so that the YAML is readable and diffs are obvious)


def _int(desc: str, *, minimum: int | None = None, maximum: int | None = None,
         default: int | None = None, **extra: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer", "description": desc}
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    if default is not None:
        s["default"] = default
    s.update(extra)
    return s


def _num(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "description": desc, **extra}


def _str(desc: str, *, max_length: int = 253, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, "maxLength": max_length, **extra}


def _bool(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "boolean", "description": desc, **extra}


def _quantity(desc: str) -> dict[str, Any]:
    # The same shape as resource.Quantity in the core API ("4", 4, "16Gi", "500m").
    return {
        "description": desc,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                   r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
    }


def _obj(desc: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "description": desc, "properties": properties, **extra}


def _opaque(desc: str, type_: str = "object") -> dict[str, Any]:
    """A core-API object kept as is (validated by the API server on the child, not here)."""
    s: dict[str, Any] = {"type": type_, "description": desc}
    if type_ == "object":
        s["x-kubernetes-preserve-unknown-fields"] = True
    else:
        s["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return s


def _secret_ref(desc: str, default_key: str) -> dict[str, Any]:
    return _obj(desc, {
        "name": _str("Name of a Secret in the InferenceService's namespace."),
        "key": _str("Key in the Secret.", default=default_key),
    }, required=["name"])


# ---------------------------------------------------------------------------------
# the spec

MODEL = _obj(
    "The model to serve.",
    {
        "uri": _str(
            "Where the weights come from: hf://ORG/NAME[@REVISION] (fetched by an init "
            "container), hf://ORG/NAME/[FOLDER/]FILE.gguf[@REVISION] (one GGUF file of a repository, in its "
            "top folder or a subfolder), "
            "pvc://CLAIM/PATH (mounted read-only; a directory or a .gguf file), file:///PATH (a directory "
            "or a .gguf file already in the image).",
            max_length=1024,
            pattern=r"^(hf://[^/@\s]+/[^/@\s]+(/([^/@\s]+/)*[^/@\s]+\.gguf)?(@[^@\s]+)?|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^\s]*)?|file:///[^\s]*)$",
            **{"x-kubernetes-validations": [{
                "rule": "self.startsWith('hf://') || self.startsWith('pvc://') || self.startsWith('file:///')",
                "message": "model.uri must use one of the schemes hf://, pvc://, file:///",
                "reason": "FieldValueInvalid",
            }]},
        ),
        "servedModelName": _str("The model name clients send in OpenAI requests "
                                "(default: ORG/NAME for hf://, else the InferenceService name)."),
        "size": _quantity("Size of the weights on disk (e.g. 16Gi), when known: sizes the "
                          "startup probe and the model volume."),
        "hfTokenSecretRef": _secret_ref("Secret with a Hugging Face token for gated hf:// models "
                                        "(env HF_TOKEN of the fetching init container).", "token"),
        "download": _obj("How hf:// models are fetched by the init container.", {
            "timeoutSeconds": _int("Timeout of one download attempt, seconds.", minimum=10, default=3600),
            "retries": _int("Attempts before the init container fails (the kubelet then restarts it "
                            "with its own back-off).", minimum=1, maximum=20, default=3),
            "claimName": _str("Cache the download in this PersistentVolumeClaim instead of an "
                              "emptyDir (survives pod restarts; one directory per ORG/NAME@REVISION, "
                              "replicas sharing it download once). A ReadWriteOnce claim cannot be "
                              "mounted by pods on other nodes: the operator reports it."),
            "allowPatterns": {"type": "array", "maxItems": 64, "default": list(DEFAULT_ALLOW_PATTERNS),
                              "items": {"type": "string", "maxLength": 256},
                              "description": "Download only the repository files matching these globs "
                                             "(huggingface_hub allow_patterns). Default: weights as "
                                             "safetensors, configs, tokenizer files and chat templates; "
                                             "add e.g. *.gguf for a GGUF repository."},
        }),
        "adapters": {"type": "array", "maxItems": 256, "x-kubernetes-list-type": "map",
                     "x-kubernetes-list-map-keys": ["name"],
                     "description": "LoRA adapters (PEFT format) served beside the base model; a request picks one "
                                    "by its model field. Declaring the list (even empty) enables LoRA; adding or "
                                    "removing an adapter does not restart pods (see docs/lora.md).",
                     "items": _obj("One LoRA adapter.", {
                         "name": _str("The model name clients send for this adapter.", max_length=128),
                         "uri": _str("hf://ORG/NAME[@REVISION], file:///PATH, or pvc://CLAIM/PATH on the model "
                                     "volume's claim.", max_length=1024),
                     }, required=["name", "uri"])},
    },
    required=["uri"],
)

RESOURCES = _obj("What one runtime pod requests (and is limited to).", {
    "gpus": _int("nvidia.com/gpu count (requests = limits). Default: "
                 "engine.tensorParallelSize when it is above 1, else 0 (CPU).", minimum=0, maximum=16),
    "cpu": _quantity("CPU request, e.g. 4 or 500m."),
    "memory": _quantity("Memory request and limit, e.g. 32Gi."),
})

RUNTIME = _obj("The runtime pods.", {
    "image": _str("Runtime container image (default: the operator's, env KVFLEET_RUNTIME_IMAGE, "
                  "which the chart's runtimeImage value sets; else " + DEFAULT_IMAGE + ").", max_length=1024),
    "imagePullPolicy": {"type": "string", "description": "Image pull policy.",
                        "enum": values(ImagePullPolicy), "default": ImagePullPolicy.IF_NOT_PRESENT.value},
    "resources": RESOURCES,
    "env": _opaque("Extra environment variables (core EnvVar objects).", "array"),
    "nodeSelector": {"type": "object", "description": "Node selector of the runtime pods.",
                     "additionalProperties": {"type": "string"}},
    "tolerations": _opaque("Tolerations of the runtime pods (core Toleration objects).", "array"),
    "affinity": _opaque("Affinity of the runtime pods (core Affinity)."),
    "serviceAccountName": _str("ServiceAccount of the runtime pods."),
    "imagePullSecrets": {"type": "array", "description": "Pull secrets for the image.",
                         "items": {"type": "object", "properties": {"name": _str("Secret name.")},
                                   "required": ["name"]}},
    "apiKeySecretRef": _secret_ref("Secret holding the API key clients must send "
                                   "(env KVFLEET_API_KEY of the runtime).", "api-key"),
    "startupTimeoutSeconds": _int("How long the startup probe waits for /ready "
                                  "(default: derived from model.size, 600 s when unknown).",
                                  minimum=10, maximum=86400),
    "shmSize": _quantity("Size of the /dev/shm memory volume (default: 1Gi, or 4Gi per GPU "
                         "with tensor parallelism)."),
    "podAnnotations": {"type": "object", "description": "Extra annotations on the runtime pods.",
                       "additionalProperties": {"type": "string"}},
})

KV_CACHE = _obj(
    "KV cache tiers beyond each replica's memory (docs/routing.md, \"Peer KV pull\" and \"Disk tier\"): "
    "the runtime's --kv-transfer-config.",
    {"tiers": {
        "type": "array", "maxItems": 2, "default": [{"type": KVTierType.PEER.value}],
        "description": "peer (the default, [{type: peer}]): a replica pulls a prompt's missing prefix blocks from "
                       "the replica the router names in a hint signed with the service's fleet Secret (the "
                       "replicas publish KV events). disk: every cached block is written through to a bounded "
                       "folder and loaded back on a hit, so a restarted container (emptyDir) or pod on the same "
                       "node (hostPath) starts warm. []: neither, and no KV events unless the router's algorithm "
                       "reads them.",
        "items": _obj("One tier.", {
            "type": {"type": "string", "enum": values(KVTierType), "description": "The tier."},
            "minPullBlocks": _int("peer: pull only when this many leading blocks are missing.", minimum=1,
                                  maximum=65536),
            "maxConcurrentPulls": _int("peer: pulls in flight at once per replica.", minimum=1, maximum=64),
            "size": _quantity("disk: the tier's bound (least recently used blocks go past it); also the "
                              "emptyDir's sizeLimit."),
            "path": _str("disk: the folder in the runtime container.", max_length=1024),
            "hostPath": _str("disk: a folder of the node instead of an emptyDir.", max_length=1024),
            "claimName": _str("disk: a PersistentVolumeClaim (ReadWriteMany) the replicas share instead of an "
                              "emptyDir: a scaled-up replica starts warm too."),
        }, required=["type"]),
        "x-kubernetes-validations": [
            {"rule": "self.all(t, self.exists_one(u, u.type == t.type))", "message": "each tier type at most once"},
            {"rule": "self.all(t, t.type != 'disk' || has(t.size))", "message": "a disk tier needs a size"},
            {"rule": "self.all(t, !has(t.hostPath) || !has(t.claimName))",
             "message": "a disk tier takes hostPath or claimName, not both"},
        ],
    }},
)

ENGINE = _obj("Engine settings, written to the runtime's config file (a ConfigMap).", {
    "blockSize": _int("Tokens per KV block.", default=16, enum=BLOCK_SIZES,
                      **{"x-kubernetes-validations": [{
                          "rule": "self in [8, 16, 32, 64, 128]",
                          "message": "blockSize must be one of 8, 16, 32, 64, 128",
                      }]}),
    "gpuMemoryUtilization": _num(
        "Fraction of each GPU's memory the engine may use, in (0, 1].",
        default=0.9, minimum=0, exclusiveMinimum=True, maximum=1,
        **{"x-kubernetes-validations": [{
            "rule": "self > 0.0 && self <= 1.0",
            "message": "gpuMemoryUtilization must be in (0, 1]",
        }]}),
    "maxNumSeqs": _int("Most sequences in one engine step.", minimum=1, maximum=65536),
    "maxNumBatchedTokens": _int("Token budget of one engine step.", minimum=1, maximum=1048576),
    "maxModelLen": _int("Longest prompt + output, tokens.", minimum=1, maximum=10485760),
    "enablePrefixCaching": _bool("Reuse the KV blocks of shared prompt prefixes."),
    "batchInvariant": _bool("Outputs independent of the batch (kvfleet serve --batch-invariant, on by default); "
                            "false: native bf16 prefill on AVX512-BF16 / AMX CPUs, faster, batch-dependent."),
    "schedulingPolicy": {"type": "string", "description": "Order of waiting requests.",
                         "enum": values(SchedulingPolicy)},
    "dtype": {"type": "string", "description": "Weights and activations dtype.",
              "enum": values(Dtype)},
    "kvCacheDtype": {"type": "string", "description": "KV cache dtype (kvfleet serve --kv-cache-dtype): auto "
                     "(the activation dtype), float32, or bfloat16 (CPU: half the cache bytes, activations float32).",
                     "enum": values(KVCacheDtype)},
    "tensorParallelSize": _int("GPUs one model replica is split over.", minimum=1, maximum=16, default=1),
    "quantization": {"type": "string", "description": "Weight-only quantization of the linear layers "
                     "(torchao): int8 (CPU and GPU) or int4 (CPU); unset: weights in dtype.",
                     "enum": values(Quantization)},
    "enforceEager": _bool("Run the model eagerly, without torch.compile (kvfleet serve --enforce-eager)."),
    "speculative": _obj(
        "Speculative decoding (kvfleet serve --speculative-config, vLLM's fields): model-free drafts "
        "verified in one step; greedy output unchanged. Unset: off.", {
            "method": {"type": "string", "description": "ngram: prompt lookup; suffix: suffix decoding.",
                       "enum": values(SpeculativeMethod), "default": SpeculativeMethod.NGRAM.value},
            "numSpeculativeTokens": _int("Most tokens proposed per step (k).", minimum=1, maximum=16),
            "promptLookupMax": _int("ngram: the longest n-gram looked up.", minimum=1, maximum=64),
            "promptLookupMin": _int("ngram: the shortest n-gram looked up.", minimum=1, maximum=64),
            "disableByBatchSize": _int("Speculate only while fewer requests than this run.", minimum=1),
            "minAcceptanceRate": _num("A request whose acceptance falls below this stops proposing "
                                      "(probing now and then).", minimum=0, maximum=1),
        }),
    "kvCache": KV_CACHE,
    "extraArgs": {
        "type": "object",
        "description": "Further options of kvfleet serve's config file, snake_case: engine options "
                       "(e.g. enable_chunked_prefill) and server options (max_queue_len, metrics_compat, "
                       "shutdown_timeout, ...; not host, port, api_key). Unknown keys make the resource "
                       "Degraded.",
        "additionalProperties": {"x-kubernetes-preserve-unknown-fields": True},
    },
})

_WINDOW = {"stabilizationWindowSeconds": None}

AUTOSCALING = _obj(
    "Replica autoscaling. none: spec.replicas as is; operator: the operator's own autoscaler "
    "writes the scale subresource; hpa: the operator creates an autoscaling/v2 HPA on the "
    "queue-depth metric that targets this resource's scale subresource.",
    {
        "mode": {"type": "string", "enum": values(AutoscalingMode), "default": AutoscalingMode.NONE.value,
                 "description": "Who scales."},
        "minReplicas": _int("Fewest replicas (0 allows scale to zero with mode operator; with mode "
                            "hpa it acts as 1, since an HPA cannot scale to zero without the "
                            "HPAScaleToZero feature gate).",
                            minimum=0, default=1),
        "maxReplicas": _int("Most replicas (required unless mode is none).", minimum=1, maximum=1000),
        "targetQueueDepth": _num("Waiting requests per replica to aim for.", default=4,
                                 minimum=0, exclusiveMinimum=True),
        "targetKVCacheUsage": _num("Mean KV cache usage (0..1] above which to add a replica.",
                                   default=0.8, minimum=0, exclusiveMinimum=True, maximum=1),
        "scaleUp": _obj("Scale-up behaviour.", {
            "stabilizationWindowSeconds": _int("Seconds; a scale-up goes only to the lowest "
                                               "recommendation over this window (HPA algorithm).",
                                               minimum=0, maximum=3600, default=0)}),
        "scaleDown": _obj("Scale-down behaviour.", {
            "stabilizationWindowSeconds": _int("Seconds; a scale-down goes only to the highest "
                                               "recommendation over this window (HPA algorithm).",
                                               minimum=0, maximum=3600, default=300)}),
        "metrics": _obj("Where the operator's autoscaler reads the pods' metrics.", {
            "source": {"type": "string", "enum": values(MetricsSource), "default": MetricsSource.PODS.value,
                       "description": "pods: scrape each ready pod's /metrics; prometheus: query "
                                      "prometheusUrl."},
            "prometheusUrl": _str("Base URL of a Prometheus server.", max_length=1024),
            "intervalSeconds": _int("Seconds between reads.", minimum=1, maximum=600, default=15),
        }),
    },
    **{"x-kubernetes-validations": [
        {"rule": "!has(self.maxReplicas) || !has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
         "message": "minReplicas must be <= maxReplicas"},
        {"rule": "!has(self.mode) || self.mode == 'none' || has(self.maxReplicas)",
         "message": "maxReplicas is required when mode is operator or hpa"},
    ]},
)

TUNING = _obj(
    "Live tuning of the engine from observed behaviour. The applied values live in "
    "status.engine and reach the pods through the ConfigMap (a rolling update); the spec "
    "is never rewritten.",
    {
        "enabled": _bool("Tune gpuMemoryUtilization and blockSize.", default=False),
        "gpuMemoryUtilization": _obj("Range and step of memory utilisation changes.", {
            "min": _num("Lowest value.", default=0.5, minimum=0, exclusiveMinimum=True, maximum=1),
            "max": _num("Highest value.", default=0.95, minimum=0, exclusiveMinimum=True, maximum=1),
            "step": _num("One change.", default=0.05, minimum=0, exclusiveMinimum=True, maximum=0.5),
        }, **{"x-kubernetes-validations": [
            {"rule": "!has(self.min) || !has(self.max) || self.min <= self.max",
             "message": "tuning.gpuMemoryUtilization.min must be <= max"}]}),
        "blockSizes": {"type": "array", "description": "Block sizes the tuner may choose.",
                       "items": {"type": "integer", "enum": BLOCK_SIZES}, "maxItems": 5,
                       "x-kubernetes-list-type": "set", "default": [16, 32]},
        "minIntervalSeconds": _int("Least time between two changes.", minimum=0, default=600),
        "oomCooldownSeconds": _int("After an out-of-memory restart, do not raise memory "
                                   "utilisation for this long.", minimum=0, default=3600),
    },
)

ROLLOUT = _obj("How new pods replace old ones.", {
    "strategy": {"type": "string", "enum": values(RolloutStrategy), "default": RolloutStrategy.AVAILABILITY.value,
                 "description": "Availability: surge one pod, never go below the replica count "
                                "(maxSurge 1, maxUnavailable 0). ResourceAware: no surge, for "
                                "clusters without a spare GPU (maxSurge 0, maxUnavailable 1)."},
})

_INT_OR_PERCENT = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}

DISRUPTION = _obj(
    "The runtime pods' PodDisruptionBudget: maxUnavailable 1 when neither field is set (a node drain takes "
    "one replica at a time, each handing its router streams off).",
    {
        "minAvailable": {**_INT_OR_PERCENT, "description": "Pods that must stay available (count or %)."},
        "maxUnavailable": {**_INT_OR_PERCENT, "description": "Pods that may be evicted at once (count or %)."},
    },
    **{"x-kubernetes-validations": [{
        "rule": "!(has(self.minAvailable) && has(self.maxUnavailable))",
        "message": "set at most one of disruption.minAvailable and disruption.maxUnavailable"}]},
)

ROUTER = _obj(
    "The fleet's request path: kvfleet router in front of the runtime pods (prefix-aware routing with "
    "bounded loads, failover, and holding requests while no replica is ready, which lets autoscaling "
    "wake a service from zero replicas). status.url points at the router when enabled. docs/routing.md.",
    {
        "enabled": _bool("Run the router (a Deployment and Service <name>-router); on by default: prefix-aware "
                         "routing, failover, mid-stream migration and hand-off drains, holding requests at zero "
                         "replicas. false: clients reach the runtime Service directly.", default=True),
        "replicas": _int("Router pods (2 by default: no single router; a PodDisruptionBudget keeps all but one "
                         "up through voluntary disruptions and rolls add one before taking one away).",
                         minimum=1, maximum=100, default=2),
        "shutdownTimeoutSeconds": _int("On SIGTERM a router pod stops taking requests and lets the ones in flight "
                                       "finish for at most this long (kvfleet router --shutdown-timeout), after a "
                                       "10 s preStop sleep; its terminationGracePeriodSeconds is 15 s more.",
                                       minimum=0, maximum=86400, default=30),
        "algorithm": {"type": "string", "enum": values(RouterAlgorithm), "default": routing.DEFAULT.value,
                      "description": "How the router picks a replica (kvfleet router --routing-algorithm). "
                                     + routing.describe() + "."},
        "prefixChars": _int("Characters of the prompt the prefix key covers.", minimum=1, maximum=65536,
                            default=256),
        "loadFactor": _num("CHWBL bound: a replica takes at most ceil(loadFactor x mean load) before its "
                           "prefixes spill to the next replica.", minimum=1, maximum=10, default=1.25),
        "maxPending": _int("Most requests held while no replica is ready (one more: HTTP 429).",
                           minimum=0, maximum=1000000, default=1024),
        "pendingTimeoutSeconds": _int("Longest a request is held (then HTTP 503); cover pod start and "
                                      "model load when scaling from zero.", minimum=1, maximum=86400,
                                      default=300),
        "image": _str("Router image (default: the runtime image, which contains kvfleet router).",
                      max_length=1024),
        "resources": _opaque("Resources of the router container (core ResourceRequirements; default: "
                             "requests cpu 100m, memory 128Mi; limit memory 512Mi)."),
        "inferencePool": _obj(
            "Gateway API Inference Extension: an InferencePool (inference.networking.k8s.io/v1) over the "
            "runtime pods on port 8000, for gateways with an endpoint picker; the runtime then also "
            "exports vLLM's metric names.",
            {
                "enabled": _bool("Create the InferencePool <name>.", default=False),
                "endpointPickerRef": _obj("The endpoint picker Service of the cluster's GIE install.", {
                    "name": _str("Service name of the endpoint picker."),
                    "port": _int("Its gRPC port.", minimum=1, maximum=65535, default=9002),
                    "failureMode": {"type": "string", "enum": values(FailureMode),
                                    "description": "What the gateway does when the picker does not answer."},
                }, required=["name"]),
            }),
    },
)



def _no_defaults(schema: Any) -> Any:
    """``schema`` without its ``default`` values (an override that must not reset what it omits)."""
    if isinstance(schema, dict):
        return {k: _no_defaults(v) for k, v in schema.items() if k != "default"}
    return [_no_defaults(v) for v in schema] if isinstance(schema, list) else schema


def _pool(role: str, work: str, **extra: Any) -> dict[str, Any]:
    return _obj(f"The {role} pool: {work}.", {
        "replicas": _int(f"{role.capitalize()} pods.", minimum=0, maximum=1000, default=1),
        "engine": {**_no_defaults(ENGINE),
                   "description": f"Engine settings of the {role} pods over spec.engine (the fields given)."}, **extra})


DISAGGREGATION = _obj(
    "Prefill/decode disaggregation (needs router.enabled): the router computes each prompt on a prefill pod "
    "(Deployment <name>-prefill, Service <name>-prefill), whose blocks a decode pod (Deployment and Service "
    "<name>; spec.autoscaling scales it) pulls over /kv_blocks to decode. Absent: every pod does both.", {
        "prefill": _pool("prefill", "computes the prompts and holds their KV blocks until read", **PREFILL_AUTOSCALING),
        "decode": _pool("decode", "pulls the blocks and streams the tokens"),
    }, required=["prefill", "decode"])

SPEC = _obj("Desired state of an InferenceService.", {
    "model": MODEL,
    "runtime": RUNTIME,
    "engine": ENGINE,
    "parallelism": PARALLELISM,
    "replicas": _int("Runtime pods. Written by the autoscaler through the scale subresource when "
                     "autoscaling.mode is not none.", minimum=0, maximum=1000, default=1),
    "autoscaling": AUTOSCALING,
    "tuning": TUNING,
    "rollout": ROLLOUT,
    "disruption": DISRUPTION,
    "router": ROUTER,
    "disaggregation": DISAGGREGATION,
}, required=["model"])

CONDITION = _obj("A kstatus condition.", {
    "type": _str("Ready, Progressing, Degraded, ..."),
    "status": {"type": "string", "enum": values(ConditionStatus), "description": "Condition status."},
    "reason": _str("CamelCase reason.", max_length=1024),
    "message": _str("Human-readable detail.", max_length=32768),
    "lastTransitionTime": {"type": "string", "format": "date-time",
                           "description": "When status last changed."},
    "observedGeneration": _int("Generation the condition was computed from.", minimum=0),
}, required=["type", "status"])

STATUS = _obj(
    "Observed state. Unknown fields are kept (autoscaler and tuner state, kopf progress).",
    {
        "observedGeneration": _int("metadata.generation the status describes.", minimum=0),
        "replicas": _int("Runtime pods that exist (scale subresource).", minimum=0),
        "readyReplicas": _int("Runtime pods that are ready.", minimum=0),
        "updatedReplicas": _int("Runtime pods with the current pod template.", minimum=0),
        "selector": _str("Label selector of the runtime pods (scale subresource).", max_length=4096),
        "url": _str("OpenAI base URL inside the cluster.", max_length=1024),
        "conditions": {"type": "array", "items": CONDITION,
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "adapters": {"type": "array", "description": "LoRA adapters: on how many ready pods each is loaded.",
                     "items": _obj("One adapter's state.", {
                         "name": _str("The adapter's name.", max_length=128),
                         "loadedReplicas": _int("Ready pods that serve it.", minimum=0),
                         "readyReplicas": _int("Ready pods.", minimum=0),
                     })},
        "pools": POOLS_STATUS,
        "engine": _obj("Engine values in effect (the spec's, or the tuner's).",
                       {"blockSize": _int("Tokens per KV block.", enum=BLOCK_SIZES),
                        "gpuMemoryUtilization": _num("Memory fraction.")},
                       **{"x-kubernetes-preserve-unknown-fields": True}),
    },
    **{"x-kubernetes-preserve-unknown-fields": True},
)

OPENAPI_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An LLM served by kvfleet runtime pods: a ConfigMap, a Deployment, a Service "
                   "and optionally a PodDisruptionBudget and an HPA, kept in line by the operator.",
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": SPEC,
        "status": STATUS,
    },
    "required": ["spec"],
}
