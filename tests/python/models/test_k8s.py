"""torch_pjrt.train's Kubernetes manifests (docs/gke.md): every output of a run lands on the shared volume (a
real run from the manifest's config, in an empty working directory); inconsistent launch settings are refused
naming the keys; each process a pod's torchrun starts gets its own chip (libtpu's per-process variables,
computed for every process of the generated manifest) or GPU, and the wrapper really starts the trainer.
No cluster here: what Kubernetes would do ($(VAR) expansion, JOB_COMPLETION_INDEX, torchrun's LOCAL_RANK)
is done by the test.
"""
import dataclasses
import os
import re
import subprocess
import sys
import typing

import pytest
import yaml

import torch_pjrt  # noqa: F401
from torch_pjrt.train import ConfigError, TrainConfig, load_config
from torch_pjrt.train import k8s, k8s_env

pytestmark = [pytest.mark.modes_inside, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(ROOT, "examples", "train_llama_tiny.yaml")
TPU_VARS = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES",
            "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID")


def _env():
    env = dict(os.environ, TORCH_PJRT_MODE="fused", OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_PJRT_CACHE_DIR"):
        env.pop(key, None)
    return env


def _pod(jobset):
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _container(cfg):
    configmap, jobset = k8s.manifests(cfg)
    return configmap, jobset, _pod(jobset)["containers"][0]


def _expand(command, values):
    """Kubernetes' $(VAR) expansion of a container command from its environment."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: str(values[m.group(1)]), c) for c in command]


def _wrapper_args(command):
    """k8s_env's parsed arguments, as torchrun's own parser hands them on from the pod's command."""
    from torch.distributed.run import get_args_parser
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    torchrun = get_args_parser().parse_args(command[3:])
    assert torchrun.module and torchrun.training_script == k8s.ENTRY_MODULE
    return k8s_env._parser().parse_args(torchrun.training_script_args)


# ---- outputs -------------------------------------------------------------------------------------------
def test_every_run_output_is_on_the_shared_volume(tmp_path):
    """A short run with the manifest's config and trainer arguments (/shared mapped to a local folder) and every
    writer on (checkpoints, HF export, CSV, TensorBoard, plot) writes nothing into its working directory."""
    cfg = load_config(EXAMPLE, ["steps=2", "checkpoint.every=1", "launch.procs_per_node=4", "precision=fp32"])
    configmap, _, container = _container(cfg)
    shared, work = tmp_path / "shared", tmp_path / "work"
    work.mkdir()
    config = configmap["data"]["config.yaml"].replace(k8s.SHARED_MOUNT + "/", f"{shared}/")
    (tmp_path / "config.yaml").write_text(config)
    command = container["command"]
    trainer_args = command[command.index(f"{k8s.CONFIG_MOUNT}/config.yaml") + 1:]
    trainer_args = [a.replace(k8s.SHARED_MOUNT + "/", f"{shared}/") for a in trainer_args]
    proc = subprocess.run([sys.executable, "-m", "torch_pjrt.train", str(tmp_path / "config.yaml"), *trainer_args],
                          cwd=work, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert sorted(os.listdir(work)) == [], "written inside the container, lost when the pod ends"
    run = shared / "llama-tiny"
    assert (run / "export" / "model.safetensors").exists()
    assert (run / "logs" / "llama-tiny" / "metrics.csv").exists() and (run / "logs" / "llama-tiny" / "plot.png").exists()
    assert (run / "logs" / "llama-tiny" / "tensorboard").is_dir()
    assert any((run / "checkpoints" / d / "DONE").exists() for d in os.listdir(run / "checkpoints"))


def _string_keys(obj=None, prefix=""):
    obj = obj or TrainConfig()
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _string_keys(getattr(obj, f.name), prefix + f.name + ".")
        elif hints[f.name] is str:
            yield prefix + f.name, f.metadata.get("doc", "")


def test_every_path_key_is_classified_and_outputs_move():
    """A new key that names a file or folder must be listed as an output (moved to the shared volume) or an input."""
    pathlike = [key for key, doc in _string_keys()
                if re.search(r"(dir|export|path|file|output)s?$", key) or re.search(r"\b(write|directory|folder)", doc)]
    not_paths = {"run_name"}  # a folder name under log.dir, which moves
    unclassified = [k for k in pathlike if k not in k8s.OUTPUT_KEYS and k not in k8s.INPUT_KEYS and k not in not_paths]
    assert not unclassified, f"add to k8s.OUTPUT_KEYS or k8s.INPUT_KEYS: {unclassified}"
    cfg = load_config(None, ["checkpoint.export=hf", "launch.procs_per_node=4"])
    moved = k8s.cluster_config(cfg)
    for key in k8s.OUTPUT_KEYS:
        section, name = key.split(".")
        assert getattr(getattr(moved, section), name).startswith(f"{k8s.SHARED_MOUNT}/run/"), key
    assert k8s.cluster_config(load_config(None, ["launch.procs_per_node=4"])).checkpoint.export == ""  # off stays off


# ---- consistency ---------------------------------------------------------------------------------------
V5E = ["launch.tpu_accelerator=tpu-v5-lite-podslice"]


@pytest.mark.parametrize("overrides,keys", [
    # a v5e 2x4 slice is 8 chips: 1 host of 4 processes leaves 4 chips idle
    (V5E + ["launch.tpu_topology=2x4", "launch.nodes=1", "launch.procs_per_node=4"],
     ["launch.tpu_topology", "launch.nodes", "launch.procs_per_node", "launch.nodes=2"]),
    (["launch.tpu_topology=2x2x2", "launch.nodes=4", "launch.procs_per_node=4"], ["launch.tpu_topology", "launch.nodes"]),
    # v5p hosts have 4 chips; multi-host v5e slices are made of 4-chip hosts
    (["launch.tpu_topology=2x2x2", "launch.nodes=1", "launch.procs_per_node=8"], ["launch.procs_per_node", "4 chips"]),
    (V5E + ["launch.tpu_topology=2x4", "launch.nodes=8", "launch.procs_per_node=1"], ["launch.procs_per_node", "4 chips"]),
    (V5E + ["launch.tpu_topology=2x2x2", "launch.nodes=2", "launch.procs_per_node=4"], ["launch.tpu_topology", "2 dimensions"]),
    (["launch.tpu_topology=2by2", "launch.procs_per_node=4"], ["launch.tpu_topology"]),
    # mesh vs world size: 2 hosts x 4 = 8 ranks
    (V5E + ["launch.tpu_topology=2x4", "launch.nodes=2", "launch.procs_per_node=4", "mesh.fsdp=3"],
     ["mesh.data", "mesh.fsdp", "world size 8"]),
    (["launch.kind=gpu", "launch.nodes=2", "launch.procs_per_node=8", "mesh.data=2", "mesh.fsdp=4"],
     ["mesh.data", "world size 16"]),
    (["launch.kind=gpu", "launch.nodes=2", "launch.procs_per_node=8", "data.global_batch=8"], ["data.global_batch"]),
])
def test_inconsistent_launch_is_refused(overrides, keys, tmp_path):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        k8s.write_manifests(cfg, str(tmp_path / "out"))
    for key in keys:
        assert key in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides", [
    V5E + ["launch.tpu_topology=2x4", "launch.nodes=2", "launch.procs_per_node=4"],
    V5E + ["launch.tpu_topology=2x4", "launch.nodes=1", "launch.procs_per_node=8"],
    V5E + ["launch.tpu_topology=1x1", "launch.nodes=1", "launch.procs_per_node=1"],
    ["launch.tpu_topology=2x2x4", "launch.nodes=4", "launch.procs_per_node=4", "launch.slices=2", "data.global_batch=32"],
    ["launch.tpu_accelerator=tpu-v6e-slice", "launch.tpu_topology=4x4", "launch.nodes=4", "launch.procs_per_node=4",
     "mesh.fsdp=4", "data.global_batch=16"],
    ["launch.kind=gpu", "launch.nodes=2", "launch.procs_per_node=8", "mesh.fsdp=8", "data.global_batch=16"],
])
def test_consistent_launch_is_accepted(overrides):
    k8s.check_launch(load_config(None, overrides))


