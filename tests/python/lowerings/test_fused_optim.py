"""Fused optimizers (_fused_adam_, _fused_adamw_, _fused_sgd_) and the foreach
paths on tpu against the same optimizers on the CPU: parameters and state agree
to float32 tolerance, nothing falls back to the CPU, and an LR scheduler does
not make later steps compile anything new."""
import copy

import pytest
import torch
import torch.nn as nn

import torch_pjrt


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def run(make_opt, device, steps=5):
    net = copy.deepcopy(model()).to(device)
    opt = make_opt(net.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 6, generator=gen).to(device), torch.randn(4, 3, generator=gen).to(device)
    compiles = []
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        sched.step()
        torch_pjrt.sync()
        compiles.append(torch_pjrt.metrics()["compiles"])
    return net, opt, compiles


def state_tensors(opt):
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for name, v in sorted(opt.state[p].items()):
                if isinstance(v, torch.Tensor):
                    out.append((name, v))
    return out


OPTIMIZERS = {
    "adamw_fused": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True, **kw),
    "adam_fused_amsgrad": lambda ps, **kw: torch.optim.Adam(ps, lr=0.05, amsgrad=True, weight_decay=0.05, fused=True),
    "adam_fused_maximize": lambda ps, **kw: torch.optim.Adam(ps, lr=0.05, maximize=True, betas=(0.4, 0.9), fused=True),
    "sgd_fused_nesterov": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                          fused=True),
    "sgd_fused_dampening": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3, fused=True),
    "sgd_fused_plain": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, maximize=True, fused=True),
    "adamw_fused_tensor_lr": lambda ps, **kw: torch.optim.AdamW(ps, lr=torch.tensor(0.05), fused=True),
    "adamw_foreach": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.07, foreach=True),
    "adam_foreach_amsgrad": lambda ps, **kw: torch.optim.Adam(ps, lr=0.05, amsgrad=True, foreach=True),
    "sgd_foreach": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_cpu(name):
    make = OPTIMIZERS[name]
    cpu_net, cpu_opt, _ = run(make, "cpu")
    torch_pjrt.reset_metrics()
    tpu_net, tpu_opt, compiles = run(make, "tpu")
    fallbacks = torch_pjrt.metrics()["cpu_fallbacks"]
    assert not fallbacks, fallbacks
    if "fused" in name:
        assert torch_pjrt.metrics()["lowered_ops"].get(
            "aten::_fused_sgd_" if "sgd" in name else
            ("aten::_fused_adamw_" if "adamw" in name else "aten::_fused_adam_") +
            (".tensor_lr" if "tensor_lr" in name else ""), 0) == 5
    for (n, a), b in zip(cpu_net.named_parameters(), tpu_net.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), atol=1e-5, rtol=1e-4, msg=n)
    cpu_state, tpu_state = state_tensors(cpu_opt), state_tensors(tpu_opt)
    assert [n for n, _ in cpu_state] == [n for n, _ in tpu_state]
    for (n, a), (_, b) in zip(cpu_state, tpu_state):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-4, msg=n)
    if torch_pjrt.get_mode() == "fused":
        # The scheduler changes the learning rate every step: nothing recompiles after step 2.
        # (Graphs key which Scalars are equal: adamw_foreach avoids 1 - lr * weight_decay == beta2.)
        assert compiles[1] == compiles[-1], compiles


def adam_lists(dtype=torch.float32, n=3):
    gen = torch.Generator().manual_seed(2)
    shapes = [(5,), (2, 3), ()][:n]
    mk = lambda positive=False: [(torch.rand(s, generator=gen) if positive else torch.randn(s, generator=gen)).to(dtype)
                                 for s in shapes]
    return dict(params=mk(), grads=mk(), exp_avgs=mk(), exp_avg_sqs=mk(True), max_sqs=mk(True),
                steps=[torch.tensor(float(k + 1)) for k in range(len(shapes))])


def call_adam(op, lists, device, amsgrad, **kw):
    lists = {k: [t.clone().to(device) for t in v] for k, v in lists.items()}
    extra = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    op(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
       lists["max_sqs"] if amsgrad else [], lists["steps"], beta1=0.9, beta2=0.99, weight_decay=0.1,
       eps=1e-8, amsgrad=amsgrad, maximize=False, **extra)
    return {k: [t.cpu() for t in v] for k, v in lists.items()}


