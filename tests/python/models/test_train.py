"""torch_pjrt.train: config errors name the key; a tiny Llama trains (bf16 autocast, gradient accumulation,
clipping, activation checkpointing) and its loss falls; a run stopped halfway and resumed in a new process
ends bitwise equal to the straight run; the HF export loads in plain CPU transformers with the same logits;
2 processes with fsdp=2 match 1 process on the global batch; the Kubernetes manifests validate against the
kubernetes client's models. Launches run under hard timeouts; the trainer adds nothing mode-specific, so the
file runs once (fused).
"""
import csv
import math
import os
import shutil
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


# ---- the command line: overrides anywhere, config errors as `error:` and status 2 -------------------------
EXAMPLE = os.path.join(ROOT, "examples", "train_llama_tiny.yaml")


def test_overrides_after_the_flags(capsys, monkeypatch):
    """The example YAML's header: `CONFIG mesh.fsdp=2 --torchrun launch.procs_per_node=2` (argparse rejected the
    items after a flag)."""
    import yaml
    assert main([EXAMPLE, "--print-config", "steps=3", "optim.lr=0.5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["steps"] == 3 and printed["optim"]["lr"] == 0.5
    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: launched.append(cmd) or 0)
    assert main([EXAMPLE, "mesh.fsdp=2", "--torchrun", "launch.procs_per_node=2"]) == 0
    assert launched[0][-3:] == [EXAMPLE, "mesh.fsdp=2", "launch.procs_per_node=2"], launched
    assert "--nproc-per-node=2" in launched[0]


def test_config_errors_exit_2_with_error_line(tmp_path, capsys, monkeypatch):
    cases = {
        "config file": [str(tmp_path / "missing.yaml")],
        "'model.name': 'nope' is no preset": ["model.name=nope"],  # found while the Trainer builds
        "world size 1": ["mesh.fsdp=2"],  # found while the Trainer builds its mesh
        "no file matches": [f"data.source={tmp_path}/none.txt"],
        "'data.tokenizer'": [f"data.source={EXAMPLE}", f"data.tokenizer={tmp_path}/no_tokenizer"],
        "'eval.fraction'": ["eval.every=1", "eval.fraction=1.5"],
    }
    for message, argv in cases.items():
        assert main(argv + ["log.progress=false", f"log.dir={tmp_path}"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)
    # --torchrun checks the mesh against the processes it would start, before starting them
    monkeypatch.setattr(subprocess, "call", lambda cmd: pytest.fail(f"launched {cmd}"))
    assert main(["mesh.fsdp=2", "--torchrun", "launch.procs_per_node=3"]) == 2
    assert "world size 3" in capsys.readouterr().err


def test_config_error_in_a_new_process_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "torch_pjrt.train", "model.name=nope", "log.progress=false"],
                          env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: config key 'model.name'"), proc.stderr


# ---- resuming: only the same run, keep-last-N, a finished run, the plot of the whole run -------------------
SMALL = BASE + ["steps=2", "optim.lr=1e-2", "precision=fp32"]


def _fit(args):
    trainer = Trainer(load_config(None, args))
    return trainer, trainer.fit()


def test_resume_refuses_another_runs_checkpoint(tmp_path, capsys):
    ckpt = [f"checkpoint.dir={tmp_path}/ckpt", f"log.dir={tmp_path}/logs"]
    _fit(SMALL + ckpt)
    other = SMALL + ckpt + ["precision=bf16", "optim.lr=3e-3", "data.seq_len=16", "steps=3"]
    with pytest.raises(ConfigError) as e:
        Trainer(load_config(None, other))
    message = str(e.value)
    for key in ("precision: 'fp32' -> 'bf16'", "optim.lr: 0.01 -> 0.003", "data.seq_len: 32 -> 16",
                "new checkpoint.dir", "checkpoint.force_resume=true"):
        assert key in message, message
    assert "steps" not in message.split(":", 1)[1].split(".", 1)[0]  # steps may change
    assert main(other) == 2 and "error: checkpoint.dir" in capsys.readouterr().err
    # what may change: more steps, the mesh, logging; and force_resume takes the checkpoint anyway
    more, history = _fit(SMALL + ckpt + ["steps=3", "compile=false", "log.every=2"])
    assert more.resumed_from.endswith("step_00000002") and [r["step"] for r in history] == [3]
    forced = Trainer(load_config(None, other + ["checkpoint.force_resume=true"]))
    assert forced.step == 3


def test_rerunning_a_finished_run_says_so(tmp_path, capsys):
    args = SMALL + [f"checkpoint.dir={tmp_path}/ckpt", f"log.dir={tmp_path}/logs"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "steps 1..2" in first
    csv_before = (tmp_path / "logs" / "run" / "metrics.csv").read_text()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "run already finished" in out and "step 2, steps=2" in out and "steps 1..2" not in out, out
    assert (tmp_path / "logs" / "run" / "metrics.csv").read_text() == csv_before
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000002"]


def test_keep_last_n_checkpoints(tmp_path):
    args = SMALL + [f"checkpoint.dir={tmp_path}/ckpt", f"log.dir={tmp_path}/logs", "checkpoint.every=1",
                    "checkpoint.keep=2"]
    _fit(args[:] + ["steps=3"])
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000002", "step_00000003"]
    resumed, history = _fit(args + ["steps=4"])
    assert resumed.resumed_from.endswith("step_00000003") and [r["step"] for r in history] == [4]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000003", "step_00000004"]


def test_plot_after_a_resume_shows_the_whole_run(tmp_path):
    """4 steps with checkpoints at 2 and 4; the step-4 one is lost (as if the process died after logging step 4),
    so a new process resumes at 2: the plot's rows are steps 1-4 once each, 3-4 from the resumed process."""
    args = SMALL + ["steps=4", f"checkpoint.dir={tmp_path}/ckpt", f"log.dir={tmp_path}/logs", "checkpoint.every=2"]
    _, straight = _fit(args)
    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")
    resumed, history = _fit(args + ["log.plot=true"])
    assert [r["step"] for r in history] == [3, 4]
    rows = resumed.logger.plot_rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight]  # bitwise resume: the same curve
    assert (tmp_path / "logs" / "run" / "plot.png").exists()


# ---- evaluation on held-out rows, and the tokenizer in the export -------------------------------------------
def _text_rows(path, n):
    """n lines of 16 distinct bytes: with data.seq_len=16 and the byte tokenizer, row i is line i."""
    lines = [f"row {i:04d} abcdefg" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return lines


class RecordingTrainer(Trainer):
    """Notes every batch compute_loss sees, with the model's mode and whether gradients were on."""

    def compute_loss(self, batch):
        self.seen = getattr(self, "seen", [])
        self.seen.append((self.model.training, torch.is_grad_enabled(), batch.cpu()))
        return super().compute_loss(batch)


def test_eval_loss_equals_cpu_model_on_held_out_rows(tmp_path):
    import transformers
    lines = _text_rows(tmp_path / "rows.txt", 80)
    args = BASE + ["steps=4", "precision=fp32", "data.seq_len=16", f"data.source={tmp_path}/rows.txt",
                   "eval.every=2", "eval.fraction=0.2", f"log.dir={tmp_path}/logs", f"checkpoint.export={tmp_path}/hf"]
    trainer = RecordingTrainer(load_config(None, args))
    history = trainer.fit()
    held_out = lines[64:]  # the last 20%: 16 rows, 2 micro-batches of 8
    as_text = [(training, grad, [bytes(r.tolist()).decode() for r in b]) for training, grad, b in trainer.seen]
    trained = {line for training, _, rows in as_text if training for line in rows}
    evaluated = [rows for training, _, rows in as_text if not training]
    assert trained and not trained & set(held_out)
    assert evaluated == [held_out[:8], held_out[8:]] * 2  # at steps 2 and 4
    assert all(not grad for training, grad, _ in as_text if not training)
    assert trainer.model.training

    assert [r["step"] for r in history if r.get("eval_loss") is not None] == [2, 4]
    assert {s: r["eval_loss"] for s, r in ((r["step"], r) for r in history) if "eval_loss" in r} == \
        {int(r["step"]): float(r["eval_loss"]) for r in csv.DictReader(open(tmp_path / "logs" / "run" / "metrics.csv"))
         if r["eval_loss"]}
    # the reference: the exported weights on CPU PyTorch, a shifted cross-entropy per batch, the batches' mean
    cpu = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    losses = []
    with torch.no_grad():
        for part in (held_out[:8], held_out[8:]):
            ids = torch.tensor([list(line.encode()) for line in part])
            logits = cpu(input_ids=ids).logits
            losses.append(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    want = torch.stack(losses).mean().item()
    assert history[-1]["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert history[-1]["eval_ppl"] == pytest.approx(math.exp(want), rel=1e-5)

    # the byte tokenizer went out with the model
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "row 0064 abcdefg, héllo"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_export_carries_an_hf_tokenizer(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["[UNK]", "</s>"] + sorted(set(" ".join(_text_rows(tmp_path / "rows.txt", 40)).split()))
    source = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    source.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=source, unk_token="[UNK]",
                                         eos_token="</s>").save_pretrained(tmp_path / "tok")
    _fit(BASE + ["steps=1", "data.seq_len=4", f"data.source={tmp_path}/rows.txt", f"data.tokenizer={tmp_path}/tok",
                 f"log.dir={tmp_path}/logs", f"checkpoint.export={tmp_path}/hf"])
    want = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    got = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "row 0007 abcdefg row 0031 abcdefg"
    assert got(text)["input_ids"] == want(text)["input_ids"] and got.eos_token == "</s>"
    assert len(got(text)["input_ids"]) == 6 and got.unk_token_id not in got(text)["input_ids"]


# ---- packaging: pip install .[train] --------------------------------------------------------------------
# import name -> the distribution that provides it (torch.utils.tensorboard needs the tensorboard package)
_DISTRIBUTIONS = {"yaml": "pyyaml", "torch.utils.tensorboard": "tensorboard"}


def _third_party_imports(directory):
    import ast
    found = set()
    for name in os.listdir(directory):
        if name.endswith(".py"):
            for node in ast.walk(ast.parse(open(os.path.join(directory, name)).read())):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    found.add(node.module)
    named = {_DISTRIBUTIONS.get(m, _DISTRIBUTIONS.get(m.split(".")[0], m.split(".")[0])) for m in found}
    return {n for n in named if n not in sys.stdlib_module_names and n not in ("torch", "torch_pjrt", "__future__")}


def test_train_extra_lists_what_the_trainer_imports():
    import re
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["train"]
    names = {re.split(r"[<>=!~\[ ]", e)[0].lower() for e in extra}
    missing = _third_party_imports(os.path.join(ROOT, "python", "torch_pjrt", "train")) - names
    assert not missing, f"pyproject.toml's train extra lacks {missing}"
    assert all(not e.startswith("torch") or e == "torch==2.13.0" for e in extra), extra
    readme = open(os.path.join(ROOT, "README.md")).read()
    trainer_bullet = readme.split("- Training:", 1)[1].split("\n- ", 1)[0]
    assert ".[train]" in trainer_bullet and ".[train]" in open(os.path.join(ROOT, "docs", "train.md")).read()
    setup = readme.split("## Set-up commands", 1)[1].split("\n## ", 1)[0]
    assert len([line for line in setup.splitlines() if line.startswith("- ")]) == 2
