"""`profile_layers` leaves the caller's modules as they were (issue #20 item 4), and the GPU way of timing
(events in the stream, one synchronize per pass; calibration to the whole pass: issue #20 item 6) checked
for its logic on CPU - explicitly, whatever the machine has. The same on a real GPU:
tests/gpu/test_profile_gpu.py."""
import pytest
import torch
from torch import nn

from pdv_ext.placement import profile as P
from pdv_ext.placement.profile import profile_layers


class Recorder(nn.Module):
    """Linear + BatchNorm (a buffer a training forward changes) that records the mode it ran in."""

    def __init__(self, i, o):
        super().__init__()
        self.lin, self.bn = nn.Linear(i, o), nn.BatchNorm1d(o)
        self.modes = []

    def forward(self, x):
        self.modes.append(self.training)
        return self.bn(self.lin(x))


def _state(mods):
    return {(i, n): t.detach().clone() for i, m in enumerate(mods) for n, t in m.state_dict().items()}


def test_caller_modules_come_back_as_they_were_after_a_move(monkeypatch):
    """A fake device move (every tensor copied to new storage, as `.to("cuda")` does) that the test can
    observe: profiling runs on the copies, and the caller gets back the same Parameter objects on their
    original storage, their gradients, buffers (objects and values), and training mode."""
    torch.manual_seed(0)
    layers = [Recorder(8, 16), nn.Linear(16, 4)]
    layers[0].eval()
    params = [p for m in layers for p in m.parameters()]
    ptrs = [p.data_ptr() for p in params]
    bufs = {n: b for n, b in layers[0].bn.named_buffers()}
    grads = [torch.full_like(p, 7.0) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    before = _state(layers)
    moved = []

    def fake_place(mod, dev):
        mod._apply(lambda t: t.clone())  # new storage: what a device move does to every tensor
        moved.append([p.data_ptr() for p in mod.parameters()])
        return mod

    monkeypatch.setattr(P, "_place", fake_place)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    prof = profile_layers(layers, x, reps=2, loss_fn=nn.functional.cross_entropy, labels=y, device="cpu")
    assert len(prof) == 2 and all(l.fwd_bwd > 0 for l in prof.layers)
    assert len(moved) == 2 and not set(moved[0] + moved[1]) & set(ptrs)  # profiled on the copies
    assert layers[0].modes and all(layers[0].modes)  # profiled in training mode...
    assert not layers[0].training and layers[1].training  # ...and handed back in the caller's mode
    assert [p for m in layers for p in m.parameters()] == params  # the same Parameter objects
    assert all(a is b for a, b in zip(params, (p for m in layers for p in m.parameters())))
    assert [p.data_ptr() for p in params] == ptrs  # on their original storage (device, dtype)
    assert all(p.grad is g for p, g in zip(params, grads))  # the caller's gradients, untouched
    assert all(layers[0].bn._buffers[n] is b for n, b in bufs.items())
    after = _state(layers)
    assert all(torch.equal(before[k], after[k]) for k in before)  # values, running statistics included


def test_caller_modules_on_the_profiling_device_keep_values_grads_and_buffers():
    """No move at all (CPU on CPU): the optimizer steps and training forwards ran on the caller's own
    tensors, and every value is put back; gradients are not wiped."""
    torch.manual_seed(0)
    layers = [Recorder(8, 16), nn.Linear(16, 4)]
    params = [p for m in layers for p in m.parameters()]
    params[0].grad = torch.ones_like(params[0])
    g0 = params[0].grad
    before = _state(layers)
    profile_layers(layers, torch.randn(16, 8), reps=2, device="cpu")
    after = _state(layers)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert params[0].grad is g0 and all(p.grad is None for p in params[1:])
    assert str(params[0].device) == "cpu" and params[0].dtype == torch.float32


class Logged(nn.Module):
    """A layer that writes its forward and backward into a shared log."""

    def __init__(self, i, log):
        super().__init__()
        self.i, self.log, self.lin = i, log, nn.Linear(4, 4)

    def forward(self, x):
        self.log.append(f"F{self.i}")
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(lambda g: self.log.append(f"B{self.i}"))
        return y


def test_pass_round_runs_forward_then_backward_then_updates_with_one_sync():
    """The GPU timing's order: every forward (events between), every backward last layer first, every
    update; one synchronize per round, none between layers."""
    log = []
    built = [Logged(i, log) for i in range(3)]
    syncs = []

    class Ev(P._HostEvent):
        def record(self):
            super().record()
            log.append("E")

    inputs = []
    x = torch.randn(2, 4)
    with torch.no_grad():
        for m in built:
            inputs.append(x)
            x = m(x)
    log.clear()
    updates = [P._Update(list(m.parameters())) for m in built]
    res = P._pass_round(built, inputs, updates, None, Ev, lambda: syncs.append(len(log)))
    for u in updates:
        u.restore()
    assert log == ["E", "F0", "E", "F1", "E", "F2", "E", "E", "B2", "E", "B1", "E", "B0", "E", "E", "E", "E", "E"]
    assert syncs == [len(log)]  # once, after everything was recorded
    assert len(res) == 3
    for fb, fw, upd, saved, out in res:
        assert fb >= fw > 0 and upd > 0 and saved > 0 and out.shape == (2, 4)


def test_pass_timing_on_cpu_gives_the_same_sizes_and_sane_times():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)]
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    kw = dict(reps=2, loss_fn=nn.functional.cross_entropy, labels=y, device="cpu")
    by_layer = profile_layers(layers, x, **kw)
    by_pass = profile_layers(layers, x, timing="pass", **kw)
    assert by_layer.meta["timing"].startswith("host clock") and by_pass.meta["timing"].startswith("events")
    for a, b in zip(by_layer.layers, by_pass.layers):
        assert (a.name, a.param_bytes, a.act_bytes, a.saved_bytes) == (b.name, b.param_bytes, b.act_bytes, b.saved_bytes)
        assert b.fwd_bwd >= b.fwd > 0
        assert (b.update > 0) == (a.param_bytes > 0)
    assert "whole_pass_seconds" not in by_layer.meta and "fwd_bwd_scale" not in by_layer.meta  # CPU: as timed
    with pytest.raises(ValueError, match="timing"):
        profile_layers(layers, x, timing="fast", device="cpu")


