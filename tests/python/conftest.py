import os
import subprocess
import sys
import warnings

import pytest

# The persistent compile cache is on by default (~/.cache/torch_pjrt); tests
# compile afresh so that they do not depend on what earlier runs left there.
# Set before the runtime starts (on first device use), and inherited by the
# subprocesses tests start; a test of the disk tier sets its own directory.
os.environ.setdefault("TORCH_PJRT_CACHE_DIR", "")

import torch  # noqa: E402

import torch_pjrt

DEVICE = "tpu"


def fused_pass_only(*values):
    """Parameter values that run in make test's fused pass only (marked modes_inside): the extra dtypes of an
    op sweep whose first values already take each mode's own path (the lowering is the same code in every
    mode; the fused pass, which has no per-op CPU fallback, checks that each dtype's program compiles)."""
    return [pytest.param(v, marks=pytest.mark.modes_inside) for v in values]


def to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def to_dev(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to(DEVICE).requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(to_dev(v) for v in x)
    return x


def cpu_and_device(make):
    """make() on the CPU, and a second make() moved to the device and given the first one's state."""
    cpu = make()
    dev = make().to(DEVICE)
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev


def tolerance(dtype):
    return {
        torch.float16: dict(atol=1e-2, rtol=1e-2),
        torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
        torch.float64: dict(atol=1e-10, rtol=1e-10),
    }.get(dtype, dict(atol=1e-5, rtol=1e-5))


def assert_matches_cpu(fn, *args, **tol):
    """Runs fn on CPU tensors and on tpu copies; results must agree (dtype too)."""
    expected = fn(*args)
    actual = fn(*to_dev(args))
    exp_list = expected if isinstance(expected, (list, tuple)) else [expected]
    act_list = actual if isinstance(actual, (list, tuple)) else [actual]
    assert len(exp_list) == len(act_list)
    for e, a in zip(exp_list, act_list):
        if not isinstance(e, torch.Tensor):
            assert e == a
            continue
        assert a.device.type == DEVICE, f"result on {a.device}"
        kw = tol or tolerance(e.dtype)
        torch.testing.assert_close(to_cpu(a), e, equal_nan=True, **kw)
    return actual


@pytest.fixture(autouse=True)
def _metrics_of_this_test():
    """torch_pjrt.metrics() counts from each test's start: the counters are process-wide, and a test asserting
    "no CPU fallback" must not see the fallbacks of tests that ran before it (order-dependent failures)."""
    torch_pjrt.reset_metrics()
    yield


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch_pjrt:")
        yield


def pytest_terminal_summary(terminalreporter):
    import sys
    module = sys.modules.get("test_opinfo")
    if module is not None and module.stats["samples"]:
        for line in module.pytest_terminal_summary_lines():
            terminalreporter.write_line(line)


def tiny_model(kind):
    """A tiny random-init causal LM ("gpt2" or "llama"), seeded, in eval mode (generation tests)."""
    import transformers
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                         bos_token_id=1, eos_token_id=2)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def errors_of(fn, *args, **kwargs):
    """Runs fn on CPU tensors and on tpu copies (reading every tensor result);
    returns both exceptions (None: no error)."""
    errors = []
    for device in ("cpu", "tpu"):
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        try:
            out = fn(*moved, **kwargs)
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    t.cpu()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the type is what we compare
            errors.append(e)
    return errors


def assert_same_error(fn, *args, **kwargs):
    """fn raises on the CPU, and tpu raises the same exception type and first message line."""
    cpu, tpu = errors_of(fn, *args, **kwargs)
    assert cpu is not None, "the CPU accepts this call; the test is wrong"
    assert tpu is not None, f"tpu did not raise; CPU raises {type(cpu).__name__}: {cpu}"
    assert type(tpu) is type(cpu), f"tpu raised {type(tpu).__name__}: {tpu}; CPU raises {type(cpu).__name__}: {cpu}"
    assert str(cpu).split("\n")[0] in str(tpu), f"tpu: {tpu}\nCPU: {cpu}"


def programs_and_replays(before, after):
    """(programs made: compiled or loaded from the disk cache, compiled-graph replays) between two metrics()."""
    programs = sum(after[k] - before[k] for k in ("compiles", "disk_cache_hits"))
    return programs, after["compiled_replays"] - before["compiled_replays"]


def run_on_two_devices(script, mode, timeout):
    """`script` run by a fresh interpreter whose CPU plugin has two devices (the device count is fixed when the
    runtime starts), in `mode`, with this process's import path."""
    env = dict(os.environ, TORCH_PJRT_CPU_DEVICES="2", TORCH_PJRT_MODE=mode)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
