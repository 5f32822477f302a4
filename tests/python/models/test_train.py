"""torch_pjrt.train: config errors name the key; a tiny Llama trains (bf16 autocast, gradient accumulation,
clipping, activation checkpointing) and its loss falls; a run stopped halfway and resumed in a new process
ends bitwise equal to the straight run; the HF export loads in plain CPU transformers with the same logits;
2 processes with fsdp=2 match 1 process on the global batch; the Kubernetes manifests validate against the
kubernetes client's models. Launches run under hard timeouts; the trainer adds nothing mode-specific, so the
file runs once (fused).
"""
import csv
import os
import subprocess
import sys

import pytest
import torch

import torch_pjrt  # noqa: F401
from torch_pjrt.train import ConfigError, Trainer, load_config
from torch_pjrt.train import k8s
from torch_pjrt.train.__main__ import main
from torch_pjrt.train.config import reference_markdown
from torch_pjrt.train.data import build_dataset

pytestmark = [pytest.mark.modes_inside, pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LAUNCH_TIMEOUT_S = 400

BASE = ["model.name=llama-tiny", "data.seq_len=32", "data.global_batch=8", "optim.lr=1e-2", "optim.warmup_steps=2",
        "log.progress=false", "log.plot=false"]


def _env():
    env = dict(os.environ, TORCH_PJRT_MODE="fused", OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run_cli(args, nproc=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    proc = subprocess.run(launcher + ["-m", "torch_pjrt.train"] + args, env=_env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc.stdout


def _losses(log_dir, run_name="run"):
    with open(os.path.join(log_dir, run_name, "metrics.csv")) as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def _exported(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


# ---- configuration ---------------------------------------------------------------------------------------
def test_config_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"'optim\.lrr'.*did you mean 'optim\.lr'"):
        load_config(str(bad))
    bad.write_text("modle:\n  name: llama-tiny\n")
    with pytest.raises(ConfigError, match=r"'modle'.*'model'"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=r"'data\.seq_len': expected int"):
        load_config(None, ["data.seq_len=abc"])
    with pytest.raises(ConfigError, match=r"'precision'.*not one of fp32, bf16"):
        load_config(None, ["precision=fp16"])
    with pytest.raises(ConfigError, match=r"'optim\.lr': must be > 0"):
        load_config(None, ["optim.lr=0"])
    with pytest.raises(ConfigError, match=r"'mesh\.rules\.\*\.q_proj\.weight'"):
        load_config(None, ["mesh.rules.*.q_proj.weight=diagonal"])
    with pytest.raises(ConfigError, match=r"'steps' has no sub-keys"):
        load_config(None, ["steps.x=1"])
    cfg = load_config(os.path.join(ROOT, "examples", "train_llama_tiny.yaml"),
                      ["optim.lr=3e-4", "model.config.num_hidden_layers=3", "mesh.rules.*.q_proj.weight=colwise",
                       "optim.betas=[0.8, 0.9]", "run_name=007"])
    assert cfg.optim.lr == 3e-4 and cfg.model.config["num_hidden_layers"] == 3 and cfg.optim.betas == [0.8, 0.9]
    assert cfg.mesh.rules == {"*.q_proj.weight": "colwise"} and cfg.run_name == "007"


def test_cli_bad_key_exits_2_naming_it(capsys):
    assert main(["log.wandbb=offline"]) == 2
    assert "'log.wandbb'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"world size 1"):
        Trainer(load_config(None, ["mesh.fsdp=2"]))


def test_docs_list_every_key():
    with open(os.path.join(ROOT, "docs", "train.md")) as f:
        docs = f.read()
    assert reference_markdown() in docs, "docs/train.md: paste `python -m torch_pjrt.train --describe`"


def test_text_files_through_datasets_and_plain_reader_agree(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "a.jsonl").write_text('{"text": "hello tpu world, ' + "x" * 100 + '"}\n{"text": "second line"}\n')
    cfg = load_config(None, [f"data.source={tmp_path}/a.jsonl", "data.seq_len=16"]).data
    with_ds, plain = build_dataset(cfg, 256, use_datasets=True), build_dataset(cfg, 256, use_datasets=False)
    assert torch.equal(with_ds.rows, plain.rows) and len(plain) == (len("hello tpu world, ") + 100 + 11) // 16
    assert bytes(plain.rows[0].tolist()).decode() == "hello tpu world,"


# ---- single process: train, resume bitwise, export ------------------------------------------------------
RESUME = BASE + ["steps=8", "optim.lr=3e-2", "precision=bf16", "data.grad_accum=2", "optim.grad_clip=0.5",
                 "model.activation_checkpointing=all"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps in this process with every logger on; then the same config stopped after step 4."""
    d = tmp_path_factory.mktemp("straight")
    cfg = load_config(None, RESUME + [f"log.dir={d}/logs", f"checkpoint.dir={d}/ckpt", f"checkpoint.export={d}/hf",
                                      "log.tensorboard=true", "log.wandb=offline", "log.plot=true"])
    os.environ["WANDB_SILENT"] = "true"
    trainer = Trainer(cfg)
    history = trainer.fit()
    half = Trainer(load_config(None, RESUME + [f"log.dir={d}/half_logs", f"checkpoint.dir={d}/half_ckpt",
                                               "stop_after=4"]))
    half_history = half.fit()
    return d, trainer, history, half_history


def test_tiny_llama_trains_loss_falls_and_logs(straight):
    d, trainer, history, _ = straight
    losses = [r["loss"] for r in history]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.2 and losses[-1] < min(losses[:4]), losses  # from ln(256) = 5.55
    assert all(r["tokens_per_s"] > 0 for r in history) and all(r["mfu"] is None for r in history)  # CPU: no peak
    assert all(r["grad_norm"] is not None for r in history)
    assert _losses(d / "logs") == {r["step"]: r["loss"] for r in history}
    run = d / "logs" / "run"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run / "tensorboard"))
    assert list((run / "wandb").glob("offline-run-*")), os.listdir(run / "wandb")
    assert (run / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_in_new_process_is_bitwise(straight):
    """Steps 1-4, checkpoint, a new process resumes 5-8: per-step losses and final parameters torch.equal."""
    d, _, history, half_history = straight
    assert [r["loss"] for r in half_history] == [r["loss"] for r in history[:4]]
    out = _run_cli(RESUME + [f"log.dir={d}/resumed_logs", f"checkpoint.dir={d}/half_ckpt",
                             f"checkpoint.export={d}/resumed_hf"])
    assert "steps 5..8" in out, out
    resumed = _losses(d / "resumed_logs")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == history[s - 1]["loss"] for s in resumed), (resumed, history)
    want, got = _exported(d / "hf"), _exported(d / "resumed_hf")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_export_loads_in_cpu_transformers(straight):
    d, trainer, _, _ = straight
    import transformers
    cpu = transformers.AutoModelForCausalLM.from_pretrained(d / "hf")
    assert type(cpu).__name__ == "LlamaForCausalLM" and next(cpu.parameters()).device.type == "cpu"
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    trainer.model.eval()
    cpu.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=x.to("tpu")).logits.cpu()
        got = cpu(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- two processes: fsdp=2, or tensor=2 with rules on some weights ------------------------------------------
# Tensor rules on the attention projections only leave the other parameters plain tensors: clipping and the
# optimizer step then see DTensors and tensors together (PyTorch's foreach kernels refuse the mix).
PARTIAL_TENSOR_RULES = ['mesh.rules={"*.q_proj.weight": colwise, "*.k_proj.weight": colwise, '
                        '"*.v_proj.weight": colwise, "*.o_proj.weight": rowwise}']


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("mesh", [["mesh.fsdp=2"], ["mesh.tensor=2"] + PARTIAL_TENSOR_RULES], ids=["fsdp", "tensor"])
def test_two_processes_match_one_process(tmp_path, mesh):
    # SGD: its update is linear in the gradient, so the two runs' float32 summation-order noise stays that
    # small (AdamW turns noise on a near-zero gradient element into an lr-sized step)
    args = BASE + ["steps=4", "optim.grad_clip=1.0", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9"]
    _run_cli(args + mesh + [f"log.dir={tmp_path}/two", f"checkpoint.export={tmp_path}/two_hf"], nproc=2)
    one = Trainer(load_config(None, args + [f"log.dir={tmp_path}/one", f"checkpoint.export={tmp_path}/one_hf"]))
    one.fit()
    two_losses, one_losses = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    torch.testing.assert_close(torch.tensor(list(two_losses.values())), torch.tensor(list(one_losses.values())),
                               rtol=1e-5, atol=1e-5)
    want, got = _exported(tmp_path / "one_hf"), _exported(tmp_path / "two_hf")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


# ---- launch ----------------------------------------------------------------------------------------------
def _pod(doc):
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_k8s_manifests_validate(kind, tmp_path):
    pytest.importorskip("kubernetes")
    import yaml
    launch = [f"launch.kind={kind}", "launch.nodes=2", "launch.procs_per_node=4", "launch.slices=2",
              "launch.tpu_topology=2x2x2", "data.global_batch=16"]  # 2 v5p hosts per slice; 16 or 8 ranks
    cfg = load_config(os.path.join(ROOT, "examples", "train_llama_tiny.yaml"), launch)
    assert main([os.path.join(ROOT, "examples", "train_llama_tiny.yaml"), *launch, "--k8s", str(tmp_path)]) == 0
    configmap, jobset = yaml.safe_load_all((tmp_path / "llama-tiny.yaml").read_text())
    assert [configmap, jobset] == k8s.manifests(cfg)
    for doc in (configmap, jobset):
        k8s.validate(doc)
    pod = _pod(jobset)
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TORCH_PJRT_PLUGIN"] == ("tpu" if kind == "tpu" else "cuda")
    assert env["TORCH_PJRT_CACHE_DIR"].startswith(k8s.SHARED_MOUNT)
    assert any(v.get("persistentVolumeClaim") for v in pod["volumes"])
    hosts = 4 if kind == "tpu" else 2  # 2 slices of 2 hosts on TPU
    cmd = " ".join(container["command"])
    assert f"--nproc-per-node=4 --nnodes={hosts} --rdzv-backend=c10d" in cmd and "-m torch_pjrt.train" in cmd
    job = jobset["spec"]["replicatedJobs"][0]
    assert job["replicas"] == (2 if kind == "tpu" else 1) and job["template"]["spec"]["parallelism"] == 2
    res = "google.com/tpu" if kind == "tpu" else "nvidia.com/gpu"
    assert container["resources"]["limits"] == {res: "4"}
    if kind == "tpu":
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == cfg.launch.tpu_topology
    assert yaml.safe_load(configmap["data"]["config.yaml"])["model"]["name"] == "llama-tiny"


def test_k8s_validation_catches_wrong_fields():
    pytest.importorskip("kubernetes")
    cfg = load_config(None, ["launch.kind=tpu", "launch.procs_per_node=4"])

    def broken(edit):
        doc = k8s.manifests(cfg)[1]
        edit(doc)
        return doc
    cases = {
        "nodeSelecter": lambda d: _pod(d).update(nodeSelecter={}),
        "name": lambda d: _pod(d)["containers"][0].pop("name"),
        "parallelism": lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"].update(parallelism="2"),
        "replicatedJob": lambda d: d["spec"].update(replicatedJob=[]),
        "mountPath": lambda d: _pod(d)["containers"][0]["volumeMounts"][0].update(mountPath=3),
    }
    for field, edit in cases.items():
        with pytest.raises(ValueError, match=field):
            k8s.validate(broken(edit))


def test_torchrun_command_local():
    cfg = load_config(None, ["launch.procs_per_node=2"])
    cmd = k8s.torchrun_command(cfg, local=True, config_path="c.yaml", overrides=["steps=3"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "--nnodes=1",
                       "-m", "torch_pjrt.train", "c.yaml", "steps=3"]
