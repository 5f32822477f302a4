"""Launch lines and Kubernetes manifests made from the trainer's config (the `launch` section).

- `torchrun_command`: one process per chip (launch.procs_per_node) on each of the hosts; locally
  `--standalone`, on a cluster a c10d rendezvous at the JobSet's first pod.
- `manifests`: a ConfigMap holding the config, and a JobSet (jobset.x-k8s.io/v1alpha2) whose
  replicated Job runs one pod per host: on TPU one Job per slice with `google.com/tpu` chips and the
  GKE TPU node selectors, on GPU one Job over the node pool with `nvidia.com/gpu`. Every pod gets
  TORCH_PJRT_PLUGIN and TORCH_PJRT_CACHE_DIR on a shared ReadWriteMany volume (checkpoints and logs
  go there too), so a program compiled by one host is loaded by the others.
- `validate`: checks a manifest's Kubernetes parts field by field against the `kubernetes` Python
  client's models (unknown field or wrong type raises), the JobSet's own fields against its schema.
"""
from __future__ import annotations

import os
import sys

import yaml

from .config import to_dict

__all__ = ["torchrun_command", "manifests", "write_manifests", "validate"]

CONFIG_MOUNT = "/etc/torch_pjrt"
SHARED_MOUNT = "/shared"
# chips per host of GKE TPU node pools (v5e/v6e single-host pools may use 1 or 4 too: set procs_per_node)
_TPU_CHIPS_PER_HOST = 4


def _hosts(cfg) -> int:
    return cfg.launch.nodes * (cfg.launch.slices if cfg.launch.kind == "tpu" else 1)


def torchrun_command(cfg, local: bool, config_path=None, overrides=(), rdzv_host: str = "") -> list[str]:
    lc = cfg.launch
    cmd = [sys.executable if local else "python", "-m", "torch.distributed.run", f"--nproc-per-node={lc.procs_per_node}"]
    if local:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        cmd += [f"--nnodes={_hosts(cfg)}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_host}:{lc.port}",
                f"--rdzv-id={cfg.run_name}"]
    cmd += ["-m", "torch_pjrt.train"] + ([config_path] if config_path else []) + list(overrides)
    return cmd


def _name(cfg) -> str:
    name = "".join(c if c.isalnum() else "-" for c in cfg.run_name.lower()).strip("-")
    return (name or "run")[:40]


