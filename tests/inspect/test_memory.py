"""The memory meter counts exactly, and remat keeps the memory promises of issue 2.

Byte counts in the toy tests are analytic: float32 is 4 bytes per element.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat import MemoryReport, measure_memory
from remat import _demo_model as demo
from remat._inspect.memory import MemoryMeter

F32 = 4


# -- the meter on toy cases ----------------------------------------------------


def test_matmul_output_counted_inputs_are_baseline() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    with MemoryMeter() as meter:
        y = x @ w
    assert (meter.current, meter.peak) == (4 * 16 * F32, 4 * 16 * F32)
    assert meter.baseline == (4 * 8 + 8 * 16) * F32
    assert meter.peak_total == meter.baseline + meter.peak
    del y


def test_views_and_aliases_counted_once() -> None:
    x = torch.randn(64)
    with MemoryMeter() as meter:
        y = x + 1
        views = [y.view(8, 8), y[:10], y.t(), y.detach(), y.view(8, 8).transpose(0, 1)]
        y.add_(1)  # in place: same storage
    assert meter.current == meter.peak == 64 * F32
    del views


def test_freed_temporary_lowers_current_not_peak() -> None:
    x = torch.randn(100)
    with MemoryMeter() as meter:
        tmp = x * 2
        out = tmp.sum()
        del tmp
    assert meter.current == F32  # the scalar
    assert meter.peak == 100 * F32 + F32
    del out


def test_storage_freed_only_when_its_last_view_dies() -> None:
    x = torch.randn(32)
    with MemoryMeter() as meter:
        y = x.exp()
        v = y[1:]
        del y
        assert meter.current == 32 * F32
        del v
        assert meter.current == 0


def test_backward_ops_are_counted() -> None:
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 8)
    with MemoryMeter() as meter:
        (x @ w).sum().backward()
    assert w.grad is not None
    assert meter.current == w.grad.nbytes  # the gradient outlives the step
    # peak: the gradient, the loss and its seed gradient ones_like(loss)
    assert meter.peak == w.grad.nbytes + 2 * F32


def test_measure_step_no_remat_is_analytic() -> None:
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 8)
    report = measure_memory(lambda x: torch.relu(x @ w).sum(), x)
    relu_out, loss, grad_w = 4 * 16 * F32, F32, 8 * 16 * F32
    # x @ w dies once relu has run; relu's output is saved for backward.
    assert report == MemoryReport(
        # at w.grad's matmul: relu's output is released, its gradient is alive
        peak_bytes=loss + F32 + 4 * 16 * F32 + grad_w,
        held_bytes=relu_out + loss,
        baseline_bytes=(4 * 8 + 8 * 16) * F32,
    )


def test_measure_step_baseline_includes_module_parameters() -> None:
    model = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    report = measure_memory(lambda x: model(x).sum(), x)
    assert report.baseline_bytes == (8 * 4 + 4 + 2 * 8) * F32


def test_meter_outside_remat_sees_its_modes_and_recompute() -> None:
    # A region with nothing saved holds only the loss; its recompute in backward
    # (relu's output again) costs no more than the peak without remat.
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w).sum()

    plain = measure_memory(f, x)
    w.grad = None
    for policy in ("nothing-saveable", "dots-saveable"):  # dots: through the replay mode
        rematerialized = measure_memory(remat.remat(f, policy=policy), x)
        w.grad = None
        assert rematerialized.held_bytes <= plain.held_bytes
    assert measure_memory(remat.remat(f), x) == MemoryReport(
        peak_bytes=plain.peak_bytes, held_bytes=F32, baseline_bytes=plain.baseline_bytes
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_step_on_cuda() -> None:
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    x = torch.randn(64, 256, device="cuda")
    report = measure_memory(lambda x: torch.relu(x @ w).sum(), x)
    assert report.held_bytes >= 64 * 256 * F32  # relu's output
    assert report.peak_bytes >= 256 * 256 * F32  # w.grad


# -- the promises, on an 8-block GPT stack -------------------------------------

VARIANTS = (
    demo.NO_REMAT,
    demo.TORCH_CHECKPOINT,
    demo.TORCH_SELECTIVE + "dots-saveable",
    "nothing-saveable",
    "dots-saveable",
    "save-last",
    "everything-saveable",
)


@pytest.fixture(scope="module")
def reports() -> dict[str, MemoryReport]:
    model = demo.Stack(depth=8, width=32, heads=2)
    x = demo.make_input(model, batch=2, seq=32)
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the counts do not depend on it; the time on a busy machine does
    try:
        for how in VARIANTS:
            model.zero_grad(set_to_none=True)
            out[how] = measure_memory(lambda x, how=how: model.loss(x, how), x)
    finally:
        torch.set_num_threads(threads)
    return out


def test_nothing_saveable_peak_at_most_torch_checkpoint(reports: dict[str, MemoryReport]) -> None:
    assert reports["nothing-saveable"].peak_bytes <= reports[demo.TORCH_CHECKPOINT].peak_bytes


def test_nothing_saveable_holds_at_most_a_quarter(reports: dict[str, MemoryReport]) -> None:
    assert reports["nothing-saveable"].held_bytes * 4 <= reports[demo.NO_REMAT].held_bytes


def test_dots_saveable_at_most_torch_selective(reports: dict[str, MemoryReport]) -> None:
    ours, torchs = reports["dots-saveable"], reports[demo.TORCH_SELECTIVE + "dots-saveable"]
    assert ours.held_bytes <= torchs.held_bytes
    assert ours.peak_bytes <= torchs.peak_bytes


def test_save_last_peak_at_most_nothing_saveable(reports: dict[str, MemoryReport]) -> None:
    assert reports["save-last"].peak_bytes <= reports["nothing-saveable"].peak_bytes


def test_everything_saveable_holds_what_no_remat_holds(reports: dict[str, MemoryReport]) -> None:
    assert reports["everything-saveable"].held_bytes == reports[demo.NO_REMAT].held_bytes
    assert reports["everything-saveable"].peak_bytes == reports[demo.NO_REMAT].peak_bytes


def test_meter_ignores_forward_mode_zero_tangents() -> None:
    # jvp makes zero tangents that own no storage (aten._efficientzerotensor).
    w, x, v = torch.randn(4, 4), torch.randn(4), torch.randn(4)
    with MemoryMeter() as meter:
        torch.func.jvp(lambda x: x @ w, (x,), (v,))
    assert meter.peak > 0
