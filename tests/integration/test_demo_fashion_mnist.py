"""On real Fashion-MNIST, K-FAC + SGD reaches a lower training loss than SGD alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from data.errors import DataUnavailableError
from data.fashion_mnist import fashion_mnist
from reproductions import demo


@pytest.fixture(scope="module")
def subsets() -> tuple[TensorDataset, TensorDataset]:
    try:
        train, test = fashion_mnist(train=True), fashion_mnist(train=False)
    except DataUnavailableError as err:
        pytest.skip(str(err))
    head = lambda ds, n: TensorDataset(*(t[:n] for t in ds.tensors))  # noqa: E731
    return head(train, 8192), head(test, 1000)


@pytest.mark.integration
def test_kfac_beats_sgd_after_the_same_steps(subsets: tuple[TensorDataset, TensorDataset]
                                             ) -> None:
    train, test = subsets
    kwargs = dict(steps=60, batch_size=128, lr=0.05, seed=0)
    sgd = demo.train("sgd", train, test, use_kfac=False, **kwargs)
    kfac = demo.train("kfac", train, test, use_kfac=True, **kwargs)
    assert all(torch.isfinite(torch.tensor(r.losses)).all() for r in (sgd, kfac))
    assert kfac.final_loss < sgd.final_loss, (kfac.final_loss, sgd.final_loss)
    assert "| K" not in demo.comparison_table([sgd])  # the table lists exactly the runs given
    assert demo.comparison_table([sgd, kfac]).count("\n") == 3


def test_the_loss_columns_average_the_tenth_of_the_steps_ending_there() -> None:
    run = demo.RunResult("sgd", [float(i) for i in range(1, 21)], 0.5, 1.0)
    assert (run.loss_at(0.25), run.loss_at(0.5), run.final_loss) == (4.5, 9.5, 19.5)
    assert "| sgd | 4.5000 | 9.5000 | 19.5000 | 50.00% | 1.0 |" in demo.comparison_table([run])