def manifests(cfg) -> list[dict]:
    lc, name = cfg.launch, _name(cfg)
    job_name = "slice" if lc.kind == "tpu" else "workers"
    # JobSet's headless service (named after the JobSet) gives pod <jobset>-<job>-<index>-<completion>.<jobset>
    rdzv_host = f"{name}-{job_name}-0-0.{name}"
    shared = f"{SHARED_MOUNT}/{name}"
    overrides = [f"checkpoint.dir={shared}/checkpoints", f"log.dir={shared}/logs", "log.progress=false"]
    command = torchrun_command(cfg, local=False, config_path=f"{CONFIG_MOUNT}/config.yaml", overrides=overrides,
                               rdzv_host=rdzv_host)
    plugin = "tpu" if lc.kind == "tpu" else "cuda"
    env = [{"name": "TORCH_PJRT_PLUGIN", "value": plugin},
           {"name": "TORCH_PJRT_CACHE_DIR", "value": f"{SHARED_MOUNT}/compile-cache"},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if lc.kind == "tpu":
        resource = {"google.com/tpu": str(lc.procs_per_node)}
        node_selector = {"cloud.google.com/gke-tpu-accelerator": lc.tpu_accelerator,
                         "cloud.google.com/gke-tpu-topology": lc.tpu_topology}
        replicas, per_job = lc.slices, lc.nodes
    else:
        resource = {"nvidia.com/gpu": str(lc.procs_per_node)}
        node_selector = {"cloud.google.com/gke-accelerator": lc.gpu_accelerator}
        replicas, per_job = 1, lc.nodes
    container = {
        "name": "trainer", "image": lc.image, "command": command, "env": env,
        "ports": [{"containerPort": lc.port, "name": "rdzv"}],
        "resources": {"limits": dict(resource), "requests": dict(resource)},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                         {"name": "shared", "mountPath": SHARED_MOUNT}],
    }
    pod = {
        "metadata": {"labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "subdomain": name,
            "nodeSelector": node_selector,
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}},
                        {"name": "shared", "persistentVolumeClaim": {"claimName": lc.cache_claim}}],
        },
    }
    if lc.kind == "gpu":
        pod["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    job_spec = {"parallelism": per_job, "completions": per_job, "completionMode": "Indexed", "backoffLimit": 0,
                "template": pod}
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": lc.namespace,
                     **({"annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}}
                        if lc.kind == "tpu" else {})},
        "spec": {
            "failurePolicy": {"maxRestarts": 3},  # a restart resumes from the newest checkpoint
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "replicatedJobs": [{"name": job_name, "replicas": replicas, "template": {"spec": job_spec}}],
        },
    }
    configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": f"{name}-config", "namespace": lc.namespace},
                 "data": {"config.yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False)}}
    return [configmap, jobset]


def write_manifests(cfg, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{_name(cfg)}.yaml")
    docs = manifests(cfg)
    try:
        for d in docs:
            validate(d)
    except ImportError:
        pass  # the kubernetes client is optional here; the tests have it
    with open(path, "w") as f:
        yaml.safe_dump_all(docs, f, sort_keys=False)
    return [path]


# ---- validation -----------------------------------------------------------------------------------------
_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object,
               "datetime": str, "date": str, "bytes": str}


def _check(value, type_name: str, where: str) -> None:
    """value (JSON-shaped) against a kubernetes client model or type name such as 'list[V1EnvVar]'."""
    import kubernetes.client as kc
    if type_name.lower().startswith("list["):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        for i, v in enumerate(value):
            _check(v, type_name[5:-1], f"{where}[{i}]")
        return
    if type_name.lower().startswith(("dict(", "dict[")):
        inner = type_name[5:-1].split(", ", 1)[1]
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        for k, v in value.items():
            _check(v, inner, f"{where}.{k}")
        return
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name]) and not (type_name in ("int", "float") and isinstance(value, bool))
        if not ok:
            raise ValueError(f"{where}: expected {type_name}, got {value!r}")
        return
    model = getattr(kc, type_name)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a {type_name} mapping, got {value!r}")
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, v in value.items():
        if key not in by_json:
            raise ValueError(f"{where}: unknown field '{key}' of {type_name}")
        _check(v, model.openapi_types[by_json[key]], f"{where}.{key}")
    # required fields and enums: the model's setters raise (nested values are checked above, not here)
    try:
        model(**{by_json[k]: v for k, v in value.items()})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


# The JobSet's own fields (jobset.x-k8s.io/v1alpha2, the subset written here); nested Kubernetes parts
# are checked against the client's models.
_JOBSET_SPEC = {"failurePolicy": {"maxRestarts": int}, "network": {"enableDNSHostnames": bool, "subdomain": str},
                "replicatedJobs": [{"name": str, "replicas": int, "template": "V1JobTemplateSpec"}],
                "successPolicy": {"operator": str, "targetReplicatedJobs": [str]}, "suspend": bool}


def _check_schema(value, schema, where):
    if isinstance(schema, str):
        return _check(value, schema, where)
    if isinstance(schema, list):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        for i, v in enumerate(value):
            _check_schema(v, schema[0], f"{where}[{i}]")
        return
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        for k, v in value.items():
            if k not in schema:
                raise ValueError(f"{where}: unknown field '{k}'")
            _check_schema(v, schema[k], f"{where}.{k}")
        return
    if not isinstance(value, schema) or (schema is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {schema.__name__}, got {value!r}")


def validate(doc: dict) -> None:
    """Raises ValueError naming the first field that the Kubernetes schemas do not allow."""
    kind = doc.get("kind")
    if kind == "JobSet":
        if doc.get("apiVersion") != "jobset.x-k8s.io/v1alpha2":
            raise ValueError(f"JobSet: apiVersion {doc.get('apiVersion')!r}")
        extra = set(doc) - {"apiVersion", "kind", "metadata", "spec"}
        if extra:
            raise ValueError(f"JobSet: unknown field '{sorted(extra)[0]}'")
        _check(doc["metadata"], "V1ObjectMeta", "JobSet.metadata")
        _check_schema(doc["spec"], _JOBSET_SPEC, "JobSet.spec")
    elif kind == "ConfigMap":
        _check(doc, "V1ConfigMap", "ConfigMap")
    else:
        raise ValueError(f"unknown manifest kind {kind!r}")
