"""Launch lines and Kubernetes manifests made from the trainer's config (the `launch` section).

- `torchrun_command`: one process per chip (launch.procs_per_node) on each of the hosts; locally
  `--standalone`, on a cluster a c10d rendezvous at the JobSet's first pod.
- `check_launch`: refuses settings that cannot run (ConfigError naming the keys): a TPU slice's chips vs
  hosts x processes per host, processes per host vs the chips of GKE's TPU hosts, the mesh vs the world size.
- `cluster_config`: the config the pods run: every output (OUTPUT_KEYS) on the shared volume.
- `manifests`: a ConfigMap holding that config, and a JobSet (jobset.x-k8s.io/v1alpha2) whose
  replicated Job runs one pod per host: on TPU one Job per slice with `google.com/tpu` chips and the
  GKE TPU node selectors, on GPU one Job over the node pool with `nvidia.com/gpu`. torchrun starts each
  process through `torch_pjrt.train.k8s_env`, which gives it its own chip (libtpu's per-process
  variables) or GPU (CUDA_VISIBLE_DEVICES). Every pod gets TORCH_PJRT_PLUGIN and TORCH_PJRT_CACHE_DIR on
  the shared ReadWriteMany volume, so a program compiled by one host is loaded by the others.
- `validate`: checks a manifest's Kubernetes parts field by field against the `kubernetes` Python
  client's models (unknown field or wrong type raises), the JobSet's own fields against its schema.
"""
from __future__ import annotations

import copy
import math
import os
import sys

import yaml

from .config import ConfigError, to_dict
from .k8s_env import CHIPS_PER_HOST_BOUNDS, parse_topology

__all__ = ["torchrun_command", "check_launch", "cluster_config", "manifests", "write_manifests", "validate",
           "OUTPUT_KEYS", "INPUT_KEYS"]

CONFIG_MOUNT = "/etc/torch_pjrt"
SHARED_MOUNT = "/shared"
# Every config key the trainer writes under, and its directory in the run's folder on the shared volume:
# a pod's own disk is lost when it ends. checkpoint.export stays off ('') when the config leaves it off.
OUTPUT_KEYS = {"checkpoint.dir": "checkpoints", "checkpoint.export": "export", "log.dir": "logs"}
# Paths the trainer only reads: they must exist in the image or on the shared volume (docs/gke.md).
INPUT_KEYS = ("model.name", "model.init_from", "data.source", "data.tokenizer")
# GKE TPU accelerators (cloud.google.com/gke-tpu-accelerator): topology dimensions, and the chips per
# host its node pools offer (multi-host slices always use 4-chip hosts). Others are checked only for
# chips == hosts x processes.
TPU_TYPES = {"tpu-v4-podslice": (3, (4,)), "tpu-v5p-slice": (3, (4,)),
             "tpu-v5-lite-podslice": (2, (1, 4, 8)), "tpu-v6e-slice": (2, (1, 4, 8))}
MULTI_HOST_CHIPS_PER_HOST = 4
ENTRY_MODULE = "torch_pjrt.train.k8s_env"


def _hosts(cfg) -> int:
    return cfg.launch.nodes * (cfg.launch.slices if cfg.launch.kind == "tpu" else 1)


def torchrun_command(cfg, local: bool, config_path=None, overrides=(), rdzv_host: str = "",
                     wrapper_args=None) -> list[str]:
    """wrapper_args (a list): start each process through k8s_env with these arguments, then `--`."""
    lc = cfg.launch
    cmd = [sys.executable if local else "python", "-m", "torch.distributed.run", f"--nproc-per-node={lc.procs_per_node}"]
    if local:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        cmd += [f"--nnodes={_hosts(cfg)}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_host}:{lc.port}",
                f"--rdzv-id={cfg.run_name}"]
    entry = ["torch_pjrt.train"] if wrapper_args is None else [ENTRY_MODULE, *wrapper_args, "--"]
    cmd += ["-m", *entry] + ([config_path] if config_path else []) + list(overrides)
    return cmd


