"""Training strategies on a real 2-rank cluster: LocalSGD, EASGD, compressed DataParallel.

Two mpiexec runs (module fixtures) run the rank-side scenarios in tests/rank_scenarios/
(strategies.py, compression.py); the tests read their reports. Plus unit tests of the
large-batch optimizer wrappers and of bad input.
"""

from __future__ import annotations

import pytest
import torch
from rank_scenarios import run_scenario


@pytest.fixture(scope="module")
def compression() -> list[dict]:
    return run_scenario("compression")[0]


@pytest.fixture(scope="module")
def strategies() -> list[dict]:
    return run_scenario("strategies")[0]


def test_local_sgd_period_1_is_data_parallel_with_plain_sgd(strategies):
    for rank in strategies:
        assert rank["period1_vs_dp"] < 1e-5


def test_local_sgd_ranks_identical_after_each_averaging_step(strategies):
    for rank in strategies:
        spreads = rank["period3_spreads"]
        assert [s == 0.0 for s in spreads] == [False, False, True, False, False, True, False]
        # warm-up 2 then period 4: averaged after steps 1, 2 and 4
        assert [s == 0.0 for s in rank["warmup_spreads"]] == [True, True, False, True, False,
                                                               False]


def test_local_sgd_reports_the_bytes_it_sends(strategies):
    for rank in strategies:
        param_bytes = rank["param_bytes"]
        pairs = rank["period3_traffic"]
        assert [reported for reported, _ in pairs] == [0, 0, param_bytes] * 2 + [0]
        assert all(reported == counted for reported, counted in pairs)
        # running ratio against DataParallel's every-step allreduce: 3 after each period
        assert rank["period3_ratio"][2] == pytest.approx(3.0)
        assert rank["period3_ratio"][5] == pytest.approx(3.0)
        assert rank["period3_ratio"][:2] == [None, None]
        assert rank["period3_counted"] == [2 * param_bytes, 7]  # mpilab.traffic()


def test_rewrapping_a_model_replaces_the_earlier_strategy(strategies):
    for rank in strategies:
        assert rank["rewrap_logs"] == 2
        assert rank["replaced_by_dp_logs"] == 0
        assert rank["replaced_by_ddp_logs"] == 0 and rank["replaced_by_ddp_steps"] == 2
        assert rank["unkept_wrapper_spreads"][1] == 0.0 < rank["unkept_wrapper_spreads"][0]


def test_strategies_see_the_steps_of_wrapped_optimizers(strategies):
    for rank in strategies:
        assert [s == 0.0 for s in rank["wrapped_optimizer_spreads"]] == [False, True] * 2
        assert rank["wrapped_optimizer_lr"] == pytest.approx(0.2)  # 0.1 × 2 ranks


def test_easgd_one_step_by_hand(strategies):
    for rank in strategies:
        assert rank["easgd_before_period"] == 0.0  # nothing moves between averaging steps
        assert rank["easgd_x_error"] < 1e-6
        assert rank["easgd_c_error"] < 1e-6
        pairs = rank["easgd_traffic"]
        assert pairs[0] == [0, 0] and pairs[1][0] > 0
        assert all(reported == counted for reported, counted in pairs)


def test_easgd_centre_identical_on_all_ranks(strategies):
    for rank in strategies:
        assert rank["easgd_center_spreads"] == [0.0] * 6
        assert rank["center_module"] == 0.0


def test_strategies_reject_bad_input(strategies):
    period, warmup, alpha, wrapped, backend = strategies[0]["errors"]
    assert period == "ValueError: LocalSGD: period must be a positive whole number of " \
                     "steps, got 0"
    assert warmup.startswith("ValueError: LocalSGD: warmup must be")
    assert alpha.startswith("ValueError: EASGD: alpha must satisfy 0 < alpha × ranks ≤ 1")
    assert "already wrapped by DataParallel" in wrapped
    assert "backend 'nccl2' is not one of" in backend


# ------------------------------------------------------------------ large-batch helpers
def test_scaled_lr_warms_up_linearly_to_the_scaled_rate():
    from mpilab.rank.large_batch import ScaledLR

    p = torch.nn.Parameter(torch.zeros(2))
    opt = ScaledLR(torch.optim.SGD([p], lr=0.1), scale=4, warmup_steps=3)
    rates = []
    for _ in range(5):
        rates.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(2)
        opt.step()
    assert rates == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    state = opt.state_dict()
    again = ScaledLR(torch.optim.SGD([p], lr=0.1), scale=4, warmup_steps=3)
    again.load_state_dict(state)
    assert again.param_groups[0]["lr"] == pytest.approx(0.4)