def test_calibrated_to_the_whole_pass():
    """`calibrate=True` (the CUDA default): the layers' forward + backward sum to the whole model's timed pass."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.Linear(64, 4)]
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    prof = profile_layers(layers, x, reps=2, loss_fn=nn.functional.cross_entropy, labels=y, calibrate=True,
                          device="cpu")
    whole = prof.meta["whole_pass_seconds"]
    assert whole > 0 and prof.meta["layer_sum_seconds"] > 0
    assert sum(l.fwd_bwd for l in prof.layers) == pytest.approx(whole)
    assert prof.meta["fwd_bwd_scale"] == pytest.approx(whole / prof.meta["layer_sum_seconds"])
    assert all(p.grad is None for m in layers for p in m.parameters())


def test_a_model_too_large_for_the_device_is_refused_before_it_moves():
    """Profiling holds every layer on one device (with a saved copy, two gradients and AdamW's moments):
    a model that does not fit gets one error naming the sizes and the way out, before any move."""
    from torch import nn

    from pdv_ext.placement.profile import PROFILE_BYTES_PER_PARAM_BYTE, ProfileMemoryError, check_fits

    layers = [nn.Linear(256, 256) for _ in range(4)]  # 4 x 257 KiB of float32 parameters
    size = sum(p.numel() * 4 for m in layers for p in m.parameters())
    check_fits(layers, PROFILE_BYTES_PER_PARAM_BYTE * size, "cuda")  # just fits
    with pytest.raises(ProfileMemoryError, match=r"pdv\.placement\.profile") as exc:
        check_fits(layers, PROFILE_BYTES_PER_PARAM_BYTE * size - 1, "cuda")
    assert "GiB of parameters" in str(exc.value)
    assert all(p.device.type == "cpu" for m in layers for p in m.parameters())
    # parameters already on the device are not in its free memory: they count as already placed
    check_fits(layers, (PROFILE_BYTES_PER_PARAM_BYTE - 1) * size, "cpu")


def test_identical_layers_share_the_median_of_their_pooled_samples():
    """The blocks of a model are one computation: each one's own median keeps the measurement's noise, which
    the solver would take for a real difference. Their samples are pooled; other layers keep their own."""
    assert P._tie([[1.0, 2.0, 3.0], [10.0, 11.0, 12.0], [5.0]], [[0, 1]]) == [6.5, 6.5, 5.0]
    assert P._tie([[1.0, 2.0, 3.0], [10.0, 11.0, 12.0]], []) == [2.0, 11.0]


def test_profile_ties_identical_layers_only():
    """Same class, shapes and dtypes: tied; another width, or the last layer with the loss: not."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)]
    x, y = torch.randn(4, 8), torch.randint(0, 16, (4,))
    prof = profile_layers(layers, x, reps=3, loss_fn=nn.functional.cross_entropy, labels=y, device="cpu")
    assert prof.meta["identical_layers"] == [[0, 1]]  # the last Linear(16, 16) computes the loss: its own cost
    a, b = prof.layers[0], prof.layers[1]
    assert (a.fwd_bwd, a.fwd, a.update) == (b.fwd_bwd, b.fwd, b.update)
    plain = profile_layers(layers, x, reps=3, device="cpu")
    assert plain.meta["identical_layers"] == [[0, 1], [3, 4]]
    assert plain.layers[3].fwd_bwd == plain.layers[4].fwd_bwd
    own = profile_layers(layers, x, reps=3, device="cpu", tie_identical=False)
    assert "identical_layers" not in own.meta