@pytest.mark.parametrize("op", [torch.ops.aten._fused_adamw_, torch.ops.aten._fused_adam_], ids=["adamw", "adam"])
@pytest.mark.parametrize("found_inf", [None, 0.0, 1.0])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_grad_scale_and_found_inf(op, found_inf, amsgrad):
    kw = dict(lr=0.01, grad_scale=torch.tensor(4.0))
    if found_inf is not None:
        kw["found_inf"] = torch.tensor(found_inf)
    lists = adam_lists()
    torch_pjrt.reset_metrics()
    expected = call_adam(op, lists, "cpu", amsgrad, **kw)
    actual = call_adam(op, lists, "tpu", amsgrad, **kw)
    assert not torch_pjrt.metrics()["cpu_fallbacks"]
    for k in expected:
        for e, a in zip(expected[k], actual[k]):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5, msg=k)
    if found_inf == 1.0:
        for e, orig in zip(expected["params"], lists["params"]):
            assert torch.equal(e, orig)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_fused_adamw_dtypes_and_tensor_lr(dtype):
    lists = adam_lists(dtype)
    expected = call_adam(torch.ops.aten._fused_adamw_, lists, "cpu", True, lr=torch.tensor(0.01))
    actual = call_adam(torch.ops.aten._fused_adamw_, lists, "tpu", True, lr=torch.tensor(0.01))
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-2, rtol=1e-2)
    for k in expected:
        for e, a in zip(expected[k], actual[k]):
            assert a.dtype == (torch.float32 if k == "steps" else dtype)
            torch.testing.assert_close(a, e, **tol, msg=k)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("found_inf", [None, 0.0, 1.0])
def test_fused_sgd_direct(first, found_inf):
    gen = torch.Generator().manual_seed(3)
    mk = lambda: [torch.randn(s, generator=gen) for s in [(4,), (2, 2)]]
    params, grads, bufs = mk(), mk(), mk()
    kw = dict(weight_decay=0.1, momentum=0.9, lr=0.2, dampening=0.1, nesterov=False, maximize=False,
              is_first_step=first, grad_scale=torch.tensor(2.0))
    if found_inf is not None:
        kw["found_inf"] = torch.tensor(found_inf)

    def call(device):
        ls = [[t.clone().to(device) for t in l] for l in (params, grads, bufs)]
        extra = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        torch.ops.aten._fused_sgd_(*ls, **extra)
        return [[t.cpu() for t in l] for l in ls]

    torch_pjrt.reset_metrics()
    for e_list, a_list in zip(call("cpu"), call("tpu")):
        for e, a in zip(e_list, a_list):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)
    assert not torch_pjrt.metrics()["cpu_fallbacks"]


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_mismatched_list_lengths_raise(device):
    z = lambda: torch.zeros(3, device=device)
    with pytest.raises(RuntimeError):
        torch.ops.aten._fused_adamw_([z()], [z(), z()], [z()], [z()], [], [torch.ones((), device=device)], lr=0.1,
                                     beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False,
                                     maximize=False)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_functional_fused_adamw(amsgrad):
    """The functional form (what functionalization records) returns the new lists in the same order."""
    lists = adam_lists()

    def call(device):
        ls = {k: [t.clone().to(device) for t in v] for k, v in lists.items()}
        out = torch.ops.aten._fused_adamw(ls["params"], ls["grads"], ls["exp_avgs"], ls["exp_avg_sqs"],
                                          ls["max_sqs"] if amsgrad else [], ls["steps"], lr=0.1, beta1=0.9,
                                          beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=amsgrad, maximize=False)
        return [[t.cpu() for t in l] for l in out]

    torch_pjrt.reset_metrics()
    expected, actual = call("cpu"), call("tpu")
    assert not torch_pjrt.metrics()["cpu_fallbacks"]
    assert [len(l) for l in expected] == [len(l) for l in actual]
    for e_list, a_list in zip(expected, actual):
        for e, a in zip(e_list, a_list):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("op", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("scaled", [False, True])
def test_fused_step_with_grads_sharing_one_storage(op, scaled):
    """Gradients that are views of one flat buffer (FSDP2's reduce-scatter output): without a grad_scale the fused
    kernels do not write grads, so the step stays on the device; with one (they unscale grads in place) it runs
    on the CPU. Parameters, state and grads equal the CPU's either way."""
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 4)]
    params = [torch.randn(s) for s in shapes]
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes))

    def step(device):
        ps = [p.clone().to(device) for p in params]
        g = flat.clone().to(device)
        grads = [v.view(s) for v, s in zip(g.split([torch.Size(s).numel() for s in shapes]), shapes)]
        kw = dict(grad_scale=torch.tensor(4.0, device=device), found_inf=torch.tensor(0.0, device=device)) \
            if scaled else {}
        steps = [torch.tensor(3.0, device=device) for _ in ps]
        if op == "sgd":
            bufs = [torch.ones_like(p) for p in ps]
            torch._fused_sgd_(ps, grads, bufs, weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=False, **kw)
            state = bufs
        else:
            avgs, sqs = [torch.full_like(p, 0.1) for p in ps], [torch.full_like(p, 0.2) for p in ps]
            fn = torch._fused_adamw_ if op == "adamw" else torch._fused_adam_
            fn(ps, grads, avgs, sqs, [], steps, lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8,
               amsgrad=False, maximize=False, **kw)
            state = avgs + sqs
        return [t.cpu() for t in ps + state + [g]]

    name = f"aten::_fused_{op}_"
    before = torch_pjrt.metrics()["cpu_fallbacks"].get(name, 0)
    got, want = step("tpu"), step("cpu")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch_pjrt.metrics()["cpu_fallbacks"].get(name, 0) - before == (1 if scaled else 0)