# ---- consistency ---------------------------------------------------------------------------------------
def _host_size_fits(accelerator: str, per_host: int, chips: int) -> bool:
    """Whether hosts of `per_host` chips can make a slice of `chips` chips of that TPU type."""
    if chips % per_host:
        return False
    if accelerator not in TPU_TYPES:
        return True
    return per_host in TPU_TYPES[accelerator][1] and (per_host == chips or per_host == MULTI_HOST_CHIPS_PER_HOST)


def _slice_hint(lc, chips: int) -> str:
    """' (for example launch.nodes=N launch.procs_per_node=P)': a shape of `chips` chips, this procs_per_node first."""
    sizes = [lc.procs_per_node, *TPU_TYPES.get(lc.tpu_accelerator, (0, ()))[1]]
    fits = [p for p in sizes if _host_size_fits(lc.tpu_accelerator, p, chips)]
    return f" (for example launch.nodes={chips // fits[0]} launch.procs_per_node={fits[0]})" if fits else ""


def _check_tpu_slice(lc) -> None:
    try:
        bounds = parse_topology(lc.tpu_topology)
    except ValueError as e:
        raise ConfigError(f"config key 'launch.tpu_topology': {e}") from None
    chips = math.prod(bounds)
    setting = (f"launch.tpu_topology={lc.tpu_topology} is {chips} chip(s) per slice, launch.nodes={lc.nodes} x "
               f"launch.procs_per_node={lc.procs_per_node} is {lc.nodes * lc.procs_per_node} process(es)")
    if chips != lc.nodes * lc.procs_per_node:
        raise ConfigError(f"config keys 'launch.tpu_topology', 'launch.nodes', 'launch.procs_per_node': {setting}; "
                          f"one process per chip needs them equal{_slice_hint(lc, chips)}")
    known = TPU_TYPES.get(lc.tpu_accelerator)
    if known is None:
        return
    ndims, per_host = known
    if len(lc.tpu_topology.lower().split("x")) != ndims:
        raise ConfigError(f"config keys 'launch.tpu_topology', 'launch.tpu_accelerator': {lc.tpu_accelerator} "
                          f"topologies have {ndims} dimensions, got {lc.tpu_topology!r}")
    allowed = (MULTI_HOST_CHIPS_PER_HOST,) if lc.nodes > 1 else per_host
    if lc.procs_per_node not in allowed:
        shape = "multi-host " if lc.nodes > 1 else ""
        raise ConfigError(f"config keys 'launch.procs_per_node', 'launch.nodes': {shape}{lc.tpu_accelerator} hosts "
                          f"have {' or '.join(map(str, allowed))} chips, and the trainer runs one process per chip; "
                          f"{setting}")
    host = CHIPS_PER_HOST_BOUNDS[lc.procs_per_node]
    if any(b % h for b, h in zip(bounds, host)):
        raise ConfigError(f"config key 'launch.tpu_topology': {lc.tpu_topology} is not made of hosts of "
                          f"{'x'.join(map(str, host))} chips")