def test_lars_scales_each_layer_by_its_trust_ratio():
    from mpilab.rank.large_batch import LARS

    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # ‖w‖ = 5
    b = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LARS(torch.optim.SGD([{"params": [w], "weight_decay": 0.1}, {"params": [b]}], lr=1.0),
               trust_coefficient=0.01)
    w.grad, b.grad = torch.tensor([0.0, 10.0]), torch.tensor([2.0])  # ‖g‖ = 10, 2
    opt.step()
    local_w = 0.01 * 5 / (10 + 0.1 * 5)
    w0 = torch.tensor([3.0, 4.0])
    expected_w = w0 - local_w * (torch.tensor([0.0, 10.0]) + 0.1 * w0)
    assert torch.allclose(w.detach(), expected_w, atol=1e-6)
    local_b = 0.01 * 1 / 2  # no weight decay in b's group
    assert torch.allclose(b.detach(), torch.tensor([1.0 - local_b * 2]), atol=1e-6)
    assert opt.param_groups[0]["weight_decay"] == 0.1  # restored after the step


def test_large_batch_wrappers_reject_bad_input():
    from mpilab.rank.large_batch import LARS, ScaledLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="scale must be positive"):
        ScaledLR(opt, scale=0)
    with pytest.raises(ValueError, match="warmup_steps must be a whole number"):
        ScaledLR(opt, scale=2, warmup_steps=1.5)
    with pytest.raises(ValueError, match="trust_coefficient must be positive"):
        LARS(opt, trust_coefficient=0)
    with pytest.raises(TypeError, match="wraps a torch optimizer, not str"):
        LARS("sgd")


def test_compression_settings_reject_bad_input():
    from mpilab.rank.compression import PowerSGD, TopK, resolve

    assert resolve("topk") == TopK(ratio=0.01) and resolve("powersgd") == PowerSGD(rank=2)
    assert resolve(TopK(0.1)) == TopK(0.1) and resolve("fp16") == "fp16" and resolve(None) is None
    with pytest.raises(ValueError, match="compression 'zip' is not None, 'fp16'"):
        resolve("zip")
    with pytest.raises(ValueError, match="TopK ratio must be in"):
        TopK(ratio=0)
    with pytest.raises(ValueError, match="PowerSGD rank must be a positive integer"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="dense_steps must be an integer ≥ 2"):
        PowerSGD(dense_steps=1)


# ------------------------------------------------------------ compressed DataParallel
@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("method", ["powersgd", "topk"])
def test_compression_with_error_feedback_converges_like_uncompressed(compression, backend,
                                                                      method):
    """Stated tolerance: the final full-data loss (it starts near 500; the noise floor is
    0.0016) is within 1e-3 of uncompressed DataParallel's after the same 150 steps."""
    for rank in compression:
        dense, run = rank[f"{backend}-dense"], rank[f"{backend}-{method}"]
        assert dense["loss"] < 2e-3
        assert abs(run["loss"] - dense["loss"]) < 1e-3, (run["loss"], dense["loss"])
        assert run["spread"] == 0.0  # every rank applied the same decompressed gradient
        assert run["steps"] == 150


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_compression_reports_the_bytes_it_sends(compression, backend):
    for rank in compression:
        powersgd, topk = rank[f"{backend}-powersgd"], rank[f"{backend}-topk"]
        # 2 dense steps of the 528 float32 gradients, then P (32×2), Q (16×2), bias (16)
        assert powersgd["reported"] == 2 * 2112 + 148 * 4 * (64 + 32 + 16)
        # 5% of 528 entries: 27 float32 values and 27 int32 indices per step
        assert topk["reported"] == 150 * 27 * 8
        assert topk["ratio"] == pytest.approx(2112 / 216)
        assert powersgd["ratio"] == pytest.approx(150 * 2112 / powersgd["reported"])
        for run in (powersgd, topk):
            if backend == "mpi":  # per step: the log record against the collectives' spans
                assert len(run["traffic"]) == 150
                assert all(reported == counted for reported, counted in run["traffic"])
            else:  # DDP's hooks send asynchronously: totals, spied on torch.distributed
                assert run["reported"] == run["wire"]
    assert rank["torch-dense"]["wire"] == 150 * 2112  # the spy sees what DDP sends


def test_data_parallel_rejects_unknown_compression(compression):
    unknown, ratio = compression[0]["errors"]
    assert unknown == ("ValueError: DataParallel compression 'zip' is not None, 'fp16', "
                       "'bf16', 'powersgd', 'topk', mpilab.PowerSGD(rank=…) or "
                       "mpilab.TopK(ratio=…)")
    assert ratio == "ValueError: TopK ratio must be in (0, 1], got 2"