# ---- per-process environment ---------------------------------------------------------------------------
def _tpu_processes(cfg):
    """{(slice, host): [env of local rank 0, 1, ...]} for every process the manifest starts, as the pods would
    compute them: Kubernetes expands $(JOBSET_JOB_INDEX) and sets JOB_COMPLETION_INDEX, torchrun LOCAL_RANK."""
    _, _, container = _container(cfg)
    defined = {e["name"] for e in container["env"]}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(container["command"]))) <= defined  # else left unexpanded
    job_index = next(e for e in container["env"] if e["name"] == "JOBSET_JOB_INDEX")
    assert job_index["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/job-index']"
    procs = int(container["resources"]["limits"]["google.com/tpu"])
    assert f"--nproc-per-node={procs}" in container["command"]
    out = {}
    for s in range(cfg.launch.slices):
        args = _wrapper_args(_expand(container["command"], {"JOBSET_JOB_INDEX": s}))
        for h in range(cfg.launch.nodes):
            out[s, h] = [k8s_env.process_env(args, {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(procs),
                                                    "JOB_COMPLETION_INDEX": str(h)}) for r in range(procs)]
    return out


def test_tpu_processes_of_a_two_host_v5e_slice_each_own_a_chip():
    """2 slices of v5e 2x4 on 2 hosts x 4 chips: libtpu's variables of all 16 processes, checked as a whole."""
    cfg = load_config(None, V5E + ["launch.tpu_topology=2x4", "launch.nodes=2", "launch.procs_per_node=4",
                                   "launch.slices=2", "data.global_batch=16"])
    pytest.importorskip("kubernetes")
    for doc in k8s.manifests(cfg):
        k8s.validate(doc)  # the downward-API variable included
    processes = _tpu_processes(cfg)
    addresses_of_slice = {}
    for (s, h), envs in processes.items():
        for env in envs:
            assert set(TPU_VARS) <= set(env)
        chips = [int(e["TPU_VISIBLE_CHIPS"]) for e in envs]
        assert sorted(chips) == list(range(4))  # disjoint, and every chip of the host
        ports = [int(e["TPU_PROCESS_PORT"]) for e in envs]
        assert len(set(ports)) == 4 and cfg.launch.port not in ports
        pod_host = f"run-slice-{s}-{h}.run"  # JobSet's DNS name of pod h of slice s (run_name "run")
        for env in envs:
            assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
            bounds = [int(b) for b in env["TPU_PROCESS_BOUNDS"].split(",")]
            assert len(bounds) == 3 and bounds[0] * bounds[1] * bounds[2] == 8  # processes of the slice
            listed = env["TPU_PROCESS_ADDRESSES"].split(",")
            assert listed[int(env["CLOUD_TPU_TASK_ID"])] == f"{pod_host}:{env['TPU_PROCESS_PORT']}"
            addresses_of_slice.setdefault(s, set()).add(env["TPU_PROCESS_ADDRESSES"])
    for s in range(2):
        (listed,) = addresses_of_slice[s]  # every process of a slice has the same list
        listed = listed.split(",")
        assert len(listed) == len(set(listed)) == 8  # every process of the slice, once
        task_ids = sorted(int(e["CLOUD_TPU_TASK_ID"]) for h in range(2) for e in processes[s, h])
        assert task_ids == list(range(8))
    assert not set(next(iter(addresses_of_slice[0])).split(",")) & set(next(iter(addresses_of_slice[1])).split(","))


def test_tpu_processes_of_a_single_host_slice():
    cfg = load_config(None, ["launch.tpu_topology=2x2x1", "launch.procs_per_node=4"])
    (envs,) = _tpu_processes(cfg).values()
    assert sorted(e["TPU_VISIBLE_CHIPS"] for e in envs) == ["0", "1", "2", "3"]
    assert {e["TPU_PROCESS_BOUNDS"] for e in envs} == {"2,2,1"}
    assert envs[0]["TPU_PROCESS_ADDRESSES"] == ",".join(f"localhost:{k8s_env.TPU_BASE_PORT + r}" for r in range(4))


def test_gpu_processes_each_own_a_gpu():
    cfg = load_config(None, ["launch.kind=gpu", "launch.nodes=2", "launch.procs_per_node=4"])
    _, _, container = _container(cfg)
    args = _wrapper_args(container["command"])
    picked = [k8s_env.process_env(args, {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4"})["CUDA_VISIBLE_DEVICES"]
              for r in range(4)]
    assert picked == ["0", "1", "2", "3"]
    # a container that already lists its GPUs: each rank takes its entry of that list
    picked = [k8s_env.process_env(args, {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4",
                                         "CUDA_VISIBLE_DEVICES": "4,5,6,7"})["CUDA_VISIBLE_DEVICES"] for r in range(4)]
    assert picked == ["4", "5", "6", "7"]


def test_wrapper_starts_the_trainer_with_the_variables(tmp_path):
    seen = {}
    environ = {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "JOB_COMPLETION_INDEX": "1", "KEEP": "1"}
    k8s_env.main(["--kind=tpu", "--topology=2x4", "--hosts=a,b", "--", "c.yaml", "steps=3"], environ,
                 execvpe=lambda path, argv, env: seen.update(path=path, argv=argv, env=env))
    assert seen["argv"] == [sys.executable, "-m", "torch_pjrt.train", "c.yaml", "steps=3"]
    assert seen["env"]["KEEP"] == "1" and seen["env"]["TPU_VISIBLE_CHIPS"] == "2"
    assert seen["env"]["CLOUD_TPU_TASK_ID"] == "6" and seen["env"]["TPU_PROCESS_PORT"] == str(k8s_env.TPU_BASE_PORT + 2)
    # for real: the wrapper replaces itself with the trainer's CLI, which sees the variable
    env = dict(_env(), LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-m", "torch_pjrt.train.k8s_env", "--kind=gpu", "--", "--print-config",
                           "steps=7"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "CUDA_VISIBLE_DEVICES=1" in proc.stderr and yaml.safe_load(proc.stdout)["steps"] == 7


def test_wrapper_refuses_a_process_outside_the_slice():
    with pytest.raises(SystemExit, match="4 chips"):
        k8s_env.main(["--kind=tpu", "--topology=2x2", "--hosts=a,b", "--", "c.yaml"],
                     {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "JOB_COMPLETION_INDEX": "0"}, execvpe=None)
    with pytest.raises(SystemExit, match="JOB_COMPLETION_INDEX"):
        k8s_env.main(["--kind=tpu", "--topology=2x2", "--hosts=a", "--", "c.yaml"],
                     {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, execvpe=None)


# ---- image recipe (docker/Dockerfile; no Docker here, so what can be checked without building) -------------
def _dockerfile():
    text = open(os.path.join(ROOT, "docker", "Dockerfile")).read()
    return re.sub(r"\\\n", " ", text)  # continuation lines joined


def test_image_recipe_pins_and_shell():
    text = _dockerfile()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    for package in ("torch", "xla-cpu-pjrt"):  # the versions the project builds and tests with
        pinned = set(re.findall(rf"\b{package}==([\w.]+)", makefile))
        assert len(pinned) == 1, (package, pinned)
        in_image = set(re.findall(rf"ARG {package.upper()}_VERSION=([\w.]+)", text)) | \
            set(re.findall(rf"\b{package}==([\w.]+)", text))
        assert in_image == pinned, (package, in_image, pinned)
    for line in text.splitlines():
        if line.startswith("RUN "):  # each RUN is shell: at least its syntax must hold
            proc = subprocess.run(["sh", "-n", "-c", line[4:]], capture_output=True, text=True)
            assert proc.returncode == 0, (line, proc.stderr)
    ignored = open(os.path.join(ROOT, "docker", "Dockerfile.dockerignore")).read().split()
    assert "build" in ignored and "**/*.so" in ignored  # setup.py would reuse a host's configured build/


@pytest.mark.parametrize("plugin,package", [("tpu", "libtpu"), ("cuda", "jax[cuda12]")])
def test_image_installs_the_package_the_plugin_lookup_names(plugin, package):
    """The package the image installs per plugin is the one torch_pjrt._plugins asks for when it is missing."""
    from torch_pjrt import _plugins
    assert f'package={package}' in _dockerfile().replace('"', "")
    try:
        _plugins.find_plugin(plugin)
    except RuntimeError as e:
        assert f"pip install {package}" in str(e)
    else:
        pytest.skip(f"the {plugin} plugin is installed here")