def _check_mesh(cfg) -> None:
    world, m = _hosts(cfg) * cfg.launch.procs_per_node, cfg.mesh
    inner = m.fsdp * m.tensor
    data = m.data if m.data != -1 else world // inner
    hosts = "launch.nodes x launch.slices" if cfg.launch.kind == "tpu" else "launch.nodes"
    if data < 1 or data * inner != world:
        raise ConfigError(f"config keys 'mesh.data', 'mesh.fsdp', 'mesh.tensor': data={m.data} x fsdp={m.fsdp} x "
                          f"tensor={m.tensor} does not make the world size {world} ({hosts} = {_hosts(cfg)} host(s) x "
                          f"launch.procs_per_node={cfg.launch.procs_per_node})")
    dp, d = data * m.fsdp, cfg.data
    if d.global_batch % d.grad_accum or (d.global_batch // d.grad_accum) % dp:
        raise ConfigError(f"config key 'data.global_batch': {d.global_batch} is not data.grad_accum={d.grad_accum} x a "
                          f"multiple of the {dp} data-parallel ranks of the launch")


def check_launch(cfg) -> None:
    """Raises ConfigError naming the keys when the launch section cannot run as configured."""
    if cfg.launch.kind == "tpu":
        _check_tpu_slice(cfg.launch)
    _check_mesh(cfg)


# ---- manifests -----------------------------------------------------------------------------------------
def _name(cfg) -> str:
    name = "".join(c if c.isalnum() else "-" for c in cfg.run_name.lower()).strip("-")
    return (name or "run")[:40]


def _set_key(cfg, key: str, value) -> None:
    section, field_name = key.split(".")
    setattr(getattr(cfg, section), field_name, value)


def _get_key(cfg, key: str):
    section, field_name = key.split(".")
    return getattr(getattr(cfg, section), field_name)


def cluster_config(cfg):
    """A copy of cfg whose outputs all go to the run's folder on the shared volume (no progress bar in logs)."""
    out, shared = copy.deepcopy(cfg), f"{SHARED_MOUNT}/{_name(cfg)}"
    for key, folder in OUTPUT_KEYS.items():
        if key == "checkpoint.export" and not _get_key(cfg, key):
            continue  # export off stays off; checkpoints are always kept (a restarted JobSet resumes from them)
        _set_key(out, key, f"{shared}/{folder}")
    out.log.progress = False
    return out


# The JobSet's index of a pod's Job (its slice on TPU), from the pod's labels through the downward API;
# Kubernetes expands $(JOBSET_JOB_INDEX) in the container's command.
_JOB_INDEX_ENV = {"name": "JOBSET_JOB_INDEX",
                  "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}}


def _wrapper_args(cfg, name: str, job_name: str) -> list[str]:
    lc = cfg.launch
    if lc.kind == "gpu":
        return ["--kind=gpu"]
    # JobSet's headless service names pod i of Job j <jobset>-<job>-<j>-<i>.<jobset>; one host: itself
    hosts = ["localhost"] if lc.nodes == 1 else \
        [f"{name}-{job_name}-$(JOBSET_JOB_INDEX)-{i}.{name}" for i in range(lc.nodes)]
    return ["--kind=tpu", f"--topology={lc.tpu_topology}", f"--hosts={','.join(hosts)}"]


def manifests(cfg) -> list[dict]:
    check_launch(cfg)
    lc, name = cfg.launch, _name(cfg)
    job_name = "slice" if lc.kind == "tpu" else "workers"
    # JobSet's headless service (named after the JobSet) gives pod <jobset>-<job>-<index>-<completion>.<jobset>
    rdzv_host = f"{name}-{job_name}-0-0.{name}"
    command = torchrun_command(cfg, local=False, config_path=f"{CONFIG_MOUNT}/config.yaml", rdzv_host=rdzv_host,
                               wrapper_args=_wrapper_args(cfg, name, job_name))
    plugin = "tpu" if lc.kind == "tpu" else "cuda"
    env = [{"name": "TORCH_PJRT_PLUGIN", "value": plugin},
           {"name": "TORCH_PJRT_CACHE_DIR", "value": f"{SHARED_MOUNT}/compile-cache"},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if lc.kind == "tpu":
        env.append(_JOB_INDEX_ENV)
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
                 "data": {"config.yaml": yaml.safe_dump(to_dict(cluster_config(cfg)), sort_keys=False)}}
    return [configmap, jobset]


def write_manifests(cfg, out_dir: str) -> list[str]:
    docs = manifests(cfg)  # ConfigError before anything is written
    try:
        for d in docs:
            validate(d)
    except ImportError:
        pass  # the kubernetes client is optional here; the tests have it
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{_name(cfg)}.yaml")
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
